"""psi-divergences for DRO: psi, its convex conjugate psi* and the derivative psi*'
(docs/explanation/ALGORITHMS.md 1.3).

Primal penalty: D_psi(p || u) = (1/n) sum_i psi(n p_i). Dual (Levy et al. 2020; Shapiro 2017):
F(x) = min_eta (1/n) sum_i [lambda psi*((l_i - eta) / lambda) + eta]. The DRO weight of record i is
psi*'((l_i - eta) / lambda) >= 0.

Every function works elementwise on torch tensors of any shape and floating dtype and returns the
same shape and dtype. All forms are written to be stable (softplus / log-sigmoid forms; see each class).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# psi*(s) = e^s - 1 overflows float32 at s ~ 88. We clamp s from above at KL_S_MAX before exp (in the
# conjugate and its derivative). It only acts where a record's loss exceeds eta by 50 lambda.
KL_S_MAX = 50.0


@dataclass(frozen=True)
class Psi:
    """Base class: a psi-divergence with conjugate ``conj`` and weight ``weight`` = psi*'.

    Attributes:
        name: config key value.
        smoothness: M, the Lipschitz constant of psi*' (inf where unbounded or non-smooth).
    """

    name: str

    @property
    def smoothness(self) -> float:
        raise NotImplementedError

    def psi(self, t: torch.Tensor) -> torch.Tensor:
        """psi(t) for t >= 0 (inf outside the domain)."""
        raise NotImplementedError

    def conj(self, s: torch.Tensor) -> torch.Tensor:
        """psi*(s) = sup_{t >= 0} (s t - psi(t))."""
        raise NotImplementedError

    def weight(self, s: torch.Tensor) -> torch.Tensor:
        """psi*'(s) >= 0: the DRO weight of a record with scaled excess loss s = (l - eta) / lambda."""
        raise NotImplementedError


@dataclass(frozen=True)
class Chi2(Psi):
    """psi(t) = (t - 1)^2 / 2; psi*(s) = ((s + 1)_+)^2 / 2 - 1/2; psi*'(s) = (s + 1)_+; M = 1."""

    name: str = "chi2"

    @property
    def smoothness(self) -> float:
        return 1.0

    def psi(self, t: torch.Tensor) -> torch.Tensor:
        return torch.where(t >= 0, (t - 1) ** 2 / 2, torch.full_like(t, math.inf))

    def conj(self, s: torch.Tensor) -> torch.Tensor:
        return torch.clamp(s + 1, min=0) ** 2 / 2 - 0.5

    def weight(self, s: torch.Tensor) -> torch.Tensor:
        return torch.clamp(s + 1, min=0)


@dataclass(frozen=True)
class KL(Psi):
    """psi(t) = t log t - t + 1; psi*(s) = e^s - 1; psi*'(s) = e^s (s clamped at KL_S_MAX); M unbounded
    (e^{B/lambda} when losses are bounded by B)."""

    name: str = "kl"

    @property
    def smoothness(self) -> float:
        return math.inf

    def psi(self, t: torch.Tensor) -> torch.Tensor:
        safe = torch.clamp(t, min=1e-300)
        val = torch.where(t > 0, t * torch.log(safe) - t + 1, torch.ones_like(t))
        return torch.where(t >= 0, val, torch.full_like(t, math.inf))

    def conj(self, s: torch.Tensor) -> torch.Tensor:
        return torch.expm1(torch.clamp(s, max=KL_S_MAX))

    def weight(self, s: torch.Tensor) -> torch.Tensor:
        return torch.exp(torch.clamp(s, max=KL_S_MAX))


@dataclass(frozen=True)
class CVaR(Psi):
    """CVaR at level alpha: psi(t) = 0 on [0, 1/alpha], +inf beyond; psi*(s) = (s)_+ / alpha;
    psi*'(s) = 1[s > 0] / alpha. psi* is not smooth: the convergence theory of the seed paper (smooth
    psi*) does not cover it. The methods still run and their privacy is unaffected (it rests on clipping),
    but no stationarity rate is claimed for this choice."""

    alpha: float = 0.1
    name: str = "cvar"

    @property
    def smoothness(self) -> float:
        return math.inf

    def psi(self, t: torch.Tensor) -> torch.Tensor:
        ok = (t >= 0) & (t <= 1 / self.alpha)
        return torch.where(ok, torch.zeros_like(t), torch.full_like(t, math.inf))

    def conj(self, s: torch.Tensor) -> torch.Tensor:
        return torch.clamp(s, min=0) / self.alpha

    def weight(self, s: torch.Tensor) -> torch.Tensor:
        return (s > 0).to(s.dtype) / self.alpha


@dataclass(frozen=True)
class SmoothedCVaR(Psi):
    """Smoothed CVaR (Jin et al. 2021): psi(t) = t log t + ((1 - alpha t) / alpha) log((1 - alpha t) / (1 - alpha))
    on [0, 1/alpha); psi*(s) = (1/alpha) log(1 - alpha + alpha e^s) (computed with logaddexp);
    psi*'(s) = sigmoid(s + logit(alpha)) / alpha in (0, 1/alpha); M = 1 / (4 alpha)."""

    alpha: float = 0.1
    name: str = "smoothed-cvar"

    @property
    def smoothness(self) -> float:
        return 1.0 / (4.0 * self.alpha)

    def psi(self, t: torch.Tensor) -> torch.Tensor:
        a = self.alpha
        inside = (t >= 0) & (t < 1 / a)
        tt = torch.where(inside, t, torch.zeros_like(t))
        rest = (1 - a * tt) / a
        first = torch.where(tt > 0, tt * torch.log(torch.clamp(tt, min=1e-300)), torch.zeros_like(tt))
        val = first + rest * torch.log(torch.clamp((1 - a * tt) / (1 - a), min=1e-300))
        return torch.where(inside, val, torch.full_like(t, math.inf))

    def conj(self, s: torch.Tensor) -> torch.Tensor:
        a = self.alpha
        return torch.logaddexp(torch.full_like(s, math.log1p(-a)), s + math.log(a)) / a

    def weight(self, s: torch.Tensor) -> torch.Tensor:
        a = self.alpha
        return torch.sigmoid(s + math.log(a) - math.log1p(-a)) / a


def make_psi(name: str, alpha: float = 0.1) -> Psi:
    """The divergence for config key ``psi``. Raises ValueError for an unknown name."""
    if name == "chi2":
        return Chi2()
    if name == "kl":
        return KL()
    if name == "cvar":
        return CVaR(alpha=alpha)
    if name == "smoothed-cvar":
        return SmoothedCVaR(alpha=alpha)
    raise ValueError(f"unknown psi {name!r}; allowed: chi2, kl, cvar, smoothed-cvar")
