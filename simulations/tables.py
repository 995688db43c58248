"""The results document of the tuned profile: ``dpdro lab report --profile tuned`` -> docs/research/RESULTS.md.

Per data set one table (method x epsilon: test accuracy and worst accuracy, mean +/- standard deviation over
the seeds), then for every epsilon the comparison of each DP-DRO method against the strongest simple
baseline (the better of dp-sgd and dp-sgd-la by mean worst accuracy), the goal figure of MNIST-ST at
epsilon 4, and the documents generated beside it (tuning, hazards, noise modes, audit, equivalence). Every
number comes from the run directories' summary.json files.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from ..common.algorithm_specs import ALGORITHM_SPECS
from ..common.atomic import atomic_write_text
from .tune import SPACES
from .tuned import (
    LEVERS_MARK,
    RECHOSEN_MARK,
    TUNED_CONFIGS,
    leading_comments,
    marked_methods,
    searched_methods,
    transferred_from,
    tuned_config_path,
)

# the simple baselines and the DP-DRO methods, from the algorithms' declarations (AlgorithmSpec.dro)
BASELINES = tuple(n for n, s in ALGORITHM_SPECS.items() if not s.dro)
DRO_METHODS = tuple(n for n, s in ALGORITHM_SPECS.items() if s.dro)
GOAL = {"dataset": "mnist-st", "epsilon": 4.0, "worst": 0.60, "accuracy": 0.85}
# The paper's two methods (either DRO level) against every other method, and the goal set for them: on MNIST-ST at
# epsilon 4 the best of them reaches worst-class >= 0.85 with accuracy >= 0.88, and in any case DP-SGDA's worst class.
PAPER_METHODS = ("dp-double-spider", "recursive-spider")
# Issue 49 adds the lower end of the 95 % interval of the mean worst class (one lucky mean of few seeds is not enough).
PAPER_GOAL = {"dataset": "mnist-st", "epsilon": 4.0, "worst": 0.85, "worst_lower": 0.82, "accuracy": 0.88,
              "reference": "dp-sgda"}


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (ddof 1; 0 for a single value) of ``values``."""
    import numpy as np

    a = np.asarray(values, dtype=float)
    return float(a.mean()), (float(a.std(ddof=1)) if len(a) > 1 else 0.0)


CONFIDENCE = 0.95  # the level of every interval in the report, and of its better/worse decisions


def difference_interval(a: list[float], b: list[float], level: float = CONFIDENCE) -> tuple[float, float] | None:
    """Welch's t interval (level, two-sided) of mean(a) - mean(b) over independent seeds (runs draw fresh noise,
    whatever the seed), or None when either side has fewer than 2 runs. Two sides without spread give the point
    interval (d, d). Source: Welch (1947), as scipy.stats.ttest_ind(equal_var=False).confidence_interval."""
    import numpy as np
    from scipy import stats

    if len(a) < 2 or len(b) < 2:
        return None
    d = float(np.mean(a) - np.mean(b))
    if np.std(a) == 0 and np.std(b) == 0:
        return d, d
    ci = stats.ttest_ind(a, b, equal_var=False).confidence_interval(level)
    return float(ci.low), float(ci.high)


def mean_interval(values: list[float], level: float = CONFIDENCE) -> tuple[float, float] | None:
    """Student's t interval (level, two-sided) of the mean of ``values``, None with fewer than 2 values."""
    import numpy as np
    from scipy import stats

    if len(values) < 2:
        return None
    a = np.asarray(values, dtype=float)
    half = float(stats.t.ppf(0.5 + level / 2, len(a) - 1) * a.std(ddof=1) / np.sqrt(len(a)))
    return float(a.mean()) - half, float(a.mean()) + half


def interval_word(lo: float, hi: float) -> str:
    """The report's decision rule on an interval of a difference: 'better' / 'worse' only where it excludes 0."""
    return "better" if lo > 0 else "worse" if hi < 0 else "no clear difference"


