"""What config key secure-noise costs in step time, alone (row (g) of ``dpdro lab bench`` measures the same inside
the full benchmark): ``python -m dpdro.simulations.secure_noise_bench [batch] [repeats]``.

Interleaves, on the GroupNorm CNN (1x28x28) of ``bench.StepBench``: a noised refresh step with the default PCG64
draw and with the secure draw (``common.rng.secure_gaussian``: 4 CSPRNG draws, Opacus' secure_mode), and the two
noise draws alone, one torch thread; prints the medians of the per-repetition ratios (``bench.median_ratio``)."""

from __future__ import annotations

import statistics
import sys

import numpy as np
import torch

from ..common.rng import gaussian_noise
from .bench import StepBench, interleaved, median_ratio, ratio_range


def secure_noise_cost(batch: int = 64, repeats: int = 15) -> dict:
    """{'dim', 'batch', 'repeats', 'step_ratio', 'step_range', 'draw_ratio', 'median_ms'}: secure / PCG64 for
    the noised refresh step and for the draw alone (CPU, one torch thread)."""
    torch.set_num_threads(1)
    device = torch.device("cpu")
    sb = StepBench("cnn", batch, 64, device)
    rng, d = np.random.default_rng(0), sb.flat_model.dim
    t = interleaved({"noised": lambda: sb.noised(False), "noised_secure": lambda: sb.noised(True),
                     "pcg64": lambda: gaussian_noise(1.0, (d,), rng),
                     "csprng": lambda: gaussian_noise(1.0, (d,), rng, secure=True)}, repeats, device)
    return {"dim": d, "batch": batch, "repeats": repeats,
            "step_ratio": median_ratio(t["noised_secure"], t["noised"]),
            "step_range": ratio_range(t["noised_secure"], t["noised"]),
            "draw_ratio": median_ratio(t["csprng"], t["pcg64"]),
            "median_ms": {k: 1e3 * statistics.median(v) for k, v in t.items()}}


def main(argv: list[str]) -> None:
    r = secure_noise_cost(*(int(a) for a in argv[:2]))
    print(f"cnn, d = {r['dim']}, batch {r['batch']}, {r['repeats']} interleaved repetitions, 1 torch thread, CPU")
    print(f"noised refresh step, secure-noise / PCG64: {r['step_ratio']:.3f} "
          f"(range {r['step_range'][0]:.2f}-{r['step_range'][1]:.2f})")
    print(f"noise draw alone, secure-noise / PCG64: {r['draw_ratio']:.1f}")
    print("median ms: " + ", ".join(f"{k} {v:.2f}" for k, v in r["median_ms"].items()))


if __name__ == "__main__":
    main(sys.argv[1:])
