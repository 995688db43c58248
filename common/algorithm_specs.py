"""What every layer may know about an algorithm without importing it: its name, the config keys it reads and
declares, the per-record quantities it asks clients for, its metadata and its tuning space (``AlgorithmSpec``).

The state machines themselves live in ``server/algorithms/`` and register with
``server.algorithms.register_algorithm(name)``, which refuses a name not declared here (a plug-in passes its
``AlgorithmSpec`` to that decorator instead and so declares both in one file). The config's allowed values
(``algorithm``), the dual-variable algorithms, the results tables' DP-DRO methods and the tuner's spaces are
derived from ``ALGORITHM_SPECS``; tests/test_registries.py checks that the two registries agree.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .config_schema import Field, param
from .registry import Registry


@dataclass(frozen=True)
class AlgorithmSpec:
    """Declaration of one algorithm.

    keys: config keys the algorithm reads besides those every run reads (iterations, epsilon, ...).
    params: the declarations (``config_schema.param``) of the keys only some algorithms read; each is in ``keys``.
        A key several algorithms read is declared by each of them with the same ``Field``; the config's keys are
        its own (common/config.py) plus every declared algorithm's params.
    local_steps: the mechanisms whose released mean is a gradient in the model's parameters at one point (a
        refresh) and which a node may replace by its update after local SGD steps (config key local-epochs,
        privacy-unit=node; ``server.releaser.Releaser.decorate``); empty: local steps do not apply.
    check: called with the algorithm's params {key: parsed value} when a config chooses the algorithm; raises
        ValueError (its message names the keys) for a combination that cannot work.
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
    params: tuple[Field, ...] = ()
    local_steps: tuple[str, ...] = ()
    check: Callable[[Mapping[str, Any]], None] | None = None

    def __post_init__(self) -> None:
        unknown = sorted(set(self.reports) - set(REPORTABLE))
        if unknown:
            raise ValueError(f"AlgorithmSpec {self.name!r}: reports {unknown} unknown; allowed: {list(REPORTABLE)}")
        undeclared = [f.key for f in self.params if f.key not in self.keys]
        if undeclared:
            raise ValueError(f"algorithm {self.name!r}: params {', '.join(map(repr, undeclared))} are not in its keys")


# The run-directory fields that only some algorithms report (AlgorithmSpec.reports), each with what it is:
# psi, lambda and dro_clip are the config keys psi, lambda and dro-clip; eval_dro_objective is F(x) of the run's psi
# and lambda on the evaluation split (docs/explanation/ALGORITHMS.md 1.2), a metrics.csv column and a summary.json
# field; eta0 is the dual variable's starting value when released from the data (eta-init-source=private-mean-loss);
# spider_noise sums up how much noise a SPIDER phase's differences added (server/diagnostics.py).
REPORTABLE = ("psi", "lambda", "dro_clip", "eval_dro_objective", "eta0", "spider_noise")


ALGORITHM_SPECS: Registry[AlgorithmSpec] = Registry("algorithm")


def declare_algorithm(spec: AlgorithmSpec) -> AlgorithmSpec:
    """Add ``spec`` to ``ALGORITHM_SPECS``; returns it. ValueError if the name is taken or one of its params is
    declared otherwise by another algorithm."""
    declared = algorithm_params()
    for f in spec.params:
        if f.key in declared and declared[f.key] != f:
            raise ValueError(f"algorithm {spec.name!r}: config key {f.key!r} is already declared otherwise by another "
                             "algorithm; reuse its declaration")
    return ALGORITHM_SPECS.register(spec.name, spec)