def verdict(a: list[float], b: list[float]) -> str:
    """'better' / 'worse' only where the 95 % interval of mean(a) - mean(b) excludes 0, else 'no clear
    difference'; the interval follows in brackets, or 'too few seeds' when a side has one run."""
    ci = difference_interval(a, b)
    if ci is None:
        return "too few seeds for an interval"
    lo, hi = ci
    return f"{interval_word(lo, hi)}, {CONFIDENCE:.0%} interval [{lo:+.3f}, {hi:+.3f}]"


LEGACY_DELTA = "n^-1.1"  # delta = 'auto' before 2026-12-02: a legacy row's delta column (sweep.LEGACY_DEFAULTS)
LEGACY_MARK = "†"  # a cell with runs made under the old defaults (delta_words)


def is_legacy(row: dict) -> bool:
    """Whether the run was made under the defaults before 2026-12-02 (its delta column says LEGACY_DELTA)."""
    return str(row.get("delta")) == LEGACY_DELTA


def legacy_mark(rs: list[dict]) -> str:
    """LEGACY_MARK when one of the runs used the old defaults, else ''."""
    return LEGACY_MARK if any(is_legacy(r) for r in rs) else ""


def _cell(rs: list[dict], key: str) -> str:
    m, s = mean_std([r[key] for r in rs])
    return f"{m:.3f} +/- {s:.3f}{legacy_mark(rs)}"


def worst_records_line(groups: dict, dataset: str, epsilons, methods) -> str:
    """On data with groups, the test records behind each run's worst-group accuracy (summary.json
    worst_group_records, results.csv worst_records), per method and epsilon, so that a figure resting on a handful
    of records reads as coarse; '' when no row records them (runs made before the count was recorded)."""
    parts = []
    for a in methods:
        for e in epsilons:
            counts = [str(r["worst_records"]) for r in groups.get((dataset, a, e), []) if r.get("worst_records") != ""
                      and r.get("worst_records") is not None]
            if counts:
                parts.append(f"{a} eps {e:g}: {', '.join(counts)}")
    if not parts:
        return ""
    return ("Test records behind the worst group, per run (runs made since summary.json records them; a worst "
            "group of n records moves in steps of 1/n): " + "; ".join(parts) + ".")


def comparison_lines(groups: dict, dataset: str, epsilons, methods) -> list[str]:
    """For each epsilon: the strongest simple baseline, and each DP-DRO method's difference to it in mean
    worst accuracy, with the verdict 'better' / 'worse' only where the 95 % interval of the difference excludes 0
    (``verdict``), else 'no clear difference'."""
    out = []
    for eps in epsilons:
        base = [(b, groups[(dataset, b, eps)]) for b in BASELINES if (dataset, b, eps) in groups]
        if not base:
            continue
        name, rs = max(base, key=lambda kv: mean_std([r["worst_accuracy"] for r in kv[1]])[0])
        bm, bs = mean_std([r["worst_accuracy"] for r in rs])
        parts = []
        for method in methods:
            if method in BASELINES or (dataset, method, eps) not in groups:
                continue
            worst = [r["worst_accuracy"] for r in groups[(dataset, method, eps)]]
            d = mean_std(worst)[0] - bm
            parts.append(f"{method} {d:+.3f} ({verdict(worst, [r['worst_accuracy'] for r in rs])})")
        out.append(f"- epsilon {eps:g}: strongest simple baseline **{name}** (worst {bm:.3f} +/- {bs:.3f}); "
                   f"DP-DRO methods, difference in mean worst accuracy: {'; '.join(parts) or 'none run'}.")
    return out


def _best(groups: dict, dataset: str, eps: float, methods) -> tuple[str, list[dict]] | None:
    """(method, its rows) of the highest mean worst accuracy among ``methods`` at (dataset, eps), None if none ran."""
    have = [(m, groups[(dataset, m, eps)]) for m in methods if (dataset, m, eps) in groups]
    return max(have, key=lambda kv: mean_std([r["worst_accuracy"] for r in kv[1]])[0]) if have else None


