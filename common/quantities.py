"""Per-record quantities a client computes, clips and sums: the only functions of private records.

Each quantity maps (parameter point, records, public per-query constants) to one vector per record,
(B, D). A query names the quantity and one or more points; the client combines them per record as
sum_j coef_j f(point_j) (refresh: one point; SPIDER difference: coefs (1, -1); STORM: (1, -(1 - beta))),
then clips. Formulas: docs/explanation/ALGORITHMS.md 1.2 (psi-divergence dual), 2.4 (shifted KL compositional terms),
6.1 (baselines).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from .dro import dro_weight
from .per_sample import FlatModel, RowBlocks, clip_rows
from .psi import Psi, make_psi
from .registry import Registry


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
    clamp_weights: bool = False  # DRO weights of min(l, B) (dro-clip=weight-after-clip, eta-clip-rule=weight-bound)
    weight_cap: float = math.inf  # public cap W_cap of every DRO weight (config weight-cap)
    soft_clamp: bool = False  # KL terms of B - softplus(B - l) instead of min(l, B) (loss-clamp=soft)
    offset: torch.Tensor | None = None  # (K,) public logit offset tau log(pi) of the logit-adjusted loss
    group_by: str = "class"  # the groups of group quantities: 'class' (y), 'attribute', 'node' or 'site' (dro-groups)

    @classmethod
    def from_config(cls, cfg) -> Problem:
        """The problem constants of a run's Config."""
        clamp = cfg.dro_clip == "weight-after-clip" or cfg.eta_clip_rule == "weight-bound"
        return cls(psi=make_psi(cfg.psi, cfg.cvar_alpha), lam=cfg.lambda_, eta_scale=cfg.eta_scale,
                   loss_bound=cfg.loss_bound, u_scale=cfg.u_scale, clamp_weights=clamp, weight_cap=cfg.weight_cap,
                   soft_clamp=cfg.loss_clamp == "soft", group_by=cfg.dro_groups)

    def with_offset(self, offset: Sequence[float], dtype: torch.dtype, device: torch.device) -> Problem:
        """This problem with the logit offset of a query (empty: the plain cross-entropy)."""
        if not offset:
            return replace(self, offset=None)
        return replace(self, offset=torch.as_tensor(list(offset), dtype=dtype, device=device))


QuantityFn = Callable[[FlatModel, torch.Tensor, float, torch.Tensor, torch.Tensor, Problem, Sequence[float]],
                      torch.Tensor]
# name -> per-record function (the name a Query carries); an algorithm's spec lists the names it uses.
QUANTITIES: Registry[QuantityFn] = Registry("quantity")


def register_quantity(name: str):
    """Function decorator: register a per-record quantity under ``name``. Signature: (model, flat, scalar, x, y,
    problem, extra) -> (B, D) tensor, one row per record (the client clips and sums the rows, so a row may depend
    on its own record only). ValueError if the name is taken."""
    return QUANTITIES.register(name)


def row_blocks(rows: Callable[..., RowBlocks]) -> QuantityFn:
    """A quantity computed as ``RowBlocks`` (per-parameter gradient blocks times a per-record factor): the
    registered function returns the (B, D) tensor (``rows(...).dense()``) and carries ``rows`` as ``.rows``,
    which the client calls for a single-point query (a refresh) to clip and sum without forming (B, D)
    (``per_sample.RowBlocks``). Both give the same sum up to rounding (tests/test_per_sample.py)."""

    def dense(*args, **kwargs) -> torch.Tensor:
        return rows(*args, **kwargs).dense()

    dense.__name__, dense.__qualname__, dense.__doc__ = rows.__name__, rows.__qualname__, rows.__doc__
    dense.rows = rows
    return dense


def record_weights(losses: torch.Tensor, eta: float, problem: Problem) -> torch.Tensor:
    """The DRO weight of each record as both blocks of dp-double-spider use it, (B,) from losses (B,):
    psi*'((l' - G eta) / lambda) with l' = min(l, B) when ``problem.clamp_weights`` (else l), then capped at
    ``problem.weight_cap``. Capping psi*' at W_cap is the psi-divergence with likelihood ratios n p_i <= W_cap
    (psi restricted to [0, W_cap]): a DRO problem of its own, whose dual optimum eta is where the mean capped
    weight is 1 (it exists for W_cap > 1)."""
    if problem.clamp_weights:
        losses = torch.clamp(losses, max=problem.loss_bound)
    w = dro_weight(losses, eta, problem.psi, problem.lam, problem.eta_scale)
    return torch.clamp(w, max=problem.weight_cap) if math.isfinite(problem.weight_cap) else w


