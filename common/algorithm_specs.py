"""What every layer may know about an algorithm without importing it: its name, the config keys it reads,
the per-record quantities it asks clients for, its metadata and its tuning space (``AlgorithmSpec``).

The state machines themselves live in ``server/algorithms/`` and register with
``server.algorithms.register_algorithm(name)``, which refuses a name not declared here (a plug-in passes its
``AlgorithmSpec`` to that decorator instead and so declares both in one file). The config's allowed values
(``algorithm``), the dual-variable algorithms, the results tables' DP-DRO methods and the tuner's spaces are
derived from ``ALGORITHM_SPECS``; tests/test_registries.py checks that the two registries agree.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .registry import Registry


@dataclass(frozen=True)
class AlgorithmSpec:
    """Declaration of one algorithm.

    keys: config keys the algorithm reads besides those every run reads (iterations, epsilon, ...).
    quantities: names in ``common.quantities.QUANTITIES`` its queries use.
    uses_eta: it has the dual variable eta (so eta-init-source='private-mean-loss' applies).
    dro: a DP-DRO method (the results tables compare it with the simple baselines, the non-DRO methods).
    logit_adjusted: it trains on the logit-adjusted loss (logit-adjust-tau 'auto' means 1, and 0 is refused).
    space: the tuner's search space (config key -> FloatRange | IntRange | Choice, ``dpdro lab tune``); empty: not
        tuned.
    fixed: keys every tuning trial of the algorithm shares (not searched).
    reports: the fields of summary.json (and, for eval_dro_objective and eta, the columns of metrics.csv) that
        apply to this algorithm only, among ``REPORTABLE``: a run of another algorithm leaves them out
        (docs/reference/run-directory.md lists every field and which algorithms report it). The per-iteration
        values of the algorithm's own ``diagnostics`` and ``eval_extras`` are its columns without declaration.
    """

    name: str
    keys: tuple[str, ...]
    quantities: tuple[str, ...]
    uses_eta: bool = False
    dro: bool = False
    logit_adjusted: bool = False
    space: Mapping[str, SearchDimension] = field(default_factory=dict)
    fixed: Mapping[str, Any] = field(default_factory=dict)
    reports: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        unknown = sorted(set(self.reports) - set(REPORTABLE))
        if unknown:
            raise ValueError(f"AlgorithmSpec {self.name!r}: reports {unknown} unknown; allowed: {list(REPORTABLE)}")


# The run-directory fields that only some algorithms report (AlgorithmSpec.reports), each with what it is:
# psi, lambda and dro_clip are the config keys psi, lambda and dro-clip; eval_dro_objective is F(x) of the run's psi
# and lambda on the evaluation split (ALGORITHMS.md 1.2), a metrics.csv column and a summary.json field; eta0 is the
# dual variable's starting value when released from the data (eta-init-source=private-mean-loss); spider_noise sums
# up how much noise a SPIDER phase's differences added (server/diagnostics.py).
REPORTABLE = ("psi", "lambda", "dro_clip", "eval_dro_objective", "eta0", "spider_noise")


ALGORITHM_SPECS: Registry[AlgorithmSpec] = Registry("algorithm")


def declare_algorithm(spec: AlgorithmSpec) -> AlgorithmSpec:
    """Add ``spec`` to ``ALGORITHM_SPECS`` (ValueError if the name is taken); returns it."""
    return ALGORITHM_SPECS.register(spec.name, spec)


# ---- the tuning spaces (simulations/tune.py: each becomes an Optuna distribution) ----
@dataclass(frozen=True)
class FloatRange:
    """A float searched in [low, high]: log-uniform when ``log`` (then low > 0), else uniform, on a grid of
    ``step`` when given (uniform only). Raises ValueError for an empty range or a log range reaching 0."""

    low: float
    high: float
    log: bool = False
    step: float | None = None

    def __post_init__(self) -> None:
        if not self.low < self.high or (self.log and self.low <= 0) or (self.log and self.step is not None):
            raise ValueError(f"FloatRange: got low={self.low}, high={self.high}, log={self.log}, step={self.step}; "
                             "allowed: low < high, low > 0 and no step when log")


@dataclass(frozen=True)
class IntRange:
    """An integer searched in [low, high] (``step`` apart; log-uniform when ``log``, then low >= 1).
    Raises ValueError for an empty range."""

    low: int
    high: int
    log: bool = False
    step: int = 1

    def __post_init__(self) -> None:
        if not self.low < self.high or self.step < 1 or (self.log and (self.low < 1 or self.step != 1)):
            raise ValueError(f"IntRange: got low={self.low}, high={self.high}, log={self.log}, step={self.step}; "
                             "allowed: low < high, step >= 1, low >= 1 and step 1 when log")


@dataclass(frozen=True)
class Choice:
    """One of ``values`` (strings, numbers or booleans; no order assumed). Raises ValueError for fewer than
    two values or repeated ones."""

    values: tuple

    def __post_init__(self) -> None:
        if len(self.values) < 2 or len(set(self.values)) != len(self.values):
            raise ValueError(f"Choice: got {self.values!r}; allowed: two or more distinct values")


SearchDimension = FloatRange | IntRange | Choice

# Every method gets the same levers: its step size, the refresh batch, post-hoc logit
# adjustment at prediction, logit adjustment in training (dp-sgd keeps 0: with tau > 0 it is dp-sgd-la) and the
# stabiliser, plus the keys of its own problem (q, lambda, ...).
_BATCH = Choice((1024, 2048))
_POSTHOC_TAU = FloatRange(0.0, 1.0, step=0.05)
_TAU = FloatRange(0.0, 1.5, step=0.05)
_TAU_LA = FloatRange(0.25, 1.5, step=0.05)  # dp-sgd-la refuses 0 (it would be dp-sgd)
_LR = FloatRange(1.0, 12.0, log=True)
# SPIDER-type methods: steps of 12 diverged in the first searches; q = 1 (a refresh every step, no differences)
# is in their space so that the search can find out whether the differences pay off at all.
_LR_SPIDER = FloatRange(0.5, 8.0, log=True)
_Q = Choice((1, 3, 5))
_LAMBDA = FloatRange(0.25, 4.0, log=True)
_LR_ETA = FloatRange(0.02, 0.5, log=True)  # once fixed at 0.1: the dual step is a lever too
# The paper methods' group uncertainty set (ALGORITHMS.md 3.3 and 4.3): its centre, how weights meet the clip and the
# weight cap: capped weight-after-clip diverged without a cap at the record level; the group level's product form
# lets minority weights grow (as dp-sgda's p / pi do), so a large cap is in the space too.
_DRO_REFERENCE = Choice(("prior", "uniform"))  # the group divergence's centre (ALGORITHMS.md 3.3)
_DRO_CLIP = Choice(("product", "weight-after-clip"))
_WEIGHT_CAP = Choice((1.5, 2.0, 3.0, 10.0))
_BETA = FloatRange(0.01, 1.0, log=True)  # STORM weight / the group losses' averaging: 1 = no averaging; below 0.05
# since the average is bias-corrected (a running mean at first) and the allocation counts it (ALGORITHMS.md 3.3)
# How the budget is split between a method's releases (server/allocation.py): the variance rule, or the declared
# ratios (eta-/s-noise-ratio 2; dp-sgda: equal multipliers). A lever of every method with two kinds of release:
# measured on recursive-spider's group level, 'ratios' took the x multiplier from 4.08 to 2.10
# (docs/research/long-tailed.md).
_ALLOCATION = Choice(("variance", "ratios"))
# The stabiliser: a linear warm-up of every step size (ALGORITHMS.md 5.5; 0 = off).
_WARMUP = IntRange(0, 200, step=25)


def _levers(lr_x: FloatRange, tau: FloatRange | None = _TAU) -> dict[str, SearchDimension]:
    """The levers every method's space shares (tau None: logit adjustment is not a lever of the method)."""
    return {"lr-x": lr_x, "refresh-batch": _BATCH, "posthoc-tau": _POSTHOC_TAU, "warmup-iterations": _WARMUP,
            **({"logit-adjust-tau": tau} if tau is not None else {})}