def _figure(rs: list[dict]) -> str:
    w, ws = mean_std([r["worst_accuracy"] for r in rs])
    a, as_ = mean_std([r["test_accuracy"] for r in rs])
    return f"worst {w:.3f} +/- {ws:.3f}, accuracy {a:.3f} +/- {as_:.3f} (n={len(rs)}){legacy_mark(rs)}"


def paper_lines(groups: dict, dataset: str, epsilons) -> list[str]:
    """For each epsilon: the best of the paper's methods (PAPER_METHODS, by mean worst accuracy) against the best of
    every other method (simple baselines and DP-SGDA, DP-SGD-dual, SpiderBoost), with the differences in mean worst
    and mean accuracy; 'better' / 'worse' only where the 95 % interval of the worst difference excludes 0."""
    out = []
    others = [m for m in ALGORITHM_SPECS if m not in PAPER_METHODS]
    for eps in epsilons:
        paper, other = _best(groups, dataset, eps, PAPER_METHODS), _best(groups, dataset, eps, others)
        if paper is None or other is None:
            continue
        (p, prs), (b, brs) = paper, other
        pw, bw = ([r["worst_accuracy"] for r in rs] for rs in (prs, brs))
        pa, ba = (mean_std([r["test_accuracy"] for r in rs])[0] for rs in (prs, brs))
        d = mean_std(pw)[0] - mean_std(bw)[0]
        out.append(f"- epsilon {eps:g}: best paper method **{p}** ({_figure(prs)}) against the best other method "
                   f"**{b}** ({_figure(brs)}): worst {d:+.3f} ({verdict(pw, bw)}), accuracy {pa - ba:+.3f}.")
    return out


def paper_goal_lines(groups: dict) -> list[str]:
    """Whether the best paper method reaches PAPER_GOAL on its data set and epsilon (means over seeds, and the lower
    end of the 95 % interval of its mean worst class: unknown, so not reached, with one seed), and how it stands
    against the reference method's mean worst accuracy."""
    g = PAPER_GOAL
    best = _best(groups, g["dataset"], g["epsilon"], PAPER_METHODS)
    if best is None:
        return ["Goal of the paper methods: not measured yet (no finished runs of them)."]
    method, rs = best
    worst, acc = (mean_std([r[k] for r in rs])[0] for k in ("worst_accuracy", "test_accuracy"))
    ci = mean_interval([r["worst_accuracy"] for r in rs])
    reached = worst >= g["worst"] and acc >= g["accuracy"] and ci is not None and ci[0] >= g["worst_lower"]
    lower = (f"the {CONFIDENCE:.0%} interval of its mean worst class [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else
             "one seed, no interval")
    ref = groups.get((g["dataset"], g["reference"], g["epsilon"]))
    versus = (f"; against {g['reference']} (worst {mean_std([r['worst_accuracy'] for r in ref])[0]:.3f}): "
              f"{worst - mean_std([r['worst_accuracy'] for r in ref])[0]:+.3f}" if ref else "")
    return [f"Goal of the paper methods ({g['dataset']}, epsilon {g['epsilon']:g}: the best of "
            f"{', '.join(PAPER_METHODS)} reaches worst-class >= {g['worst']:.2f} (the lower end of its "
            f"{CONFIDENCE:.0%} interval >= {g['worst_lower']:.2f}) with accuracy >= {g['accuracy']:.2f}, and in any "
            f"case {g['reference']}'s worst class): **{method}** reaches {_figure(rs)}, {lower}: goal "
            f"**{'reached' if reached else 'not reached'}** (worst {worst - g['worst']:+.3f} from the goal){versus}."]


