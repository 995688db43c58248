"""The dual DRO loss L(x, eta; xi) and the exact DRO objective F(x) (docs/explanation/ALGORITHMS.md 1.1-1.2).

L(x, eta; xi) = lambda psi*((l(x; xi) - G eta) / lambda) + G eta, with G = eta-scale (the seed's rescaled
dual variable). Per record: grad_x L = w grad_x l and d_eta L = G (1 - w), with w = psi*'(s) the DRO weight.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .psi import Psi


def dro_weight(losses: torch.Tensor, eta: float, psi: Psi, lam: float, eta_scale: float = 1.0) -> torch.Tensor:
    """psi*'((l - G eta) / lambda) per record. losses: (B,) any float dtype; returns (B,) same dtype."""
    return psi.weight((losses - eta_scale * eta) / lam)


def dual_loss(losses: torch.Tensor, eta: float, psi: Psi, lam: float, eta_scale: float = 1.0) -> torch.Tensor:
    """L(x, eta; xi) per record from per-record losses (B,); returns (B,)."""
    return lam * psi.conj((losses - eta_scale * eta) / lam) + eta_scale * eta


def dual_eta_grad(losses: torch.Tensor, eta: float, psi: Psi, lam: float, eta_scale: float = 1.0) -> torch.Tensor:
    """d L / d eta per record: G (1 - psi*'(s)); (B,)."""
    return eta_scale * (1.0 - dro_weight(losses, eta, psi, lam, eta_scale))


def dro_objective(losses: np.ndarray, psi: Psi, lam: float, iters: int = 200) -> tuple[float, float]:
    """Exact F = min_eta mean L(eta) on a fixed set of losses, and the minimising (unscaled) eta.

    losses: (n,) non-negative floats (computed in float64). The mean of 1 - psi*'((l - eta)/lambda) is
    non-decreasing in eta, so the minimiser is found by bisection on it (for non-smooth cvar this returns
    a point of the sub-differential). Bracket: [min l - lambda - 1, max l + 1], where the mean weight is
    >= 1 and <= 1 respectively for every supported psi.

    Returns (F, eta_star). Raises ValueError for an empty input.
    """
    ls = torch.as_tensor(np.asarray(losses, dtype=np.float64))
    if ls.numel() == 0:
        raise ValueError("dro_objective needs at least one loss")
    lo = float(ls.min()) - lam - 1.0
    hi = float(ls.max()) + 1.0
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        if float(psi.weight((ls - mid) / lam).mean()) > 1.0:
            lo = mid
        else:
            hi = mid
    eta = 0.5 * (lo + hi)
    value = float(dual_loss(ls, eta, psi, lam).mean())
    if psi.name == "kl":  # closed form (docs/explanation/ALGORITHMS.md 1.3), stabler than the bisection value
        m = float(ls.max())
        value = m + lam * math.log(float(torch.exp((ls - m) / lam).mean()))
    return value, eta
