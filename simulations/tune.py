"""Hyper-parameter search without test leakage: ``dpdro tune``.

    dpdro tune --dataset mnist-st --epsilon 4 [--trials 8] [--methods dp-sgd dp-sgd-la ...] [--jobs 2]

Every method gets the same number of trials (random search over its space below, seeded by ``--seed`` and
the method's name). A trial is a full private run at the target epsilon that trains on the training split
minus a held-out validation split (``validation-fraction`` of every class, seeded by ``split-seed``; CelebA
uses its own validation split) and is evaluated on that validation split only: the test split is never
looked at. The trial with the best validation worst-class accuracy (worst-group on CelebA) wins, ties broken
by validation accuracy, then by trial order. Its keys are written as a config file that trains on the whole
training split and is evaluated on the test split:

    simulations/configs/tuned/<dataset>-eps<e>-<method>.toml     one per method
    simulations/configs/<dataset>-eps<e>-best.toml               the best method's (the overall winner)

``dpdro tune --dataset D --transfer-from S`` runs no trial: it writes D's tuned files from S's, keeping each
method's searched keys (batch sizes in units of the data set's 'batch-scale') and taking everything else from
D's trial keys. Nothing of D is then looked at to choose the hyper-parameters, so the choice costs D no privacy
at all; the files' first line and docs/RESULTS.md say where they came from.

and every trial's validation figures go to ``docs/TUNING.md`` (``dpdro tune --report``). Runs are resumable:
a trial whose summary.json exists is not run again.

Not privacy-accounted: the search reads noiseless validation metrics of private training records, so the
chosen hyper-parameters depend on the private data beyond the runs' epsilon (the standard practice the
results document states). Private selection (e.g. random stopping, Papernot & Steinke 2022) is not
implemented.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

from ..common.algorithm_specs import ALGORITHM_SPECS
from ..common.config import Config, toml_lines
from ..common.rng import derived_rng
from .tuned import TRANSFER_MARK, transferred_from, tuned_config_path

log = logging.getLogger(__name__)

# Keys shared by every trial of a data set (the training budget is the same for every method).
BASE = {"num-clients": 4, "threads": 1, "reproducible": False, "checkpoint-every": 0, "iterations": 500,
        "clip-x": 1.0, "clip-eta": 1.0, "noise-allocation": "variance"}
PER_DATASET = {
    "mnist-st": {"validation-fraction": 0.2},
    "fashion-mnist-st": {"validation-fraction": 0.2},
    "cifar10-st": {"validation-fraction": 0.2},
    "celeba": {"iterations": 300, "batch-scale": 0.5},  # 8,000 training images: half the batch sizes
}
# Per method: the searched keys and the keys every trial shares, declared with the algorithm
# (common/algorithm_specs.py: AlgorithmSpec.space and .fixed).
# Baselines first, then the DP-DRO methods (the order of the runs, the report and of ties between winners).
_ORDER = sorted(ALGORITHM_SPECS.values(), key=lambda s: s.dro)
SPACES: dict[str, dict[str, tuple]] = {s.name: dict(s.space) for s in _ORDER if s.space}
FIXED: dict[str, dict] = {n: dict(s.fixed) for n, s in ALGORITHM_SPECS.items() if s.fixed}
METHODS = tuple(SPACES)


def trial_keys(method: str, trials: int, seed: int) -> list[dict]:
    """``trials`` distinct points of the method's space, drawn uniformly without replacement (all of them,
    in a seeded order, when the space is smaller). Raises ValueError for an unknown method."""
    if method not in SPACES:
        raise ValueError(f"unknown method {method!r}; allowed: {', '.join(SPACES)}")
    space = SPACES[method]
    names = sorted(space)
    sizes = [len(space[k]) for k in names]
    total = math.prod(sizes)
    rng = derived_rng(seed, "tune", method)
    picks = rng.choice(total, size=min(trials, total), replace=False)
    out = []
    for flat in picks:
        point, rest = {}, int(flat)
        for k, size in zip(names, sizes, strict=True):
            point[k] = space[k][rest % size]
            rest //= size
        out.append(point)
    return out


def trial_config(dataset: str, epsilon: float, method: str, keys: dict, out_dir: Path) -> Config:
    """The configuration of one trial: BASE, the data set's keys, the method's FIXED keys, the trial's
    searched keys; batch sizes scaled by the data set's 'batch-scale', SPIDER difference (and s) batches at
    half (and equal to) the refresh batch; evaluated on the validation split only."""
    per = dict(PER_DATASET.get(dataset, {}))
    scale = per.pop("batch-scale", 1.0)
    values = {**BASE, **per, **FIXED.get(method, {}), **keys, "dataset": dataset, "algorithm": method,
              "epsilon": epsilon, "seed": 0, "eval-split": "validation", "out-dir": str(out_dir)}
    batch = int(values["refresh-batch"] * scale)
    values.update({"refresh-batch": batch, "diff-batch": batch // 2, "s-batch": batch})
    values["eval-every"] = values["iterations"]
    return Config.from_mapping(values)


def final_keys(cfg: Config) -> dict:
    """The keys of a tuned config file, with the validation split off and the test split evaluated: every key
    the search set (BASE, the method's FIXED and searched keys, the batches) and every other key that differs
    from its default, minus run-local keys (out-dir, seed, eval-every). Writing the searched keys even where
    they equal today's defaults keeps the file's meaning if a default changes."""
    default = Config.from_mapping({}).to_dict()
    values = cfg.with_updates({"validation-fraction": 0.0, "eval-split": "test"}).to_dict()
    explicit = ({"algorithm", "dataset", "epsilon", "iterations", "refresh-batch", "diff-batch", "s-batch"}
                | set(BASE) | set(FIXED.get(cfg.algorithm, {})) | set(SPACES.get(cfg.algorithm, {})))
    drop = {"out-dir", "seed", "eval-every", "validation-fraction", "eval-split"}
    return {k: v for k, v in values.items() if k not in drop and (k in explicit or v != default[k])}


def trial_dir(root: Path, dataset: str, epsilon: float, method: str, i: int) -> Path:
    """Run directory of trial i: <root>/<dataset>/eps<e>/<method>/trial<ii>."""
    return root / dataset / f"eps{epsilon:g}" / method / f"trial{i:02d}"


def run_tune(dataset: str, epsilon: float, methods: list[str], trials: int, root: Path, configs: Path,
             seed: int = 0, jobs: int = 2) -> dict[str, dict]:
    """Run every unfinished trial (``jobs`` processes), then write the tuned config files. Returns
    method -> the winning trial's record (see ``collect_trials``)."""
    from ..common.data import DataError
    from ..server.rundir import continue_keys
    from .runner import run_many

    stored = search_file(root, dataset, epsilon)
    if stored.exists() and search_size(root, dataset, epsilon, trials, seed) != (trials, seed):
        raise ValueError(f"{stored} records a search with other --trials/--seed "
                         f"{search_size(root, dataset, epsilon, trials, seed)}; use those or another --root")
    stored.parent.mkdir(parents=True, exist_ok=True)
    stored.write_text(json.dumps({"trials": trials, "seed": seed}))
    plans = []
    for method in methods:
        for i, keys in enumerate(trial_keys(method, trials, seed)):
            cfg = trial_config(dataset, epsilon, method, keys, trial_dir(root, dataset, epsilon, method, i))
            if not (Path(cfg.out_dir) / "summary.json").exists():  # unfinished: resume it, or start again
                plans.append(cfg.with_updates(continue_keys(cfg.out_dir)))
    log.info("%d trials to run", len(plans))
    for _, missing in run_many(plans, jobs, f"tune {dataset} eps {epsilon:g}"):
        if missing:
            raise DataError(missing)
    return write_tuned(dataset, epsilon, methods, trials, root, configs, seed)


def collect_trials(dataset: str, epsilon: float, method: str, trials: int, root: Path, seed: int) -> list[dict]:
    """One record per finished trial of the search recorded in the search's ``search.json`` (or, without it,
    the ``trials``/``seed`` given): index, searched keys (read back from the trial's config.json), validation
    accuracy and worst accuracy."""
    from ..server.rundir import read_json

    trials, seed = search_size(root, dataset, epsilon, trials, seed)
    out = []
    for i in range(len(trial_keys(method, trials, seed))):
        path = trial_dir(root, dataset, epsilon, method, i) / "summary.json"
        if not path.exists():
            continue
        config = read_json(path.parent / "config.json")
        keys = {k: config[k] for k in sorted(SPACES[method])}
        s = read_json(path)
        worst = s.get("worst_group_accuracy", s["worst_class_accuracy"])
        out.append({"trial": i, "keys": keys, "val_accuracy": s["test_accuracy"], "val_worst": worst,
                    "epsilon_spent": s["epsilon_spent"], "wall_seconds": s["wall_seconds"],
                    "out_dir": str(path.parent)})
    return out


def search_file(root: Path, dataset: str, epsilon: float) -> Path:
    """The search's record of its size (trials per method, seed)."""
    return root / dataset / f"eps{epsilon:g}" / "search.json"


def search_size(root: Path, dataset: str, epsilon: float, trials: int, seed: int) -> tuple[int, int]:
    """(trials per method, search seed) of the search stored under ``root`` (the arguments if none is)."""
    path = search_file(root, dataset, epsilon)
    if path.exists():
        d = json.loads(path.read_text())
        return int(d["trials"]), int(d["seed"])
    return trials, seed


def best_trial(records: list[dict]) -> dict | None:
    """The record with the highest validation worst accuracy, then validation accuracy, then lowest index."""
    if not records:
        return None
    return max(records, key=lambda r: (r["val_worst"], r["val_accuracy"], -r["trial"]))


def write_tuned(dataset: str, epsilon: float, methods: list[str], trials: int, root: Path, configs: Path,
                seed: int = 0) -> dict[str, dict]:
    """Write the tuned config files from the finished trials; returns method -> winning record."""
    from ..server.engine import load_run_config

    winners = {}
    trials, seed = search_size(root, dataset, epsilon, trials, seed)
    (configs / "tuned").mkdir(parents=True, exist_ok=True)
    for method in methods:
        win = best_trial(collect_trials(dataset, epsilon, method, trials, root, seed))
        if win is None:
            continue
        winners[method] = win
        keys = final_keys(load_run_config(win["out_dir"]))
        header = (f"# Tuned by `dpdro tune --dataset {dataset} --epsilon {epsilon:g} --trials {trials}`: trial "
                  f"{win['trial']} of {method}, validation accuracy {win['val_accuracy']:.4f}, validation worst "
                  f"{win['val_worst']:.4f}.\n# Trains on the whole training split, evaluates on the test split. "
                  "The search itself is not privacy-accounted (docs/TUNING.md).\n")
        write_toml(tuned_config_path(dataset, epsilon, method, configs / "tuned"), keys, header)
    if winners:
        method, win = max(winners.items(), key=lambda kv: (kv[1]["val_worst"], kv[1]["val_accuracy"]))
        keys = {**final_keys(load_run_config(win["out_dir"])), "out-dir": f"runs/{dataset}-eps{epsilon:g}-best"}
        header = (f"# Best configuration for {dataset} at epsilon {epsilon:g} over {', '.join(methods)} "
                  f"({trials} trials each, selected on validation worst accuracy): {method}, trial "
                  f"{win['trial']}.\n# Run: dpdro train --config <this file>. The search is not "
                  "privacy-accounted (docs/TUNING.md).\n")
        write_toml(configs / f"{dataset}-eps{epsilon:g}-best.toml", keys, header)
    return winners


def transfer_tuned(target: str, source: str, epsilon: float, methods: list[str], configs: Path) -> dict[str, Path]:
    """Write ``configs/tuned/<target>-eps<e>-<method>.toml`` from the source data set's tuned file of each method:
    the method's searched keys (SPACES) of the source file, 'refresh-batch' divided by the source's and multiplied
    by the target's 'batch-scale', every other key from the target's trial keys (``trial_config``), evaluated on
    the test split. Methods without a source file are skipped. No run, no look at the target's data.

    Returns method -> written path. Raises ValueError when target == source or when no source file exists."""
    import tomllib

    if target == source:
        raise ValueError(f"--transfer-from: source {source!r} is the target data set; pick another data set")
    written = {}
    src_scale = PER_DATASET.get(source, {}).get("batch-scale", 1.0)
    for method in methods:
        path = tuned_config_path(source, epsilon, method, configs / "tuned")
        if not path.exists():
            log.warning("no tuned config %s: %s is not transferred", path, method)
            continue
        text = path.read_text()
        src = tomllib.loads(text)
        keys = {k: src[k] for k in SPACES[method] if k in src}
        keys["refresh-batch"] = int(round(src["refresh-batch"] / src_scale))
        cfg = trial_config(target, epsilon, method, keys, configs / "unused")
        origin = text.splitlines()[0].lstrip("# ").rstrip(".")
        header = (f"{TRANSFER_MARK} by `dpdro tune --dataset {target} --epsilon {epsilon:g} --transfer-from {source}`: "
                  f"the searched keys of {path.name} ({origin}); no trial on {target}.\n# Trains on the whole "
                  "training split, evaluates on the test split. Nothing of this data set chose these keys.\n")
        out = tuned_config_path(target, epsilon, method, configs / "tuned")
        write_toml(out, final_keys(cfg), header)
        written[method] = out
    if not written:
        raise ValueError(f"--transfer-from {source}: no tuned config {source}-eps{epsilon:g}-<method>.toml under "
                         f"{configs / 'tuned'}; run `dpdro tune --dataset {source}` first")
    return written




def write_toml(path: Path, keys: dict, header: str = "") -> None:
    """A flat TOML file of configuration keys (atomic)."""
    from ..server.rundir import atomic_write_bytes

    lines = [header.rstrip("\n")] if header else []
    atomic_write_bytes(path, ("\n".join([*lines, toml_lines(keys)]) + "\n").encode())


def tuning_report(entries: list[tuple[str, float]], methods: list[str], trials: int, root: Path, docs: Path,
                  seed: int = 0) -> Path:
    """docs/TUNING.md: every trial's searched keys and validation figures, per (dataset, epsilon)."""
    lines = ["# Hyper-parameter search (generated by `dpdro tune --report`)", "",
             "Random search with the same number of trials for every method, each a full private run at the target "
             "epsilon, trained without the validation split and evaluated on it; the winner maximises validation "
             "worst-class (CelebA: worst-group) accuracy. The test split is never used here. **The search is not "
             "privacy-accounted**: it reads noiseless validation metrics of private training records. Shared keys: "
             + ", ".join(f"{k}={v}" for k, v in sorted(BASE.items())) + "; per data set: "
             + "; ".join(f"{d}: " + ", ".join(f"{k}={v}" for k, v in kv.items()) for d, kv in PER_DATASET.items())
             + ". SPIDER difference batches are half the refresh batch.", ""]
    for dataset, epsilon in entries:
        n_trials, _ = search_size(root, dataset, epsilon, trials, seed)
        lines += [f"## {dataset}, epsilon {epsilon:g} ({n_trials} trials per method)", ""]
        for method in methods:
            records = collect_trials(dataset, epsilon, method, trials, root, seed)
            if not records:
                continue
            win = best_trial(records)
            lines += [f"### {method} ({len(records)} of {n_trials} trials; winner: trial {win['trial']})", "",
                      "| trial | val worst | val accuracy | keys |", "|---|---|---|---|"]
            for r in records:
                mark = " **(selected)**" if r is win else ""
                keys = ", ".join(f"{k}={v}" for k, v in sorted(r["keys"].items()))
                lines.append(f"| {r['trial']}{mark} | {r['val_worst']:.3f} | {r['val_accuracy']:.3f} | {keys} |")
            lines.append("")
    docs.mkdir(parents=True, exist_ok=True)
    out = docs / "TUNING.md"
    out.write_text("\n".join(lines))
    return out


def space_size(method: str) -> int:
    """Number of points of the method's search space."""
    return math.prod(len(v) for v in SPACES[method].values())


__all__ = ["run_tune", "transfer_tuned", "transferred_from", "trial_keys", "best_trial", "write_tuned",
           "tuning_report", "METHODS", "SPACES", "space_size"]
