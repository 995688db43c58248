"""The GPU check: the paper profile on CIFAR10-ST (GroupNorm ResNet20, the main methods, epsilon 4, one seed) and
``dpdro lab bench``'s step-time rows, on one device, every output under one folder.

    python -m dpdro.simulations.gpu_check [--out runs/gpu-check] [--device cuda] [--iterations N]
                                          [--budget-seconds 540] [--tiny]

Meant to finish in under 10 minutes on one GPU: every run has the paper profile's keys (``sweep.PROFILES['paper']``:
batches 1024/512, q 10, threads 0) except ``iterations`` (default 400 of the paper's 2000); a run is started only
while less than ``--budget-seconds`` have passed, and the ones left out are listed as not run. ``--tiny`` shrinks
everything (a few records and iterations) so that the same code is tested on a CPU in seconds
(tests/test_gpu_check.py). Nothing here is tuned: the figures check that the GPU path works and how fast it is,
they are not results for docs/research/RESULTS.md's tables.

Outputs under ``--out``: ``runs/paper/cifar10-st/<method>/eps4/seed0/`` (ordinary run directories),
``PERFORMANCE-<device>.md`` and ``.json`` (``dpdro lab bench --quick --no-flower`` with ResNet20 and the CIFAR CNN in
table (f)), and ``gpu_check.json`` / ``GPU_CHECK.md`` (per run: wall seconds, seconds per iteration, test and
worst-class accuracy, epsilon spent).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from ..common.atomic import atomic_write_text
from ..common.config import Config, check_device
from .sweep import PROFILES, plan_runs

DATASET = "cifar10-st"
METHODS = ("dp-sgd", "dp-double-spider", "recursive-spider")
EPSILON = 4.0
# Table (f) rows: the paper model and the CPU default on 3x32x32, at the paper's refresh batch.
BENCH_SWEEP = [("resnet20", 1024, 256), ("resnet20", 1024, 1024), ("cnn32", 1024, 1024)]
TINY_RUN = {"q": 2, "refresh-batch": 16, "diff-batch": 8, "s-batch": 16, "eval-every": 2,
            "max-train-records": 200, "max-test-records": 50, "chunk-size": 8}
TINY_BENCH = {"batch": 8, "chunk_size": 4, "repeats": 1, "sweep": [("resnet20", 4, 2)]}


def plan(out: Path, device: str, iterations: int, tiny: bool, methods: tuple[str, ...] = METHODS) -> list[dict]:
    """Config mappings (kebab-case keys) of the check's runs: the paper profile's CIFAR10-ST runs of ``methods`` at
    epsilon 4, seed 0, model resnet20, on ``device``; ``tiny`` adds ``TINY_RUN``. ConfigError for a bad value."""
    cfgs = plan_runs(PROFILES["paper"], out / "runs", [DATASET], algorithms=list(methods), epsilons=[EPSILON])
    extra = {"device": device, "model": "resnet20", "iterations": iterations, "overwrite": True,
             **({**TINY_RUN, "threads": 1} if tiny else {})}
    return [Config.from_mapping({**c.to_dict(), **extra}).to_dict() for c in cfgs if c.seed == 0]


def run_check(out: Path, device: str = "cuda", iterations: int = 400, budget_seconds: float = 540.0,
              tiny: bool = False, methods: tuple[str, ...] = METHODS, log=print) -> dict:
    """Run the check and write its outputs under ``out``; returns what ``gpu_check.json`` holds.

    Raises ConfigError before any work when ``device`` cannot be used here (no GPU for 'cuda') or a key is bad,
    DataError when CIFAR-10 is not found.
    """
    from ..client.local_transport import LocalTransport
    from ..common.data import load_from_config
    from ..server.engine import train
    from ..server.rundir import check_out_dir
    from .bench import BenchOptions, run_bench

    check_device(device)
    runs = [Config.from_mapping(v) for v in plan(out, device, iterations, tiny, methods)]
    started = time.perf_counter()
    result: dict = {"device": device, "dataset": DATASET, "epsilon": EPSILON, "iterations": iterations,
                    "tiny": tiny, "runs": [], "not_run": []}
    data = None  # loaded once: every run has the same data keys, and each load re-checks every file's md5
    for cfg in runs:
        elapsed = time.perf_counter() - started
        if elapsed > budget_seconds:  # never start a run past the budget: the check must stay short
            result["not_run"].append({"algorithm": cfg.algorithm, "why": f"time budget ({elapsed:.0f} s)"})
            continue
        log(f"{cfg.algorithm}: {cfg.iterations} iterations on {device} ...")
        t0 = time.perf_counter()
        check_out_dir(cfg.out_dir, resume=False, overwrite=True)
        if data is None:
            data = load_from_config(cfg, True), load_from_config(cfg, False)
        s = train(cfg, LocalTransport(cfg, data[0]), data[1]).summary
        result["runs"].append({"algorithm": cfg.algorithm, "wall_seconds": time.perf_counter() - t0,
                               "train_seconds": s["wall_seconds"],
                               "seconds_per_iteration": s["wall_seconds"] / cfg.iterations,
                               "test_accuracy": s["test_accuracy"], "worst_class_accuracy": s["worst_class_accuracy"],
                               "epsilon_spent": s["epsilon_spent"], "out_dir": cfg.out_dir})
    log("bench (steps and table (f)) ...")
    doc = out / f"PERFORMANCE-{device}.md"
    opts = dict(TINY_BENCH) if tiny else {"sweep": BENCH_SWEEP}
    bench = run_bench(BenchOptions(quick=True, device=device, threads=1 if tiny or device == "cpu" else 0,
                                   flower=False, doc=str(doc), **opts), log=lambda _: None)
    result["bench_rows"] = bench["sweep"]
    result["bench_doc"] = str(doc)
    result["seconds"] = time.perf_counter() - started
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "gpu_check.json", json.dumps(result, indent=1, default=str))
    atomic_write_text(out / "GPU_CHECK.md", render(result))
    return result


def render(result: dict) -> str:
    """GPU_CHECK.md: one row per run, the runs left out, and the bench rows."""
    lines = [f"# GPU check ({result['device']}{', tiny' if result['tiny'] else ''})", "",
             f"Paper profile on {result['dataset']} (GroupNorm ResNet20), epsilon {result['epsilon']:g}, seed 0, "
             f"{result['iterations']} iterations per run; {result['seconds']:.0f} s in all. Not tuned: a check of "
             "the device path, not a results table.", "",
             "| method | wall s | s / iteration | test accuracy | worst-class accuracy | epsilon spent |",
             "|---|---|---|---|---|---|"]
    for r in result["runs"]:
        lines.append(f"| {r['algorithm']} | {r['wall_seconds']:.1f} | {r['seconds_per_iteration']:.3f} | "
                     f"{r['test_accuracy']:.4f} | {r['worst_class_accuracy']:.4f} | {float(r['epsilon_spent']):.3f} |")
    for r in result["not_run"]:
        lines.append(f"| {r['algorithm']} | not run: {r['why']} | | | | |")
    lines += ["", "Refresh step (per-record gradients, clip, sum) by `dpdro lab bench` on the same device:", "",
              "| model | parameters | batch | chunk | step (s) | samples/s | peak MiB |",
              "|---|---|---|---|---|---|---|"]
    for r in result["bench_rows"]:
        lines.append(f"| {r['model']} | {r['dim']} | {r['batch']} | {r['chunk']} | {r['seconds']:.4f} | "
                     f"{r['samples_per_second']:.0f} | {r['peak_mib']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Command line of the check (see the module docstring); exit status 0 on success."""
    p = argparse.ArgumentParser(prog="python -m dpdro.simulations.gpu_check", description=__doc__.split("\n")[0])
    p.add_argument("--out", default="runs/gpu-check", help="folder for every output (runs, bench, summary)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--iterations", type=int, default=None,
                   help="iterations per run (default 400, or 2 with --tiny; the paper profile has 2000)")
    p.add_argument("--budget-seconds", type=float, default=540.0, help="start no run after this many seconds")
    p.add_argument("--tiny", action="store_true", help="a few records and iterations: a CPU test of the script")
    args = p.parse_args(argv)
    iterations = args.iterations or (2 if args.tiny else 400)
    result = run_check(Path(args.out), args.device, iterations, args.budget_seconds, args.tiny)
    print((Path(args.out) / "GPU_CHECK.md").read_text())
    return 0 if result["runs"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
