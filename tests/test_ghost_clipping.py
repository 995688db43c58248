"""per-record-engine 'ghost' (per_sample.OuterRows): ghost clipping of a model whose trainable parameters are one
linear layer's gives the same per-record gradients, clipped sums and clip counts as the generic torch.func engine
(float64: 1e-10), its norm bound is an upper bound within a hair of the exact norm, a bad row contributes zero,
and a model it does not fit is refused with a message naming what to do."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from dpdro.client.worker import clipped_total
from dpdro.common.config import Config, ConfigError
from dpdro.common.models import make_model
from dpdro.common.per_sample import FlatModel, OuterRows, clipped_sum_and_count
from dpdro.common.psi import make_psi
from dpdro.common.quantities import QUANTITIES, Problem

N = 9


def _frozen_except(module: nn.Module, prefix: str) -> nn.Module:
    for name, p in module.named_parameters():
        p.requires_grad_(name.startswith(prefix))
    return module


def _cases():
    """(model, input shape): a linear head on scattering-shaped features, a CNN's middle linear layer with the
    rest frozen (a layer followed by frozen ones), an MLP's first layer."""
    return [
        (make_model("scatter-linear", 10, 0, torch.float64, (27, 4, 4)), (27, 4, 4)),
        (_frozen_except(make_model("cnn", 10, 1, torch.float64), "head.1."), (1, 28, 28)),
        (_frozen_except(make_model("mlp", 10, 2, torch.float64, (5,)), "net.1."), (5,)),
    ]


@pytest.fixture(params=range(3), ids=["scatter-linear", "cnn-middle-linear", "mlp-first-linear"])
def case(request):
    module, shape = _cases()[request.param]
    gen = torch.Generator().manual_seed(7)
    x = torch.rand(N, *shape, generator=gen, dtype=torch.float64) * 2 - 1
    y = torch.randint(0, 10, (N,), generator=gen)
    generic, ghost = FlatModel(module, "torch.func"), FlatModel(module, "ghost")
    flat0 = generic.initial()
    flat1 = flat0 + 0.3 * torch.randn(flat0.shape, generator=gen, dtype=torch.float64)
    return generic, ghost, x, y, flat0, flat1