@register_quantity("dual-eta")
def dual_eta(model, flat, eta, x, y, problem, extra=()) -> torch.Tensor:
    """d_eta L(x, eta; xi) = G (1 - w) per record, shape (B, 1), w = ``record_weights`` (psi*'(s), of the loss
    clamped at B and capped as the problem says, so both blocks see the same weights). ``eta`` is the point's
    scalar.

    Range: 0 <= w <= W (``dro_weight_bound``) when the loss is clamped or the weight capped, so
    |G (1 - w)| <= G max(1, W - 1): a clip at that bound (config eta-clip-rule=weight-bound) clips nothing and
    the eta-refresh's sensitivity is G max(1, W - 1)."""
    with torch.no_grad():
        losses = model.losses(flat, x, y, problem.offset)
        w = record_weights(losses, eta, problem)
    return (problem.eta_scale * (1.0 - w)).unsqueeze(1)


@register_quantity("dual-x")
@row_blocks
def dual_x(model, flat, eta, x, y, problem, extra=()) -> RowBlocks:
    """grad_x L(x, eta; xi) = w grad_x l(x; xi) per record, shape (B, d), w = ``record_weights`` (psi*'(s) when
    the problem neither clamps nor caps)."""
    losses, rows = model.losses_and_grad_rows(flat, x, y, problem.offset)
    return rows.weighted(record_weights(losses.detach(), eta, problem))


def dro_weight_bound(psi: Psi, eta: float, lam: float, eta_scale: float, loss_bound: float,
                     weight_cap: float = math.inf) -> float:
    """W = min(psi*'((B - G eta) / lambda), W_cap): the largest DRO weight a record with loss clamped at the
    public bound B can get (psi*' is non-decreasing), capped at the public W_cap (inf: no cap). Public: B and
    W_cap are constants and eta a released iterate."""
    w = float(psi.weight(torch.tensor([(loss_bound - eta_scale * eta) / lam], dtype=torch.float64))[0])
    return min(w, weight_cap)


@register_quantity("dual-x-wac")
def dual_x_weight_after_clip(model, flat, eta, x, y, problem, extra=()) -> torch.Tensor:
    """DRO weights that survive clipping (docs/explanation/ALGORITHMS.md 5.4): w~ clip_C(grad_x l) per record, shape (B,
    d), with C = extra[0] the clip of the loss gradient and w~ = min(psi*'((min(l, B) - G eta) / lambda), W_cap)
    the weight of the loss clamped at the public bound B, capped at the public W_cap (config weight-cap; inf:
    no cap).

    Sensitivity: 0 <= w~ <= W = ``dro_weight_bound`` (psi*' is non-decreasing; W <= W_cap), so every record's
    vector has norm <= C W. A refresh release clips at C W (a no-op kept as a guard) and adds noise z C W; the
    product form clip_C(w grad l) would instead clip high- and low-weight records to the same norm and
    erase the re-weighting. Clamping the loss at B makes the weight constant in l beyond B (part of the
    model, like the KL terms of Algorithm 3)."""
    losses, grads = model.losses_and_grads(flat, x, y, problem.offset)
    w = record_weights(losses.detach(), eta, replace(problem, clamp_weights=True))
    return clip_rows(grads, float(extra[0])).mul_(w.unsqueeze(1))


@register_quantity("dual-joint")
def dual_joint(model, flat, eta, x, y, problem, extra=()) -> torch.Tensor:
    """[grad_x L ; d_eta L] per record, shape (B, d + 1): the gradient in z = (x, eta) as one variable
    (dp-sgd-dual and dp-spiderboost)."""
    losses, grads = model.losses_and_grads(flat, x, y, problem.offset)
    w = dro_weight(losses.detach(), eta, problem.psi, problem.lam, problem.eta_scale)
    return torch.cat([grads.mul_(w.unsqueeze(1)), (problem.eta_scale * (1.0 - w)).unsqueeze(1)], dim=1)


@register_quantity("ce-grad")
@row_blocks
def ce_grad(model, flat, scalar, x, y, problem, extra=()) -> RowBlocks:
    """grad_x l(x; xi) of the cross-entropy (ERM, dp-sgd; logit-adjusted when the query carries an offset),
    shape (B, d). ``scalar`` is unused."""
    return model.losses_and_grad_rows(flat, x, y, problem.offset)[1]


def uses_groups(fn: QuantityFn) -> QuantityFn:
    """Mark a quantity that reads each record's group: the client passes ``groups`` (B,) int64, the record's
    class with dro-groups=class, its declared group attribute with dro-groups=attribute or its node's index with
    dro-groups=node (``Problem.group_by``);
    a call without ``groups`` uses the classes y."""
    fn.uses_groups = True
    return fn