def goal_lines(groups: dict, best_method: str | None) -> list[str]:
    """Whether the goal figure is reached by the saved best configuration's method (mean over seeds)."""
    key = (GOAL["dataset"], best_method, GOAL["epsilon"])
    if best_method is None or key not in groups:
        return ["Goal figure: not measured yet (no finished runs of the best configuration)."]
    rs = groups[key]
    acc, acc_sd = mean_std([r["test_accuracy"] for r in rs])
    worst, worst_sd = mean_std([r["worst_accuracy"] for r in rs])
    reached = worst >= GOAL["worst"] and acc >= GOAL["accuracy"]
    ordered = sorted(rs, key=lambda r: r["seed"])
    seeds = ", ".join(f"{r['test_accuracy']:.3f} / {r['worst_accuracy']:.3f}" for r in ordered)
    return [f"Goal (MNIST-ST, epsilon 4: worst-class >= {GOAL['worst']:.2f} with average >= "
            f"{GOAL['accuracy']:.2f}): the selected best configuration, **{best_method}** "
            f"(`simulations/configs/mnist-st-eps4-best.toml`), reaches test accuracy {acc:.3f} +/- {acc_sd:.3f} and "
            f"worst-class accuracy {worst:.3f} +/- {worst_sd:.3f}{legacy_mark(rs)} over {len(rs)} seeds (per seed, "
            "accuracy / worst: "
            f"{seeds}): goal **{'reached' if reached else 'not reached'}** on the mean."]


def _data_missing(dataset: str) -> str | None:
    """Why the data set cannot be loaded here (DataError's message), or None when it can."""
    from ..common.config import Config
    from ..common.data import data_missing

    return data_missing(Config.from_mapping({"dataset": dataset}))


def best_method_of(configs: Path) -> str | None:
    """The algorithm of simulations/configs/mnist-st-eps4-best.toml, or None before tuning."""
    import tomllib

    path = configs / "mnist-st-eps4-best.toml"
    if not path.exists():
        return None
    with open(path, "rb") as f:
        return tomllib.load(f).get("algorithm")


def _origin_line(dataset: str, epsilon: float, configs: Path) -> str:
    """Where the data set's hyper-parameters came from (tune.transferred_from), as a sentence."""
    source = transferred_from(dataset, epsilon, configs)
    if source:
        chose = ("only its validation split chose a key: the post-hoc tau of the methods named below (`dpdro lab tune "
                 "--choose-posthoc-tau`, the same rule for each method that releases class priors)"
                 if marked_methods(dataset, epsilon, configs, f"{RECHOSEN_MARK} on {dataset}'s")
                 else "so none of its data chose anything")
        levered = marked_methods(dataset, epsilon, configs, f"{LEVERS_MARK} on {dataset}'s")
        if levered:  # keys chosen after the transfer by one-factor lever tables on this data set's validation split
            tables = (f"the keys of {', '.join(levered)} that one-factor lever tables on its validation split chose "
                      "(`dpdro lab levers`; each file's comment lines name the keys, the table and the figures)")
            chose = (f"so none of its data chose anything but {tables}" if chose.startswith("so none")
                     else f"{chose}, and {tables}")
        searched = searched_methods(dataset, epsilon, configs)
        if searched:
            return (f"Hyper-parameters: **searched on {dataset}** for {', '.join(searched)} (the same budget each, "
                    f"docs/research/TUNING.md, each search's first trial the method's keys transferred from {source}); "
                    "every "
                    f"other method keeps the keys its search on {source} selected (`dpdro lab tune --dataset {dataset} "
                    f"--transfer-from {source}`), {chose}.")
        effort = (f"unequal tuning effort: {', '.join(levered)} had more on {dataset} than the other methods"
                  if levered else "equal tuning effort: every method's keys come from the same search")
        return (f"Hyper-parameters: **transferred from {source}** (`dpdro lab tune --dataset {dataset} --transfer-from "
                f"{source}`): each method keeps the keys its search on {source} selected; no trial ran on {dataset}, "
                f"{chose} ({effort}).")
    return f"Hyper-parameters: searched on {dataset} (docs/research/TUNING.md)."