def algorithm_params() -> dict[str, Field]:
    """Every key an algorithm declares (key -> Field), in declaration order; read when needed, so that a plug-in
    declared later is included."""
    out: dict[str, Field] = {}
    for spec in ALGORITHM_SPECS.values():
        for f in spec.params:
            out.setdefault(f.key, f)
    return out


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
# The paper methods' group uncertainty set (docs/explanation/ALGORITHMS.md 3.3 and 4.3): its centre, how weights meet
# the clip and the weight cap: capped weight-after-clip diverged without a cap at the record level; the group level's
# product form lets minority weights grow (as dp-sgda's p / pi do), so a large cap is in the space too.
_DRO_REFERENCE = Choice(("prior", "uniform"))  # the group divergence's centre (docs/explanation/ALGORITHMS.md 3.3)
_DRO_CLIP = Choice(("product", "weight-after-clip"))
_WEIGHT_CAP = Choice((1.5, 2.0, 3.0, 10.0))
_BETA = FloatRange(0.01, 1.0, log=True)  # STORM weight / the group losses' averaging: 1 = no averaging; below 0.05
# since the average is bias-corrected (a running mean at first) and the allocation counts it
# (docs/explanation/ALGORITHMS.md 3.3) How the budget is split between a method's releases (server/allocation.py): the
# variance rule, or the declared ratios (eta-/s-noise-ratio 2; dp-sgda: equal multipliers). A lever of every method with
# two kinds of release: measured on recursive-spider's group level, 'ratios' took the x multiplier from 4.08 to 2.10
# (docs/research/long-tailed.md).
_ALLOCATION = Choice(("variance", "ratios"))
# The stabiliser: a linear warm-up of every step size (docs/explanation/ALGORITHMS.md 5.5; 0 = off).
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