@register_quantity("class-weighted-grad")
@uses_groups
@row_blocks
def class_weighted_grad(model, flat, scalar, x, y, problem, extra=(), groups=None) -> RowBlocks:
    """extra[g] * grad_x l(x; xi): per-group weights (K,) given by the query (dp-sgda's descent), g the record's
    class or declared group (as ``class_loss_stats``), (B, d)."""
    weights = torch.as_tensor(list(extra), dtype=flat.dtype, device=flat.device)
    rows = model.losses_and_grad_rows(flat, x, y, problem.offset)[1]
    return rows.weighted(weights[y if groups is None else groups])


@register_quantity("class-onehot")
def class_onehot(model, flat, scalar, x, y, problem, extra=()) -> torch.Tensor:
    """e_y per record, shape (B, K) with K = len(extra): summed, the class histogram (norm 1 per record, so
    its sensitivity against the null record is 1). Touches no parameter."""
    return torch.nn.functional.one_hot(y, len(extra)).to(flat.dtype)


@register_quantity("bounded-loss")
def bounded_loss(model, flat, scalar, x, y, problem, extra=()) -> torch.Tensor:
    """min(l(x; xi), B) per record, shape (B, 1), in [0, B]: summed, the loss total behind a private
    eta initialisation (sensitivity B)."""
    with torch.no_grad():
        return torch.clamp(model.losses(flat, x, y, problem.offset), max=problem.loss_bound).unsqueeze(1)


@register_quantity("class-loss-stats")
@uses_groups
def class_loss_stats(model, flat, scalar, x, y, problem, extra=(), groups=None) -> torch.Tensor:
    """[e_g min(l, B) ; e_g] per record, shape (B, 2K) with K = len(extra), g the record's group (its class y, or
    its declared group attribute with dro-groups=attribute): summed, the per-group sums of (bounded) losses and
    per-group counts (dp-sgda's ascent). Norm <= sqrt(B^2 + 1)."""
    k = len(extra)
    with torch.no_grad():
        losses = torch.clamp(model.losses(flat, x, y, problem.offset), max=problem.loss_bound)
    onehot = torch.nn.functional.one_hot(y if groups is None else groups, k).to(flat.dtype)
    return torch.cat([onehot * losses.unsqueeze(1), onehot], dim=1)


@register_quantity("channel-moments")
def channel_moments_quantity(model, flat, scalar, x, y, problem, extra=()) -> torch.Tensor:
    """[mean_c x ; mean_c x^2] per record over each channel's positions, shape (B, 2C): summed and divided by n, the
    moments behind feature-norm=private (``common.feature_norm``; clipped to feature-norm-clip, the sensitivity).
    Touches no parameter."""
    from .feature_norm import channel_moments

    return channel_moments(x).to(flat.dtype)


@register_quantity("group-onehot")
@uses_groups
def group_onehot(model, flat, scalar, x, y, problem, extra=(), groups=None) -> torch.Tensor:
    """e_g per record, shape (B, G) with G = len(extra): summed, the histogram of the groups (norm 1 per record,
    sensitivity 1). Touches no parameter."""
    return torch.nn.functional.one_hot(y if groups is None else groups, len(extra)).to(flat.dtype)


@register_quantity("group-loss")
@uses_groups
def group_loss(model, flat, scalar, x, y, problem, extra=(), groups=None) -> torch.Tensor:
    """e_g min(l, B) per record, shape (B, G) with G = len(extra), g the record's group: summed, the G-vector of
    group loss sums behind dro-level=group (docs/explanation/ALGORITHMS.md 3.3). One record touches one coordinate, so a
    row's norm is min(l, B) <= B; a SPIDER or STORM combination of two points has norm |c(l_t) - c' c(l_{t-1})|."""
    with torch.no_grad():
        losses = torch.clamp(model.losses(flat, x, y, problem.offset), max=problem.loss_bound)
    groups = y if groups is None else groups
    return torch.nn.functional.one_hot(groups, len(extra)).to(flat.dtype) * losses.unsqueeze(1)


