"""Sweeps: algorithms x datasets x epsilon x seeds, single-node or on Flower's simulation, resumable.

    dpdro lab sweep --profile quick [--transport local|flower] [--root runs/sweep] [--only-dataset D ...]
                [--only-method A ...] [--only-epsilon E ...] [--only-seed S ...]
    dpdro lab report [--root runs/sweep] [--profile tuned]      -> docs/research/: RESULTS.md, results.csv, plots/

Each run writes its own run directory ``<root>/<profile>/<dataset>/<algorithm>/eps<e>/seed<s>``; a run whose
summary.json exists is skipped, so an interrupted sweep continues where it stopped. Every number in the
report comes from those summaries. No pre-training: every run starts from the seeded initialisation.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

from ..common.atomic import atomic_write_text
from ..common.config import Config, ConfigError
from ..common.data import DataError, data_missing
from .tables import LEGACY_DELTA, carried_sentence, delta_words, legacy_mark, mean_std, write_tuned_report
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
    # (dataset, epsilon) -> the methods that decide that table (the best paper method and the best other method):
    # their cells also run ``decisive_seeds``, so the decision rests on more seeds than the rest of the table
    decisive: dict = field(default_factory=dict)
    decisive_seeds: tuple[int, ...] = ()

    def seeds_of(self, dataset: str, algorithm: str, epsilon: float) -> tuple[int, ...]:
        """The seeds planned for one cell: ``seeds``, plus ``decisive_seeds`` for a decisive cell."""
        more = self.decisive_seeds if algorithm in self.decisive.get((dataset, float(epsilon)), ()) else ()
        return self.seeds + tuple(s for s in more if s not in self.seeds)


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
    # Every method with its hyper-parameters tuned at epsilon 4 (`dpdro lab tune`), at epsilon 1, 4 and 8, 3 seeds
    # (5 for the cells that decide a table: the best paper method and the best other method of the 3-seed tables,
    # and MNIST-ST's strongest simple baseline, the main job), evaluated on the test split: docs/research/RESULTS.md.
    "tuned": Profile(
        "tuned", ("mnist-st", "fashion-mnist-st", "celeba", "cifar10-st"),
        ("dp-sgd", "dp-sgd-la", "dp-double-spider", "recursive-spider", "dp-sgda", "dp-sgd-dual", "dp-spiderboost"),
        (1.0, 4.0, 8.0), (0, 1, 2), base={"eval-every": 100}, tuned_at=4.0,
        decisive={("mnist-st", 4.0): ("recursive-spider", "dp-sgda", "dp-sgd-la"),
                  ("mnist-st", 1.0): ("recursive-spider", "dp-sgda"),
                  ("fashion-mnist-st", 4.0): ("dp-double-spider", "dp-sgd-la"),
                  ("celeba", 4.0): ("recursive-spider", "dp-sgd-la"),
                  ("cifar10-st", 4.0): ("dp-double-spider", "dp-sgd-la")},
        decisive_seeds=(3, 4),
    ),
    # Meant for a GPU: the protocol of docs/explanation/ALGORITHMS.md 6.3 at full length.
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
                    log.warning("no tuned config %s (run `dpdro lab tune --dataset %s`): its rows stay empty", path, ds)
                    continue
                with open(path, "rb") as f:
                    tuned = tomllib.load(f)
            for eps in profile.epsilons:
                if epsilons and eps not in epsilons:
                    continue
                for seed in profile.seeds_of(ds, algo, eps):
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
              seeds: list[int] | None = None, tuned_folder: Path = TUNED_CONFIGS) -> dict:
    """Run every unfinished run of the profile (``jobs`` processes at a time for the local transport), a tuned
    profile with the config files in ``tuned_folder``; returns counts {'done', 'skipped', 'missing-data'}."""
    from ..launch.simulate import run_simulation
    from ..server.rundir import continue_keys
    from .runner import run_many

    cfgs = plan_runs(PROFILES[profile_name], root, datasets, tuned_folder, algorithms, epsilons, seeds)
    stale = changed_runs(cfgs)
    if stale:
        raise ConfigError(f"{len(stale)} finished run directories were made with another configuration than the "
                          "config files now plan (e.g. a method tuned again), so skipping them would report the "
                          "old experiment as the new one: " + "; ".join(f"{d} (config_sha {have}, planned {want})"
                                                                       for d, have, want in stale)
                          + ". Move them away (e.g. to <dir>.old) and the sweep runs them again.")
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


def changed_runs(planned: list[Config]) -> list[tuple[str, str, str]]:
    """(run directory, its config_sha, the planned config_sha) of each planned run that finished (summary.json)
    under another configuration than the planned one (``config_fingerprint`` of its config.json). A finished run
    directory without config.json is not compared."""
    from ..server.engine import load_run_config

    out = []
    for cfg in planned:
        run = Path(cfg.out_dir)
        if (run / "summary.json").exists() and (run / "config.json").exists():
            have, want = config_fingerprint(load_run_config(run)), config_fingerprint(cfg)
            if have != want:
                out.append((str(run), have, want))
    return out


# The defaults before 2026-12-02 (delta = 'auto' meant n^-1.1, server/ledger.py AUTO_DELTA_RULE is today's rule; the
# accountant was RDP, PLD since): runs made under them are carried, marked, until a run of the same cell replaces
# them (carried_rows).
LEGACY_DEFAULTS = {"delta": f"auto: {LEGACY_DELTA}", "accountant": "rdp"}
# Keys that say where a run's files are, not what it computes (beside the engine's runtime keys).
_PATH_KEYS = frozenset({"data-root", "cache-dir"})
# Keys added after runs were published, with the value that computes what every run made before them computed: left
# out of the fingerprint at that value, so that adding a key does not orphan the published rows (a sweep of
# 2026-12-04 dropped every carried row when block-order joined the configuration).
KEYS_ADDED_LATER = {"block-order": "sequential", "reproducible-for-testing": False, "model-fix": "none",
                    "init-weights": "", "trainable": "all", "features": "none", "secure-noise": False,
                    "eval-data": "auto", "eval-epsilon": 0.1, "eval-noise-multiplier": 0.0,
                    "x-estimator": "spider", "x-storm-a": 0.1, "clip-diff-rule": "fixed", "clip-diff-quantile": 0.5,
                    "clip-diff-quantile-lr": 0.2, "clip-diff-quantile-noise-ratio": 5.0,
                    "node-sampling-rate": 1.0, "privacy-unit": "record", "momentum": 0.0, "ema-decay": 0.0,
                    "checkpoint-select": "last", "ddg-bits": "auto",
                    "ddg-wrap-probability": 1e-9, "ddg-shortfall": "refuse", "local-epochs": 0,
                    "local-lr": 0.05, "local-batch": 16, "feature-norm": "groupnorm", "feature-norm-clip": 1.0,
                    "feature-norm-noise-multiplier": 8.0, "num-sites": 0}
# Keys that change only what a run states about itself (the summary's not_accounted), never what it computes: left
# out of the fingerprint at every value.
STATEMENT_KEYS = ("chosen-on-private-data",)


def config_fingerprint(cfg: Config, legacy: bool = False) -> str:
    """16 hex digits of SHA-256 over the keys that decide what a run computes: every configuration key (seed
    included) except the runtime ones (``engine.RUNTIME_KEYS``: out-dir, threads, eval-every, ...) and the data
    paths, as sorted JSON of the validated Config, with the 'auto' values whose meaning is a rule resolved: the
    logit-adjustment tau (``Config.tau``) and delta (``ledger.AUTO_DELTA_RULE``, the rule of today's code), and
    without the ``KEYS_ADDED_LATER`` that hold the value reproducing the runs made before them, and without the
    ``STATEMENT_KEYS``.
    ``legacy``: the fingerprint the same keys had under LEGACY_DEFAULTS (runs before 2026-12-02, whose files set
    neither delta nor the accountant). Two runs with the same fingerprint are the same experiment; the code version
    itself is not in it (a change of what a configuration computes must be followed by new runs, ``dpdro lab report
    --no-carry``)."""
    import hashlib
    import json

    from ..common.config import AUTO
    from ..server.engine import RUNTIME_KEYS
    from ..server.ledger import AUTO_DELTA_RULE

    keys = {k: v for k, v in cfg.to_dict().items()
            if k not in RUNTIME_KEYS and k not in _PATH_KEYS and k not in STATEMENT_KEYS}
    keys["logit-adjust-tau"] = cfg.tau
    for key, before in KEYS_ADDED_LATER.items():
        if keys.get(key) == before:
            del keys[key]
    if keys["delta"] == AUTO:
        keys["delta"] = f"auto: {AUTO_DELTA_RULE}"
    if legacy:
        keys.update(LEGACY_DEFAULTS)
    return hashlib.sha256(json.dumps(keys, sort_keys=True, default=str).encode()).hexdigest()[:16]


def collect(root: Path, profile_name: str) -> list[dict]:
    """One row per finished run: dataset, algorithm, epsilon, seed, the summary's figures, worst_records (the
    test records of the worst group on data with groups; empty for other data and for summaries written before it
    was recorded) and config_sha (the run's ``config_fingerprint``; empty for a run directory without
    config.json)."""
    from ..server.engine import load_run_config
    from ..server.rundir import read_json

    rows = []
    for path in sorted((root / profile_name).glob("*/*/eps*/seed*/summary.json")):
        s = read_json(path)
        worst = s.get("worst_group_accuracy", s["worst_class_accuracy"])
        eps = s["epsilon_spent"]
        sha = config_fingerprint(load_run_config(path.parent)) if (path.parent / "config.json").exists() else ""
        rows.append({"dataset": s["dataset"], "algorithm": s["algorithm"], "epsilon_target": s["epsilon_target"],
                     "seed": s["seed"], "test_accuracy": s["test_accuracy"], "worst_accuracy": worst,
                     "epsilon_spent": math.inf if eps == "inf" else float(eps), "wall_seconds": s["wall_seconds"],
                     "transport": s.get("transport", "local"), "accountant": s.get("accountant", "rdp"),
                     "delta": s.get("delta", ""), "worst_records": s.get("worst_group_records", ""),
                     "config_sha": sha, "source": "run"})
    return rows


def _cell(row: dict) -> tuple:
    return row["dataset"], row["algorithm"], float(row["epsilon_target"]), int(row["seed"])


def _read_csv(path: Path) -> list[dict]:
    import csv

    if not path.exists():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _typed(row: dict) -> dict:
    """A CSV row with the cell and the figures typed as ``collect`` types them."""
    cell = _cell(row)
    figures = {k: float(row[k]) for k in ("test_accuracy", "worst_accuracy", "epsilon_spent", "wall_seconds")
               if k in row}
    return {**row, **figures, "epsilon_target": cell[2], "seed": cell[3]}


def carried_rows(previous: Path, planned: list[Config], have: list[dict]) -> list[dict]:
    """The rows of an earlier results CSV (``previous``, e.g. docs/research/results.csv) for planned runs that
    have no run directory here (no row in ``have``), kept only when the row's config_sha is the planned run's
    ``config_fingerprint``: the same experiment, run on another machine or before this one was wiped; also when it is
    the fingerprint under LEGACY_DEFAULTS (the same keys under the defaults before 2026-12-02; the row's delta and
    accountant columns say so and the tables mark it). A row without config_sha, or of a configuration that has
    changed since (e.g. a method tuned again), is dropped. Returns the rows typed, with source 'carried'."""
    want = {(c.dataset, c.algorithm, float(c.epsilon), int(c.seed)): (config_fingerprint(c),
                                                                       config_fingerprint(c, legacy=True))
            for c in planned}
    done = {_cell(r) for r in have}
    out = []
    for r in _read_csv(previous):
        cell = _cell(r)
        if cell not in done and r.get("config_sha") and r["config_sha"] in want.get(cell, ()):
            done.add(cell)
            out.append({**_typed(r), "accountant": r.get("accountant") or "rdp", "source": "carried"})
    return out


def carried_curves(previous: Path, kept: list[dict]) -> list[dict]:
    """The rows of an earlier training-curves CSV (``previous``, e.g. docs/research/curves.csv) of the runs
    ``kept`` from the earlier results CSV (``carried_rows``): same cell, same config_sha."""
    want = {_cell(r): r["config_sha"] for r in kept}
    return [{**_typed(r), "iteration": int(r["iteration"])} for r in _read_csv(previous)
            if r.get("config_sha") and want.get(_cell(r)) == r["config_sha"]]


def write_report(root: Path, profile_name: str, docs: Path, configs: Path | None = None, carry: bool = True) -> Path:
    """Write the results document (RESULTS.md for the tuned profile, RESULTS-<profile>.md for the others),
    results[-<profile>].csv, the training curves they plot (curves[-<profile>].csv) and plots/*.png into ``docs``
    (docs/research by default) from the finished runs under ``root`` and, with ``carry``, the rows of the
    previous CSVs that ``carried_rows`` keeps (runs of the same configuration whose directories are not on this
    machine). The CSVs are replaced atomically."""
    from collections import defaultdict

    profile = PROFILES[profile_name]
    suffix = "" if profile_name == "tuned" else f"-{profile_name}"
    csv_path, curves_path = docs / f"results{suffix}.csv", docs / f"curves{suffix}.csv"
    planned = plan_runs(profile, root, tuned_folder=(configs or TUNED_CONFIGS.parent) / "tuned")
    want = {(c.dataset, c.algorithm, float(c.epsilon), int(c.seed)): config_fingerprint(c) for c in planned}
    rows = []
    for r in collect(root, profile_name):  # a run of an older configuration of its cell is not the planned one
        if r["config_sha"] and want.get(_cell(r), r["config_sha"]) != r["config_sha"]:
            log.warning("%s %s eps %g seed %d: its run directory has config_sha %s, the config files plan %s; "
                        "left out of the report", *_cell(r), r["config_sha"], want[_cell(r)])
            continue
        rows.append(r)
    curves = curve_rows(root, profile, rows)
    if carry:
        kept = carried_rows(csv_path, planned, rows)
        rows += kept
        curves += carried_curves(curves_path, kept)
    rows.sort(key=_cell)
    curves.sort(key=lambda r: (*_cell(r), int(r["iteration"])))
    docs.mkdir(parents=True, exist_ok=True)
    _write_csv(csv_path, rows)
    _write_csv(curves_path, curves)
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        groups[(r["dataset"], r["algorithm"], r["epsilon_target"])].append(r)
    if profile_name == "tuned":
        plots = _plot(groups, profile, docs / "plots") + _plot_curves(curves, profile, docs / "plots")
        return write_tuned_report(rows, profile, docs, configs or TUNED_CONFIGS.parent, plots)
    lines = [f"# Results ({profile_name} profile)", "",
             f"Generated by `dpdro lab report --profile {profile_name}` from the run directories under "
             f"`{root}/{profile_name}`; every figure is the mean +/- standard deviation over the seeds that "
             "finished (n = seeds). 'worst' is the worst-class test accuracy (MNIST-ST, Fashion-MNIST-ST, "
             "CIFAR10-ST) or the worst-group test accuracy over the 4 (Blond_Hair, Male) cells (CelebA); "
             + delta_words(rows) + ". " + carried_sentence(rows), "",
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
                acc, acc_sd = mean_std([r["test_accuracy"] for r in rs])
                worst, worst_sd = mean_std([r["worst_accuracy"] for r in rs])
                spent, _ = mean_std([r["epsilon_spent"] for r in rs])
                lines.append(f"| {algo} | {eps:g} | {len(rs)} | {acc:.3f} +/- {acc_sd:.3f}{legacy_mark(rs)} | "
                             f"{worst:.3f} +/- {worst_sd:.3f}{legacy_mark(rs)} | {spent:.3f} |")
        if not any_row:
            lines.append("| (not run: data not available here yet) | | | | | |")
        lines.append("")
    plot = _plot(groups, profile, docs / "plots") + _plot_curves(curves, profile, docs / "plots")
    if plot:
        lines += ["## Plots", ""] + [f"![{p.stem}](plots/{p.name})" for p in plot] + [""]
    for extra in ("AUDIT.md", "EQUIVALENCE.md"):  # generated by `dpdro lab audit` / `dpdro lab equivalence`
        if (docs / extra).exists():
            body = (docs / extra).read_text().splitlines()
            lines += ["#" + body[0], *body[1:], ""]
    out = docs / f"RESULTS{suffix}.md"
    atomic_write_text(out, "\n".join(lines))
    return out


def _curve_epsilon(profile: Profile) -> float:
    return min(profile.epsilons, key=lambda e: abs(e - 4.0))


def curve_rows(root: Path, profile: Profile, rows: list[dict]) -> list[dict]:
    """The training curves the report plots, one row per evaluation: of seed ``profile.seeds[0]`` at the epsilon
    closest to 4, for each run of ``rows`` whose run directory is here (its metrics.csv): dataset, algorithm,
    epsilon_target, seed, config_sha, iteration, test_accuracy, worst_accuracy (worst class, or worst group where
    the run measures groups)."""
    import csv

    eps, out = _curve_epsilon(profile), []
    for r in rows:
        if r.get("source") != "run" or float(r["epsilon_target"]) != eps or int(r["seed"]) != profile.seeds[0]:
            continue
        path = run_dir(root, profile.name, r["dataset"], r["algorithm"], eps, profile.seeds[0]) / "metrics.csv"
        if not path.exists():
            continue
        with open(path, newline="") as f:
            metrics = list(csv.DictReader(f))
        worst = "worst_group_accuracy" if metrics and "worst_group_accuracy" in metrics[0] else "worst_class_accuracy"
        out += [{"dataset": r["dataset"], "algorithm": r["algorithm"], "epsilon_target": eps, "seed": r["seed"],
                 "config_sha": r["config_sha"], "iteration": int(m["iteration"]),
                 "test_accuracy": float(m["test_accuracy"]), "worst_accuracy": float(m[worst])}
                for m in metrics if m.get("test_accuracy") not in (None, "")]
    return out


def _write_csv(path: Path, rows: list[dict]) -> None:
    import csv
    import io

    from ..common.atomic import atomic_write_bytes

    buf = io.StringIO()
    columns = list(dict.fromkeys(k for r in rows for k in r)) or ["dataset"]  # rows carried from older CSVs
    w = csv.DictWriter(buf, fieldnames=columns, restval="", lineterminator="\n")  # may lack newer columns
    w.writeheader()
    w.writerows(rows)
    atomic_write_bytes(path, buf.getvalue().encode())


def _plot_curves(curves: list[dict], profile: Profile, folder: Path) -> list[Path]:
    """Training curves (test and worst accuracy against iteration, ``curve_rows``), one PNG per dataset."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    eps = _curve_epsilon(profile)
    paths = []
    for ds in profile.datasets:
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        drawn = False
        for algo in profile.algorithms:
            rows = [r for r in curves if r["dataset"] == ds and r["algorithm"] == algo]
            if not rows:
                continue
            its = [int(r["iteration"]) for r in rows]
            for ax, key in zip(axes, ("test_accuracy", "worst_accuracy"), strict=True):
                ax.plot(its, [float(r[key]) for r in rows], marker="o", label=algo)
            drawn = True
        if not drawn:
            plt.close(fig)
            continue
        paths.append(_finish(fig, axes, "iteration", f"{ds}, epsilon {eps:g}, seed {profile.seeds[0]}",
                             folder / f"{_prefix(profile)}{ds}_training_curves.png"))
    return paths


def _prefix(profile: Profile) -> str:
    """Plot file prefix: none for the tuned profile (docs/research/RESULTS.md), '<profile>_' for the others."""
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
                means = [mean_std([r[key] for r in rs]) for _, rs in pts]
                ax.errorbar([e for e, _ in pts], [m for m, _ in means], yerr=[s for _, s in means], marker="o",
                            label=algo, capsize=3)
        for ax in axes:
            ax.set_xscale("log", base=2)
        paths.append(_finish(fig, axes, "epsilon", ds, folder / f"{_prefix(profile)}{ds}_accuracy_vs_epsilon.png"))
    return paths