# ---- the keys of the built-in algorithms (their own; the keys every run reads are in common/config.py) ----
# SPIDER phases (dp-double-spider, recursive-spider, dp-spiderboost)
_SPIDER_PARAMS = (
    param("q", "int", 5, "SPIDER phase length: a refresh every q iterations, differences in between.",
          low=1, high=10_000_000, role="algorithm"),
    param("diff-batch", "int", 512, "Expected Poisson batch size of difference releases.", low=1, high=10**9,
          role="algorithm"),
    param("clip-diff", "float", 4.0, "C_diff: difference clip C_t = min(C_diff * Delta_t, C_max), Delta_t the "
          "distance between the two parameter points.", low=0.0, low_open=True, high=1e6, role="algorithm"),
    param("clip-diff-max", "float", 0.15, "C_max, the largest difference clipping norm (0.15 with q = 5 and "
          "diff-batch = refresh-batch / 2 keeps a phase's difference noise near its refresh noise: "
          "server/diagnostics.py).",
          low=0.0, low_open=True, high=1e6, role="algorithm"),
)
# The dual variable eta of the psi-divergence dual (dp-double-spider, dp-sgd-dual, dp-spiderboost)
_DUAL_PARAMS = (
    param("lr-eta", "float", 0.5, "Step size gamma_eta of the dual variable.", low=0.0, high=1e6, role="algorithm"),
    param("eta-scale", "float", 1.0, "G in L(x, eta) = L^(x, G eta): rescales the dual variable "
          "(docs/explanation/ALGORITHMS.md 1.1).", low=0.0, low_open=True, high=1e6, role="algorithm"),
    param("eta-init", "float", 0.0, "Initial dual variable when eta-init-source='config' (public).",
          low=-1e6, high=1e6, role="algorithm"),
    param("eta-init-source", "str", "config", "'config': eta starts at eta-init; 'private-mean-loss': at the mean "
          "loss min(l, B) of all records at the initial model divided by eta-scale, released once with Gaussian "
          "noise (multiplier eta-init-noise-multiplier, sensitivity B) and charged to the ledger (chi2's optimal "
          "eta when every DRO weight is positive).", choices=("config", "private-mean-loss"), role="algorithm"),
    param("eta-init-noise-multiplier", "float", 10.0, "Noise multiplier of the private eta initialisation "
          "(std = multiplier * loss-bound on the loss sum over all n records).", low=0.0, low_open=True, high=1e6,
          role="privacy"),
)
# The public loss bound and the groups (dp-double-spider, recursive-spider, dp-sgda)
_BOUNDED_LOSS_PARAMS = (
    param("loss-bound", "float", 4.0, "Public loss bound B: losses are clamped at B in the KL terms "
          "g~ = exp((min(l, B) - B) / lambda) and in dp-sgda's class losses (docs/explanation/ALGORITHMS.md 2.4).",
          low=0.0, low_open=True, high=1e4, role="algorithm"),
    param("dro-groups", "str", "class", "The groups of dro-level=group and of dp-sgda: 'class' (the K classes), "
          "'attribute' (the data set's declared group attribute, e.g. CelebA's 4 groups 2 * Blond_Hair + Male; a data "
          "set without one is refused) or 'node' (the m = num-clients nodes, each record's group its node's index: "
          "the worst-off node, agnostic federated learning, Mohri et al. 2019; needs num-clients >= 2) or 'site' "
          "(the num-sites sites, each record's group its node's public site label). With dro-level=group, "
          "'attribute', 'node' and 'site' release a histogram of the groups before training "
          "(prior-noise-multiplier); dp-sgda estimates the group frequencies from its own releases "
          "(docs/explanation/ALGORITHMS.md 3.3).",
          choices=("class", "attribute", "node", "site"), role="algorithm"),
)
# The paper methods' group level and DRO weights (dp-double-spider, recursive-spider)
_GROUP_DRO_PARAMS = (
    param("dro-level", "str", "record", "Uncertainty set of dp-double-spider and recursive-spider: 'record' (the "
          "paper's: a psi-divergence ball over records) or 'group' (over the K classes: q near the class priors pi, "
          "group losses from SPIDER / STORM releases of the K-vector of class loss sums, record weights w_y public "
          "functions of them; docs/explanation/ALGORITHMS.md 3.3, 4.3). 'group' releases the class histogram "
          "before training.",
          choices=("record", "group"), role="algorithm"),
    param("block-order", "str", "sequential", "Order of the dual (eta, or the group weights) and model blocks of "
          "dp-double-spider and group-level recursive-spider: 'sequential' (the paper's Algorithm 2: the x block is "
          "evaluated at the eta or weights released in the same iteration, two message rounds per iteration) or "
          "'simultaneous' (both blocks at the same point (x_t, eta_t), the x block with the weights of the previous "
          "iteration's release: one round per iteration, the same releases and sensitivities; "
          "docs/explanation/ALGORITHMS.md 3.4). "
          "Record-level recursive-spider is simultaneous by construction (Algorithm 3) and ignores the key.",
          choices=("sequential", "simultaneous"), role="algorithm"),
    param("dro-reference", "str", "prior", "Reference distribution r of dro-level=group's psi-divergence "
          "D_psi(q || r): 'prior' (the group priors pi: the paper's centre, the empirical distribution, so q = pi is "
          "ERM) or 'uniform' (1/K: the balanced centre, as dp-sgda's KL(p || uniform); q = r weighs every group "
          "equally). A public choice: the record weights are w_k = r_k v_k / pi_k with v_k = q_k / r_k "
          "(docs/explanation/ALGORITHMS.md 3.3, 4.3).", choices=("prior", "uniform"), role="algorithm"),
    param("dro-clip", "str", "product", "How DRO weights meet clipping (dp-double-spider): 'product' clips "
          "w grad l to C (weights of clipped records are erased); 'weight-after-clip' uses w~ clip_C(grad l) with "
          "w~ the weight of min(l, B), sensitivity C W for the public bound W = psi*'((B - G eta) / lambda) "
          "(docs/explanation/ALGORITHMS.md 5.4).", choices=("product", "weight-after-clip"), role="algorithm"),
    param("weight-cap", "float", math.inf, "Public cap W_cap > 1 of dp-double-spider's DRO weights: every weight is "
          "min(w, W_cap) in both blocks (the psi-divergence with likelihood ratios <= W_cap). With "
          "dro-clip='weight-after-clip' the x sensitivity is C min(W, W_cap); with eta-clip-rule='weight-bound' the "
          "eta clip is G max(1, min(W, W_cap) - 1) (docs/explanation/ALGORITHMS.md 3.1). inf: no cap.", low=1.0,
          low_open=True, high=1e6, allow_inf=True, role="algorithm"),
    param("beta", "float", 0.5, "STORM weight beta in [0, 1] of recursive-spider's estimate s_t of g(w) (at "
          "dro-level=group: of its group-loss estimate; dp-double-spider at dro-level=group: the weight of the newest "
          "SPIDER estimate in the bias-corrected exponential average of the group losses; 0: their running mean).",
          low=0.0, high=1.0, role="algorithm"),
)
# The levers of a gradient-difference release of the x block (dp-double-spider; recursive-spider at dro-level=group;
# server/algorithms/diff_levers.py)
_DIFF_LEVER_PARAMS = (
    param("x-estimator", "str", "spider", "Estimator of the x gradient between refreshes (dp-double-spider's x block; "
          "recursive-spider's at dro-level=group only): 'spider' (the paper's: b_t = b_{t-1} + noisy mean of "
          "clip_{C_t}(g(x_t) - g(x_{t-1}))) or 'storm' (Cutkosky & Orabona 2019: b_t = (1 - a) b_{t-1} + noisy mean "
          "of clip_{S_t}(g(x_t) - (1 - a) g(x_{t-1})), a = x-storm-a, sensitivity S_t = a C_ref + (1 - a) C_t).",
          choices=("spider", "storm"), role="algorithm"),
    param("x-storm-a", "float", 0.1, "STORM weight a in [0, 1] of x-estimator='storm' (0: SPIDER; 1: a plain "
          "gradient on the difference batch every iteration).", low=0.0, high=1.0, role="algorithm"),
    param("clip-diff-rule", "str", "fixed", "How C_diff of the difference clip C_t = min(C_diff Delta_t, C_max) is "
          "set (x block of dp-double-spider; of recursive-spider at dro-level=group only): 'fixed' (clip-diff) or "
          "'private-quantile' (starts at clip-diff and follows a privately released quantile of the per-record "
          "difference norms over Delta_t, Andrew et al. 2021's geometric update; one count release per difference "
          "iteration, charged as mechanism '<diff>-quantile').", choices=("fixed", "private-quantile"),
          role="algorithm"),
    param("clip-diff-quantile", "float", 0.5, "Target fraction gamma of records under the uncapped difference clip "
          "(clip-diff-rule='private-quantile').", low=0.0, low_open=True, high=1.0, high_open=True, role="algorithm"),
    param("clip-diff-quantile-lr", "float", 0.2, "Step eta_C of the geometric update C_diff <- C_diff "
          "exp(-eta_C (b - gamma)) (clip-diff-rule='private-quantile'; Andrew et al. 2021 use 0.2).",
          low=0.0, low_open=True, high=10.0, role="algorithm"),
    param("clip-diff-quantile-noise-ratio", "float", 5.0, "Noise multiplier of the private quantile's count "
          "releases relative to the x releases (noise-allocation='ratios'; sensitivity 1 record).",
          low=0.0, low_open=True, high=1e4, role="privacy"),
)
_DIFF_LEVER_KEYS = tuple(f.key for f in _DIFF_LEVER_PARAMS)
# Dp-double-spider only
_DOUBLE_SPIDER_PARAMS = (
    param("clip-eta", "float", 1.0, "Clipping norm C_eta of per-record eta-gradients (refresh).",
          low=0.0, low_open=True, high=1e6, role="algorithm"),
    param("eta-noise-ratio", "float", 2.0, "Noise multiplier of the eta releases relative to the x releases "
          "(calibration scales both to meet the target; noise-allocation='ratios').", low=0.0, low_open=True,
          high=1e3, role="privacy"),
    param("eta-clip-rule", "str", "fixed", "Clip of dp-double-spider's eta-refresh: 'fixed' clips G (1 - w) at "
          "clip-eta (biased where weights exceed 1 + clip-eta / G: fatal for kl); 'weight-bound' computes w from "
          "min(l, B) and clips at G max(1, W - 1), W = min(psi*'((B - G eta_t) / lambda), weight-cap) the public "
          "weight bound at the released eta_t, which no record exceeds: no clipping bias "
          "(docs/explanation/ALGORITHMS.md 3.1).",
          choices=("fixed", "weight-bound"), role="algorithm"),
    param("output-iterate", "str", "last", "'last': the final iterate; 'random': a uniformly drawn iterate "
          "(public coin) as in the theory.", choices=("last", "random"), role="algorithm"),
)
# Recursive-spider only
_RECURSIVE_SPIDER_PARAMS = (
    param("rho", "float", 0.5, "KL radius rho of the constrained KL-DRO (recursive-spider, "
          "docs/explanation/ALGORITHMS.md 2.1).", low=0.0, high=1e3, role="algorithm"),
    param("lambda-init", "float", 1.0, "Initial lambda of recursive-spider (public).", low=0.0, low_open=True,
          high=1e6, role="algorithm"),
    param("lambda0", "float", 0.1, "Lower bound lambda0 > 0 of recursive-spider's lambda.", low=0.0,
          low_open=True, high=1e6, role="algorithm"),
    param("lambda-max", "float", 10.0, "Upper bound of recursive-spider's lambda.", low=0.0, low_open=True,
          high=1e6, role="algorithm"),
    param("u-scale", "float", 1.0, "c_u: the d_lambda block is multiplied by c_u before the joint clip of "
          "recursive-spider's v/u release (and divided after), so it is not swamped by the d-dim block.",
          low=0.0, low_open=True, high=1e6, role="algorithm"),
    param("s-batch", "int", 1024, "Expected Poisson batch size of recursive-spider's s release.", low=1,
          high=10**9, role="algorithm"),
    param("clip-s", "float", 1.0, "Clipping norm of the per-record STORM term g~(w_t) - (1-beta) g~(w_{t-1}) "
          "(|term| <= 1, so 1 clips nothing).", low=0.0, low_open=True, high=1e6, role="algorithm"),
    param("s-noise-ratio", "float", 2.0, "Noise multiplier of the s releases relative to the v/u releases.",
          low=0.0, low_open=True, high=1e3, role="privacy"),
    param("s-min", "float", 1e-3, "Floor s_min > 0 of s_t before log and division.", low=0.0, low_open=True,
          high=1.0, role="algorithm"),
    param("s-clip-units", "str", "absolute", "recursive-spider's s release: 'absolute' (clip-s bounds the STORM term "
          "g~(w_t) - (1-beta) g~(w_{t-1}), noise std z clip-s / N) or 'relative' (the term is divided by the released "
          "s_{t-1} before the clip and the mean multiplied back, so clip-s bounds a relative change and the noise is a "
          "fixed fraction of s; docs/explanation/ALGORITHMS.md 2.5).", choices=("absolute", "relative"),
          role="algorithm"),
    param("rs-clip-units", "str", "absolute", "recursive-spider's v/u clip bounds: 'absolute' (clip-x, clip-diff "
          "on [grad_x g~ ; c_u d_lambda g~]) or 'relative' (the vector is scaled by lambda_t / s_{t-1} first, so the "
          "bounds are in the units of the update z = lambda v / s; docs/explanation/ALGORITHMS.md 5.4).",
          choices=("absolute", "relative"), role="algorithm"),
    param("loss-clamp", "str", "hard", "How recursive-spider's KL terms bound the loss at loss-bound B: 'hard' "
          "min(l, B) (records with l > B get zero gradient) or 'soft' B - softplus(B - l) (smooth, strictly "
          "increasing, < B: every record keeps a gradient; g~ stays in (0, 1], so sensitivities are unchanged; "
          "docs/explanation/ALGORITHMS.md 2.4).", choices=("hard", "soft"), role="algorithm"),
    param("lr-lambda", "float", 0.05, "Step size gamma_lambda of recursive-spider's lambda.", low=0.0,
          high=1e6, role="algorithm"),
)
# Dp-sgda only
_SGDA_PARAMS = (
    param("clip-stats", "float", 4.2, "Clipping norm of dp-sgda's per-record class statistics "
          "[e_y min(l, B); e_y] (norm <= sqrt(B^2 + 1)).", low=0.0, low_open=True, high=1e6, role="algorithm"),
    param("lr-p", "float", 0.1, "Mirror-ascent step size of dp-sgda's class weights p.", low=0.0, high=1e6,
          role="algorithm"),
)