@register_quantity("group-weighted-grad")
@uses_groups
@row_blocks
def group_weighted_grad(model, flat, index, x, y, problem, extra=(), groups=None) -> RowBlocks:
    """w_g c(grad_x l) per record, shape (B, d), g the record's group, for dro-level=group
    (docs/explanation/ALGORITHMS.md 3.3).

    extra = (C_g, K, w^(0)_1..w^(0)_K[, w^(1)_1..w^(1)_K]): the public group weights of each point of the query, and
    the point's scalar ``index`` (0 or 1) says which set this point uses (a SPIDER difference pairs the weights of
    x_t with x_t and those of x_{t-1} with x_{t-1}). c = clip_{C_g} when C_g is finite (dro-clip=weight-after-clip:
    the row's norm is <= C_g max_k w_k, the weights survive the clip), the identity when C_g = inf
    (dro-clip=product: the client's clip of the whole row then applies, as for clip_C(w grad l))."""
    grad_clip, k, j = float(extra[0]), int(extra[1]), int(round(index))
    w = torch.as_tensor(list(extra[2 + j * k:2 + (j + 1) * k]), dtype=flat.dtype, device=flat.device)
    rows = model.losses_and_grad_rows(flat, x, y, problem.offset)[1]
    if math.isfinite(grad_clip):
        rows = rows.clipped(grad_clip)
    return rows.weighted(w[y if groups is None else groups])


def clamped_loss(losses: torch.Tensor, bound: float, soft: bool = False) -> torch.Tensor:
    """The bounded loss of the KL terms (docs/explanation/ALGORITHMS.md 2.4), same shape and dtype as ``losses``.

    Hard (loss-clamp=hard): min(l, B), flat beyond B, so a record with l > B gets zero gradient. Soft
    (loss-clamp=soft): B - softplus(B - l), smooth and strictly increasing with slope sigmoid(B - l) in (0, 1),
    below B everywhere and within log(1 + e^{-(B - l)}) <= e^{-(B - l)} of l below B: the hardest records keep
    a gradient. Either way the result is <= B, so g~ = exp((clamped - B) / lambda) stays in (0, 1]."""
    if soft:
        return bound - torch.nn.functional.softplus(bound - losses)
    return torch.clamp(losses, max=bound)


def _kl_terms(losses: torch.Tensor, lam: float, bound: float, soft: bool = False) -> torch.Tensor:
    """g~ = exp((clamped(l) - B) / lambda) in (0, 1] (docs/explanation/ALGORITHMS.md 2.4): no data-dependent shift."""
    return torch.exp((clamped_loss(losses, bound, soft) - bound) / lam)


@register_quantity("kl-g")
def kl_g(model, flat, lam, x, y, problem, extra=()) -> torch.Tensor:
    """k g~(w; xi) per record, shape (B, 1), at w = (flat, lambda), g~ in (0, 1] with either loss clamp.

    k = extra[0] (default 1) is a public scale: 1 / s_{t-1} with s-clip-units=relative, so that clip-s bounds
    a record's STORM term in units of the previous estimate s_{t-1} (sensitivity clip-s in those units; the
    server multiplies the released mean by s_{t-1}; recursive_spider.py)."""
    with torch.no_grad():
        losses = model.losses(flat, x, y, problem.offset)
    out = _kl_terms(losses, lam, problem.loss_bound, problem.soft_clamp).unsqueeze(1)
    return out * float(extra[0]) if extra else out


@register_quantity("kl-vu")
def kl_vu(model, flat, lam, x, y, problem, extra=()) -> torch.Tensor:
    """k [grad_x g~ ; c_u d_lambda g~] per record, shape (B, d + 1), with grad_x g~ = g~ c'(l) grad l / lambda
    and d_lambda g~ = g~ (B - c(l)) / lambda^2, c the loss clamp (``clamped_loss``): with loss-clamp=hard
    c'(l) = 1[l <= B] (zero beyond B: the clamp is part of the model), with loss-clamp=soft
    c'(l) = sigmoid(B - l) > 0 everywhere. Sensitivity is unchanged by the clamp (the client clips the row).

    k = extra[0] (default 1) is a public scale of the whole vector: with k = lambda_t / s_{t-1} the clip
    bound is in the units of the update z = lambda v / s (docs/explanation/ALGORITHMS.md 5.4; config
    rs-clip-units=relative), and the server divides the released mean by k."""
    losses, grads = model.losses_and_grads(flat, x, y, problem.offset)
    losses = losses.detach()
    bound = problem.loss_bound
    g = _kl_terms(losses, lam, bound, problem.soft_clamp)
    slope = torch.sigmoid(bound - losses) if problem.soft_clamp else (losses <= bound).to(g.dtype)
    v = grads.mul_((g * slope / lam).unsqueeze(1))  # in place, as below: each (B, d) pass saved is one copy
    u = g * (bound - clamped_loss(losses, bound, problem.soft_clamp)) / lam**2
    out = torch.cat([v, (problem.u_scale * u).unsqueeze(1)], dim=1)
    return out.mul_(float(extra[0])) if extra else out
