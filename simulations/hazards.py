"""The hazards of docs/explanation/ALGORITHMS.md 5.4, measured on MNIST-ST at epsilon 4: ``dpdro lab hazards``.

    dpdro lab hazards [--seeds 0 1 2] [--jobs 2] [--root runs/hazards] [--docs docs]

Starting from the tuned configuration of dp-double-spider (and of recursive-spider) for MNIST-ST at epsilon 4
(``simulations/configs/tuned/``), one factor changes at a time, each variant trained on the whole training
split with every seed and evaluated on the test split:

- clipping erases the DRO weights: dro-clip product vs weight-after-clip;
- SPIDER only helps in its regime: q = 1 (no differences at all) against q = 5, and the difference cap
  clip-diff-max 1.0 (differences as noisy as refreshes) against the tuned cap;
- minority classes drown first: the logit-adjusted loss off / on;
- the noise allocation: eta-noise-ratio ratios vs the variance rule;
- eta initialisation: eta_0 = 0 vs the private mean loss;
- the eta clip: eta-clip-rule fixed (biased) vs weight-bound (docs/explanation/ALGORITHMS.md 3.1);
- the scale of Algorithm 3's quantities: rs-clip-units absolute vs relative.

A tuned configuration at dro-level=group gets the group level's own factors instead (GROUP_TOGGLES): the
divergence's centre (dro-reference prior vs uniform), the record level, no averaging of the group losses (beta 1),
q, the logit-adjusted loss off, the clip form and (dp-double-spider) the divergence.

A second block asks whether DRO adds anything on top of the strongest simple baseline: dp-double-spider at the
tuned dp-sgd-la setting (its step size, batches, post-hoc tau, logit-adjusted loss), with either DRO clip. These
rows are evaluated on the test split and are a diagnostic, not a tuned result (nothing is selected on them).

docs/research/HAZARDS.md lists, per variant, test accuracy and worst-class accuracy (mean +/- std over seeds), the
fraction of SPIDER phases whose differences added more noise than their refresh, the mean accumulated
difference-to-refresh noise ratio, and the mean (noisy) clipped fraction of the x refreshes and differences.
"""

from __future__ import annotations

import csv
import json
import tomllib
from pathlib import Path

from ..common.atomic import atomic_write_text
from ..common.config import Config
from .tuned import tuned_config_path

DATASET, EPSILON = "mnist-st", 4.0
TOGGLES = {
    "dp-double-spider": [("dro-clip", "product"), ("dro-clip", "weight-after-clip"), ("q", 1), ("q", 5),
                         ("clip-diff-max", 1.0), ("logit-adjust-tau", 0.0), ("logit-adjust-tau", 1.0),
                         ("noise-allocation", "ratios"), ("eta-init-source", "config"),
                         ("eta-clip-rule", "fixed"), ("eta-clip-rule", "weight-bound")],
    "recursive-spider": [("rs-clip-units", "absolute"), ("rs-clip-units", "relative"), ("q", 1), ("q", 5),
                         ("clip-diff-max", 1.0), ("logit-adjust-tau", 0.0), ("logit-adjust-tau", 1.0)],
}
# At dro-level=group (docs/explanation/ALGORITHMS.md 3.3, 4.3) the eta and s keys above are inert; the group level's own
# levers are the divergence's centre, the averaging of the group losses (beta 1: none), the level itself, the clip form
# and q.
GROUP_TOGGLES = {
    "dp-double-spider": [("dro-reference", "prior"), ("dro-reference", "uniform"), ("dro-level", "record"),
                         ("beta", 1.0), ("q", 1), ("q", 5), ("logit-adjust-tau", 0.0), ("dro-clip", "product"),
                         ("dro-clip", "weight-after-clip"), ("psi", "chi2"), ("psi", "kl")],
    "recursive-spider": [("dro-reference", "prior"), ("dro-reference", "uniform"), ("dro-level", "record"),
                         ("beta", 1.0), ("q", 1), ("q", 5), ("logit-adjust-tau", 0.0), ("dro-clip", "product"),
                         ("dro-clip", "weight-after-clip")],
}


