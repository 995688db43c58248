"""Cost of a SPIDER difference step against a refresh step and of a refresh against a non-private step, per model
and per-record engine (the goals: difference / refresh <= 1.5, refresh / non-private <= 1.3).

The steps are ``dpdro lab bench``'s (simulations/bench.py, ``StepBench``: the x quantity 'dual-x' through the
clients' own ``clipped_total``, clip 1, synthetic inputs of the model's input shape), on the CNN (1x28x28 images)
and on scatter-linear (a linear layer on MNIST's scattering features, 81x7x7), each with the engines that support
it; compared steps are interleaved and each ratio is the median of the per-repetition ratios.

    .venv/bin/python -m dpdro.simulations.bench_diff [--batch 256] [--repeats 15] [--threads 1]

Prints one line per (model, engine): the median seconds and the two ratios; then the clip-and-sum part of a
two-point difference on a linear layer whose input differs between the points, by ghost norms (``OuterDiffRows``)
and by dense rows, against a refresh of the same layer.
"""

from __future__ import annotations

import argparse

import torch

from .bench import INPUT_SHAPES, StepBench, interleaved, median_ratio

# MNIST's scattering features (config key features=scatternet: Scattering2D(J=2) on 28x28 gives 81 x 7 x 7)
SHAPES = {**INPUT_SHAPES, "scatter-linear": (81, 7, 7)}
CASES = (("cnn", "torch.func"), ("scatter-linear", "torch.func"), ("scatter-linear", "ghost"))


def measure(model: str, engine: str, batch: int, repeats: int, chunk_size: int = 256) -> dict:
    """Median seconds of the non-private, refresh and difference steps and the ratios b = difference / refresh,
    a = refresh / non-private, for ``model`` with per-record ``engine`` on a synthetic batch of ``batch`` records."""
    INPUT_SHAPES.setdefault(model, SHAPES[model])
    sb = StepBench(model, batch, chunk_size, torch.device("cpu"), engine=engine)
    t = interleaved({"nonprivate": sb.nonprivate, "refresh": sb.refresh, "difference": sb.difference}, repeats,
                    torch.device("cpu"))
    return {"model": model, "engine": engine, "seconds": {k: sorted(v)[len(v) // 2] for k, v in t.items()},
            "a": median_ratio(t["refresh"], t["nonprivate"]), "b": median_ratio(t["difference"], t["refresh"])}


def measure_outer_diff(batch: int, repeats: int, n_in: int = 3969, k: int = 10) -> dict:
    """The clip-and-sum part alone on one linear layer (n_in inputs, k outputs, bias) whose input differs between
    the two points (what a trainable layer after another trainable one sees): a refresh of one point's factored rows
    (``OuterRows``), the two-point difference by ghost norms (``OuterDiffRows``) and the same difference through
    its dense (B, k (n_in + 1)) rows. Median seconds and the ratios to the refresh."""
    from ..common.per_sample import OuterRows, clipped_sum_and_count, combine_outer

    gen = torch.Generator().manual_seed(0)
    g1, g2 = (torch.randn(batch, k, generator=gen) for _ in range(2))
    h1 = torch.randn(batch, n_in, generator=gen)
    h2 = h1 + 0.01 * torch.randn(batch, n_in, generator=gen)

    def refresh():
        return clipped_sum_and_count(OuterRows(g1, h1, True), 1.0)

    def ghost():
        return clipped_sum_and_count(combine_outer([OuterRows(g1, h1, True), OuterRows(g2, h2, True)], (1.0, -1.0)),
                                     1.0)

    def dense():
        rows = torch.cat(OuterRows(g1, h1, True).blocks, 1) - torch.cat(OuterRows(g2, h2, True).blocks, 1)
        return clipped_sum_and_count(rows, 1.0)

    t = interleaved({"refresh": refresh, "ghost": ghost, "dense": dense}, repeats, torch.device("cpu"))
    return {"seconds": {k_: sorted(v)[len(v) // 2] for k_, v in t.items()},
            "ghost/refresh": median_ratio(t["ghost"], t["refresh"]),
            "dense/refresh": median_ratio(t["dense"], t["refresh"])}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    for model, engine in CASES:
        r = measure(model, engine, args.batch, args.repeats)
        s = r["seconds"]
        print(f"{model:15s} {engine:10s} non-private {s['nonprivate'] * 1e3:7.2f} ms  refresh "
              f"{s['refresh'] * 1e3:7.2f} ms  difference {s['difference'] * 1e3:7.2f} ms  "
              f"refresh/non-private {r['a']:.2f}  difference/refresh {r['b']:.2f}")
    r = measure_outer_diff(args.batch, args.repeats)
    s = r["seconds"]
    print(f"linear layer 3969->10, inputs differ, clip-and-sum only: refresh {s['refresh'] * 1e3:.2f} ms, difference "
          f"by ghost norms {s['ghost'] * 1e3:.2f} ms ({r['ghost/refresh']:.2f}x), by dense rows "
          f"{s['dense'] * 1e3:.2f} ms ({r['dense/refresh']:.2f}x)")


if __name__ == "__main__":
    main()
