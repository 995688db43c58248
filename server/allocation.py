"""Per-mechanism noise allocation (config ``noise-allocation``).

'ratios' keeps each algorithm's declared relative multipliers (eta-noise-ratio, s-noise-ratio). 'variance'
derives them from the rule below; in both cases calibration then scales every multiplier by one common
factor with the exact accountant, so the rule only shapes the split of the budget, never the guarantee.

The rule (a documented proxy, not a theorem). For mechanism k released n_k times with sampling rate r_k,
expected batch N_k = r_k n, D_k coordinates, nominal clip C_k and multiplier z_k, the noise variance that
the updates see is

    V = sum_k n_k w_k D_k (z_k C_k / N_k)^2,

where w_k is how many updates one release feeds on average: a SPIDER refresh of a phase of length q feeds
all q updates of its phase, a difference q/2 of them on average, a STORM term 1 / (1 - (1 - beta)^2) (its
geometric tail), a plain per-step release 1. In the small-rate regime the Renyi divergence of a
Poisson-subsampled Gaussian of order alpha is about 2 alpha r^2 / z^2 (Mironov, Talwar & Zhang 2019,
section 3.3), so the privacy cost is P = sum_k n_k r_k^2 / z_k^2 up to a common factor. Minimising V at
fixed P (Lagrange) gives

    z_k proportional to r_k / (w_k D_k C_k^2)^(1/4):

more noise where a release is cheap to protect (high rate) or matters little (few coordinates, small weight),
less where many coordinates or many updates depend on it. The rule only compares like with like when every
release is in the units its error reaches the update in: a scalar that divides the update (recursive-spider's
s) is one coordinate of its own tiny scale in absolute units, so the rule starved it (multiplier 16.7-23.3
against 1.4-2.0, noise std above s itself); released in units of s_{t-1} (s-clip-units=relative) its noise is
a relative error, and its profile carries the weight of that error on the update (docs/explanation/ALGORITHMS.md 2.5).
For a difference the nominal clip is C_max (its clip C_t = min(C_diff Delta_t, C_max) is not known before training).

What V is for a SPIDER block (does 'variance' minimise the estimator's error or only set a ratio?). The
estimate at position j of a phase of q iterations is b = R + D_1 + ... + D_j with independent noises, so its DP
noise variance is D (z_R C_R / N_R)^2 + j D (z_D C_D / N_D)^2 (the noise term of the estimator diagnostics,
simulations/estimator.py). Summed over the q estimates of the phase, the refresh's noise counts q times and the
differences' q - 1 + q - 2 + ... + 1 = q (q - 1) / 2 times, i.e. q / 2 per difference: exactly the weights w_R = q
and w_D = q / 2 above. So V is the sum over all iterations of the noise term of the estimator's mean squared
error, and the rule is the multiplier split that minimises it at a fixed privacy cost (under the small-rate
Renyi proxy; calibration then meets the exact target): derivation, with a_k = n_k w_k D_k C_k^2 / N_k^2 and
b_k = n_k r_k^2, min sum_k a_k z_k^2 subject to sum_k b_k / z_k^2 = P gives a_k z_k^4 = mu b_k, i.e.
z_k proportional to (b_k / a_k)^(1/4) = n^(1/2) r_k / (w_k D_k C_k^2)^(1/4) since N_k = r_k n. It is the
error-minimising allocation of the noise term, not a fixed ratio ('ratios' is the fixed ratio). The other two terms
of the error do not depend on the multipliers: sampling (set by the batches) and clipping bias (set by C_t), so
no split of the noise changes them. Two approximations remain: the difference's nominal clip C_max over-states its
noise where C_t < C_max, and with x-estimator='storm' the weights are the geometric tails of
``diff_levers.storm_weights`` (a release reaches the later estimates of its phase scaled by (1 - a)^k).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from .ledger import Mechanism


@dataclass(frozen=True)
class NoiseProfile:
    """What the rule needs of one mechanism: ``dim`` coordinates D, nominal clip C > 0 and update weight
    w > 0 (module docstring)."""

    dim: int
    clip: float
    weight: float


def variance_rule(rates: Mapping[str, float], profiles: Mapping[str, NoiseProfile]) -> dict[str, float]:
    """Relative noise multipliers r_k / (w_k D_k C_k^2)^(1/4), scaled so that the largest is 1.

    Raises ValueError for a mechanism without a profile or with a non-positive entry."""
    raw = {}
    for name, r in rates.items():
        if name not in profiles:
            raise ValueError(f"mechanism {name!r} has no noise profile")
        p = profiles[name]
        if not (r > 0 and p.dim > 0 and p.clip > 0 and p.weight > 0):
            raise ValueError(f"mechanism {name!r}: rate, dim, clip and weight must be > 0, got {r}, {p}")
        raw[name] = r / (p.weight * p.dim * p.clip**2) ** 0.25
    top = max(raw.values())
    return {k: v / top for k, v in raw.items()}


def allocate(plan: Mapping[Mechanism, int], profiles: Mapping[str, NoiseProfile] | None) -> dict[Mechanism, int]:
    """The plan with relative multipliers from ``variance_rule`` (``profiles`` None: the plan unchanged).
    Mechanisms with a fixed multiplier keep it and are left out of the rule."""
    if profiles is None:
        return dict(plan)
    free = {m.name: m.rate for m in plan if m.fixed_noise is None}
    rel = variance_rule(free, profiles)
    return {(Mechanism(m.name, m.rate, rel[m.name]) if m.fixed_noise is None else m): n for m, n in plan.items()}


def proxy_variance(plan: Mapping[Mechanism, int], noise: Mapping[str, float], profiles: Mapping[str, NoiseProfile],
                   n: int) -> float:
    """V of the module docstring for the multipliers ``noise`` (name -> z) of ``plan`` over n records (the
    proxy the rule minimises; reported in the summary so that allocations can be compared)."""
    total = 0.0
    for m, count in plan.items():
        if m.name in profiles:
            p = profiles[m.name]
            total += count * p.weight * p.dim * (noise[m.name] * p.clip / (m.rate * n)) ** 2
    return total
