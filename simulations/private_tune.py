"""A privacy-accounted hyper-parameter search: ``dpdro lab tune --private``.

    dpdro lab tune --private --dataset mnist-st --epsilon 4 --methods dp-sgd [--distribution tnb --eta 1
                   --gamma 0.1 | --distribution poisson --mu 10] [--score-noise-multiplier 10]

The private selection of Papernot and Steinke (ICLR 2022; server/private_tuning.py for the bound). Per method:

1. The number of trials K is drawn from the chosen distribution (truncated negative binomial D_{eta, gamma} or
   Poisson(mu)) with a generator seeded from the operating system: K is secret and is never released.
2. Each trial draws its point of the method's space at random (``random_point``; a generator seeded by ``--seed``,
   the method and the trial's index: data-independent, no TPE, no pruning, no confirmation runs, none of which the
   bound covers) and is a full private run at the per-trial target epsilon on the training split minus the
   validation split (``tune.trial_config``), evaluated once, at its end, on the validation split.
3. Its score is a charged release: the per-class correct and total counts on the validation records with Gaussian
   noise (``private_tuning.noisy_worst_class``, sensitivity sqrt 2), the noisy worst-class accuracy.
4. Only the trial with the highest noisy score is released (K = 0 under Poisson: nothing).

The per-trial RDP curve is declared before any trial runs, from the plans (server/run_plan.py, via ``plan_fn``) of the
first ``REFERENCE_POINTS`` points of the seeded generator, plus the score's release: the pointwise maximum. The
searched keys that change a trial's plan (``PLAN_KEYS``: the refresh batch sets the sampling rate) are fixed in a
private search (``fixed_plan_keys``); a drawn trial whose own plan would exceed the declared curve at some order is
not run (it scores nothing and touches no data), so every trial satisfies the declared curve and the bound holds.
After a trial ran, its summary's releases are checked against its plan (a mismatch stops the search).

Files, under <root>/<dataset>/eps<e>/private/<method>/:
- trialNN/ the trials' run directories (the operator's own: their summaries hold noiseless validation figures);
- search.json the operator's record (K, every trial's noisy score): publishing it is outside the guarantee;
- released.json what may be published: the best trial's keys, its noisy score, epsilon_total, delta, the theorem.
The best trial's summary.json gets a ``private_search`` block and its MODEL_CARD.md a section stating
epsilon_total. A second search on the same folder is refused, also after an interrupted one (there is no resuming:
K and the trials already run would be redrawn, and every search spends its own budget).
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np

from ..common.algorithm_specs import Choice, FloatRange, IntRange, SearchDimension
from ..common.atomic import atomic_write_bytes
from ..common.config import Config, ConfigError
from ..common.rng import derived_rng
from ..server.private_tuning import TrialCount, dominated, noisy_worst_class, rdp_curve, score_counts, search_privacy
from . import tune

log = logging.getLogger(__name__)

PLAN_KEYS = ("refresh-batch",)  # searched keys that change a trial's privacy plan: fixed in a private search
REFERENCE_POINTS = 4  # seeded points whose plans declare the per-trial RDP curve
DEFAULT_SCORE_NOISE = 10.0  # noise multiplier of the noisy score: std 10 sqrt 2 ~ 14 records per count
PlanFn = Callable[[Config], dict]  # dpdro plan's privacy_plan: cfg -> {"releases": [...], "delta": ...}


def fixed_plan_keys(method: str, dataset: str | None = None) -> dict:
    """The values a private search gives the method's searched ``PLAN_KEYS``: a choice's first value, a range's
    low end."""
    out = {}
    for key, dim in tune.space(method, dataset).items():
        if key in PLAN_KEYS:
            out[key] = dim.values[0] if isinstance(dim, Choice) else dim.low
    return out


def _draw(dim: SearchDimension, rng: np.random.Generator):
    if isinstance(dim, Choice):
        return dim.values[int(rng.integers(len(dim.values)))]
    if dim.step is not None:
        steps = int(round((dim.high - dim.low) / dim.step))
        value = dim.low + dim.step * int(rng.integers(steps + 1))
        return int(value) if isinstance(dim, IntRange) else float(value)
    if isinstance(dim, FloatRange):
        if dim.log:
            return float(math.exp(rng.uniform(math.log(dim.low), math.log(dim.high))))
        return float(rng.uniform(dim.low, dim.high))
    if dim.log:
        return int(round(math.exp(rng.uniform(math.log(dim.low), math.log(dim.high + 1) - 1e-12) - 0.5)))
    return int(rng.integers(dim.low, dim.high + 1))


def random_point(method: str, dataset: str | None, seed: int, index: int) -> dict:
    """Trial ``index``'s point: each searched key drawn uniformly (log-uniformly on a log range, uniformly over a
    grid or a choice) by a generator seeded by (seed, method, index), data-independent; ``PLAN_KEYS`` fixed
    (``fixed_plan_keys``)."""
    rng = derived_rng(seed, "private-tune", method, index)
    point = {k: _draw(d, rng) for k, d in sorted(tune.space(method, dataset).items()) if k not in PLAN_KEYS}
    return {**tune.point_keys(method, point, dataset), **fixed_plan_keys(method, dataset)}


def plan_counts(plan: dict) -> Counter:
    """(rate, noise multiplier) -> count of a ``privacy_plan`` dict."""
    counts: Counter = Counter()
    for r in plan["releases"]:
        counts[(float(r["sampling_rate"]), float(r["noise_multiplier"]))] += int(r["count"])
    return counts


def summary_counts(summary: dict) -> Counter:
    """(rate, noise multiplier) -> count of the releases a run's summary.json records; ConfigError when it made
    releases beyond its plan (their kind is not in the summary)."""
    if summary.get("releases_beyond_plan"):
        raise ConfigError(f"a trial made {summary['releases_beyond_plan']} release(s) beyond its plan; a private "
                          "search cannot bound them")
    counts: Counter = Counter()
    for name, n in summary["releases"].items():
        counts[(float(summary["sampling_rates"][name]), float(summary["noise_multipliers"][name]))] += int(n)
    return counts


def private_dir(root: Path, dataset: str, epsilon: float, method: str) -> Path:
    return tune.search_dir(root, dataset, epsilon) / "private" / method


def _trial_cfg(dataset: str, epsilon: float, method: str, point: dict, out_dir: Path, seed: int,
               trial_keys: dict | None = None) -> Config:
    """A trial's configuration (tune.trial_config) with ``trial_keys`` (e.g. iterations) over it, evaluated once."""
    cfg = tune.trial_config(dataset, epsilon, method, point, out_dir, seed)
    cfg = cfg.with_updates(dict(trial_keys or {}))
    return cfg.with_updates({"eval-every": cfg.iterations})  # one evaluation, at the end


