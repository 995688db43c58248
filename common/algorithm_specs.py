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
    space: the tuner's search space (config key -> values, ``dpdro tune``); empty: not tuned.
    fixed: keys every tuning trial of the algorithm shares (not searched).
    """

    name: str
    keys: tuple[str, ...]
    quantities: tuple[str, ...]
    uses_eta: bool = False
    dro: bool = False
    logit_adjusted: bool = False
    space: Mapping[str, tuple[Any, ...]] = field(default_factory=dict)
    fixed: Mapping[str, Any] = field(default_factory=dict)


ALGORITHM_SPECS: Registry[AlgorithmSpec] = Registry("algorithm")


def declare_algorithm(spec: AlgorithmSpec) -> AlgorithmSpec:
    """Add ``spec`` to ``ALGORITHM_SPECS`` (ValueError if the name is taken); returns it."""
    return ALGORITHM_SPECS.register(spec.name, spec)


# ---- the tuning spaces (simulations/tune.py) ----
_LR = (2.0, 4.0, 6.0, 8.0, 12.0)
# SPIDER-type methods: 12 always diverged in the first trials, 1 is added; q = 1 (a refresh every step, no
# differences) is in their space so that the search can find out whether the differences pay off at all.
_LR_SPIDER = (1.0, 2.0, 4.0, 6.0, 8.0)
_Q = (1, 5)
_BATCH = (1024, 2048)
_TAU = (0.0, 1.0)
# SPIDER-type methods run in their useful regime (C_max = 0.15 with difference batches half the refresh batch: at
# q = 5 a phase's differences add at most about the refresh's noise; server/diagnostics.py), and the dual variable
# starts from the private mean loss.
_SPIDER = {"clip-diff-max": 0.15, "lr-eta": 0.1, "eta-init-source": "private-mean-loss"}
_DUAL = ("psi", "lambda", "cvar-alpha", "eta-scale", "eta-init", "eta-init-source", "eta-init-noise-multiplier")

# ---- the built-in algorithms (docs/ALGORITHMS.md) ----
declare_algorithm(AlgorithmSpec(
    "dp-double-spider",
    keys=("q", "refresh-batch", "diff-batch", "lr-x", "lr-eta", "clip-x", "clip-eta", "clip-diff", "clip-diff-max",
          "eta-noise-ratio", "output-iterate", "dro-clip", "eta-clip-rule", "weight-cap", "loss-bound", *_DUAL),
    quantities=("dual-x", "dual-x-wac", "dual-eta"), uses_eta=True, dro=True,
    space={"lr-x": _LR_SPIDER, "refresh-batch": _BATCH, "q": _Q, "lambda": (0.5, 1.0, 2.0),
           "dro-clip": ("product", "weight-after-clip"), "logit-adjust-tau": _TAU},
    fixed=_SPIDER))
declare_algorithm(AlgorithmSpec(
    "recursive-spider",
    keys=("q", "refresh-batch", "diff-batch", "s-batch", "clip-x", "clip-diff", "clip-diff-max", "clip-s",
          "s-noise-ratio", "beta", "s-min", "rho", "lambda-init", "lambda0", "lambda-max", "loss-bound", "u-scale",
          "lr-x", "lr-lambda", "rs-clip-units"),
    quantities=("kl-vu", "kl-g"), dro=True,
    space={"lr-x": (0.5, 1.0, 2.0, 4.0, 8.0), "refresh-batch": _BATCH, "q": _Q, "rho": (0.1, 0.5, 1.0),
           "logit-adjust-tau": _TAU},
    # The loss clamp B zeroes the gradient of records with l > B (ALGORITHMS.md 2.4): B = 10 keeps minority records
    # (whose logit-adjusted losses exceed 4) in play; the clips are in the units of the update (every trial of
    # the first search in absolute units, B = 4, lost the minority classes).
    fixed={"clip-diff-max": 0.15, "lr-lambda": 0.05, "beta": 0.5, "loss-bound": 10.0, "rs-clip-units": "relative"}))
declare_algorithm(AlgorithmSpec(
    "dp-sgd", keys=("refresh-batch", "clip-x", "lr-x"), quantities=("ce-grad",),
    space={"lr-x": _LR, "refresh-batch": _BATCH}))
declare_algorithm(AlgorithmSpec(
    "dp-sgd-la", keys=("refresh-batch", "clip-x", "lr-x", "logit-adjust-tau", "class-prior", "prior-noise-multiplier"),
    quantities=("ce-grad",), logit_adjusted=True,
    space={"lr-x": _LR, "refresh-batch": _BATCH, "posthoc-tau": (0.0, 0.5)}))
declare_algorithm(AlgorithmSpec(
    "dp-sgda", keys=("refresh-batch", "clip-x", "clip-stats", "loss-bound", "lr-x", "lr-p", "lambda"),
    quantities=("class-loss-stats", "class-weighted-grad"), dro=True,
    space={"lr-x": _LR, "refresh-batch": _BATCH, "lr-p": (0.05, 0.2, 1.0), "lambda": (0.1, 1.0),
           "logit-adjust-tau": _TAU}))

declare_algorithm(AlgorithmSpec(
    "dp-sgd-dual", keys=("refresh-batch", "clip-x", "lr-x", "lr-eta", *_DUAL), quantities=("dual-joint",),
    uses_eta=True, dro=True,
    space={"lr-x": _LR, "refresh-batch": _BATCH, "lambda": (0.5, 1.0, 2.0), "logit-adjust-tau": _TAU},
    fixed={"lr-eta": 0.1, "eta-init-source": "private-mean-loss"}))
declare_algorithm(AlgorithmSpec(
    "dp-spiderboost",
    keys=("q", "refresh-batch", "diff-batch", "clip-x", "clip-diff", "clip-diff-max", "lr-x", "lr-eta", *_DUAL),
    quantities=("dual-joint",), uses_eta=True, dro=True,
    space={"lr-x": _LR_SPIDER, "refresh-batch": _BATCH, "q": _Q, "lambda": (0.5, 1.0, 2.0), "logit-adjust-tau": _TAU},
    fixed=_SPIDER))

def algorithm_names() -> tuple[str, ...]:
    """Every declared algorithm, in declaration order (the config's allowed values)."""
    return ALGORITHM_SPECS.names()


def eta_algorithms() -> tuple[str, ...]:
    """The algorithms with a dual variable eta."""
    return tuple(n for n, s in ALGORITHM_SPECS.items() if s.uses_eta)