def _tuned(algo: str, folder: Path | None) -> dict:
    """The keys of the tuned config of ``algo`` for MNIST-ST at epsilon 4 (FileNotFoundError if missing)."""
    with open(tuned_config_path(DATASET, EPSILON, algo, *([folder] if folder else [])), "rb") as f:
        return tomllib.load(f)


def variants(folder: Path | None = None) -> list[tuple[str, str, dict]]:
    """(label, algorithm, config keys) of the tuned configurations and each single-factor change that differs
    from them (the difference cap of a q = 1 configuration is changed together with q = 5).
    Raises FileNotFoundError when a tuned configuration is missing (run `dpdro lab tune` first)."""
    out = []
    for algo in TOGGLES:
        tuned = _tuned(algo, folder)
        base = Config.from_mapping(tuned)
        toggles = (GROUP_TOGGLES if base.dro_level == "group" else TOGGLES)[algo]
        out.append((f"{algo} (tuned)", algo, tuned))
        for key, value in toggles:
            change = {key: value}
            if key == "clip-diff-max" and base.q == 1:  # no differences at q = 1: compare the caps at q = 5
                change = {"q": 5, key: value}
            changed = Config.from_mapping({**tuned, **change})
            same = changed.tau == base.tau if key == "logit-adjust-tau" else changed == base
            if not same:
                label = ", ".join(f"{k}={v}" for k, v in change.items())
                out.append((f"{algo}, {label}", algo, {**tuned, **change}))
    return out


# The keys of the strongest simple baseline's tuned config that the second block carries over.
BASELINE, CARRIED = "dp-sgd-la", ("lr-x", "refresh-batch", "diff-batch", "s-batch", "posthoc-tau")


def baseline_variants(folder: Path | None = None) -> list[tuple[str, str, dict]]:
    """(label, algorithm, keys): the tuned dp-double-spider config with the CARRIED keys of the tuned dp-sgd-la
    config and logit-adjust-tau 1, once per dro-clip. Raises FileNotFoundError when a tuned config is missing."""
    configs = {algo: _tuned(algo, folder) for algo in ("dp-double-spider", BASELINE)}
    carried = {k: configs[BASELINE][k] for k in CARRIED if k in configs[BASELINE]}
    return [(f"dp-double-spider at the {BASELINE} setting, dro-clip={clip}", "dp-double-spider",
             {**configs["dp-double-spider"], **carried, "logit-adjust-tau": 1.0, "dro-clip": clip})
            for clip in ("product", "weight-after-clip")]


def _slug(label: str) -> str:
    return "".join(c if c.isalnum() or c in "-." else "_" for c in label)


def run_hazards(seeds: list[int], root: Path, docs: Path, jobs: int = 2) -> Path:
    """Run every variant x seed not finished yet (``jobs`` at a time), then write docs/research/HAZARDS.md."""
    from ..server.rundir import continue_keys
    from .runner import run_many

    plans = []
    for label, _, keys in variants() + baseline_variants():
        for seed in seeds:
            out = root / _slug(label) / f"seed{seed}"
            if not (out / "summary.json").exists():  # unfinished: resume it, or start again
                plans.append(Config.from_mapping({**keys, "seed": seed, "epsilon": EPSILON, "eval-every": 100,
                                                  "out-dir": str(out), **continue_keys(out)}))
    run_many(plans, jobs, "hazards")
    return write_hazards(seeds, root, docs)


def _mean_std(values: list[float]) -> str:
    import numpy as np

    if not values:
        return "-"
    a = np.asarray(values, dtype=float)
    return f"{a.mean():.3f} +/- {a.std(ddof=1) if len(a) > 1 else 0.0:.3f}"