def _check_lambda_range(values: Mapping[str, Any]) -> None:
    if not values["lambda0"] <= values["lambda-init"] <= values["lambda-max"]:
        raise ValueError(f"config keys 'lambda0', 'lambda-init', 'lambda-max': got {values['lambda0']}, "
                         f"{values['lambda-init']}, {values['lambda-max']}; allowed: lambda0 <= lambda-init <= "
                         "lambda-max")


def _check_recursive_spider(values: Mapping[str, Any]) -> None:
    """lambda0 <= lambda-init <= lambda-max, and the x-block levers (x-estimator, clip-diff-rule) only at
    dro-level=group: the record level's v/u release keeps the paper's SPIDER with a fixed C_diff."""
    _check_lambda_range(values)
    if values["dro-level"] == "record":
        for key, default in (("x-estimator", "spider"), ("clip-diff-rule", "fixed")):
            if values[key] != default:
                raise ValueError(f"config key {key!r}: got {values[key]!r} with recursive-spider at "
                                 f"dro-level='record'; allowed: {default!r} (the lever applies to its x block at "
                                 "dro-level='group')")


# ---- the built-in algorithms (docs/explanation/ALGORITHMS.md) ----
declare_algorithm(AlgorithmSpec(
    "dp-double-spider",
    keys=("q", "refresh-batch", "diff-batch", "lr-x", "lr-eta", "clip-x", "clip-eta", "clip-diff", "clip-diff-max",
          "eta-noise-ratio", "output-iterate", "dro-clip", "eta-clip-rule", "weight-cap", "loss-bound", "dro-level",
          "block-order",
          "dro-groups", "dro-reference", "beta", *_DIFF_LEVER_KEYS, *_DUAL),
    quantities=("dual-x", "dual-x-wac", "dual-eta", "group-loss", "group-weighted-grad"), uses_eta=True, dro=True,
    # eta clipped at its public weight bound (no clipping bias, docs/explanation/ALGORITHMS.md 3.1); capped weights make
    # weight-after-clip affordable (measured: without a cap it diverged at lr 2; kl + cap 2 was the best found)
    # The search runs at dro-level=group (docs/explanation/ALGORITHMS.md 3.3): the record level's searches
    # (docs/research/TUNING.md, earlier rounds) reached worst-class 0.02 at best, and half of a joint search's
    # trials went to it. lr-eta is inert at the group level (eta is solved exactly), so it is not searched; the
    # divergence's centre is.
    space={**_levers(_LR_SPIDER), "q": _Q, "lambda": _LAMBDA, "psi": Choice(("chi2", "kl")),
           "dro-clip": _DRO_CLIP, "weight-cap": _WEIGHT_CAP, "dro-reference": _DRO_REFERENCE, "beta": _BETA,
           "noise-allocation": _ALLOCATION},
    fixed={**_SPIDER, "eta-clip-rule": "weight-bound", "dro-level": "group"},
    reports=("psi", "lambda", "dro_clip", "eval_dro_objective", "eta0", "spider_noise"),
    params=(*_SPIDER_PARAMS, *_DUAL_PARAMS, *_BOUNDED_LOSS_PARAMS, *_GROUP_DRO_PARAMS, *_DIFF_LEVER_PARAMS,
            *_DOUBLE_SPIDER_PARAMS),
    local_steps=("x-refresh",)))
