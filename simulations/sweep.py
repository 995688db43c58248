"""Sweeps: algorithms x datasets x epsilon x seeds, single-node or on Flower's simulation, resumable.

    dpdro sweep --profile quick [--transport local|flower] [--root runs/sweep] [--only-dataset D ...]
                [--only-method A ...] [--only-epsilon E ...] [--only-seed S ...]
    dpdro report [--root runs/sweep] [--profile tuned]      -> docs/RESULTS.md, docs/results.csv, docs/plots/

Each run writes its own run directory ``<root>/<profile>/<dataset>/<algorithm>/eps<e>/seed<s>``; a run whose
summary.json exists is skipped, so an interrupted sweep continues where it stopped. Every number in the
report comes from those summaries. No pre-training: every run starts from the seeded initialisation.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

from ..common.config import Config
from ..common.data import DataError, data_missing
from .tables import write_tuned_report
from .tuned import TUNED_CONFIGS, tuned_config_path

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Profile:
    """A named grid: datasets, algorithms, epsilons, seeds, and the keys every run shares (``base``) plus
    per-dataset and per-algorithm overrides."""

    name: str
    datasets: tuple[str, ...]
    algorithms: tuple[str, ...]
    epsilons: tuple[float, ...]
    seeds: tuple[int, ...]
    base: dict = field(default_factory=dict)
    per_dataset: dict = field(default_factory=dict)
    per_algorithm: dict = field(default_factory=dict)
    tuned_at: float | None = None  # runs take their keys from the tuned config files of this epsilon


_COMMON = {"num-clients": 4, "threads": 1, "reproducible": False, "checkpoint-every": 0}
PROFILES = {
    # Meant to finish within about an hour on 2 CPU cores: short runs, so absolute accuracies are low.
    "quick": Profile(
        "quick", ("mnist-st", "fashion-mnist-st", "celeba"),
        ("dp-sgd", "dp-double-spider", "recursive-spider", "dp-sgda"), (1.0, 2.0, 4.0, 8.0), (0, 1, 2),
        base={**_COMMON, "iterations": 60, "q": 10, "refresh-batch": 256, "diff-batch": 128, "s-batch": 256,
              "eval-every": 60, "max-test-records": 2000, "lr-x": 0.5},
        per_dataset={"celeba": {"max-test-records": 0}},
    ),
    # CI smoke: every real-data pipeline end to end in seconds (numbers meaningless).
    "smoke": Profile(
        "smoke", ("mnist-st", "fashion-mnist-st", "celeba"), ("dp-sgd", "dp-double-spider"), (4.0,), (0,),
        base={**_COMMON, "iterations": 2, "q": 2, "refresh-batch": 64, "diff-batch": 32, "s-batch": 64,
              "eval-every": 2, "max-train-records": 1000, "max-test-records": 200},
    ),
    # Every method with its hyper-parameters tuned at epsilon 4 (`dpdro tune`), at epsilon 1, 4 and 8, 3 seeds,
    # evaluated on the test split: the tables of docs/RESULTS.md.
    "tuned": Profile(
        "tuned", ("mnist-st", "fashion-mnist-st", "celeba", "cifar10-st"),
        ("dp-sgd", "dp-sgd-la", "dp-double-spider", "recursive-spider", "dp-sgda", "dp-sgd-dual", "dp-spiderboost"),
        (1.0, 4.0, 8.0), (0, 1, 2), base={"eval-every": 100}, tuned_at=4.0,
    ),
    # Meant for a GPU: the protocol of ALGORITHMS.md 6.3 at full length.
    "paper": Profile(
        "paper", ("mnist-st", "fashion-mnist-st", "cifar10-st", "celeba"),
        ("dp-sgd", "dp-sgd-dual", "dp-spiderboost", "dp-sgda", "dp-double-spider", "recursive-spider"),
        (1.0, 2.0, 4.0, 8.0), (0, 1, 2),
        base={**_COMMON, "iterations": 2000, "q": 10, "refresh-batch": 1024, "diff-batch": 512, "s-batch": 1024,
              "eval-every": 200, "device": "cuda", "threads": 0},
        per_dataset={"cifar10-st": {"model": "resnet20"}},  # the paper's model (the default, cnn32, is CPU-sized)
    ),
}


def run_dir(root: Path, profile: str, dataset: str, algorithm: str, eps: float, seed: int) -> Path:
    """Run directory of one sweep run: <root>/<profile>/<dataset>/<algorithm>/eps<e>/seed<s>."""
    return root / profile / dataset / algorithm / f"eps{eps:g}" / f"seed{seed}"


def plan_runs(profile: Profile, root: Path, datasets: list[str] | None = None,
              tuned_folder: Path = TUNED_CONFIGS, algorithms: list[str] | None = None,
              epsilons: list[float] | None = None, seeds: list[int] | None = None) -> list[Config]:
    """Validated configs of every run of the profile (ConfigError before any work if one is bad), restricted
    to ``datasets``, ``algorithms``, ``epsilons`` and ``seeds`` when given. A tuned profile skips, with a warning, every
    (dataset, algorithm) that has no tuned config file yet."""
    import tomllib

    out = []
    for ds in profile.datasets:
        if datasets and ds not in datasets:
            continue
        for algo in profile.algorithms:
            if algorithms and algo not in algorithms:
                continue
            tuned = {}
            if profile.tuned_at is not None:
                path = tuned_config_path(ds, profile.tuned_at, algo, tuned_folder)
                if not path.exists():
                    log.warning("no tuned config %s (run `dpdro tune --dataset %s`): its rows stay empty", path, ds)
                    continue
                with open(path, "rb") as f:
                    tuned = tomllib.load(f)
            for eps in profile.epsilons:
                if epsilons and eps not in epsilons:
                    continue
                for seed in profile.seeds:
                    if seeds and seed not in seeds:
                        continue
                    values = {**tuned, **profile.base, **profile.per_dataset.get(ds, {}),
                              **profile.per_algorithm.get(algo, {}),
                              "dataset": ds, "algorithm": algo, "epsilon": eps, "seed": seed,
                              "out-dir": str(run_dir(root, profile.name, ds, algo, eps, seed))}
                    out.append(Config.from_mapping(values))
    return out


def run_sweep(profile_name: str, root: Path, transport: str = "local", datasets: list[str] | None = None,
              jobs: int = 1, algorithms: list[str] | None = None, epsilons: list[float] | None = None,
              seeds: list[int] | None = None) -> dict:
    """Run every unfinished run of the profile (``jobs`` processes at a time for the local transport);
    returns counts {'done', 'skipped', 'missing-data'}."""
    from ..launch.simulate import run_simulation
    from ..server.rundir import continue_keys
    from .runner import run_many

    cfgs = plan_runs(PROFILES[profile_name], root, datasets, algorithms=algorithms, epsilons=epsilons, seeds=seeds)
    counts = {"done": 0, "skipped": 0, "missing-data": 0}
    todo = []
    for cfg in cfgs:
        if (Path(cfg.out_dir) / "summary.json").exists():
            counts["skipped"] += 1
        else:  # an unfinished run goes on from its checkpoint (or starts again if it has none)
            todo.append(cfg.with_updates(continue_keys(cfg.out_dir)))
    if transport == "flower":
        for cfg in todo:
            try:
                run_simulation(cfg, stream=False)
                counts["done"] += 1
            except DataError as e:  # e.g. CIFAR-10 not in ../shared/datasets yet: say so, never fake the row
                log.warning("%s: data not available, its rows stay empty: %s", cfg.dataset, e)
                counts["missing-data"] += 1
        return counts
    missing = {}
    for cfg in todo:  # find missing data sets before starting anything
        if cfg.dataset not in missing:
            missing[cfg.dataset] = data_missing(cfg)
    runnable = [c for c in todo if not missing[c.dataset]]
    for ds, why in missing.items():
        if why:
            log.warning("%s: data not available, its rows stay empty: %s", ds, why)
    counts["missing-data"] = len(todo) - len(runnable)
    counts["done"] = len(run_many(runnable, jobs, f"sweep {profile_name}"))
    return counts


def _mean_std(values: list[float]) -> tuple[float, float]:
    import numpy as np

    a = np.asarray(values, dtype=float)
    return float(a.mean()), float(a.std(ddof=1)) if len(a) > 1 else 0.0


def collect(root: Path, profile_name: str) -> list[dict]:
    """One row per finished run: dataset, algorithm, epsilon, seed and the summary's figures."""
    from ..server.rundir import read_json

    rows = []
    for path in sorted((root / profile_name).glob("*/*/eps*/seed*/summary.json")):
        s = read_json(path)
        worst = s.get("worst_group_accuracy", s["worst_class_accuracy"])
        eps = s["epsilon_spent"]
        rows.append({"dataset": s["dataset"], "algorithm": s["algorithm"], "epsilon_target": s["epsilon_target"],
                     "seed": s["seed"], "test_accuracy": s["test_accuracy"], "worst_accuracy": worst,
                     "epsilon_spent": math.inf if eps == "inf" else float(eps), "wall_seconds": s["wall_seconds"],
                     "transport": s.get("transport", "local"), "accountant": s.get("accountant", "rdp")})
    return rows


