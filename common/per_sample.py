"""Per-record losses and gradients on a flat parameter vector; per-record clipping.

A model's trainable parameters are handled as one flat vector x in R^d (the order of ``named_parameters``),
which keeps the algorithms' updates plain vector arithmetic; frozen ones (``requires_grad`` False: config key
``trainable``) stay in the module as constants. Per-record gradients come from a well-kept library,
one of two *engines* behind ``FlatModel.losses_and_grads`` (config key ``per-record-engine``):

- 'torch.func' (default): ``vmap(grad(...))`` over records (no Python loop over records);
- 'opacus': Opacus' grad-sample hooks (``opacus.GradSampleModule``, per-layer outer products), which
  ``dpdro lab bench`` measures against torch.func per model and device (docs/research/PERFORMANCE.md). Needs opacus
  installed;
- 'ghost': for a model whose trainable parameters are one ``nn.Linear`` layer's (a linear head on fixed features:
  scatter-linear, or trainable=head), each record's gradient is the outer product g_i h_i^T (g_i the gradient of
  its loss at the layer's output, h_i the layer's input; the bias's is g_i), so its norm is
  ||g_i|| sqrt(||h_i||^2 + 1) and the clipped sum is one (K, B) x (B, in) product: ghost clipping (Li et al.,
  ICLR 2022, "Large language models can be strong differentially private learners", sec. 4; Opacus'
  ``compute_linear_norm_sample``), without the (B, d) matrix (``OuterRows``). The norm is computed here, not
  taken from Opacus, because the clip needs an upper bound that covers rounding (``OuterRows.norm_upper_bound``).

The engines give the same gradients up to rounding (tests/test_per_sample.py checks 1e-6). Callers chunk large batches
to bound memory. ``FlatModel.losses_and_grad_blocks`` gives the gradients as one (B, numel) block per parameter,
where the engine leaves them; ``RowBlocks`` (blocks times a per-record factor) is clipped and summed without
forming the (B, d) matrix, which is what a refresh release does (``quantities.row_blocks``).

Clipped vectors are summed in float64 whatever the working dtype (``clipped_sum_and_count``): a float32 sum's
rounding changes when one record changes, by far more than the float64 bound that the release's noise is
inflated for (``release.sum_rounding_factor``; Casacuberta et al., CCS 2022).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

ENGINES = ("torch.func", "opacus", "ghost")


class FlatModel:
    """Functional view of ``module`` with parameters as one flat vector.

    Args:
        module: a validated model (see ``models.validate_model``); its buffers, and its parameters with
            ``requires_grad`` False (frozen: config key ``trainable``, ``model_init.prepare_model``), are used as
            they are. The flat vector, the gradients and ``dim`` cover the trainable parameters only.
        engine: per-record gradient engine, one of ``ENGINES`` (module docstring). ValueError otherwise,
            ValueError for a module without a trainable parameter, and for 'ghost' when the trainable parameters
            are not one ``nn.Linear`` layer's weight (and bias).
    """

    def __init__(self, module: nn.Module, engine: str = "torch.func") -> None:
        if engine not in ENGINES:
            raise ValueError(f"per-record engine {engine!r}; allowed: {', '.join(map(repr, ENGINES))}")
        if engine == "opacus":
            try:
                import opacus  # noqa: F401 - fail here, before any work, not at the first release
            except ImportError as e:
                raise ImportError("per-record engine 'opacus' (config key per-record-engine) needs opacus, which is "
                                  "not installed here: pip install opacus==1.6.0, or use 'torch.func'") from e
        self.engine = engine
        self._hooked: nn.Module | None = None  # the opacus engine's hooked copy of module (built on first use)
        self.module = module
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("the model has no trainable parameter (every parameter has requires_grad False)")
        self.names = [n for n, _ in named]
        self.shapes = [p.shape for _, p in named]
        self.numels = [p.numel() for _, p in named]
        self.dim = sum(self.numels)
        self.dtype = named[0][1].dtype
        self.buffers = dict(module.named_buffers())
        self._linear = _ghost_layer(module, self.names) if engine == "ghost" else None

    def buffers_changed(self) -> None:
        """Call after changing the module's buffers in place (the worker's feature statistics): the computations
        here read the module's own buffer tensors, and an engine's copy of the module (Opacus') is rebuilt."""
        self._hooked = None

    def initial(self) -> torch.Tensor:
        """The module's current trainable parameters as a flat (d,) tensor."""
        return torch.cat([p.detach().reshape(-1) for p in self.module.parameters() if p.requires_grad])

    def unflatten(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views of ``flat`` (d,) shaped as the module's trainable parameters (name -> view)."""
        parts = torch.split(flat, self.numels)
        return {n: p.view(s) for n, p, s in zip(self.names, parts, self.shapes, strict=False)}

    def logits(self, flat: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Model outputs (B, K) at trainable parameters ``flat`` (the frozen ones as the module holds them) for
        inputs ``x`` (B, ...)."""
        return functional_call(self.module, (self.unflatten(flat), self.buffers), (x,))

    def losses(self, flat: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
               offset: torch.Tensor | None = None) -> torch.Tensor:
        """Per-record cross-entropy (B,) at ``flat`` of the logits plus ``offset`` (K,) if given: with
        offset = tau log(pi) this is the logit-adjusted loss of Menon et al. (2021), eq. (10)."""
        logits = self.logits(flat, x)
        return F.cross_entropy(logits if offset is None else logits + offset, y, reduction="none")

    def losses_and_grads(self, flat: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
                         offset: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-record cross-entropy (B,) and its gradients (B, d) at ``flat``, by this model's engine;
        ``offset`` (K,) as in ``losses``."""
        losses, blocks = self.losses_and_grad_blocks(flat, x, y, offset)
        return losses, torch.cat(blocks, dim=1)

    def losses_and_grad_blocks(self, flat: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
                               offset: torch.Tensor | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Per-record cross-entropy (B,) and its gradients as one (B, numel) block per parameter, in the order
        of the flat vector (``torch.cat(blocks, 1)`` is ``losses_and_grads``' (B, d)): where the engine leaves
        them, without the (B, d) copy. ``offset`` (K,) as in ``losses``."""
        if self.engine == "opacus":
            return self._opacus_losses_and_grads(flat, x, y, offset)
        if self.engine == "ghost":
            losses, rows = self.losses_and_grad_rows(flat, x, y, offset)
            return losses, rows.blocks

        def one(params: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
            out = functional_call(self.module, (params, self.buffers), (xi.unsqueeze(0),))
            return F.cross_entropy(out if offset is None else out + offset, yi.unsqueeze(0))

        grads, losses = vmap(grad_and_value(one), in_dims=(None, 0, 0))(self.unflatten(flat), x, y)
        return losses, [grads[n].reshape(x.shape[0], -1) for n in self.names]

    def losses_and_grad_rows(self, flat: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
                             offset: torch.Tensor | None = None) -> tuple[torch.Tensor, RowBlocks]:
        """Per-record cross-entropy (B,) and its gradients as ``RowBlocks`` (rows (B, d)): with the 'ghost'
        engine in factored form (``OuterRows``: no (B, d) matrix), else the engine's blocks. ``offset`` as in
        ``losses``."""
        if self.engine != "ghost":
            losses, blocks = self.losses_and_grad_blocks(flat, x, y, offset)
            return losses, RowBlocks(blocks)
        layer, seen = self._linear, []

        def hook(mod, inputs, out):  # the layer's input h and a leaf for its output, whose gradient is g
            seen.append((inputs[0].detach(), out.detach().requires_grad_()))
            return seen[-1][1]

        handle = layer.register_forward_hook(hook)
        try:
            with torch.enable_grad():
                logits = functional_call(self.module, (self.unflatten(flat), self.buffers), (x,))
                losses = F.cross_entropy(logits if offset is None else logits + offset, y, reduction="none")
                if len(seen) != 1 or seen[0][0].dim() != 2:
                    raise ValueError("per-record engine 'ghost' needs the trainable nn.Linear layer called once per "
                                     f"forward on (B, in) inputs; it was called {len(seen)} time(s) on "
                                     f"{[tuple(h.shape) for h, _ in seen]}: use per-record-engine 'torch.func'")
                h, out = seen[0]
                (g,) = torch.autograd.grad(losses.sum(), out)  # records are independent: row i is record i's
        finally:
            handle.remove()
        return losses.detach(), OuterRows(g, h, layer.bias is not None and layer.bias.requires_grad)

    def _opacus_losses_and_grads(self, flat: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
                                 offset: torch.Tensor | None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The 'opacus' engine: a private copy of the module wrapped in Opacus' ``GradSampleModule`` (loss
        reduction 'sum': the gradient of sum_i loss_i leaves each record's own gradient in ``grad_sample``), its
        trainable parameters set to ``flat`` (the frozen ones, copied with the module, have no grad_sample); one
        forward and backward over the batch. Returns (losses (B,), one (B, numel) block per trainable parameter)."""
        import copy
        import warnings

        if self._hooked is None:
            from opacus import GradSampleModule

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self._hooked = GradSampleModule(copy.deepcopy(self.module), batch_first=True, loss_reduction="sum")
        params = [p for p in self._hooked.parameters() if p.requires_grad]
        with torch.no_grad():
            for p, v in zip(params, self.unflatten(flat).values(), strict=True):
                p.copy_(v)
        for p in params:
            p.grad_sample = None
            p.grad = None
        with torch.enable_grad(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Full backward hook is firing")  # Opacus' hooks, harmless
            out = self._hooked(x)
            losses = F.cross_entropy(out if offset is None else out + offset, y, reduction="none")
            losses.sum().backward()
        blocks = [p.grad_sample.reshape(x.shape[0], -1) for p in params]
        for p in params:  # the module lets go of them: the blocks are the caller's alone
            p.grad_sample = None
            p.grad = None
        return losses.detach(), blocks


# Entries per partial sum of squares in ``norm_upper_bound``. Any summation order of b non-negative floats
# errs by at most (b - 1) u relative (u = eps / 2; Higham 2002, sec. 4.2), whatever torch's kernel does, so
# short float sums plus a float64 sum over blocks bound the exact norm tightly at ~3x the cost of one norm.
NORM_BLOCK = 64


def clip_margin(dtype: torch.dtype) -> float:
    """Relative safety margin of the clip factor in ``dtype``: (NORM_BLOCK + 8) eps, ~8.6e-6 in float32 and
    ~1.6e-14 in float64. It covers the rounding of the blocked norm (~NORM_BLOCK eps / 2), of the scale
    factor and of the scaled entries (u each), so a clipped row's exact norm never exceeds the bound."""
    return (NORM_BLOCK + 8) * torch.finfo(dtype).eps


def norm_upper_bound(v: torch.Tensor) -> torch.Tensor:
    """Upper bound (B,) float64 on the exact L2 norm of each row of v (B, D), within a factor
    1 + 2 ``clip_margin(v.dtype)`` of it: float sums of squares over blocks of NORM_BLOCK entries in v's
    dtype, summed in float64, times 1 + ``clip_margin``. Rows with a NaN give NaN, rows whose squares
    overflow give inf."""
    return _block_squares(v).sqrt() * (1.0 + clip_margin(v.dtype))


class RowBlocks:
    """Per-record vectors (B, D) kept as the engine produced them: column blocks (B, d_1), ..., (B, d_k) with
    D = sum d_j (one per parameter, ``FlatModel.losses_and_grad_blocks``) and a per-record factor (B,) or None.
    Row i is factor_i [blocks_1[i], ..., blocks_k[i]].

    ``clipped_sum_and_count`` clips and sums such rows without forming them: the norm of row i is |factor_i|
    times that of its blocks, and the factor joins the clip factor, so a refresh of a weighted gradient (the DRO
    weight, a group weight) costs no (B, D) concatenation and no (B, D) product. ``dense()`` forms the matrix
    (for the difference of two points, and for callers of the (B, D) form).

    Args: blocks (list of 2-D tensors, same B, dtype and device); factor (B,) in their dtype, or None for 1.
    ValueError for an empty list or blocks of unequal rows.
    """

    def __init__(self, blocks: list[torch.Tensor], factor: torch.Tensor | None = None) -> None:
        if not blocks or any(b.dim() != 2 or b.shape[0] != blocks[0].shape[0] for b in blocks):
            raise ValueError(f"row blocks must be 2-D with equal rows; got shapes {[tuple(b.shape) for b in blocks]}")
        self.blocks = blocks
        self.factor = factor

    @property
    def shape(self) -> tuple[int, int]:
        return self.blocks[0].shape[0], sum(b.shape[1] for b in self.blocks)

    def scaled(self, c: float) -> RowBlocks:
        """These rows times the public constant c (self when c is 1)."""
        if c == 1.0:
            return self
        rows = self.blocks[0].shape[0]
        base = self.factor if self.factor is not None else torch.ones(rows, dtype=self.blocks[0].dtype,
                                                                     device=self.blocks[0].device)
        return RowBlocks(self.blocks, base * c)

    def weighted(self, factor: torch.Tensor) -> RowBlocks:
        """These rows times a per-record factor (B,) (the rows' own factor, if any, kept)."""
        return RowBlocks(self.blocks, factor if self.factor is None else self.factor * factor)

    def clipped(self, bound: float) -> RowBlocks:
        """These rows clipped to exact norm <= ``bound`` as ``clip_rows`` clips the dense rows (rows with NaN or Inf
        become zero); the clip factor kept as the rows' factor where the form allows it (``OuterRows``)."""
        return RowBlocks([clip_rows(self.dense(), bound)])

    def weighted_block(self, j: int) -> torch.Tensor:
        """Column block j times the factor, (B, d_j): the block itself, scaled in place (the blocks are this
        object's own; a block read this way must not be read again through it)."""
        block = self.blocks[j]
        return block if self.factor is None else block.mul_(self.factor.unsqueeze(1))

    def dense(self) -> torch.Tensor:
        """The rows as a (B, D) tensor: the blocks concatenated (a new tensor), times the factor (in place on the
        copy); with one block, that block itself when there is no factor, else a new product."""
        if len(self.blocks) == 1:
            v = self.blocks[0]
            return v if self.factor is None else v * self.factor.unsqueeze(1)
        v = torch.cat(self.blocks, dim=1)
        return v if self.factor is None else v.mul_(self.factor.unsqueeze(1))

    def norm_upper_bound(self) -> torch.Tensor:
        """Upper bound (B,) float64 on the exact L2 norm of each row, as ``norm_upper_bound`` of the dense rows
        would give it (blocks of NORM_BLOCK entries per column block, summed in float64, the same margin), times
        |factor| (in float64)."""
        rows = self.blocks[0].shape[0]
        squares = torch.zeros(rows, dtype=torch.float64, device=self.blocks[0].device)
        for b in self.blocks:
            squares += _block_squares(b)
        norms = squares.sqrt() * (1.0 + clip_margin(self.blocks[0].dtype))
        return norms if self.factor is None else norms * self.factor.to(torch.float64).abs()


class OuterRows(RowBlocks):
    """Per-record gradients of one linear layer in factored form: row i is factor_i [vec(g_i h_i^T), g_i] (the
    bias part only when ``bias``), g (B, K) the gradient of each record's loss at the layer's output, h (B, n) the
    layer's input (the 'ghost' engine, ``FlatModel.losses_and_grad_rows``). ``blocks`` forms the (B, K n) and
    (B, K) blocks on first use; ``clipped_sum_and_count`` never forms them.

    Args: g (B, K) and h (B, n) of one dtype and device; bias (bool); factor (B,) or None for 1."""

    def __init__(self, g: torch.Tensor, h: torch.Tensor, bias: bool, factor: torch.Tensor | None = None) -> None:
        if g.dim() != 2 or h.dim() != 2 or g.shape[0] != h.shape[0]:
            raise ValueError(f"outer rows need g (B, K) and h (B, n); got {tuple(g.shape)} and {tuple(h.shape)}")
        self.g, self.h, self.bias, self.factor = g, h, bias, factor
        self._blocks: list[torch.Tensor] | None = None
        self._h64: torch.Tensor | None = None

    @property
    def blocks(self) -> list[torch.Tensor]:  # type: ignore[override]
        if self._blocks is None:
            rows = self.g.shape[0]
            self._blocks = [(self.g.unsqueeze(2) * self.h.unsqueeze(1)).reshape(rows, -1)]
            if self.bias:
                self._blocks.append(self.g.clone())
        return self._blocks

    @property
    def shape(self) -> tuple[int, int]:
        k, n = self.g.shape[1], self.h.shape[1]
        return self.g.shape[0], k * n + (k if self.bias else 0)

    def scaled(self, c: float) -> OuterRows:
        if c == 1.0:
            return self
        base = self.factor if self.factor is not None else torch.ones(self.g.shape[0], dtype=self.g.dtype,
                                                                     device=self.g.device)
        return OuterRows(self.g, self.h, self.bias, base * c)

    def weighted(self, factor: torch.Tensor) -> OuterRows:
        """These rows times a per-record factor (B,) (the rows' own factor, if any, kept)."""
        return OuterRows(self.g, self.h, self.bias, factor if self.factor is None else self.factor * factor)

    def clipped(self, bound: float) -> OuterRows:
        """These rows clipped to exact norm <= ``bound`` (finite, >= 0), in factored form: the clip factor
        min(1, bound / N_i) of ``norm_upper_bound`` (in g's dtype, as ``clip_scales`` gives it) joins the factor;
        a row whose bound is not finite gets factor 0 and its g and h rows are zeroed (0 * NaN would be NaN)."""
        norms = self.norm_upper_bound()
        finite = torch.isfinite(norms)
        scale = _clip_factors(norms, bound).to(self.g.dtype)
        g, h = self.g, self.h
        if not bool(finite.all()):
            g = torch.where(finite.unsqueeze(1), g, torch.zeros((), dtype=g.dtype, device=g.device))
            h = torch.where(finite.unsqueeze(1), h, torch.zeros((), dtype=h.dtype, device=h.device))
        factor = scale if self.factor is None else scale * torch.where(finite, self.factor, 0.0)
        return OuterRows(g, h, self.bias, factor)

    def h64(self) -> torch.Tensor:
        """h (B, n) in float64 (exact), converted once: the norm and the sum both read it."""
        if self._h64 is None:
            self._h64 = self.h.to(torch.float64)
        return self._h64

    def norm_upper_bound(self) -> torch.Tensor:
        """Upper bound (B,) float64 on the exact L2 norm of each row: |factor_i| ||g_i|| sqrt(||h_i||^2 + 1[bias]),
        from upper bounds on ||g_i|| and ||h_i|| (``norm_upper_bound``: blocked sums of squares in their dtype,
        with its margin), times 1 + (n / NORM_BLOCK + K / NORM_BLOCK + 16) eps64 for the float64 sums over blocks,
        the product and the root (Higham 2002, sec. 4.2); ``norm_upper_bound``'s margin covers the rounding of the
        clip factor and of the scaled entries, as for a dense row."""
        eps = torch.finfo(torch.float64).eps
        slack = 1.0 + (self.h.shape[1] // NORM_BLOCK + self.g.shape[1] // NORM_BLOCK + 16) * eps
        nh = norm_upper_bound(self.h)
        norms = norm_upper_bound(self.g) * (nh * nh + (1.0 if self.bias else 0.0)).sqrt() * slack
        return norms if self.factor is None else norms * self.factor.to(torch.float64).abs()


class OuterDiffRows(RowBlocks):
    """The per-record combination a_1 [vec(g_1 h_1^T), g_1] + a_2 [vec(g_2 h_2^T), g_2] of one linear layer's
    gradients at two points whose inputs differ (h_1 != h_2), in factored form: ghost norms for two-point
    differences. With a_j = coef_j factor_j (per record) and b = 1[bias], the squared norm of row i is

        a_1^2 |g_1|^2 (|h_1|^2 + b) + 2 a_1 a_2 (g_1.g_2)(h_1.h_2 + b) + a_2^2 |g_2|^2 (|h_2|^2 + b)

    (for SPIDER's a = (1, -1): (h1.h1)(g1.g1) - 2 (h1.h2)(g1.g2) + (h2.h2)(g2.g2) plus the bias terms), so the
    norm costs O(B (K + n)) and the clipped sum two (K, B) x (B, n) products, never the (B, K n) rows (Li et al.,
    ICLR 2022, sec. 4's ghost clipping, for a difference of two points). ``clipped_sum_and_count`` clips and sums
    it; ``blocks`` forms the dense rows (for callers of that form).

    Args: terms (two ``OuterRows`` of one layer: same bias flag, B, dtype and device), coefs (two floats).
    """

    def __init__(self, terms: list[OuterRows], coefs) -> None:
        if len(terms) != 2 or terms[0].bias != terms[1].bias or terms[0].g.shape[0] != terms[1].g.shape[0]:
            raise ValueError("outer difference rows need two OuterRows of one layer (same bias and records)")
        self.terms, self.coefs, self.bias, self.factor = terms, tuple(float(c) for c in coefs), terms[0].bias, None
        self._blocks: list[torch.Tensor] | None = None

    @property
    def blocks(self) -> list[torch.Tensor]:  # type: ignore[override]
        if self._blocks is None:
            parts = [[b * c if t.factor is None else b * (c * t.factor).unsqueeze(1) for b in t.blocks]
                     for t, c in zip(self.terms, self.coefs, strict=True)]
            self._blocks = [p + q for p, q in zip(*parts, strict=True)]
        return self._blocks

    @property
    def shape(self) -> tuple[int, int]:
        return self.terms[0].shape

    def coefficients(self) -> list[torch.Tensor]:
        """a_j (B,) float64 of each term: coef_j times the term's factor."""
        out = []
        for t, c in zip(self.terms, self.coefs, strict=True):
            ones = torch.ones(t.g.shape[0], dtype=torch.float64, device=t.g.device)
            out.append(c * (ones if t.factor is None else t.factor.to(torch.float64)))
        return out

    def norm_upper_bound(self) -> torch.Tensor:
        """Upper bound (B,) float64 on the exact norm of each row: the square root of the formula above (dot products
        of the float64 conversions, exact inputs) plus its rounding, bounded by 4 (n + K + 16) eps64
        (sum_j |a_j| |g_j| sqrt(|h_j|^2 + b))^2 (Higham 2002, sec. 3.1: every product and sum of the formula has
        a relative error at most that many eps against the sum of the absolute values), plus 4 eps64 times that
        sum for the float64 rounding of the coefficients a_j c_i g_j that the clipped sum multiplies; then times
        1 + ``clip_margin`` as every norm bound here. NaN or inf in g, h or a factor: not finite."""
        eps = torch.finfo(torch.float64).eps
        (t1, t2), (a1, a2) = self.terms, self.coefficients()
        g1, g2, h1, h2 = t1.g.to(torch.float64), t2.g.to(torch.float64), t1.h64(), t2.h64()
        b = 1.0 if self.bias else 0.0
        gg11, gg22, gg12 = _row_dots(g1, g1), _row_dots(g2, g2), _row_dots(g1, g2)
        hh11, hh22, hh12 = _row_dots(h1, h1) + b, _row_dots(h2, h2) + b, _row_dots(h1, h2) + b
        square = a1 * a1 * gg11 * hh11 + 2.0 * a1 * a2 * gg12 * hh12 + a2 * a2 * gg22 * hh22
        scale = a1.abs() * (gg11 * hh11).sqrt() + a2.abs() * (gg22 * hh22).sqrt()
        slack = 4.0 * (h1.shape[1] + g1.shape[1] + 16) * eps
        norms = (square.clamp(min=0.0) + slack * scale * scale).sqrt() + 4.0 * eps * scale
        return norms * (1.0 + clip_margin(t1.g.dtype))


def _row_dots(u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """u_i . v_i per row (B,) for u, v (B, n), as a batched matrix product (no (B, n) temporary)."""
    return torch.bmm(u.unsqueeze(1), v.unsqueeze(2)).reshape(-1)


def _clipped_outer_diff_sum_and_count(v: OuterDiffRows, bound: float) -> tuple[torch.Tensor, int]:
    """``clipped_sum_and_count`` of ``v.dense()`` without forming it: per-record clip factors c_i of
    ``OuterDiffRows.norm_upper_bound``, then sum_j [vec((c a_j g_j)^T h_j), sum_i c_i a_ij g_ij] as float64
    products (as ``_clipped_outer_sum_and_count``, one per term). Rows whose bound is not finite contribute zero."""
    a = v.coefficients()
    if math.isinf(bound):
        scale, n_clipped = torch.ones_like(a[0]), 0
    else:
        norms = v.norm_upper_bound()
        scale = _clip_factors(norms, bound)
        n_clipped = int((scale < 1.0).sum())
    finite = scale > 0
    total = None
    for t, aj in zip(v.terms, a, strict=True):
        g, h = t.g.to(torch.float64), t.h64()
        coef = torch.where(finite, scale * aj, 0.0)
        if not bool(finite.all()):
            g = torch.where(finite.unsqueeze(1), g, torch.zeros((), dtype=g.dtype, device=g.device))
            h = torch.where(finite.unsqueeze(1), h, torch.zeros((), dtype=h.dtype, device=h.device))
        weighted = g * coef.unsqueeze(1)
        parts = [(weighted.t() @ h).reshape(-1)]
        if v.bias:
            parts.append(weighted.sum(0))
        part = torch.cat(parts)
        total = part if total is None else total + part
    return total, n_clipped


def combine_outer(terms: list[OuterRows], coefs) -> OuterRows | OuterDiffRows | None:
    """sum_j coefs[j] terms[j] in factored form: one ``OuterRows`` when every term has the same input h (a linear
    layer on inputs that no trainable parameter changes), i.e. g = sum_j coefs[j] factor_j g_j; an
    ``OuterDiffRows`` for two terms whose inputs differ; None otherwise."""
    first = terms[0]
    if any(t.bias != first.bias or not torch.equal(t.h, first.h) for t in terms[1:]):
        if len(terms) == 2 and terms[1].bias == first.bias:
            return OuterDiffRows(terms, coefs)
        return None
    g = None
    for t, c in zip(terms, coefs, strict=True):
        part = t.g * (float(c) if t.factor is None else float(c) * t.factor.unsqueeze(1))
        g = part if g is None else g + part
    return OuterRows(g, first.h, first.bias)


def _ghost_layer(module: nn.Module, names: list[str]) -> nn.Linear:
    """The one ``nn.Linear`` layer whose weight (and bias) are all of ``module``'s trainable parameters
    ``names``, for the 'ghost' engine; ValueError naming the trainable parameters otherwise."""
    for prefix, layer in module.named_modules():
        if isinstance(layer, nn.Linear) and layer.weight.requires_grad:
            own = [f"{prefix}.{n}" if prefix else n for n, p in layer.named_parameters() if p.requires_grad]
            if own == names:
                return layer
    raise ValueError(f"per-record engine 'ghost' needs the trainable parameters to be one nn.Linear layer's weight "
                     f"(and bias); this model trains {', '.join(names[:6])}{' ...' if len(names) > 6 else ''}: use "
                     "per-record-engine 'torch.func', or config key trainable = the linear layer")


def _block_squares(v: torch.Tensor) -> torch.Tensor:
    """Float64 sum of squares (B,) of each row of v (B, D), as float sums over NORM_BLOCK entries."""
    rows, dim = v.shape
    whole = dim - dim % NORM_BLOCK
    squares = torch.zeros(rows, dtype=torch.float64, device=v.device)
    if whole:
        blocks = torch.linalg.vector_norm(v[:, :whole].reshape(rows, whole // NORM_BLOCK, NORM_BLOCK), dim=2)
        squares += (blocks.to(torch.float64) ** 2).sum(1)
    if whole < dim:
        squares += torch.linalg.vector_norm(v[:, whole:], dim=1).to(torch.float64) ** 2
    return squares


def clip_scales(v: torch.Tensor, bound: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-row clip factors (B,) in v's dtype, rows (B,) bool that were scaled down) for v (B, D) and a
    finite ``bound`` >= 0.

    The factor is min(1, bound / N) with N = ``norm_upper_bound`` (the norm with a safety margin), so
    factor * row has exact L2 norm <= bound in v's dtype, rounding included: clipping never overshoots.
    A row with a NaN or Inf entry gets factor 0 (and counts as scaled down): every record's contribution is
    bounded whatever its values, so an honest client's sum is always finite and within its bound (no reply is
    rejected because of the records it happened to sample). Rows already shorter than bound / (1 + margin)
    are unchanged; a row within the margin of the bound shrinks by at most ~1e-5 (float32)."""
    scale = _clip_factors(norm_upper_bound(v), bound)
    return scale.to(v.dtype), scale < 1.0


def _clip_factors(norms: torch.Tensor, bound: float) -> torch.Tensor:
    """min(1, bound / N) per row (B,) float64 from norm upper bounds N (B,) float64; 0 where N is not finite."""
    scale = torch.clamp(bound / torch.clamp(norms, min=1e-300), max=1.0)
    return torch.where(torch.isfinite(norms), scale, torch.zeros_like(scale))


def _finite_rows(v: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """v with its rows of factor 0 zeroed (0 * NaN would be NaN); v itself if every factor is positive (then
    every row is finite: a NaN or Inf entry makes the row's factor 0)."""
    if bool((scale > 0).all()):
        return v
    return torch.where((scale > 0).unsqueeze(1), v, torch.zeros((), dtype=v.dtype, device=v.device))


def clip_rows(v: torch.Tensor, bound: float) -> torch.Tensor:
    """Scale each row of v (B, D) to exact L2 norm at most ``bound`` (>= 0; inf means no clipping) in v's
    dtype (``clip_scales``: a safety margin absorbs rounding; rows with NaN or Inf become zero).

    Rows shorter than the bound are unchanged; a zero bound gives zero rows. Returns a new (B, D) tensor.
    """
    if math.isinf(bound):
        return v
    scale, _ = clip_scales(v, bound)
    return _finite_rows(v, scale) * scale.unsqueeze(1)


def clipped_sum(v: torch.Tensor, bound: float) -> torch.Tensor:
    """Sum over rows of ``clip_rows(v, bound)``, shape (D,) float64, computed as matrix-vector products of the
    per-row scales with v (no clipped (B, D) copy is formed). Same bound semantics as ``clip_rows``."""
    return clipped_sum_and_count(v, bound)[0]


# Most float64 entries of the copy that a float64 sum of float32 rows converts at a time (1 MiB, so it stays in
# cache). Measured on one CPU thread at load average 3, a (256, 26106) float32 chunk: 4.9 ms, against 1.4 ms for
# its float32 matrix-vector product and 34 ms for converting the whole chunk at once.
SUM_SLICE_ENTRIES = 2**17


def sum64(coef: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """sum_i coef_i v_i, shape (D,) float64, for coef (B,) float64 and rows v (B, D) of any float dtype: every
    product and addition in float64. v's entries convert to float64 exactly, a slice of rows of at most
    ``SUM_SLICE_ENTRIES`` entries (or one row) at a time, each slice's sum added to the total.

    Rounding: each coordinate is a sum of B products, so whatever the order of the sum it is within
    gamma_B sum_i |coef_i v_ij| of the exact value (Higham 2002, eq. (3.5)), gamma_k = k u / (1 - k u), u = 2^-53."""
    rows, dim = v.shape
    if v.dtype == torch.float64:
        return coef @ v
    step = max(1, SUM_SLICE_ENTRIES // max(dim, 1))
    total = torch.zeros(dim, dtype=torch.float64, device=v.device)
    for i in range(0, rows, step):
        total.addmv_(v[i:i + step].to(torch.float64).t(), coef[i:i + step])
    return total


def clipped_sum_and_count(v: torch.Tensor, bound: float) -> tuple[torch.Tensor, int]:
    """(``clipped_sum(v, bound)``, number of rows that were scaled down by the clip): the sum (D,) is float64
    whatever v's dtype (``sum64``).

    Each clipped row y_i = c_i v_i (c_i the float64 clip factor) has exact norm <= bound (the margin of
    ``clip_margin``), and the sum of B of them in float64 is within gamma_B B bound of the exact sum of the y_i
    (``sum64``). So two batches that differ in one row (the other rows the same) give sums at most
    bound (1 + 2 B gamma_B) apart: a public bound, unlike a float32 sum's, whose rounding error (gamma_B in
    u = 2^-24) would be ~5e8 times larger (``release.sum_rounding_factor`` inflates the noise for the float64
    bound; ``release.reply_tolerance`` checks the norm)."""
    if isinstance(v, OuterRows):
        return _clipped_outer_sum_and_count(v, bound)
    if isinstance(v, OuterDiffRows):
        return _clipped_outer_diff_sum_and_count(v, bound)
    if isinstance(v, RowBlocks):
        return _clipped_blocks_sum_and_count(v, bound)
    if math.isinf(bound):
        return v.sum(0, dtype=torch.float64), 0
    scale = _clip_factors(norm_upper_bound(v), bound)
    return sum64(scale, _finite_rows(v, scale)), int((scale < 1.0).sum())


def _clipped_blocks_sum_and_count(v: RowBlocks, bound: float) -> tuple[torch.Tensor, int]:
    """``clipped_sum_and_count`` of ``v.dense()`` without forming it: per-row float64 coefficients factor_i c_i,
    c_i the clip factor of the row's norm bound (``RowBlocks.norm_upper_bound``), applied to each column block by
    ``sum64``. The exact norm of a contributed row is <= |fl(factor_i c_i)| ||blocks[i]|| <= bound: the margin
    of ``clip_scales``' factor covers the float64 rounding of the coefficient. A row whose bound is not finite
    (NaN or Inf in its blocks or factor) goes through the dense path, which zeroes it."""
    if math.isinf(bound):
        if v.factor is None:
            return torch.cat([b.sum(0, dtype=torch.float64) for b in v.blocks]), 0
        return torch.cat([sum64(v.factor.to(torch.float64), b) for b in v.blocks]), 0
    norms = v.norm_upper_bound()
    if not bool(torch.isfinite(norms).all()):
        return clipped_sum_and_count(v.dense(), bound)
    scale = _clip_factors(norms, bound)
    coef = scale if v.factor is None else scale * v.factor.to(torch.float64)
    return torch.cat([sum64(coef, b) for b in v.blocks]), int((scale < 1.0).sum())


def _clipped_outer_sum_and_count(v: OuterRows, bound: float) -> tuple[torch.Tensor, int]:
    """``clipped_sum_and_count`` of ``v.dense()`` without forming it: per-row float64 coefficients
    coef_i = factor_i c_i (c_i the clip factor of ``OuterRows.norm_upper_bound``), G = coef * g in float64, and the
    sum [vec(G^T h), sum_i G_i] as float64 products. The contributed row fl(coef_i g_i) h_i^T has exact norm
    <= bound (the bound's margin covers the rounding of G), and each entry of the sum has one rounding per product
    and B - 1 additions: within gamma_B B bound of the exact sum, as ``sum64``. Rows whose bound is not finite
    (NaN or Inf in g, h or the factor) contribute zero."""
    g, h = v.g.to(torch.float64), v.h64()
    if math.isinf(bound):
        coef = torch.ones(g.shape[0], dtype=torch.float64, device=g.device)
        if v.factor is not None:
            coef = v.factor.to(torch.float64)
        n_clipped = 0
    else:
        norms = v.norm_upper_bound()
        finite = torch.isfinite(norms)
        scale = _clip_factors(norms, bound)
        if not bool(finite.all()):  # 0 * NaN is NaN: zero the rows first
            g = torch.where(finite.unsqueeze(1), g, torch.zeros((), dtype=g.dtype, device=g.device))
            h = torch.where(finite.unsqueeze(1), h, torch.zeros((), dtype=h.dtype, device=h.device))
        coef = scale if v.factor is None else scale * torch.where(finite, v.factor.to(torch.float64), 0.0)
        n_clipped = int((scale < 1.0).sum())
    weighted = g * coef.unsqueeze(1)
    parts = [(weighted.t() @ h).reshape(-1)]
    if v.bias:
        parts.append(weighted.sum(0))
    return torch.cat(parts), n_clipped