def test_ghost_gradients_equal_torch_func(case):
    """Losses and per-record gradients (the dense form of the factored rows), with and without a logit offset."""
    generic, ghost, x, y, flat0, flat1 = case
    assert ghost.dim == generic.dim < sum(p.numel() for p in generic.module.parameters()) + 1
    for flat, offset in ((flat0, None), (flat1, torch.linspace(-1, 1, 10, dtype=torch.float64))):
        (la, ga), (lb, gb) = generic.losses_and_grads(flat, x, y, offset), ghost.losses_and_grads(flat, x, y, offset)
        torch.testing.assert_close(lb, la, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(gb, ga, rtol=1e-10, atol=1e-12)
        assert float(ga.abs().max()) > 1e-3
        _, rows = ghost.losses_and_grad_rows(flat, x, y, offset)
        assert isinstance(rows, OuterRows) and rows.shape == (N, generic.dim)


@pytest.mark.parametrize("quantity", ["ce-grad", "dual-x", "class-weighted-grad", "group-weighted-grad",
                                      "group-weighted-grad-wac"])
@pytest.mark.parametrize("clip", [math.inf, 0.05])
def test_ghost_clipped_sums_equal_torch_func(case, quantity, clip):
    """The client's clipped sums (``worker.clipped_total``) of a refresh (one point) and of a difference (two
    points, combined in factored form) are the generic engine's, with the same number of clipped records; at 0.05
    the clip binds on some records. '-wac': group weights after a per-record clip at 0.1 (dro-clip =
    weight-after-clip), kept in factored form by the ghost engine."""
    generic, ghost, x, y, flat0, flat1 = case
    problem = Problem(psi=make_psi("chi2"), lam=0.7, eta_scale=2.0)
    extra = {"class-weighted-grad": tuple(float(v) for v in torch.linspace(0.5, 2.0, 10)),
             "group-weighted-grad": (math.inf, 10, *(float(v) for v in torch.linspace(0.5, 2.0, 20))),
             "group-weighted-grad-wac": (0.1, 10, *(float(v) for v in torch.linspace(0.5, 2.0, 20))),
             }.get(quantity, ())
    fn, rows = QUANTITIES[quantity.removesuffix("-wac")], torch.arange(N)
    for flats, scalars, coefs in (([flat1], [1.2], [1.0]), ([flat1, flat0], [1.0, 0.0], [1.0, -1.0])):
        ta, ca = clipped_total(generic, fn, flats, scalars, coefs, x, y, rows, clip, generic.dim, problem, extra, 4)
        tb, cb = clipped_total(ghost, fn, flats, scalars, coefs, x, y, rows, clip, ghost.dim, problem, extra, 4)
        torch.testing.assert_close(tb, ta, rtol=1e-10, atol=1e-13)
        assert cb == ca and (ca > 0 if math.isfinite(clip) else ca == 0)


def test_ghost_norm_bound_is_a_tight_upper_bound(case):
    """OuterRows.norm_upper_bound >= the exact norm of each dense row (float64), within 1e-10 relative, with a
    factor; a row scaled to the bound has norm <= the bound."""
    generic, ghost, x, y, flat0, flat1 = case
    _, rows = ghost.losses_and_grad_rows(flat1, x, y)
    factor = torch.linspace(-2.0, 3.0, N, dtype=torch.float64)
    weighted = rows.weighted(factor)
    exact = weighted.dense().norm(dim=1)
    bound = weighted.norm_upper_bound()
    assert torch.all(bound >= exact) and torch.all(bound <= exact * (1 + 1e-10))
    total, count = clipped_sum_and_count(weighted, 1e-3)
    assert count == N and float(total.norm()) <= N * 1e-3


def test_ghost_bad_record_contributes_zero(case):
    """A record whose factor is NaN (or infinite) adds nothing and the others are summed as without it."""
    generic, ghost, x, y, flat0, flat1 = case
    _, rows = ghost.losses_and_grad_rows(flat1, x, y)
    factor = torch.ones(N, dtype=torch.float64)
    factor[2], factor[5] = math.nan, math.inf
    total, _ = clipped_sum_and_count(rows.weighted(factor), 0.05)
    keep = torch.ones(N, dtype=torch.bool)
    keep[[2, 5]] = False
    _, dense = generic.losses_and_grads(flat1, x[keep], y[keep])
    expected, _ = clipped_sum_and_count(dense, 0.05)
    assert torch.isfinite(total).all()
    torch.testing.assert_close(total, expected, rtol=1e-10, atol=1e-13)


def test_ghost_refuses_models_it_does_not_fit():
    """All-trainable CNN: refused at construction, naming the engine and what to use; a linear layer called twice
    per forward: refused at the first gradient; the config key lists the engine."""
    with pytest.raises(ValueError, match="per-record engine 'ghost' needs the trainable parameters to be one "
                                         r"nn.Linear layer's weight \(and bias\); this model trains features.0.weight"):
        FlatModel(make_model("cnn", 10, 0), "ghost")

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(self.lin(x))

    model = FlatModel(Twice(), "ghost")
    with pytest.raises(ValueError, match=r"called once per forward on \(B, in\) inputs; it was called 2 time"):
        model.losses_and_grad_rows(model.initial(), torch.zeros(3, 4), torch.zeros(3, dtype=torch.long))
    assert Config.from_mapping({"per-record-engine": "ghost"}).per_record_engine == "ghost"
    with pytest.raises(ConfigError, match="per-record-engine.*'ghost'"):
        Config.from_mapping({"per-record-engine": "vmap"})