def no_difference_line(dataset: str, epsilon: float, configs: Path, methods) -> str | None:
    """A sentence naming the SPIDER-type methods (those with 'q' in their search space) whose tuned config of
    ``dataset`` has q = 1, i.e. a refresh every iteration and no difference release; None if there is none."""
    import tomllib

    plain = []
    for method in methods:
        path = tuned_config_path(dataset, epsilon, method, configs / "tuned")
        if "q" in SPACES.get(method, {}) and path.exists():
            with open(path, "rb") as f:
                if tomllib.load(f).get("q") == 1:
                    plain.append(method)
    if not plain:
        return None
    return (f"Selected q = 1 (a refresh every iteration, no SPIDER difference releases): {', '.join(plain)}; "
            "these rows measure the method without its variance-reduced estimator.")


def rechosen_tau_line(dataset: str, epsilon: float, configs: Path, methods) -> str | None:
    """A sentence naming the methods whose tuned file of ``dataset`` has a posthoc-tau chosen after the search on
    validation (a comment line at its top carries ``RECHOSEN_MARK``), with that tau; None if there is none."""
    import tomllib

    named = []
    for method in methods:
        path = tuned_config_path(dataset, epsilon, method, configs / "tuned")
        if path.exists() and any(RECHOSEN_MARK in line for line in leading_comments(path.read_text())):
            with open(path, "rb") as f:
                named.append(f"{method} ({tomllib.load(f).get('posthoc-tau', 0.0):g})")
    if not named:
        return None
    return ("Post-hoc tau chosen after the search (or the transfer), by the search's score over a grid of taus on "
            "a validation split of this data set (applying a tau is post-processing of a released model; choosing it "
            "on private training records is not accounted, and the file's key chosen-on-private-data says so; the "
            f"tuned file's comment lines give the model, the command and the figures): {', '.join(named)}.")


def carried_sentence(rows: list[dict]) -> str:
    """How many rows come from the previous results CSV rather than a run directory on this machine."""
    carried = sum(r.get("source") == "carried" for r in rows)
    return (f"{carried} of the {len(rows)} runs are carried from the previous results CSV: their run directories are "
            "not on this machine, and their configuration fingerprint (results.csv column config_sha, every key "
            "that decides what a run computes) is the one the current config files plan "
            "(`simulations/sweep.py: carried_rows`; `--no-carry` drops them).") if carried else ""


def delta_words(rows: list[dict]) -> str:
    """The runs' delta in words. A row's delta is the run's resolved delta, or 'n^-1.1' for a run made before
    2026-12-02 under the then defaults (delta = 'auto' meant n^-1.1, the accountant was RDP; sweep.LEGACY_DEFAULTS);
    today's 'auto' is server/ledger.py AUTO_DELTA_RULE."""
    from ..server.ledger import AUTO_DELTA_RULE

    old = sum(is_legacy(r) for r in rows)
    if old == 0:
        return f"delta = {AUTO_DELTA_RULE} (the default, 'auto')"
    if old == len(rows):
        return "delta = n^-1.1 (the default 'auto' of the code that made these runs, before 2026-12-02)"
    return (f"delta = {AUTO_DELTA_RULE} (today's default 'auto'), except in the cells marked {LEGACY_MARK}: {old} "
            f"of the {len(rows)} runs were made before 2026-12-02 under the then defaults, delta n^-1.1 (a weaker "
            "guarantee: n^-1.1 > 1/(10 n) for every n below 10^10) and the RDP accountant (results.csv columns delta "
            "and accountant); a new run of the same cell replaces them")


def _accountants(rows: list[dict]) -> str:
    """The accountant(s) of the runs, as the report states them (summaries before the PLD default: RDP)."""
    return " and ".join(sorted({str(r.get("accountant", "rdp")).upper() for r in rows})) or "PLD"


def _seed_words(profile) -> str:
    """The seeds of the protocol in words, the decisive cells' extra seeds named."""
    base = ", ".join(str(s) for s in profile.seeds)
    if not profile.decisive_seeds:
        return base
    cells = "; ".join(f"{ds} epsilon {e:g}: {', '.join(algos)}" for (ds, e), algos in profile.decisive.items())
    more = ", ".join(str(s) for s in profile.decisive_seeds)
    return (f"{base}, and also {more} in the cells that decide a table ({cells}; the best paper method and the "
            "best other method of the 3-seed tables)")


