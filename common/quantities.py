"""Per-record quantities a client computes, clips and sums: the only functions of private records.

Each quantity maps (parameter point, records) to one vector per record, (B, D). A query names the
quantity and one point (refresh) or two points (difference: value at the first minus value at the second).
Formulas: ALGORITHMS.md 1.2 (dual gradients of the psi-divergence DRO loss).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .dro import dro_weight, dual_eta_grad
from .per_sample import FlatModel
from .psi import Psi, make_psi


@dataclass(frozen=True)
class Problem:
    """Public constants of the objective that per-record quantities need (from the run's config)."""

    psi: Psi
    lam: float
    eta_scale: float

    @classmethod
    def from_config(cls, cfg) -> Problem:
        return cls(psi=make_psi(cfg.psi, cfg.cvar_alpha), lam=cfg.lambda_, eta_scale=cfg.eta_scale)


QuantityFn = Callable[[FlatModel, torch.Tensor, float, torch.Tensor, torch.Tensor, Problem], torch.Tensor]


def dual_eta(model: FlatModel, flat: torch.Tensor, eta: float, x: torch.Tensor, y: torch.Tensor,
             problem: Problem) -> torch.Tensor:
    """d_eta L(x, eta; xi) = G (1 - psi*'(s)) per record, shape (B, 1)."""
    with torch.no_grad():
        losses = model.losses(flat, x, y)
    return dual_eta_grad(losses, eta, problem.psi, problem.lam, problem.eta_scale).unsqueeze(1)


def dual_x(model: FlatModel, flat: torch.Tensor, eta: float, x: torch.Tensor, y: torch.Tensor,
           problem: Problem) -> torch.Tensor:
    """grad_x L(x, eta; xi) = psi*'(s) grad_x l(x; xi) per record, shape (B, d)."""
    losses, grads = model.losses_and_grads(flat, x, y)
    w = dro_weight(losses.detach(), eta, problem.psi, problem.lam, problem.eta_scale)
    return grads * w.unsqueeze(1)


QUANTITIES: dict[str, QuantityFn] = {
    "dual-eta": dual_eta,
    "dual-x": dual_x,
}


def quantity_dim(name: str, model_dim: int) -> int:
    """Length D of the per-record vector of quantity ``name`` for a model with ``model_dim`` parameters."""
    return {"dual-eta": 1, "dual-x": model_dim}[name]
