"""Correctness of the performance work, no timing assertions: torch.func per-record gradients of
the larger models equal single-record autograd, chunked sums equal unchunked ones, the clipped sum equals
clip-then-sum, the ResNet20 is GroupNorm-only, and a tiny ``dpdro lab bench`` run yields every ratio as a finite
number and writes its document."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpdro.client.worker import clipped_total
from dpdro.common.models import GroupNormCNN, make_model
from dpdro.common.per_sample import FlatModel, clip_rows, clipped_sum
from dpdro.common.psi import make_psi
from dpdro.common.quantities import QUANTITIES, Problem


def _data(shape, b, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand(b, *shape, generator=gen, dtype=torch.float64) * 2 - 1
    y = torch.randint(0, 10, (b,), generator=gen)
    return x, y


@pytest.mark.parametrize(("name", "shape"), [("resnet20", (3, 32, 32)), ("cnn32", (3, 32, 32)),
                                             ("cnn64", (3, 64, 64))])
def test_torch_func_per_record_gradients_equal_single_record_autograd(name, shape):
    module = make_model(name, 10, 2, torch.float64)
    fm = FlatModel(module)
    x, y = _data(shape, 3, seed=4)
    _, g = fm.losses_and_grads(fm.initial(), x, y)
    params = list(module.parameters())
    for i in range(3):
        loss = F.cross_entropy(module(x[i:i + 1]), y[i:i + 1])
        ref = torch.cat([t.reshape(-1) for t in torch.autograd.grad(loss, params)])
        torch.testing.assert_close(g[i], ref, rtol=1e-9, atol=1e-11)
    assert float(g.abs().max()) > 1e-4  # not trivially zero


def test_clipped_sum_equals_clip_then_sum():
    gen = torch.Generator().manual_seed(0)
    v = torch.randn(7, 5, generator=gen, dtype=torch.float64) * torch.tensor([0.1, 1, 3, 10, 0.5, 2, 0.01],
                                                                             dtype=torch.float64)[:, None]
    for bound in (0.0, 0.3, 1.0, 100.0, math.inf):
        torch.testing.assert_close(clipped_sum(v, bound), clip_rows(v, bound).sum(0), rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("coefs", [(1.0,), (1.0, -1.0), (1.0, -0.5)])
def test_chunked_total_equals_unchunked_and_reference(coefs):
    module = GroupNormCNN().double()
    fm = FlatModel(module)
    x, y = _data((1, 28, 28), 11)
    flat0 = fm.initial()
    flats = [flat0 + 0.02 * j * torch.ones_like(flat0) for j in range(len(coefs))]
    problem = Problem(psi=make_psi("chi2", 0.1), lam=1.0, eta_scale=1.0)
    rows = torch.tensor([0, 2, 3, 5, 6, 7, 9, 10])
    fn = QUANTITIES["dual-x"]
    scalars = [0.1 * (j + 1) for j in range(len(coefs))]
    full, clipped = clipped_total(fm, fn, flats, scalars, coefs, x, y, rows, 0.05, fm.dim, problem, (),
                                  chunk_size=1000)
    ref_v = sum(c * fn(fm, f, s, x[rows], y[rows], problem) for c, f, s in zip(coefs, flats, scalars, strict=True))
    ref = clip_rows(ref_v, 0.05).sum(0)
    torch.testing.assert_close(full, ref, rtol=1e-10, atol=1e-12)
    assert clipped == int((torch.linalg.vector_norm(ref_v, dim=1) > 0.05).sum())
    for chunk in (1, 3, 8):
        part, n = clipped_total(fm, fn, flats, scalars, coefs, x, y, rows, 0.05, fm.dim, problem, (), chunk_size=chunk)
        torch.testing.assert_close(part, full, rtol=1e-10, atol=1e-12)
        assert n == clipped
    assert full.dtype == torch.float64 and float(full.norm()) <= 0.05 * len(rows) + 1e-12
    empty, none = clipped_total(fm, fn, flats, scalars, coefs, x, y, rows[:0], 0.05, fm.dim, problem, (),
                                chunk_size=4)
    assert torch.count_nonzero(empty) == 0 and none == 0


def test_resnet20_is_groupnorm_and_deterministic():
    a, b = make_model("resnet20", 10, 3), make_model("resnet20", 10, 3)
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in a.modules())
    assert sum(isinstance(m, nn.GroupNorm) for m in a.modules()) == 21
    assert 250_000 < sum(p.numel() for p in a.parameters()) < 300_000
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)
    assert a(torch.zeros(2, 3, 32, 32)).shape == (2, 10)
    cnn = make_model("cnn", 10, 3)
    ref = copy.deepcopy(cnn)
    torch.manual_seed(3)
    fresh = GroupNormCNN(10)
    for p, q in zip(fresh.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q)  # 'cnn' unchanged: same initialisation as the class under the seed


def test_cifar10_st_defaults_to_the_cpu_cnn_and_the_paper_profile_to_resnet20(tmp_path):
    from dpdro.common.models import resolve_model
    from dpdro.simulations.sweep import PROFILES, plan_runs

    cnn32 = make_model(resolve_model("auto", "cifar10-st"), 10, 0)
    assert type(cnn32).__name__ == "GroupNormCNN32"
    assert sum(p.numel() for p in cnn32.parameters()) == 34_058
    assert sum(isinstance(m, nn.GroupNorm) for m in cnn32.modules()) == 3
    assert cnn32(torch.zeros(2, 3, 32, 32)).shape == (2, 10)
    paper = plan_runs(PROFILES["paper"], tmp_path, ["cifar10-st"], algorithms=["dp-sgd"], epsilons=[4.0])
    assert {c.model for c in paper} == {"resnet20"}


def test_tiny_bench_run_has_every_ratio(tmp_path):
    from dpdro.simulations.bench import BenchOptions, ratio_rows, run_bench

    doc = tmp_path / "PERF.md"
    res = run_bench(BenchOptions(quick=True, batch=16, chunk_size=8, repeats=2, flower=False, doc=str(doc),
                                 sweep=[("cnn", 16, 8), ("resnet20", 4, 2)]), log=lambda s: None)
    rows = {k: v for k, _, v, _, _ in ratio_rows(res)}
    assert set(rows) == {"a", "b", "c", "c-torch.func", "c-opacus", "e", "g"}
    assert rows["c"] == min(rows["c-torch.func"], rows["c-opacus"])  # (c) is the faster engine's
    assert 0 < rows["g"] < math.inf  # secure-noise's step time over PCG64's
    assert res["steps"]["chosen_engine"] in ("torch.func", "opacus")
    for k, v in rows.items():
        assert math.isfinite(v) and v > 0, (k, v)
    assert res["ledger"]["releases"] == 10_000 and math.isfinite(res["ledger"]["epsilon"])
    assert [(r["model"], r["batch"], r["chunk"]) for r in res["sweep"]] == [("cnn", 16, 8), ("resnet20", 4, 2)]
    assert all(np.isfinite([r["seconds"], r["peak_mib"]]).all() for r in res["sweep"])
    text = doc.read_text()
    for key in ("(a)", "(b)", "(c)", "(c-opacus)", "(e)", "not measured here", "Versions:", "per-record-engine="):
        assert key in text
    assert doc.with_suffix(".json").exists()


@pytest.mark.flower
def test_fedavg_floor_runs_flowers_own_fedavg_on_the_simulation(tmp_path):
    """(d)'s floor: Flower's FedAvg app on the same simulation engine gives one positive duration per round
    (through launch.simulate.run_app, which also runs dpdro's own simulations)."""
    from dpdro.simulations.bench import fedavg_simulation_rounds

    rounds = fedavg_simulation_rounds(2, 3, tmp_path / "fedavg.json", dim=10)
    assert len(rounds) == 3 and all(0.0 < r < 120.0 for r in rounds), rounds