_CHECKOUT = TUNED_CONFIGS.parent.parent.parent  # simulations/configs/tuned -> the checkout


def _shown(configs: Path) -> str:
    """A configs folder as the report names it: relative to the checkout when inside it."""
    try:
        return str(configs.resolve().relative_to(_CHECKOUT.resolve()))
    except ValueError:
        return str(configs)


def _research_link(docs: Path, page: str) -> str:
    """A link from a report written in ``docs`` to a page of the checkout's docs/research/ (the page's bare name when
    the report is written there, e.g. docs/research/scatter/RESULTS.md links ../NODES.md)."""
    import os

    research = _CHECKOUT / "docs" / "research"
    inside = docs.resolve().is_relative_to(research.resolve())
    return os.path.relpath(research / page, docs.resolve()) if inside else page


def write_tuned_report(rows: list[dict], profile, docs: Path, configs: Path, plots: list[Path]) -> Path:
    """docs/research/RESULTS.md for the tuned profile from the collected rows (see sweep.collect)."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        groups[(r["dataset"], r["algorithm"], r["epsilon_target"])].append(r)
    eps_cols = profile.epsilons
    lines = ["# Results: every method tuned, at epsilon 1, 4 and 8", "",
             "Generated by `dpdro lab report --profile tuned` from the run directories of `dpdro lab sweep --profile "
             "tuned`. "
             "Protocol: every method got the same Optuna budget (TPE trials with median pruning over the same "
             "levers, its top trials confirmed on more seeds when the search asked for it; `dpdro lab tune`, "
             "docs/research/TUNING.md states the budget and the confirmation) at epsilon 4 on a data set "
             "(each table says "
             "which; a data set without "
             "its own search reuses another's selected keys), each trial trained on the training split minus a "
             "held-out validation split and evaluated on that split, the winner selected on validation worst-class "
             "(worst-group) accuracy, ties broken by the two lowest classes, then accuracy; the test split was never "
             "used to "
             f"choose anything. The selected configuration of each method (`{_shown(configs)}/tuned/`) was then "
             "trained on the whole training split at epsilon 1, 4 and 8 (the epsilon 4 hyper-parameters are reused "
             f"at 1 and 8) with seeds {_seed_words(profile)} and evaluated on the test split; cells are mean +/- "
             f"standard deviation over the seeds, {delta_words(rows)}, accountant {_accountants(rows)}, 4 clients, "
             "every run from scratch (no "
             "pre-training). 'worst' is the worst-class test accuracy (MNIST-ST, Fashion-MNIST-ST, CIFAR10-ST) or "
             "the worst-group test accuracy over the 4 (Blond_Hair, Male) cells (CelebA). An empty cell is a run not "
             "made yet (`dpdro lab sweep --profile tuned --jobs 2` runs exactly the missing ones); '(n=k)' after a "
             "method is the most seeds of any of its cells, and a cell with fewer seeds than the protocol plans for it "
             "(the seeds above) says its own n. "
             + carried_sentence(rows), "",
             "**Not privacy-accounted**: the hyper-parameter search itself (it reads noiseless validation metrics of "
             "private training records; private selection such as random stopping is not implemented). Every "
             "run's own releases, including the class histogram and the eta initialisation, are accounted.", "",
             "CelebA here is the 10,000-image subset of `../shared/datasets/celeba` (89x109 copies resized to "
             "64x64, all from CelebA's official training partition) with our seeded split stratified by the 4 "
             "cells, 80/10/10 (split-seed 0): about 8 blond men in each of validation and test, so its worst-group "
             "figures are coarse, and not comparable with published full-CelebA results.", ""]
    if configs.resolve() != TUNED_CONFIGS.parent.resolve():
        lines += [f"**These rows run the files of `{_shown(configs)}/tuned/`**, not the main table's: each file's "
                  "comment lines say where its keys came from and what changed them after the search (the protocol "
                  "above is the main table's, from which these files start).", ""]
    lines += ["Fleets: node-level privacy against Flower's own DP-FedAvg wrapper on 1,000 simulated nodes, and the "
              f"worst-off node: [NODES.md]({_research_link(docs, 'NODES.md')}); round time, start-up and memory "
              f"from 30 to 1,000 nodes: [FLEETS.md]({_research_link(docs, 'FLEETS.md')}).", ""]
    lines += goal_lines(groups, best_method_of(configs)) + [""] + paper_goal_lines(groups) + [""]
    for ds in profile.datasets:
        have = [a for a in profile.algorithms if any((ds, a, e) in groups for e in eps_cols)]
        lines += [f"## {ds}", ""]
        if not have:
            missing = _data_missing(ds)
            if missing:
                why = missing.splitlines()[0].rstrip(".")
                lines += [f"Not run: its data is not available here ({why}). The same commands run "
                          f"on it unchanged once it is (`dpdro lab tune --dataset {ds}`, then the sweep).", ""]
            elif not any((configs / "tuned").glob(f"{ds}-eps{profile.tuned_at:g}-*.toml")):
                lines += [f"Not run: not tuned yet (`dpdro lab tune --dataset {ds}`, then `dpdro lab sweep --profile "
                          f"tuned --only-dataset {ds}`).", ""]
            else:
                lines += [f"Not run: tuned, but its sweep has not been run (`dpdro lab sweep --profile tuned "
                          f"--only-dataset {ds}`).", ""]
            continue
        lines += [_origin_line(ds, profile.tuned_at, configs), ""]
        for extra in (no_difference_line(ds, profile.tuned_at, configs, have),
                      rechosen_tau_line(ds, profile.tuned_at, configs, have)):
            lines += [extra, ""] if extra else []
        header = "| method | " + " | ".join(f"eps {e:g}: accuracy | eps {e:g}: worst" for e in eps_cols) + " |"
        lines += [header, "|---|" + "---|" * (2 * len(eps_cols))]
        for a in have:
            cells = []
            for e in eps_cols:
                rs = groups.get((ds, a, e))
                # a cell with fewer seeds than the profile's says how many it has
                few = f" (n={len(rs)})" if rs and len(rs) < len(profile.seeds_of(ds, a, e)) else ""
                cells += [_cell(rs, "test_accuracy") + few, _cell(rs, "worst_accuracy") + few] if rs else ["", ""]
            n = max(len(groups.get((ds, a, e), [])) for e in eps_cols)
            lines.append(f"| {a} (n={n}) | " + " | ".join(cells) + " |")
        records = worst_records_line(groups, ds, eps_cols, have)
        lines += ["", records] if records else []
        lines += ["", "DP-DRO against the strongest simple baseline (same tuning effort):", ""]
        lines += comparison_lines(groups, ds, eps_cols, have) + [""]
        versus = paper_lines(groups, ds, eps_cols)
        if versus:
            lines += ["The paper's methods against every other method (same tuning effort):", "", *versus, ""]
    if plots:
        lines += ["## Plots", ""] + [f"![{p.stem}](plots/{p.name})" for p in plots] + [""]
    for extra in ("HAZARDS.md", "NOISE_MODES.md", "AUDIT.md", "EQUIVALENCE.md"):
        if (docs / extra).exists():
            body = (docs / extra).read_text().splitlines()
            lines += ["#" + body[0], *body[1:], ""]
    lines += ["The tuning trials (every searched configuration with its validation figures) are in "
              f"[TUNING.md]({_research_link(docs, 'TUNING.md')}); the untuned quick profile of an earlier version "
              f"is in [RESULTS-quick.md]({_research_link(docs, 'RESULTS-quick.md')}).", ""]
    out = docs / "RESULTS.md"
    atomic_write_text(out, "\n".join(lines))
    return out