def _clipped(run: Path, mech: str) -> float | None:
    rows = list(csv.DictReader(open(run / "metrics.csv")))
    values = [float(r[f"clipped_{mech}"]) for r in rows if r.get(f"clipped_{mech}")]
    return sum(values) / len(values) if values else None


def _privacy_words(summaries: list[dict]) -> str:
    """The delta and accountant the tabled runs' summaries record (a summary made before the PLD default has no
    accountant field: RDP), so the header says what the rows were run under, not today's default."""
    found = {(f"{s['delta']:.3g}", str(s.get("accountant", "rdp")).upper()) for s in summaries}
    if not found:
        return "no finished runs"
    return "; ".join(f"delta {delta}, {accountant} accountant" for delta, accountant in sorted(found))


def write_hazards(seeds: list[int], root: Path, docs: Path) -> Path:
    """docs/research/HAZARDS.md from the finished variant runs (module docstring: the columns)."""
    header = ["| variant | test accuracy | worst-class accuracy | noise-dominated phases | phase noise ratio | "
              "clipped (refresh / diff) |", "|---|---|---|---|---|---|"]
    lines = [*header]  # the title and the protocol line go on top once every tabled summary is read
    tabled: list[dict] = []
    second = baseline_variants()
    for label, algo, _ in variants() + second:
        if label == second[0][0]:
            lines += ["", "Does DRO add anything on top of the strongest simple baseline? dp-double-spider at the "
                      f"tuned {BASELINE} setting ({', '.join(CARRIED)}, logit-adjust-tau 1); a test-split "
                      "diagnostic, not a tuned result.", "", *header]
        runs = [root / _slug(label) / f"seed{s}" for s in seeds]
        runs = [r for r in runs if (r / "summary.json").exists()]
        if not runs:
            continue
        sums = [json.loads((r / "summary.json").read_text()) for r in runs]
        tabled += sums
        phases = [s["spider_noise"] for s in sums if "spider_noise" in s]  # a method without SPIDER has none
        dominated = [p["phases_noise_dominated"] / p["phases"] for p in phases if p["phases"]]
        ratio = [p["mean_phase_noise_ratio"] for p in phases if p["mean_phase_noise_ratio"] is not None]
        group = json.loads((runs[0] / "config.json").read_text()).get("dro-level") == "group"
        ref, diff = ("x-refresh", "x-diff") if algo == "dp-double-spider" or group else ("vu-refresh", "vu-diff")
        clip_ref = [v for v in (_clipped(r, ref) for r in runs) if v is not None]
        clip_diff = [v for v in (_clipped(r, diff) for r in runs) if v is not None]
        lines.append(f"| {label} (n={len(runs)}) | {_mean_std([s['test_accuracy'] for s in sums])} | "
                     f"{_mean_std([s['worst_class_accuracy'] for s in sums])} | {_mean_std(dominated)} | "
                     f"{_mean_std(ratio)} | {_mean_std(clip_ref)} / {_mean_std(clip_diff)} |")
    lines[:0] = ["# Hazards of DP-DRO on MNIST-ST (generated by `dpdro lab hazards`)", "",
                 f"Epsilon {EPSILON:g}, {_privacy_words(tabled)}, seeds {', '.join(map(str, seeds))}, test split. "
                 "Each row changes one key of the tuned configuration (first row of each block). 'noise-dominated "
                 "phases' is the share of SPIDER phases whose differences added more noise than their refresh "
                 "(server/diagnostics.py), 'phase noise ratio' the mean accumulated difference noise in units of the "
                 "refresh noise, 'clipped' the mean noisy clipped fraction of the x refreshes / x differences (v/u for "
                 "recursive-spider).", ""]
    docs.mkdir(parents=True, exist_ok=True)
    path = docs / "HAZARDS.md"
    atomic_write_text(path, "\n".join(lines) + "\n")
    return path
