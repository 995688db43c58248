"""Per-record losses and gradients with torch.func, on a flat parameter vector; per-record clipping.

A model's parameters are handled as one flat vector x in R^d (the order of ``named_parameters``), which
keeps the algorithms' updates plain vector arithmetic. Per-record gradients are computed with torch.func,
``vmap(grad(...))`` over records (no Python loop over records); callers chunk large batches to bound memory.
A hand-written per-layer engine (Opacus-style outer products) was measured faster on this CPU (see
docs/PERFORMANCE.md) but is not used: per-record gradients are generic machinery that torch.func maintains.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad_and_value, vmap


class FlatModel:
    """Functional view of ``module`` with parameters as one flat vector.

    Args:
        module: a validated model (see ``models.validate_model``); its buffers are used as they are.
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        named = list(module.named_parameters())
        self.names = [n for n, _ in named]
        self.shapes = [p.shape for _, p in named]
        self.numels = [p.numel() for _, p in named]
        self.dim = sum(self.numels)
        self.dtype = named[0][1].dtype
        self.buffers = dict(module.named_buffers())

    def initial(self) -> torch.Tensor:
        """The module's current parameters as a flat (d,) tensor."""
        return torch.cat([p.detach().reshape(-1) for p in self.module.parameters()])

    def unflatten(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views of ``flat`` (d,) shaped as the module's parameters."""
        parts = torch.split(flat, self.numels)
        return {n: p.view(s) for n, p, s in zip(self.names, parts, self.shapes, strict=False)}

    def logits(self, flat: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Model outputs (B, K) at parameters ``flat`` for inputs ``x`` (B, ...)."""
        return functional_call(self.module, (self.unflatten(flat), self.buffers), (x,))

    def losses(self, flat: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
               offset: torch.Tensor | None = None) -> torch.Tensor:
        """Per-record cross-entropy (B,) at ``flat`` of the logits plus ``offset`` (K,) if given: with
        offset = tau log(pi) this is the logit-adjusted loss of Menon et al. (2021), eq. (10)."""
        logits = self.logits(flat, x)
        return F.cross_entropy(logits if offset is None else logits + offset, y, reduction="none")

    def losses_and_grads(self, flat: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
                         offset: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-record cross-entropy (B,) and its gradients (B, d) at ``flat``, vectorised with torch.func;
        ``offset`` (K,) as in ``losses``."""

        def one(p: torch.Tensor, xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
            out = functional_call(self.module, (self.unflatten(p), self.buffers), (xi.unsqueeze(0),))
            return F.cross_entropy(out if offset is None else out + offset, yi.unsqueeze(0))

        grads, losses = vmap(grad_and_value(one), in_dims=(None, 0, 0))(flat, x, y)
        return losses, grads


def clip_rows(v: torch.Tensor, bound: float) -> torch.Tensor:
    """Scale each row of v (B, D) to L2 norm at most ``bound`` (>= 0; inf means no clipping).

    Rows with norm <= bound are unchanged; a zero bound gives zero rows. Returns a new (B, D) tensor.
    """
    if math.isinf(bound):
        return v
    norms = torch.linalg.vector_norm(v, dim=1, keepdim=True)
    scale = torch.clamp(bound / torch.clamp(norms, min=1e-30), max=1.0)
    return v * scale


def clipped_sum(v: torch.Tensor, bound: float) -> torch.Tensor:
    """Sum over rows of ``clip_rows(v, bound)``, shape (D,), computed as one matrix-vector product of the
    per-row scales with v (no clipped (B, D) copy is formed). Same bound semantics as ``clip_rows``."""
    return clipped_sum_and_count(v, bound)[0]


def clipped_sum_and_count(v: torch.Tensor, bound: float) -> tuple[torch.Tensor, int]:
    """(``clipped_sum(v, bound)``, number of rows whose norm exceeded ``bound`` and were scaled down)."""
    if math.isinf(bound):
        return v.sum(0), 0
    norms = torch.linalg.vector_norm(v, dim=1)
    scale = torch.clamp(bound / torch.clamp(norms, min=1e-30), max=1.0)
    return scale @ v, int((norms > bound).sum())