# SPIDER-type methods run in their useful regime (C_max = 0.15 with difference batches half the refresh batch: at
# q = 5 a phase's differences add at most about the refresh's noise; server/diagnostics.py), and the dual variable
# starts from the private mean loss.
_SPIDER = {"clip-diff-max": 0.15, "eta-init-source": "private-mean-loss"}
_DUAL = ("psi", "lambda", "cvar-alpha", "eta-scale", "eta-init", "eta-init-source", "eta-init-noise-multiplier")

# ---- the built-in algorithms (docs/explanation/ALGORITHMS.md) ----
declare_algorithm(AlgorithmSpec(
    "dp-double-spider",
    keys=("q", "refresh-batch", "diff-batch", "lr-x", "lr-eta", "clip-x", "clip-eta", "clip-diff", "clip-diff-max",
          "eta-noise-ratio", "output-iterate", "dro-clip", "eta-clip-rule", "weight-cap", "loss-bound", "dro-level",
          "block-order",
          "dro-groups", "dro-reference", "beta", *_DUAL),
    quantities=("dual-x", "dual-x-wac", "dual-eta", "group-loss", "group-weighted-grad"), uses_eta=True, dro=True,
    # eta clipped at its public weight bound (no clipping bias, ALGORITHMS.md 3.1); capped weights make
    # weight-after-clip affordable (measured: without a cap it diverged at lr 2; kl + cap 2 was the best found)
    # The search runs at dro-level=group (ALGORITHMS.md 3.3): the record level's searches
    # (docs/research/TUNING.md, earlier rounds) reached worst-class 0.02 at best, and half of a joint search's
    # trials went to it. lr-eta is inert at the group level (eta is solved exactly), so it is not searched; the
    # divergence's centre is.
    space={**_levers(_LR_SPIDER), "q": _Q, "lambda": _LAMBDA, "psi": Choice(("chi2", "kl")),
           "dro-clip": _DRO_CLIP, "weight-cap": _WEIGHT_CAP, "dro-reference": _DRO_REFERENCE, "beta": _BETA,
           "noise-allocation": _ALLOCATION},
    fixed={**_SPIDER, "eta-clip-rule": "weight-bound", "dro-level": "group"},
    reports=("psi", "lambda", "dro_clip", "eval_dro_objective", "eta0", "spider_noise")))
