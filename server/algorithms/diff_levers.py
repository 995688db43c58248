"""The levers that set what a gradient-difference release of the x block costs (docs/research/SPIDER.md).

Two public rules, shared by dp-double-spider (record level: its x block; group level) and group-level
recursive-spider (its x block), each behind a config key:

**The x estimator** (key x-estimator). 'spider' (the paper's): inside a phase of q iterations

    b_t = b_{t-1} + (1/N) [sum_{B} clip_{C_t}(g_i(x_t) - g_i(x_{t-1})) + N(0, (z C_t)^2 I)],

and 'storm' (Cutkosky & Orabona 2019, "Momentum-based variance reduction in non-convex SGD", NeurIPS, eq. (3);
the recursion the paper already uses for recursive-spider's s) with weight a = key x-storm-a in [0, 1]:

    b_t = (1 - a) b_{t-1} + (1/N) [sum_{B} clip_{S_t}(g_i(x_t) - (1 - a) g_i(x_{t-1})) + N(0, (z S_t)^2 I)],

i.e. d_t = g_t + (1 - a)(d_{t-1} - g'_t) with both gradients on one Poisson batch. Refreshes (t mod q == 0) are
unchanged. Sensitivity: the per-record vector is a g_i(x_t) + (1 - a)(g_i(x_t) - g_i(x_{t-1})), so the same rule
as a difference's bounds it by S_t = a C_ref + (1 - a) C_t (``storm_clip``), C_ref the refresh's clip and C_t
the difference clip min(C_diff Delta_t, C_max) (both public); the client clips every record at S_t, so S_t is the
release's sensitivity whatever the data (no smoothness is assumed for privacy). a = 0 is SPIDER exactly (coefs
(1, -1), clip C_t); a = 1 is a refresh at every iteration on the difference batch (coefs (1, 0), clip C_ref).

**The difference clip's C_diff** (key clip-diff-rule). 'fixed': the constant clip-diff. 'private-quantile': C_diff
follows a privately released quantile of the per-record difference norms over Delta_t, by the geometric update of
Andrew et al. 2021 ("Differentially private learning with adaptive clipping", NeurIPS, Algorithm 1): at each
difference iteration a release of its own (mechanism '<diff>-quantile', Poisson batch at the difference rate)
counts the sampled records whose difference vector has norm <= the unbounded threshold T_t (C_t before its cap
C_max, with the current C_diff,t), b_t = (count + N(0, z_b^2)) / N, and

    C_diff,t+1 = C_diff,t exp(-eta_C (b_t - gamma)),

gamma = clip-diff-quantile (the target fraction of records under the clip), eta_C = clip-diff-quantile-lr. Each
record adds 1 or 0 to the count and the null record 0: sensitivity 1 (``Query.count_only``), a
Poisson-subsampled Gaussian of multiplier z_b that the ledger charges as its own mechanism (relative noise
clip-diff-quantile-noise-ratio against the x releases; 'variance' allocation: one coordinate of clip 1 and
weight 1). C_diff,t depends on released counts only, so C_t stays public. The estimate converges in expectation
to the C_diff at which a fraction gamma of the records' ||g_i(x_t) - g_i(x_{t-1})|| / Delta_t lies below it
(tests/test_diff_levers.py).
"""

from __future__ import annotations

import math
from dataclasses import replace

from ...common.messages import Query

QUANTILE_SUFFIX = "-quantile"


def storm_a(cfg) -> float:
    """The STORM weight a of the x estimator: key x-storm-a with x-estimator='storm', 0 (SPIDER) otherwise."""
    return cfg.x_storm_a if cfg.x_estimator == "storm" else 0.0


def storm_clip(a: float, refresh_clip: float, diff_clip: float) -> float:
    """S = a C_ref + (1 - a) C_t: the clip (and sensitivity) of a STORM term g(x_t) - (1 - a) g(x_{t-1}) (module
    docstring); C_t itself at a = 0 (also when C_ref is inf)."""
    return diff_clip if a == 0.0 else a * refresh_clip + (1.0 - a) * diff_clip


def storm_coefs(a: float) -> tuple[float, ...]:
    """Per-point coefficients of the difference query: () (the default (1, -1)) at a = 0, else (1, -(1 - a))."""
    return () if a == 0.0 else (1.0, -(1.0 - a))


def estimate(previous, released, a: float):
    """b_t = (1 - a) b_{t-1} + released (a = 0: SPIDER's b_{t-1} + released)."""
    return previous + released if a == 0.0 else (1.0 - a) * previous + released


def storm_weights(q: int, a: float) -> tuple[float, float]:
    """(refresh weight, mean difference weight) of the 'variance' noise allocation (server/allocation.py): how
    many estimates of a phase each release's noise reaches, counted in variance. A term released at position j of
    the phase (0: the refresh) reaches estimate k >= j scaled by (1 - a)^(k - j), so its weight is
    sum_{m=0}^{q-1-j} rho^m with rho = (1 - a)^2; the refresh's is j = 0, the differences' their mean over
    j = 1..q-1 (a = 0: q and q / 2, SPIDER's). q = 1: (1, 1)."""
    rho = (1.0 - a) ** 2

    def tail(length: int) -> float:
        return float(length) if rho == 1.0 else (1.0 - rho**length) / (1.0 - rho)

    if q <= 1:
        return 1.0, 1.0
    return tail(q), sum(tail(q - j) for j in range(1, q)) / (q - 1)


def quantile_rule(cfg) -> bool:
    """Whether C_diff is the private quantile (clip-diff-rule='private-quantile')."""
    return cfg.clip_diff_rule == "private-quantile"


def clip_diff_now(cfg, current: float) -> float:
    """C_diff in effect: the state's estimate ``current`` under the private-quantile rule (0: not yet set, e.g. a
    checkpoint from before the rule, means the configured clip-diff), else clip-diff."""
    return current if quantile_rule(cfg) and current > 0 else cfg.clip_diff


def quantile_query(diff: Query, threshold: float, rate: float) -> Query:
    """The count release of the private quantile for difference query ``diff``: the same quantity and points with
    SPIDER's coefficients (the norms of g(x_t) - g(x_{t-1}), whatever the estimator), clip = ``threshold`` (the
    uncapped C_t, finite), count-only (sensitivity 1), its own mechanism and Poisson batch at ``rate``."""
    if not (threshold >= 0 and math.isfinite(threshold)):
        raise ValueError(f"private-quantile threshold must be finite and >= 0, got {threshold}")
    return replace(diff, mechanism=diff.mechanism + QUANTILE_SUFFIX, coefs=(), clip=threshold, rate=rate,
                   count_only=True)


def next_clip_diff(current: float, fraction: float, target: float, lr: float) -> float:
    """Andrew et al. (2021) Algorithm 1's geometric step: C exp(-lr (fraction - target)), from the released
    fraction of records under the clip (noisy, so it may leave [0, 1]; the step stays bounded by e^{lr |.|})."""
    return current * math.exp(-lr * (fraction - target))
