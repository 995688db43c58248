"""Per-record losses, gradients and DRO dual quantities against torch.autograd on single records (float64),
per-record clipping, and the model validator (ALGORITHMS.md 1.2, 5.3 item 8, 7)."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpdro.client.worker import ShardWorker
from dpdro.common.config import Config
from dpdro.common.data import ArrayDataset
from dpdro.common.dro import dual_loss
from dpdro.common.messages import Point, Query
from dpdro.common.models import GroupNormCNN, ModelError, make_model, validate_model
from dpdro.common.per_sample import FlatModel, clip_rows
from dpdro.common.psi import make_psi
from dpdro.common.quantities import QUANTITIES, Problem, dual_eta, dual_x

B = 6
SEED = 3


@pytest.fixture(scope="module")
def setup():
    module = make_model("cnn", 10, SEED, torch.float64)
    fm = FlatModel(module)
    gen = torch.Generator().manual_seed(123)
    x = torch.rand(B, 1, 28, 28, generator=gen, dtype=torch.float64) * 2 - 1
    y = torch.randint(0, 10, (B,), generator=gen)
    flat0 = fm.initial()
    flat1 = flat0 + 0.05 * torch.randn(flat0.shape, generator=gen, dtype=torch.float64)
    return module, fm, x, y, flat0, flat1


def single_records(module: nn.Module, flat: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
                   eta: float | None = None, problem: Problem | None = None):
    """Reference, one record at a time (Python loop) with plain autograd on an nn.Module copy (no
    torch.func, no FlatModel). Returns stacked (losses (B,), grads of the loss wrt flat params (B, d)) or,
    with eta/problem, (L (B,), grad_x L (B, d), d_eta L (B,))."""
    m = copy.deepcopy(module)
    nn.utils.vector_to_parameters(flat.detach().clone(), m.parameters())
    params = list(m.parameters())
    out = []
    for i in range(x.shape[0]):
        loss = F.cross_entropy(m(x[i].unsqueeze(0)), y[i].unsqueeze(0))
        if problem is None:
            grads = torch.autograd.grad(loss, params)
            out.append((loss.detach(), torch.cat([g.reshape(-1) for g in grads])))
            continue
        eta_t = torch.tensor(eta, dtype=torch.float64, requires_grad=True)
        big_l = dual_loss(loss.reshape(1), eta_t, problem.psi, problem.lam, problem.eta_scale)[0]
        grads = torch.autograd.grad(big_l, params + [eta_t])
        out.append((big_l.detach(), torch.cat([g.reshape(-1) for g in grads[:-1]]), grads[-1].detach()))
    return tuple(torch.stack(parts) for parts in zip(*out, strict=True))


def test_flat_model_layout(setup):
    module, fm, x, y, flat0, _ = setup
    assert fm.dim == sum(p.numel() for p in module.parameters()) == flat0.numel()
    assert 20_000 < fm.dim < 40_000
    assert fm.dtype == torch.float64 and flat0.dtype == torch.float64
    parts = fm.unflatten(flat0)
    for (name, p) in module.named_parameters():
        torch.testing.assert_close(parts[name], p.detach(), rtol=0, atol=0)
    torch.testing.assert_close(fm.logits(flat0, x), module(x).detach(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("point", [0, 1])
def test_losses_and_grads_equal_single_record_autograd(setup, point):
    module, fm, x, y, flat0, flat1 = setup
    flat = (flat0, flat1)[point]
    losses, grads = fm.losses_and_grads(flat, x, y)
    assert losses.shape == (B,) and grads.shape == (B, fm.dim)
    assert grads.dtype == torch.float64
    torch.testing.assert_close(fm.losses(flat, x, y), losses, rtol=1e-12, atol=1e-12)
    ref_l, ref_g = single_records(module, flat, x, y)
    torch.testing.assert_close(losses, ref_l, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grads, ref_g, rtol=1e-9, atol=1e-11)
    assert torch.all(ref_g.norm(dim=1) > 1e-3)  # non-trivial gradients are compared
    # records differ: per-record gradients are not all the same row (no batch mixing)
    assert (grads[0] - grads[1]).norm() > 1e-6


PROBLEMS = [
    ("chi2", 0.1, 0.7, 1.0, 1.5),
    ("chi2", 0.1, 0.2, 2.5, 1.02),  # G eta = 2.55: some records get weight 0, some positive
    ("kl", 0.1, 1.3, 1.0, 2.0),
    ("kl", 0.1, 0.8, 3.0, 0.5),
    ("cvar", 0.3, 1.0, 1.0, 2.2),
    ("smoothed-cvar", 0.2, 0.5, 2.0, 1.1),
]


@pytest.mark.parametrize("name,alpha,lam,g,eta", PROBLEMS)
def test_dual_quantities_equal_autograd(setup, name, alpha, lam, g, eta):
    module, fm, x, y, flat0, _ = setup
    problem = Problem(psi=make_psi(name, alpha), lam=lam, eta_scale=g)
    vx = dual_x(fm, flat0, eta, x, y, problem)
    ve = dual_eta(fm, flat0, eta, x, y, problem)
    assert vx.shape == (B, fm.dim) and ve.shape == (B, 1)
    assert QUANTITIES["dual-x"] is dual_x and QUANTITIES["dual-eta"] is dual_eta
    _, gx, ge = single_records(module, flat0, x, y, eta, problem)
    torch.testing.assert_close(vx, gx, rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(ve[:, 0], ge, rtol=1e-10, atol=1e-12)
    # d/deta L = G (1 - w): the eta-scale factor is there
    li = fm.losses(flat0, x, y)
    w = problem.psi.weight((li - g * eta) / lam)
    torch.testing.assert_close(ve[:, 0], g * (1 - w), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(vx, w[:, None] * fm.losses_and_grads(flat0, x, y)[1], rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("name,alpha,lam,g,eta", [PROBLEMS[0], PROBLEMS[3], PROBLEMS[5]])
def test_difference_equals_difference_of_single_record_autograd(setup, name, alpha, lam, g, eta):
    module, fm, x, y, flat0, flat1 = setup
    problem = Problem(psi=make_psi(name, alpha), lam=lam, eta_scale=g)
    eta0, eta1 = eta, eta + 0.3
    diff_x = dual_x(fm, flat1, eta1, x, y, problem) - dual_x(fm, flat0, eta0, x, y, problem)
    diff_e = dual_eta(fm, flat1, eta1, x, y, problem) - dual_eta(fm, flat0, eta0, x, y, problem)
    _, gx1, ge1 = single_records(module, flat1, x, y, eta1, problem)
    _, gx0, ge0 = single_records(module, flat0, x, y, eta0, problem)
    torch.testing.assert_close(diff_x, gx1 - gx0, rtol=1e-8, atol=1e-11)
    torch.testing.assert_close(diff_e[:, 0], ge1 - ge0, rtol=1e-9, atol=1e-12)
    assert torch.all((gx1 - gx0).norm(dim=1) > 1e-4)


@pytest.mark.parametrize("engine", ["torch.func", "opacus"])
@pytest.mark.parametrize("clip", [math.inf, 0.05])
def test_worker_difference_sum_equals_autograd(setup, clip, engine):
    """ShardWorker.answer of a difference query at rate 1 (every record sampled): the sum over records of
    clip(value at points[0] - value at points[1]), with either per-record gradient engine."""
    module, fm, x, y, flat0, flat1 = setup
    cfg = Config.from_mapping({"dtype": "float64", "seed": SEED, "psi": "chi2", "lambda": 0.7,
                               "eta-scale": 2.0, "reproducible": True, "reproducible-for-testing": True,
                               "chunk-size": 4,
                               "per-record-engine": engine})
    worker = ShardWorker(cfg, ArrayDataset(x, y, 10, "synthetic"), partition=0)
    eta0, eta1 = 1.0, 1.2
    query = Query(iteration=5, mechanism="x-diff", quantity="dual-x",
                  points=(Point(1, eta1), Point(0, eta0)), rate=1.0, clip=clip, dim=fm.dim)
    reply = worker.answer(query, {0: flat0.numpy(), 1: flat1.numpy()})
    assert worker.model.engine == engine
    assert reply.count == B and reply.qid == "5:x-diff" and reply.total.shape == (fm.dim,)
    problem = Problem(psi=make_psi("chi2"), lam=0.7, eta_scale=2.0)
    diffs = (single_records(module, flat1, x, y, eta1, problem)[1]
             - single_records(module, flat0, x, y, eta0, problem)[1])
    if math.isfinite(clip):
        assert torch.all(diffs.norm(dim=1) > clip)  # the clip binds, so this checks the clipping too
        diffs = diffs * (clip / diffs.norm(dim=1, keepdim=True))
    np.testing.assert_allclose(reply.total, diffs.sum(0).numpy(), rtol=1e-8, atol=1e-11)


@pytest.mark.parametrize("engine", ["torch.func", "opacus"])
@pytest.mark.parametrize("clip", [math.inf, 0.05])
def test_worker_refresh_sum_equals_autograd(setup, clip, engine):
    """ShardWorker.answer of a refresh query at rate 1 (one point: the client clips and sums the quantity's row
    blocks, ``quantities.row_blocks``, never forming the (B, d) matrix): the sum over records of clip(w grad_x l)
    with the single-record autograd reference, with either engine, at a clip that binds and at none."""
    module, fm, x, y, flat0, flat1 = setup
    cfg = Config.from_mapping({"dtype": "float64", "seed": SEED, "psi": "chi2", "lambda": 0.7,
                               "eta-scale": 2.0, "reproducible": True, "reproducible-for-testing": True,
                               "chunk-size": 4,
                               "per-record-engine": engine})
    worker = ShardWorker(cfg, ArrayDataset(x, y, 10, "synthetic"), partition=0)
    assert callable(getattr(QUANTITIES["dual-x"], "rows", None))
    query = Query(iteration=4, mechanism="x-refresh", quantity="dual-x", points=(Point(1, 1.2),), rate=1.0,
                  clip=clip, dim=fm.dim)
    reply = worker.answer(query, {1: flat1.numpy()})
    grads = single_records(module, flat1, x, y, 1.2, Problem(psi=make_psi("chi2"), lam=0.7, eta_scale=2.0))[1]
    if math.isfinite(clip):
        assert torch.all(grads.norm(dim=1) > clip)  # the clip binds
        grads = grads * (clip / grads.norm(dim=1, keepdim=True))
    np.testing.assert_allclose(reply.total, grads.sum(0).numpy(), rtol=1e-8, atol=1e-11)


# ---- clip_rows ----

def test_clip_rows_bounds_norms():
    gen = torch.Generator().manual_seed(0)
    scales = torch.logspace(-3, 3, 50, dtype=torch.float64)[:, None]
    v = torch.randn(50, 17, generator=gen, dtype=torch.float64) * scales
    for bound in (1e-6, 0.1, 1.0, 37.0):
        out = clip_rows(v, bound)
        assert out.shape == v.shape
        norms = out.norm(dim=1)
        assert torch.all(norms <= bound + 1e-12)
        big = v.norm(dim=1) > bound
        assert big.any()
        # clipped rows keep their direction and land on the bound
        torch.testing.assert_close(norms[big], torch.full_like(norms[big], bound), rtol=1e-12, atol=0)
        cos = (out[big] * v[big]).sum(1) / (norms[big] * v[big].norm(dim=1))
        torch.testing.assert_close(cos, torch.ones_like(cos), rtol=1e-12, atol=1e-12)
        # rows below the bound are unchanged (bit for bit)
        if (~big).any():
            assert torch.equal(out[~big], v[~big])
    # the input is not modified
    v2 = v.clone()
    clip_rows(v, 0.5)
    assert torch.equal(v, v2)


def test_clip_rows_edge_bounds():
    v = torch.tensor([[3.0, 4.0], [0.0, 0.0], [1e-40, 0.0], [-1e30, 1e30]], dtype=torch.float64)
    zero = clip_rows(v, 0.0)
    assert torch.equal(zero, torch.zeros_like(v))
    assert torch.equal(clip_rows(v, math.inf), v)
    out = clip_rows(v, 1.0)
    assert torch.all(torch.isfinite(out))
    torch.testing.assert_close(out[0], torch.tensor([0.6, 0.8], dtype=torch.float64))
    assert torch.equal(out[1], v[1]) and torch.equal(out[2], v[2])
    assert out[3].norm() == pytest.approx(1.0, rel=1e-12)
    # float32 too
    out32 = clip_rows(v.float(), 2.0)
    assert out32.dtype == torch.float32 and torch.all(out32.norm(dim=1) <= 2.0 * (1 + 1e-6))


# ---- models ----

def test_validate_model_refuses_batchnorm():
    bad = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
    with pytest.raises(ModelError, match="GroupNorm") as info:
        validate_model(bad)
    assert "BatchNorm2d" in str(info.value)
    assert isinstance(info.value, ValueError)
    with pytest.raises(ModelError):
        validate_model(nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)))
    with pytest.raises(ModelError, match="track_running_stats"):
        validate_model(nn.Sequential(nn.Conv2d(1, 4, 3), nn.InstanceNorm2d(4, track_running_stats=True)))
    ok = GroupNormCNN(10)
    assert validate_model(ok) is ok
    ok2 = nn.Sequential(nn.Conv2d(1, 4, 3), nn.InstanceNorm2d(4), nn.LayerNorm(4))
    assert validate_model(ok2) is ok2


def test_make_model_deterministic_in_seed():
    before = torch.random.get_rng_state()
    a = make_model("cnn", 10, 7)
    b = make_model("cnn", 10, 7)
    c = make_model("cnn", 10, 8)
    # the global RNG is left as it was
    assert torch.equal(torch.random.get_rng_state(), before)
    pa, pb, pc = (torch.cat([p.detach().reshape(-1) for p in m.parameters()]) for m in (a, b, c))
    assert torch.equal(pa, pb)
    assert not torch.allclose(pa, pc)
    assert pa.dtype == torch.float32
    d = make_model("cnn", 10, 7, torch.float64)
    pd = torch.cat([p.detach().reshape(-1) for p in d.parameters()])
    assert pd.dtype == torch.float64
    torch.testing.assert_close(pd.float(), pa, rtol=0, atol=0)
    out = a(torch.zeros(2, 1, 28, 28))
    assert out.shape == (2, 10)
    assert make_model("cnn", 3, 7)(torch.zeros(1, 1, 28, 28)).shape == (1, 3)
    with pytest.raises(ValueError, match="allowed"):
        make_model("resnet", 10, 0)


@pytest.mark.parametrize(("name", "shape", "dtype", "tol"), [
    ("cnn", (1, 28, 28), torch.float32, 1e-6), ("cnn32", (3, 32, 32), torch.float32, 1e-6),
    ("cnn", (1, 28, 28), torch.float64, 1e-10), ("mlp", (5,), torch.float64, 1e-12)])
def test_opacus_engine_equals_torch_func(name, shape, dtype, tol):
    """The two per-record gradient engines (per_sample.ENGINES) give the same losses and per-record gradients,
    with and without a logit offset, at two parameter points in a row (the hooked copy is re-pointed)."""
    module = make_model(name, 10, 2, dtype, shape) if name == "mlp" else make_model(name, 10, 2, dtype)
    func, hooks = FlatModel(module, "torch.func"), FlatModel(module, "opacus")
    gen = torch.Generator().manual_seed(1)
    x = (torch.rand(7, *shape, generator=gen, dtype=torch.float64) * 2 - 1).to(dtype)
    y = torch.randint(0, 10, (7,), generator=gen)
    flat0 = func.initial()
    for flat, offset in ((flat0, None), (flat0 + 0.05 * torch.randn(flat0.shape, generator=gen).to(dtype),
                                         torch.linspace(-1, 1, 10, dtype=dtype))):
        (la, ga), (lb, gb) = func.losses_and_grads(flat, x, y, offset), hooks.losses_and_grads(flat, x, y, offset)
        assert ga.shape == gb.shape == (7, func.dim)
        torch.testing.assert_close(lb, la, rtol=tol, atol=tol)
        torch.testing.assert_close(gb, ga, rtol=tol, atol=tol)
        assert float(ga.abs().max()) > 1e-3  # not trivially zero
    with pytest.raises(ValueError, match="per-record engine 'jax'; allowed: 'torch.func', 'opacus', 'ghost'"):
        FlatModel(module, "jax")