def declared_curve(dataset: str, epsilon: float, method: str, seed: int, score_noise: float, plan_fn: PlanFn,
                   root: Path, trial_keys: dict | None = None) -> tuple[np.ndarray, float]:
    """(per-trial RDP curve at private_tuning.ORDERS, delta): the pointwise maximum over the plans of the first
    ``REFERENCE_POINTS`` seeded points plus the score release. ConfigError when their deltas differ."""
    curves, deltas = [], set()
    for i in range(REFERENCE_POINTS):
        cfg = _trial_cfg(dataset, epsilon, method, random_point(method, dataset, seed, i),
                         private_dir(root, dataset, epsilon, method) / "reference", 0, trial_keys)
        plan = plan_fn(cfg)
        counts = plan_counts(plan) + score_counts(score_noise)
        curves.append(rdp_curve(counts))
        deltas.add(float(plan["delta"]))
    if len(deltas) != 1:
        raise ConfigError(f"the trials' plans resolve different deltas {sorted(deltas)}; give config key delta")
    return np.max(curves, axis=0), deltas.pop()


def run_private_search(dataset: str, epsilon: float, method: str, dist: TrialCount, root: Path, plan_fn: PlanFn,
                       seed: int = 0, score_noise: float = DEFAULT_SCORE_NOISE,
                       rng: np.random.Generator | None = None, train_fn=None,
                       trial_keys: dict | None = None) -> dict:
    """One method's private search (module docstring); returns released.json's dict plus 'record' (the path of
    the operator's search.json). ``rng``: the secret generator of K and of the score noise (default: seeded from
    the operating system; tests pass their own). ``train_fn``: tune.train_trial (tests replace it). Raises
    ConfigError before any trial when the folder holds a search already or a parameter is out of range.
    ``trial_keys``: config keys set in every trial over the search's own (e.g. iterations for a short search;
    not searched keys: data-independent, so the bound is unchanged)."""
    from ..server.rundir import write_json

    score_counts(score_noise)  # checks it before any work
    if method not in tune.SPACES:
        raise ConfigError(f"--methods: got {method!r}; allowed: {', '.join(tune.SPACES)}")
    folder = private_dir(root, dataset, epsilon, method)
    if folder.exists() and any(folder.iterdir()):
        raise ConfigError(f"{folder} holds a private search already (finished, or interrupted: its trials spent "
                          "their budget all the same): a second one spends its own budget on top; use another --root")
    train_fn = train_fn or tune.train_trial
    rng = rng if rng is not None else np.random.default_rng()  # secret: OS entropy, never saved
    clash = sorted(set(trial_keys or {}) & set(tune.space(method, dataset)))
    if clash:
        raise ConfigError(f"--trial-keys: {', '.join(clash)} are searched keys of {method}; allowed: other keys")
    curve, delta = declared_curve(dataset, epsilon, method, seed, score_noise, plan_fn, root, trial_keys)
    privacy = search_privacy(dist, curve, delta)
    k = dist.draw(rng)
    trials, best = [], None
    for i in range(k):
        point = random_point(method, dataset, seed, i)
        cfg = _trial_cfg(dataset, epsilon, method, point, folder / f"trial{i:02d}", i, trial_keys)
        planned = plan_counts(plan_fn(cfg)) + score_counts(score_noise)
        if not dominated(planned, curve):
            log.info("trial %d: its plan exceeds the declared per-trial curve; not run", i)
            trials.append({"trial": i, "keys": point, "skipped": "plan above the declared per-trial RDP curve"})
            continue
        summary = train_fn(cfg, None)
        if summary_counts(summary) + score_counts(score_noise) != planned:
            raise ConfigError(f"trial {i} ({cfg.out_dir}) released other than its plan; the search stops")
        score = noisy_worst_class(summary["eval_class_correct"], summary["eval_class_total"], score_noise, rng)
        trials.append({"trial": i, "keys": point, "out_dir": str(cfg.out_dir), "noisy_worst": score["worst"]})
        if best is None or score["worst"] > best[1]["worst"]:
            best = (trials[-1], score)
    folder.mkdir(parents=True, exist_ok=True)
    write_json(folder / "search.json", {"method": method, "dataset": dataset, "epsilon_per_trial": epsilon,
                                        "trial_keys": dict(trial_keys or {}),
                                        "seed": seed, "score_noise_multiplier": score_noise, "trials_drawn": k,
                                        "trials": trials, **privacy,
                                        "note": "the operator's record: K and the other trials' scores are not "
                                                "covered by epsilon_total; do not publish it"})
    released = {"method": method, "dataset": dataset, "epsilon_per_trial": epsilon, **privacy,
                "score_noise_multiplier": score_noise, "score": "noisy worst-class validation accuracy",
                "best": None if best is None else {"keys": best[0]["keys"], "out_dir": best[0]["out_dir"],
                                                   "noisy_worst": best[1]["worst"],
                                                   "noisy_per_class": best[1]["per_class"]}}
    write_json(folder / "released.json", released)
    if best is not None:
        mark_released(Path(best[0]["out_dir"]), released)
    return {**released, "record": str(folder / "search.json")}