declare_algorithm(AlgorithmSpec(
    "recursive-spider",
    keys=("q", "refresh-batch", "diff-batch", "s-batch", "clip-x", "clip-diff", "clip-diff-max", "clip-s",
          "s-noise-ratio", "beta", "s-min", "rho", "lambda-init", "lambda0", "lambda-max", "loss-bound", "u-scale",
          "lr-x", "lr-lambda", "rs-clip-units", "s-clip-units", "loss-clamp", "dro-level", "dro-groups",
          "dro-reference", "dro-clip", "weight-cap", "block-order", *_DIFF_LEVER_KEYS),
    quantities=("kl-vu", "kl-g", "group-loss", "group-weighted-grad"), dro=True,
    space={**_levers(FloatRange(0.25, 8.0, log=True)), "q": _Q, "rho": FloatRange(0.1, 1.0, log=True),
           "dro-reference": _DRO_REFERENCE, "dro-clip": _DRO_CLIP, "weight-cap": _WEIGHT_CAP, "beta": _BETA,
           "loss-bound": Choice((4.0, 10.0)), "noise-allocation": _ALLOCATION},
    # The loss clamp B zeroes the gradient of records with l > B (docs/explanation/ALGORITHMS.md 2.4): B = 10 keeps
    # minority records (whose logit-adjusted losses exceed 4) in play at the record level, while the group level's
    # K-vector release has sensitivity B (so B = 4 is in the space); the clips are in the units of the update (every
    # trial of the first search in absolute units, B = 4, lost the minority classes).
    # s released in units of s_{t-1} (docs/explanation/ALGORITHMS.md 2.5; measured: 0.39 -> 0.83 accuracy at lr 6), with
    # a floor below the starting s (about 4.5e-4 on MNIST-ST)
    fixed={"clip-diff-max": 0.15, "lr-lambda": 0.05, "rs-clip-units": "relative",
           "s-clip-units": "relative", "s-min": 1e-6, "dro-level": "group"},
    # its objective is KL-DRO with rho (its own eval_kl_dro_objective), not the psi-divergence of key psi
    reports=("dro_clip", "spider_noise"),
    params=(*_SPIDER_PARAMS, *_BOUNDED_LOSS_PARAMS, *_GROUP_DRO_PARAMS, *_DIFF_LEVER_PARAMS, *_RECURSIVE_SPIDER_PARAMS),
    local_steps=("x-refresh",),  # dro-level=group only: the record level's x release is the compositional v/u
    check=_check_recursive_spider))
