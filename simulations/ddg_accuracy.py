"""Accuracy of noise-mode=distributed-discrete against noise-mode=central at equal epsilon, and the bits per
coordinate it costs, on MNIST-ST in-process (single node):

    nice -n 10 python -m dpdro.simulations.ddg_accuracy [--iterations 100] [--seeds 0] [--root runs/ddg-accuracy]
        [--refresh-batch B] [--modes central distributed-discrete] [--epsilon E]

Runs the main job's configuration (simulations/configs/main.toml: DP-SGD with the logit-adjusted loss, 4 clients,
epsilon 4) for ``--iterations`` iterations (the noise recalibrated to epsilon 4 over them) in both modes and prints a
Markdown table: test and worst-class accuracy, epsilon of the outputs, epsilon against the server (inf in central
mode: the server sees clipped sums without noise; the DDG's holds against it), the gradient's noise multiplier
(the DDG's from its own accounting, ``common.ddg``), its bits per coordinate (from the run's events), and wall time.
``--refresh-batch`` replaces the main job's expected batch (2,048) in every mode: the DDG's subsampling bound is
loosest at moderate sampling rates (``ddg_cost --grid``), so the plan is a lever of the distributed mode. Every
figure comes from the runs' summary.json and events.jsonl; finished runs are reused. ``--epsilon`` replaces the
target (4): with ``--modes central`` and the epsilon at which the central calibration gives the DDG's multiplier
(``dpdro plan``), it separates the cost of the DDG's accounting from that of its encoding.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from ..common.config import Config
from .noise_modes import base_keys

MODES = ("central", "distributed-discrete")


def run_one(keys: dict, out: Path) -> tuple[dict, list[dict]]:
    """Train ``keys`` in-process into ``out`` (unless its summary.json exists); (summary, events)."""
    from ..client.local_transport import LocalTransport
    from ..common.data import load_from_config
    from ..server.engine import train
    from ..server.rundir import RunDir, read_json

    if not (out / "summary.json").exists():
        cfg = Config.from_mapping({**keys, "out-dir": str(out), "overwrite": True})
        train(cfg, LocalTransport(cfg, load_from_config(cfg, True)), load_from_config(cfg, False))
    return read_json(out / "summary.json"), RunDir(out).read_events()


def table(rows: list[tuple[str, int, dict, list[dict]]]) -> list[str]:
    """Markdown rows: mode, seed, accuracy, worst class, epsilon, against the server, z of 'grad', bits, wall."""
    out = ["| noise mode | seed | test accuracy | worst-class accuracy | epsilon | epsilon against the server | "
           "gradient noise multiplier | bits per coordinate (gradient) | wall time (s) |",
           "|---|---|---|---|---|---|---|---|---|"]
    for mode, seed, s, events in rows:
        against = s["epsilon_against_server"]
        against = "inf" if against in ("inf", math.inf) else f"{float(against):.3f}"
        bits = sorted({e["ddg_bits"] for e in events if "ddg_bits" in e and e["mechanism"] == "grad"})
        z = s["noise_multipliers"].get("grad", float("nan"))
        out.append(f"| {mode} | {seed} | {s['test_accuracy']:.4f} | {s['worst_class_accuracy']:.4f} | "
                   f"{float(s['epsilon_spent']):.3f} | {against} | {z:.3f} | "
                   f"{'-' if not bits else '-'.join(str(b) for b in sorted({bits[0], bits[-1]}))} | "
                   f"{s['wall_seconds']:.0f} |")
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iterations", type=int, default=100)
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--root", type=Path, default=Path("runs/ddg-accuracy"))
    p.add_argument("--refresh-batch", type=int, default=None, help="expected batch (default: the main job's)")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--epsilon", type=float, default=4.0, help="target epsilon of every run (default: 4)")
    a = p.parse_args(argv)
    rows = []
    batch = {} if a.refresh_batch is None else {"refresh-batch": a.refresh_batch}
    tag = "" if a.refresh_batch is None else f"-B{a.refresh_batch}"
    tag += "" if a.epsilon == 4.0 else f"-eps{a.epsilon:g}"
    for seed in a.seeds:
        for mode in a.modes:
            keys = {**base_keys(), **batch, "iterations": a.iterations, "eval-every": a.iterations,
                    "noise-mode": mode, "seed": seed, "epsilon": a.epsilon}
            s, events = run_one(keys, (a.root / f"{mode}-T{a.iterations}{tag}-seed{seed}").resolve())
            rows.append((mode, seed, s, events))
    print("\n".join(table(rows)))
    for mode in a.modes:  # the mean over the seeds
        acc = [s["test_accuracy"] for m, _, s, _ in rows if m == mode]
        worst = [s["worst_class_accuracy"] for m, _, s, _ in rows if m == mode]
        print(f"{mode}: mean test accuracy {sum(acc) / len(acc):.4f}, mean worst-class accuracy "
              f"{sum(worst) / len(worst):.4f} over {len(acc)} seed(s)")


if __name__ == "__main__":
    main()