def card_section(released: dict) -> str:
    """The model card's section on the private search that released this model."""
    return "\n".join([
        "", "## Private hyper-parameter search", "",
        f"- This model was released by a private hyper-parameter search (Papernot and Steinke 2022, "
        f"{released['theorem']}): trials {released['distribution']} "
        + (f"(mu {released['mu']:g})" if released["distribution"] == "poisson"
           else f"(eta {released['eta']:g}, gamma {released['gamma']:g})")
        + f", E[K] {released['expected_trials']:.4g}, each a full run at epsilon {released['epsilon_per_trial']:g} "
        f"plus its noisy worst-class validation score (noise multiplier {released['score_noise_multiplier']:g}).",
        f"- epsilon_total = {released['epsilon_total']:.4f} at delta {released['delta']:.3g} covers the whole "
        "search (every trial's training and score, and the choice of this trial); the test-split evaluation is "
        "public data (no cost).",
        "- Not covered: the noiseless validation figures in this folder (summary.json, metrics.csv, the results "
        "section above) and the search's record (the number of trials, the other trials' scores); publish only "
        "the model, its keys, its noisy score and test-split figures.", ""])


def mark_released(run_dir: Path, released: dict) -> None:
    """Add ``private_search`` (epsilon_total, delta, distribution, theorem) to the best trial's summary.json and the
    search's section to its MODEL_CARD.md when it has one (atomic writes)."""
    from ..server.rundir import read_json, write_json

    block = {k: released[k] for k in ("epsilon_total", "delta", "theorem", "distribution", "expected_trials",
                                      "epsilon_per_trial", "score_noise_multiplier") if k in released}
    summary_path = run_dir / "summary.json"
    if summary_path.exists():
        write_json(summary_path, {**read_json(summary_path), "private_search": block})
    card = run_dir / "MODEL_CARD.md"
    if card.exists():
        atomic_write_bytes(card, (card.read_text() + card_section(released)).encode())