declare_algorithm(AlgorithmSpec(
    "dp-sgd", keys=("refresh-batch", "clip-x", "lr-x"), quantities=("ce-grad",),
    space=_levers(_LR, tau=None), local_steps=("grad",)))
declare_algorithm(AlgorithmSpec(
    "dp-sgd-la", keys=("refresh-batch", "clip-x", "lr-x", "logit-adjust-tau", "class-prior", "prior-noise-multiplier"),
    quantities=("ce-grad",), logit_adjusted=True,
    space=_levers(_LR, tau=_TAU_LA), local_steps=("grad",)))
declare_algorithm(AlgorithmSpec(
    "dp-sgda", keys=("refresh-batch", "clip-x", "clip-stats", "loss-bound", "lr-x", "lr-p", "lambda", "dro-groups"),
    quantities=("class-loss-stats", "class-weighted-grad"), dro=True,
    space={**_levers(_LR), "lr-p": FloatRange(0.02, 1.0, log=True), "lambda": FloatRange(0.05, 2.0, log=True),
           "noise-allocation": _ALLOCATION},
    reports=("lambda",),
    params=(*_BOUNDED_LOSS_PARAMS, *_SGDA_PARAMS), local_steps=("grad",)))

# dp-sgd-dual and dp-spiderboost read loss-bound too: the private eta initialisation's sensitivity (server/setup.py)
declare_algorithm(AlgorithmSpec(
    "dp-sgd-dual", keys=("refresh-batch", "clip-x", "lr-x", "lr-eta", "loss-bound", *_DUAL),
    quantities=("dual-joint",), params=_DUAL_PARAMS,
    uses_eta=True, dro=True,
    space={**_levers(_LR), "lambda": _LAMBDA, "lr-eta": _LR_ETA},
    fixed={"eta-init-source": "private-mean-loss"},
    reports=("psi", "lambda", "eval_dro_objective", "eta0")))
declare_algorithm(AlgorithmSpec(
    "dp-spiderboost",
    keys=("q", "refresh-batch", "diff-batch", "clip-x", "clip-diff", "clip-diff-max", "lr-x", "lr-eta", "loss-bound",
          *_DUAL),
    params=(*_SPIDER_PARAMS, *_DUAL_PARAMS),
    quantities=("dual-joint",), uses_eta=True, dro=True,
    space={**_levers(_LR_SPIDER), "q": _Q, "lambda": _LAMBDA, "lr-eta": _LR_ETA},
    fixed=_SPIDER, reports=("psi", "lambda", "eval_dro_objective", "eta0", "spider_noise")))

def algorithm_names() -> tuple[str, ...]:
    """Every declared algorithm, in declaration order (the config's allowed values)."""
    return ALGORITHM_SPECS.names()


def eta_algorithms() -> tuple[str, ...]:
    """The algorithms with a dual variable eta."""
    return tuple(n for n, s in ALGORITHM_SPECS.items() if s.uses_eta)