def write_report(root: Path, profile_name: str, docs: Path, configs: Path | None = None) -> Path:
    """Write the results document (docs/RESULTS.md for the tuned profile, docs/RESULTS-<profile>.md for the
    others), docs/results[-<profile>].csv and docs/plots/*.png from the finished runs."""
    import csv
    from collections import defaultdict

    rows = collect(root, profile_name)
    docs.mkdir(parents=True, exist_ok=True)
    suffix = "" if profile_name == "tuned" else f"-{profile_name}"
    with open(docs / f"results{suffix}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["dataset"])
        w.writeheader()
        w.writerows(rows)
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        groups[(r["dataset"], r["algorithm"], r["epsilon_target"])].append(r)
    profile = PROFILES[profile_name]
    if profile_name == "tuned":
        plots = _plot(groups, profile, docs / "plots") + _plot_curves(root, profile, docs / "plots")
        return write_tuned_report(rows, profile, docs, configs or TUNED_CONFIGS.parent, plots)
    lines = [f"# Results ({profile_name} profile)", "",
             f"Generated by `dpdro report --profile {profile_name}` from the run directories under "
             f"`{root}/{profile_name}`; every figure is the mean +/- standard deviation over the seeds that "
             "finished (n = seeds). 'worst' is the worst-class test accuracy (MNIST-ST, Fashion-MNIST-ST, "
             "CIFAR10-ST) or the worst-group test accuracy over the 4 (Blond_Hair, Male) cells (CelebA).", "",
             "Protocol of this profile: " + ", ".join(f"{k}={v}" for k, v in sorted(profile.base.items())) + ".",
             "CelebA here is the 10,000-image subset of `../shared/datasets/celeba` (89x109 copies resized to "
             "64x64, all from CelebA's official training partition) with our seeded split stratified by the 4 "
             "cells, 80/10/10 (split-seed 0): its numbers are not comparable with published full-CelebA results.",
             "Hyper-parameters were fixed, not tuned on these runs (the tuning is not privacy-accounted in any case).",
             ""]
    for ds in profile.datasets:
        lines += [f"## {ds}", "", "| algorithm | epsilon | n | test accuracy | worst accuracy | epsilon spent |",
                  "|---|---|---|---|---|---|"]
        any_row = False
        for algo in profile.algorithms:
            for eps in profile.epsilons:
                rs = groups.get((ds, algo, eps))
                if not rs:
                    continue
                any_row = True
                acc, acc_sd = _mean_std([r["test_accuracy"] for r in rs])
                worst, worst_sd = _mean_std([r["worst_accuracy"] for r in rs])
                spent, _ = _mean_std([r["epsilon_spent"] for r in rs])
                lines.append(f"| {algo} | {eps:g} | {len(rs)} | {acc:.3f} +/- {acc_sd:.3f} | "
                             f"{worst:.3f} +/- {worst_sd:.3f} | {spent:.3f} |")
        if not any_row:
            lines.append("| (not run: data not available here yet) | | | | | |")
        lines.append("")
    plot = _plot(groups, profile, docs / "plots") + _plot_curves(root, profile, docs / "plots")
    if plot:
        lines += ["## Plots", ""] + [f"![{p.stem}](plots/{p.name})" for p in plot] + [""]
    for extra in ("AUDIT.md", "EQUIVALENCE.md"):  # generated by `dpdro audit` / `dpdro equivalence`
        if (docs / extra).exists():
            body = (docs / extra).read_text().splitlines()
            lines += ["#" + body[0], *body[1:], ""]
    out = docs / f"RESULTS{suffix}.md"
    out.write_text("\n".join(lines))
    return out


def _plot_curves(root: Path, profile: Profile, folder: Path) -> list[Path]:
    """Training curves (test and worst accuracy against iteration, from each run's metrics.csv) of seed
    ``profile.seeds[0]`` at the epsilon closest to 4, one PNG per dataset."""
    import csv

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    eps = min(profile.epsilons, key=lambda e: abs(e - 4.0))
    paths = []
    for ds in profile.datasets:
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        drawn = False
        for algo in profile.algorithms:
            path = run_dir(root, profile.name, ds, algo, eps, profile.seeds[0]) / "metrics.csv"
            if not path.exists():
                continue
            rows = list(csv.DictReader(open(path)))
            worst = "worst_group_accuracy" if "worst_group_accuracy" in rows[0] else "worst_class_accuracy"
            its = [int(r["iteration"]) for r in rows]
            for ax, key in zip(axes, ("test_accuracy", worst), strict=True):
                ax.plot(its, [float(r[key]) for r in rows], marker="o", label=algo)
            drawn = True
        if not drawn:
            plt.close(fig)
            continue
        paths.append(_finish(fig, axes, "iteration", f"{ds}, epsilon {eps:g}, seed {profile.seeds[0]}",
                             folder / f"{_prefix(profile)}{ds}_training_curves.png"))
    return paths


def _prefix(profile: Profile) -> str:
    """Plot file prefix: none for the tuned profile (docs/RESULTS.md), '<profile>_' for the others."""
    return "" if profile.name == "tuned" else f"{profile.name}_"


def _finish(fig, axes, xlabel: str, title: str, path: Path) -> Path:
    """Label the (accuracy, worst accuracy) pair of axes, save the figure as PNG and close it."""
    import matplotlib.pyplot as plt

    for ax, what in zip(axes, ("test accuracy", "worst-class / worst-group accuracy"), strict=True):
        ax.set_xlabel(xlabel)
        ax.set_title(f"{title}: {what}")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _plot(groups: dict, profile: Profile, folder: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for ds in profile.datasets:
        if not any(k[0] == ds for k in groups):
            continue
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        for algo in profile.algorithms:
            pts = [(eps, groups[(ds, algo, eps)]) for eps in profile.epsilons if (ds, algo, eps) in groups]
            if not pts:
                continue
            for ax, key in zip(axes, ("test_accuracy", "worst_accuracy"), strict=True):
                means = [_mean_std([r[key] for r in rs]) for _, rs in pts]
                ax.errorbar([e for e, _ in pts], [m for m, _ in means], yerr=[s for _, s in means], marker="o",
                            label=algo, capsize=3)
        for ax in axes:
            ax.set_xscale("log", base=2)
        paths.append(_finish(fig, axes, "epsilon", ds, folder / f"{_prefix(profile)}{ds}_accuracy_vs_epsilon.png"))
    return paths
