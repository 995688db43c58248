"""Per-record quantities a client computes, clips and sums: the only functions of private records.

Each quantity maps (parameter point, records, public per-query constants) to one vector per record,
(B, D). A query names the quantity and one or more points; the client combines them per record as
sum_j coef_j f(point_j) (refresh: one point; SPIDER difference: coefs (1, -1); STORM: (1, -(1 - beta))),
then clips. Formulas: ALGORITHMS.md 1.2 (psi-divergence dual), 2.4 (shifted KL compositional terms),
6.1 (baselines).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .dro import dro_weight, dual_eta_grad
from .per_sample import FlatModel
from .psi import Psi, make_psi


@dataclass(frozen=True)
class Problem:
    """Public constants of the objective that per-record quantities need (from the run's config):
    psi and lambda of the psi-divergence dual, eta-scale G, the public loss bound B of the KL terms, the
    scale c_u of the d_lambda block in Algorithm 3's joint release."""

    psi: Psi
    lam: float
    eta_scale: float
    loss_bound: float = 10.0
    u_scale: float = 1.0

    @classmethod
    def from_config(cls, cfg) -> Problem:
        return cls(psi=make_psi(cfg.psi, cfg.cvar_alpha), lam=cfg.lambda_, eta_scale=cfg.eta_scale,
                   loss_bound=cfg.loss_bound, u_scale=cfg.u_scale)


QuantityFn = Callable[[FlatModel, torch.Tensor, float, torch.Tensor, torch.Tensor, Problem, Sequence[float]],
                      torch.Tensor]


def dual_eta(model, flat, eta, x, y, problem, extra=()) -> torch.Tensor:
    """d_eta L(x, eta; xi) = G (1 - psi*'(s)) per record, shape (B, 1). ``eta`` is the point's scalar."""
    with torch.no_grad():
        losses = model.losses(flat, x, y)
    return dual_eta_grad(losses, eta, problem.psi, problem.lam, problem.eta_scale).unsqueeze(1)


def dual_x(model, flat, eta, x, y, problem, extra=()) -> torch.Tensor:
    """grad_x L(x, eta; xi) = psi*'(s) grad_x l(x; xi) per record, shape (B, d)."""
    losses, grads = model.losses_and_grads(flat, x, y)
    w = dro_weight(losses.detach(), eta, problem.psi, problem.lam, problem.eta_scale)
    return grads * w.unsqueeze(1)


def dual_joint(model, flat, eta, x, y, problem, extra=()) -> torch.Tensor:
    """[grad_x L ; d_eta L] per record, shape (B, d + 1): the gradient in z = (x, eta) as one variable
    (dp-sgd-dual and dp-spiderboost)."""
    losses, grads = model.losses_and_grads(flat, x, y)
    w = dro_weight(losses.detach(), eta, problem.psi, problem.lam, problem.eta_scale)
    return torch.cat([grads * w.unsqueeze(1), (problem.eta_scale * (1.0 - w)).unsqueeze(1)], dim=1)


def ce_grad(model, flat, scalar, x, y, problem, extra=()) -> torch.Tensor:
    """grad_x l(x; xi) of the cross-entropy (ERM, dp-sgd), shape (B, d). ``scalar`` is unused."""
    return model.losses_and_grads(flat, x, y)[1]


def class_weighted_grad(model, flat, scalar, x, y, problem, extra=()) -> torch.Tensor:
    """extra[y] * grad_x l(x; xi): per-class weights (K,) given by the query (dp-sgda's descent), (B, d)."""
    weights = torch.as_tensor(list(extra), dtype=flat.dtype, device=flat.device)
    return model.losses_and_grads(flat, x, y)[1] * weights[y].unsqueeze(1)


def class_loss_stats(model, flat, scalar, x, y, problem, extra=()) -> torch.Tensor:
    """[e_y min(l, B) ; e_y] per record, shape (B, 2K) with K = len(extra): summed, the per-class sums of
    (bounded) losses and per-class counts (dp-sgda's ascent). Norm <= sqrt(B^2 + 1)."""
    k = len(extra)
    with torch.no_grad():
        losses = torch.clamp(model.losses(flat, x, y), max=problem.loss_bound)
    onehot = torch.nn.functional.one_hot(y, k).to(flat.dtype)
    return torch.cat([onehot * losses.unsqueeze(1), onehot], dim=1)


def _kl_terms(losses: torch.Tensor, lam: float, bound: float) -> torch.Tensor:
    """g~ = exp((min(l, B) - B) / lambda) in (0, 1] (ALGORITHMS.md 2.4): no data-dependent shift."""
    return torch.exp((torch.clamp(losses, max=bound) - bound) / lam)


def kl_g(model, flat, lam, x, y, problem, extra=()) -> torch.Tensor:
    """g~(w; xi) per record, shape (B, 1), at w = (flat, lambda)."""
    with torch.no_grad():
        losses = model.losses(flat, x, y)
    return _kl_terms(losses, lam, problem.loss_bound).unsqueeze(1)


def kl_vu(model, flat, lam, x, y, problem, extra=()) -> torch.Tensor:
    """[grad_x g~ ; c_u d_lambda g~] per record, shape (B, d + 1), with grad_x g~ = g~ grad l / lambda
    (zero where l > B: the clamp is part of the model) and d_lambda g~ = g~ (B - min(l, B)) / lambda^2."""
    losses, grads = model.losses_and_grads(flat, x, y)
    losses = losses.detach()
    g = _kl_terms(losses, lam, problem.loss_bound)
    inside = (losses <= problem.loss_bound).to(g.dtype)
    v = grads * (g * inside / lam).unsqueeze(1)
    u = g * (problem.loss_bound - torch.clamp(losses, max=problem.loss_bound)) / lam**2
    return torch.cat([v, (problem.u_scale * u).unsqueeze(1)], dim=1)


QUANTITIES: dict[str, QuantityFn] = {
    "dual-eta": dual_eta,
    "dual-x": dual_x,
    "dual-joint": dual_joint,
    "ce-grad": ce_grad,
    "class-weighted-grad": class_weighted_grad,
    "class-loss-stats": class_loss_stats,
    "kl-g": kl_g,
    "kl-vu": kl_vu,
}
