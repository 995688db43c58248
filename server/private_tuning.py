"""Private hyper-parameter tuning: the best of a random number of trials, with the RDP bounds of Papernot and
Steinke (``dpdro lab tune --private``, simulations/private_tune.py). Selections among a fixed set of candidates
through noisy counts (post-hoc tau, checkpoints) are server/private_selection.py's.

Papernot and Steinke, "Hyperparameter tuning with Renyi differential privacy", ICLR 2022 (arXiv:2110.03620).
A randomised trial Q (one full training run at its own epsilon plus the release of its noisy validation score) is
run K times, K drawn at random and kept secret, and only the trial with the highest noisy score is released (its
score, hyper-parameters and model; nothing is released for K = 0). If Q satisfies (lambda, eps(lambda))-RDP at
every order lambda (its "per-trial RDP curve"), the selection satisfies (lambda, eps'(lambda))-RDP with

- K truncated negative binomial D_{eta, gamma} (Theorem 2; eta > -1, 0 < gamma < 1, eta = 1 the truncated
  geometric, eta = 0 the logarithmic distribution), for any lambda_hat >= 1:
      eps'(lambda) = eps(lambda) + (1 + eta)(1 - 1/lambda_hat) eps(lambda_hat) + (1 + eta) log(1/gamma) / lambda_hat
                     + log(E[K]) / (lambda - 1),
  E[K] = eta (1 - gamma) / (gamma (1 - gamma^eta)) (eta != 0), (1/gamma - 1) / log(1/gamma) (eta = 0);
  lambda_hat is chosen here among the same orders (the one minimising the middle terms).
- K Poisson with mean mu (Theorem 6): if Q is also (eps_hat, delta_hat)-DP with e^eps_hat <= 1 + 1/(lambda - 1),
      eps'(lambda) = eps(lambda) + mu delta_hat + log(mu) / (lambda - 1);
  eps_hat = log(1 + 1/(lambda - 1)) and delta_hat is the per-trial RDP curve's delta at eps_hat (dp-accounting's
  RDP-to-DP conversion, valid for any RDP curve).

The per-trial curve comes from dp-accounting's RDP accountant at ``ORDERS`` (the trial's releases: (Poisson
sampling rate, noise multiplier) -> count, the ledger's form, server/ledger.py, same neighbouring relation) and the
selection's curve is turned into (epsilon, delta) by dp-accounting's conversion (``epsilon_from_rdp``). The bound
holds only when the trials are independent draws of Q (hyper-parameters drawn at random, not adaptively from earlier
trials' scores), K stays secret, and nothing but the best trial is released.

The noisy score (``noisy_worst_class``): the per-class correct and total counts on the validation records,
(correct_0..K-1, total_0..K-1), plus N(0, (z sqrt 2)^2) on each coordinate. Replacing one record with the null
record changes its class's two counts by at most 1 each, so the L2 sensitivity is sqrt 2 and the release is a
Gaussian mechanism with noise multiplier z: one release (rate 1, z) in the ledger's terms (``score_counts``).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from dp_accounting.rdp import rdp_privacy_accountant

from ..common.config import ConfigError
from .ledger import NEIGHBOURING_RELATION, composed_event

DISTRIBUTIONS = ("tnb", "poisson")
# RDP orders of the per-trial and the selection curves: dp-accounting's defaults (1.1 .. 1024).
ORDERS: tuple[float, ...] = tuple(float(a) for a in rdp_privacy_accountant.DEFAULT_RDP_ORDERS)
SCORE_SENSITIVITY = math.sqrt(2.0)  # L2 sensitivity of the (correct, total) per-class counts, see the docstring


@dataclass(frozen=True)
class TrialCount:
    """The distribution of the number of trials K: 'tnb' (truncated negative binomial D_{eta, gamma}, Papernot and
    Steinke Section 2 / Theorem 2; K >= 1) or 'poisson' (mean mu, Theorem 6; K may be 0). Raises ConfigError naming
    the parameter, its value and what is allowed."""

    kind: str = "tnb"
    eta: float = 1.0
    gamma: float = 0.1
    mu: float = 10.0

    def __post_init__(self) -> None:
        if self.kind not in DISTRIBUTIONS:
            raise ConfigError(f"trial distribution: got {self.kind!r}; allowed: {', '.join(DISTRIBUTIONS)}")
        if self.kind == "tnb":
            if not (self.eta > -1 and math.isfinite(self.eta)):
                raise ConfigError(f"eta: got {self.eta}; allowed: a finite number > -1")
            if not 0 < self.gamma < 1:
                raise ConfigError(f"gamma: got {self.gamma}; allowed: 0 < gamma < 1")
        elif not (self.mu > 0 and math.isfinite(self.mu)):
            raise ConfigError(f"mu: got {self.mu}; allowed: a finite number > 0")

    def expected(self) -> float:
        """E[K] (Papernot and Steinke, Section 2 for D_{eta, gamma})."""
        if self.kind == "poisson":
            return self.mu
        eta, g = self.eta, self.gamma
        if eta == 0:
            return (1 / g - 1) / math.log(1 / g)
        return eta * (1 - g) / (g * (1 - g**eta))

    def pmf(self, k: int) -> float:
        """P[K = k]."""
        if self.kind == "poisson":
            return math.exp(k * math.log(self.mu) - self.mu - math.lgamma(k + 1))
        if k < 1:
            return 0.0
        eta, g = self.eta, self.gamma
        if eta == 0:
            return (1 - g) ** k / (k * math.log(1 / g))
        # (1 - g)^k / (g^-eta - 1) * prod_{l < k} (l + eta) / (l + 1)
        log_prod = math.lgamma(k + eta) - math.lgamma(eta) - math.lgamma(k + 1) if eta > 0 else None
        if log_prod is not None:
            return math.exp(k * math.log(1 - g) + log_prod) / (g**-eta - 1)
        prod = 1.0
        for ell in range(k):
            prod *= (ell + eta) / (ell + 1)
        return (1 - g) ** k * prod / (g**-eta - 1)

    def draw(self, rng: np.random.Generator) -> int:
        """One K (inverse CDF of ``pmf`` for 'tnb', numpy's Poisson sampler for 'poisson'). ``rng`` must be secret
        (the bound assumes the adversary does not know K): the search passes a generator seeded from the OS."""
        if self.kind == "poisson":
            return int(rng.poisson(self.mu))
        u, k, cdf = rng.random(), 0, 0.0
        while cdf <= u and k < 10**7:
            k += 1
            cdf += self.pmf(k)
        return k

    def describe(self) -> str:
        if self.kind == "poisson":
            return f"Poisson (mu {self.mu:g}, E[K] {self.mu:g})"
        return f"truncated negative binomial (eta {self.eta:g}, gamma {self.gamma:g}, E[K] {self.expected():.4g})"

    def to_json(self) -> dict:
        common = {"distribution": self.kind, "expected_trials": self.expected()}
        return {**common, **({"mu": self.mu} if self.kind == "poisson" else {"eta": self.eta, "gamma": self.gamma})}


def score_counts(noise_multiplier: float) -> Counter:
    """The noisy score's release in the ledger's form: {(rate 1, z): 1} (a Gaussian mechanism, sensitivity sqrt 2
    absorbed in the noise std z sqrt 2). Raises ConfigError for z <= 0."""
    if not (noise_multiplier > 0 and math.isfinite(noise_multiplier)):
        raise ConfigError(f"score noise multiplier: got {noise_multiplier}; allowed: a finite number > 0")
    return Counter({(1.0, float(noise_multiplier)): 1})


def rdp_curve(counts: Mapping[tuple[float, float], int], orders=ORDERS) -> np.ndarray:
    """RDP epsilon (len(orders),) of the composition of the releases ``counts`` ((Poisson sampling rate, noise
    multiplier) -> count, as in server/ledger.py), by dp-accounting's RDP accountant with the ledger's neighbouring
    relation. inf where a noise multiplier is 0."""
    acc = rdp_privacy_accountant.RdpAccountant(orders=list(orders), neighboring_relation=NEIGHBOURING_RELATION)
    acc.compose(composed_event(counts))
    return np.asarray(acc._rdp, dtype=float)  # noqa: SLF001 (dp-accounting 0.6 keeps the curve here)


def delta_from_rdp(orders, rdp, epsilon: float) -> float:
    """Smallest delta at ``epsilon`` that the RDP curve (orders, rdp) gives (dp-accounting's conversion)."""
    return float(rdp_privacy_accountant.compute_delta(list(orders), list(rdp), epsilon)[0])


def epsilon_from_rdp(orders, rdp, delta: float) -> tuple[float, float]:
    """(epsilon, optimal order) at ``delta`` of the RDP curve (orders, rdp) (dp-accounting's conversion)."""
    eps, order = rdp_privacy_accountant.compute_epsilon(list(orders), list(rdp), delta)
    return float(eps), float(order)


def selection_rdp(dist: TrialCount, trial_rdp, orders=ORDERS) -> np.ndarray:
    """RDP curve (len(orders),) of releasing the best of K trials whose per-trial RDP curve is ``trial_rdp`` at
    ``orders``: Papernot and Steinke, Theorem 2 (``dist.kind`` 'tnb', lambda_hat minimised over ``orders``) or
    Theorem 6 ('poisson'); see the module docstring."""
    a = np.asarray(orders, dtype=float)
    r = np.asarray(trial_rdp, dtype=float)
    if a.shape != r.shape or np.any(a <= 1):
        raise ValueError(f"orders and curve must have the same shape and orders > 1; got {a.shape}, {r.shape}")
    if dist.kind == "tnb":
        c = 1 + dist.eta
        middle = float(np.min(c * (1 - 1 / a) * r + c * math.log(1 / dist.gamma) / a))
        return r + middle + math.log(dist.expected()) / (a - 1)
    out = np.empty_like(r)
    for i, lam in enumerate(a):
        delta_hat = delta_from_rdp(a, r, math.log1p(1 / (lam - 1)))
        out[i] = r[i] + dist.mu * delta_hat + math.log(dist.mu) / (lam - 1)
    return out


def search_epsilon(dist: TrialCount, trial_counts: Mapping[tuple[float, float], int], delta: float,
                   orders=ORDERS) -> dict:
    """The privacy of a private search whose every trial spends at most ``trial_counts`` (training plus the noisy
    score): ``search_privacy`` of their RDP curve. Raises ValueError for delta outside (0, 1)."""
    return search_privacy(dist, rdp_curve(trial_counts, orders), delta, orders)


def search_privacy(dist: TrialCount, trial_rdp, delta: float, orders=ORDERS) -> dict:
    """The privacy of a private search whose every trial satisfies the RDP curve ``trial_rdp`` at ``orders``:
    epsilon_total (of the selection, at ``delta``), the order it is reached at, the per-trial epsilon by the RDP
    conversion at the same delta, E[K] and the distribution's parameters. Raises ValueError for delta outside
    (0, 1)."""
    if not 0 < delta < 1:
        raise ValueError(f"delta: got {delta}; allowed: 0 < delta < 1")
    eps_total, order = epsilon_from_rdp(orders, selection_rdp(dist, trial_rdp, orders), delta)
    eps_trial, _ = epsilon_from_rdp(orders, trial_rdp, delta)
    return {"epsilon_total": eps_total, "order": order, "delta": delta, "epsilon_per_trial_rdp": eps_trial,
            "theorem": "Papernot & Steinke 2022, " + ("Theorem 2" if dist.kind == "tnb" else "Theorem 6"),
            **dist.to_json()}


def dominated(counts: Mapping[tuple[float, float], int], bound: np.ndarray, orders=ORDERS) -> bool:
    """True when the RDP curve of ``counts`` is at most ``bound`` at every order (so a trial spending ``counts``
    satisfies the declared per-trial curve)."""
    return bool(np.all(rdp_curve(counts, orders) <= np.asarray(bound) * (1 + 1e-12) + 1e-15))


def noisy_worst_class(correct, total, noise_multiplier: float, rng: np.random.Generator) -> dict:
    """The charged validation score: (correct, total) per class (K,) each, plus N(0, (z sqrt 2)^2) on every
    coordinate; returns worst (min over classes of the noisy accuracy, each clipped to [0, 1], a class whose noisy
    total is below 1 counting 0), per_class and the noise std. Post-processing of one Gaussian release
    (``score_counts``). ``rng`` must be secret."""
    c = np.asarray(correct, dtype=float)
    t = np.asarray(total, dtype=float)
    if c.shape != t.shape or c.ndim != 1 or not len(c):
        raise ValueError(f"correct and total must be equal-length vectors, got {c.shape} and {t.shape}")
    std = noise_multiplier * SCORE_SENSITIVITY
    nc = c + rng.normal(0.0, std, c.shape)
    nt = t + rng.normal(0.0, std, t.shape)
    per_class = np.where(nt >= 1, np.clip(nc / np.maximum(nt, 1), 0, 1), 0.0)
    return {"worst": float(per_class.min()), "per_class": [float(v) for v in per_class], "noise_std": std}