declare_algorithm(AlgorithmSpec(
    "recursive-spider",
    keys=("q", "refresh-batch", "diff-batch", "s-batch", "clip-x", "clip-diff", "clip-diff-max", "clip-s",
          "s-noise-ratio", "beta", "s-min", "rho", "lambda-init", "lambda0", "lambda-max", "loss-bound", "u-scale",
          "lr-x", "lr-lambda", "rs-clip-units", "s-clip-units", "loss-clamp", "dro-level", "dro-groups",
          "dro-reference", "dro-clip", "weight-cap", "block-order"),
    quantities=("kl-vu", "kl-g", "group-loss", "group-weighted-grad"), dro=True,
    space={**_levers(FloatRange(0.25, 8.0, log=True)), "q": _Q, "rho": FloatRange(0.1, 1.0, log=True),
           "dro-reference": _DRO_REFERENCE, "dro-clip": _DRO_CLIP, "weight-cap": _WEIGHT_CAP, "beta": _BETA,
           "loss-bound": Choice((4.0, 10.0)), "noise-allocation": _ALLOCATION},
    # The loss clamp B zeroes the gradient of records with l > B (ALGORITHMS.md 2.4): B = 10 keeps minority records
    # (whose logit-adjusted losses exceed 4) in play at the record level, while the group level's K-vector release
    # has sensitivity B (so B = 4 is in the space); the clips are in the units of the update (every trial of the
    # first search in absolute units, B = 4, lost the minority classes).
    # s released in units of s_{t-1} (ALGORITHMS.md 2.5; measured: 0.39 -> 0.83 accuracy at lr 6), with a floor
    # below the starting s (about 4.5e-4 on MNIST-ST)
    fixed={"clip-diff-max": 0.15, "lr-lambda": 0.05, "rs-clip-units": "relative",
           "s-clip-units": "relative", "s-min": 1e-6, "dro-level": "group"},
    # its objective is KL-DRO with rho (its own eval_kl_dro_objective), not the psi-divergence of key psi
    reports=("dro_clip", "spider_noise")))
declare_algorithm(AlgorithmSpec(
    "dp-sgd", keys=("refresh-batch", "clip-x", "lr-x"), quantities=("ce-grad",),
    space=_levers(_LR, tau=None)))
declare_algorithm(AlgorithmSpec(
    "dp-sgd-la", keys=("refresh-batch", "clip-x", "lr-x", "logit-adjust-tau", "class-prior", "prior-noise-multiplier"),
    quantities=("ce-grad",), logit_adjusted=True,
    space=_levers(_LR, tau=_TAU_LA)))
declare_algorithm(AlgorithmSpec(
    "dp-sgda", keys=("refresh-batch", "clip-x", "clip-stats", "loss-bound", "lr-x", "lr-p", "lambda", "dro-groups"),
    quantities=("class-loss-stats", "class-weighted-grad"), dro=True,
    space={**_levers(_LR), "lr-p": FloatRange(0.02, 1.0, log=True), "lambda": FloatRange(0.05, 2.0, log=True),
           "noise-allocation": _ALLOCATION},
    reports=("lambda",)))

declare_algorithm(AlgorithmSpec(
    "dp-sgd-dual", keys=("refresh-batch", "clip-x", "lr-x", "lr-eta", *_DUAL), quantities=("dual-joint",),
    uses_eta=True, dro=True,
    space={**_levers(_LR), "lambda": _LAMBDA, "lr-eta": _LR_ETA},
    fixed={"eta-init-source": "private-mean-loss"},
    reports=("psi", "lambda", "eval_dro_objective", "eta0")))
declare_algorithm(AlgorithmSpec(
    "dp-spiderboost",
    keys=("q", "refresh-batch", "diff-batch", "clip-x", "clip-diff", "clip-diff-max", "lr-x", "lr-eta", *_DUAL),
    quantities=("dual-joint",), uses_eta=True, dro=True,
    space={**_levers(_LR_SPIDER), "q": _Q, "lambda": _LAMBDA, "lr-eta": _LR_ETA},
    fixed=_SPIDER, reports=("psi", "lambda", "eval_dro_objective", "eta0", "spider_noise")))

def algorithm_names() -> tuple[str, ...]:
    """Every declared algorithm, in declaration order (the config's allowed values)."""
    return ALGORITHM_SPECS.names()


def eta_algorithms() -> tuple[str, ...]:
    """The algorithms with a dual variable eta."""
    return tuple(n for n, s in ALGORITHM_SPECS.items() if s.uses_eta)
