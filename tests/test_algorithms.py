"""Every algorithm against an independent reference: non-private full-batch runs (rate 1, no clipping, no
noise) must reproduce plain gradient methods computed here with autograd; DP Recursive-Spider's formulas
against autograd of Psi(w); STORM recursion, projections and floors; ledger event structure."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dpdro.client.local_transport import LocalTransport
from dpdro.common.config import Config
from dpdro.common.data import ArrayDataset
from dpdro.common.dro import dual_loss
from dpdro.common.models import make_model
from dpdro.common.per_sample import FlatModel
from dpdro.common.psi import make_psi
from dpdro.common.quantities import Problem, kl_g, kl_vu
from dpdro.server.algorithms import make_algorithm
from dpdro.server.algorithms.recursive_spider import RecursiveSpiderState
from dpdro.server.engine import train
from dpdro.server.ledger import epsilon_of

N, K = 24, 10


def tiny_data(seed=0) -> ArrayDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(N, 1, 28, 28, generator=g, dtype=torch.float64) * 2 - 1
    y = torch.arange(N) % K
    return ArrayDataset(x, y, K, "tiny")


def full_batch_cfg(tmp_path, **kw) -> Config:
    values = {"epsilon": "inf", "refresh-batch": N, "diff-batch": N, "s-batch": N, "num-clients": 2,
              "dtype": "float64", "reproducible": True, "iterations": 4, "q": 2, "eval-every": 4,
              "out-dir": str(tmp_path / "run"), "lr-x": 0.3, "lr-eta": 0.2, "seed": 3}
    values.update({k.rstrip("_").replace("_", "-"): v for k, v in kw.items()})
    return Config.from_mapping(values)


def run(cfg, data):
    return train(cfg, LocalTransport(cfg, data), data)


def setup_model(cfg, data):
    model = FlatModel(make_model("cnn", K, cfg.seed, torch.float64))
    return model, model.initial().clone()


def full_losses(model, flat, data):
    return model.losses(flat, data.x, data.y)


def test_dp_sgd_full_batch_is_gradient_descent(tmp_path):
    data = tiny_data()
    cfg = full_batch_cfg(tmp_path, algorithm="dp-sgd")
    model, x = setup_model(cfg, data)
    for _ in range(cfg.iterations):
        x = x.detach().requires_grad_(True)
        (g,) = torch.autograd.grad(full_losses(model, x, data).mean(), x)
        x = x - cfg.lr_x * g
    np.testing.assert_allclose(run(cfg, data).params, x.detach().numpy(), rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("algorithm", ["dp-sgd-dual", "dp-spiderboost"])
@pytest.mark.parametrize("psi", ["chi2", "kl"])
def test_dual_methods_full_batch_are_gradient_descent_on_z(tmp_path, algorithm, psi):
    """Full-batch SpiderBoost telescopes to the exact gradient: both equal GD on z = (x, eta)."""
    data = tiny_data()
    cfg = full_batch_cfg(tmp_path, algorithm=algorithm, psi=psi, lambda_=2.0, eta_init=1.0)
    model, x = setup_model(cfg, data)
    eta = torch.tensor(cfg.eta_init, dtype=torch.float64)
    for _ in range(cfg.iterations):
        x = x.detach().requires_grad_(True)
        eta = eta.detach().requires_grad_(True)
        obj = dual_loss(full_losses(model, x, data), eta, make_psi(psi), cfg.lambda_).mean()
        gx, ge = torch.autograd.grad(obj, (x, eta))
        x, eta = x - cfg.lr_x * gx, eta - cfg.lr_eta * ge
    np.testing.assert_allclose(run(cfg, data).params, x.detach().numpy(), rtol=1e-9, atol=1e-11)


def test_double_spider_full_batch_is_alternating_gradient_descent(tmp_path):
    """eta first at (x_t, eta_t), then x at (x_t, eta_{t+1}) (ALGORITHMS.md 3)."""
    data = tiny_data()
    cfg = full_batch_cfg(tmp_path, algorithm="dp-double-spider", psi="chi2", lambda_=1.5, eta_init=0.5, eta_scale=2.0)
    model, x = setup_model(cfg, data)
    psi = make_psi("chi2")
    eta = torch.tensor(cfg.eta_init, dtype=torch.float64)
    for _ in range(cfg.iterations):
        e = eta.clone().requires_grad_(True)
        (ge,) = torch.autograd.grad(dual_loss(full_losses(model, x, data).detach(), e, psi, 1.5, 2.0).mean(), e)
        eta = eta - cfg.lr_eta * ge
        xx = x.detach().requires_grad_(True)
        (gx,) = torch.autograd.grad(dual_loss(full_losses(model, xx, data), eta, psi, 1.5, 2.0).mean(), xx)
        x = x - cfg.lr_x * gx
    np.testing.assert_allclose(run(cfg, data).params, x.detach().numpy(), rtol=1e-9, atol=1e-11)


def test_dp_sgda_full_batch_matches_reference(tmp_path):
    data = tiny_data()
    cfg = full_batch_cfg(tmp_path, algorithm="dp-sgda", lr_p=0.5, lambda_=0.3, loss_bound=100.0)
    model, x = setup_model(cfg, data)
    p, pi = np.full(K, 1 / K), np.full(K, 1 / K)
    y = data.y.numpy()
    for _ in range(cfg.iterations):
        xx = x.detach().requires_grad_(True)
        losses = full_losses(model, xx, data)
        w = torch.as_tensor(p / pi)[data.y]
        (g,) = torch.autograd.grad((w * losses).mean(), xx)
        lk = np.array([losses.detach().numpy()[y == k].mean() for k in range(K)])
        logits = np.log(p) + cfg.lr_p * (lk - cfg.lambda_ * np.log(K * p))
        p = np.exp(logits - logits.max())
        p /= p.sum()
        pi = 0.9 * pi + 0.1 * np.bincount(y, minlength=K) / N
        x = x.detach() - cfg.lr_x * g
    np.testing.assert_allclose(run(cfg, data).params, x.numpy(), rtol=1e-9, atol=1e-11)


# ---- DP Recursive-Spider ----

def psi_kl(model, flat, lam, data, bound, rho):
    g = torch.exp((torch.clamp(full_losses(model, flat, data), max=bound) - bound) / lam)
    return lam * torch.log(g.mean()) + bound + lam * rho


def test_recursive_spider_gradient_formulas_equal_autograd_of_psi():
    data = tiny_data(1)
    model = FlatModel(make_model("cnn", K, 0, torch.float64))
    flat = model.initial().clone()
    lam, bound, rho = 0.7, 50.0, 0.3
    prob = Problem(make_psi("kl"), 1.0, 1.0, loss_bound=bound, u_scale=1.0)
    vu = kl_vu(model, flat, lam, data.x, data.y, prob).mean(0)
    s = kl_g(model, flat, lam, data.x, data.y, prob).mean()
    v, u = vu[:-1], vu[-1]
    z_x = lam * v / s
    z_lam = torch.log(s) + rho + lam * u / s
    f = flat.clone().requires_grad_(True)
    lt = torch.tensor(lam, dtype=torch.float64, requires_grad=True)
    gx, gl = torch.autograd.grad(psi_kl(model, f, lt, data, bound, rho), (f, lt))
    torch.testing.assert_close(z_x, gx, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(z_lam, gl, rtol=1e-9, atol=1e-12)


def test_b_shift_leaves_psi_and_gradient_unchanged():
    data = tiny_data(2)
    model = FlatModel(make_model("cnn", K, 0, torch.float64))
    flat = model.initial().clone().requires_grad_(True)
    lam, rho = 0.5, 0.2
    losses = full_losses(model, flat, data)
    assert float(losses.detach().max()) < 20.0
    plain = lam * torch.log(torch.exp(losses / lam).mean()) + lam * rho
    outs = [plain] + [psi_kl(model, flat, lam, data, b, rho) for b in (20.0, 60.0)]
    grads = [torch.autograd.grad(o, flat, retain_graph=True)[0] for o in outs]
    for o, g in zip(outs[1:], grads[1:], strict=True):
        torch.testing.assert_close(o, outs[0], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(g, grads[0], rtol=1e-8, atol=1e-12)


def rs_algo(tmp_path, **kw):
    cfg = Config.from_mapping({"algorithm": "recursive-spider", "out-dir": str(tmp_path), "iterations": 20,
                               **{k.rstrip("_").replace("_", "-"): v for k, v in kw.items()}})
    return cfg, make_algorithm(cfg, n=1000, dim=3)


def test_storm_recursion_matches_direct_computation(tmp_path):
    """s_t = m_t + (1 - beta)(s_{t-1} - m'_t), fed with the released combined term m_t - (1 - beta) m'_t."""
    cfg, algo = rs_algo(tmp_path, beta=0.3, s_min=1e-6)
    state = algo.init_state(np.zeros(3))
    rng = np.random.default_rng(0)
    s_direct = None
    for t in range(6):
        m_now, m_prev = rng.uniform(0.2, 0.8, 2)
        if t == 0:
            released_s, s_direct = m_now, m_now
        else:
            released_s = m_now - 0.7 * m_prev
            s_direct = m_now + 0.7 * (s_direct - m_prev)
        vu = np.zeros(4)
        state = algo.apply(state, {"vu-refresh" if t % cfg.q == 0 else "vu-diff": vu, "s": np.array([released_s])})
        assert state.s == pytest.approx(s_direct, rel=1e-12)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(-1e6, 1e6), st.floats(-1e6, 1e6), st.floats(-1e3, 1e3)), min_size=1, max_size=8))
def test_lambda_stays_in_bounds_and_s_above_floor(tmp_path_factory, releases):
    cfg, algo = rs_algo(tmp_path_factory.mktemp("rs"), lambda0=0.2, lambda_max=3.0, lambda_init=1.0, s_min=0.01)
    state: RecursiveSpiderState = algo.init_state(np.zeros(3))
    for t, (v, u, s) in enumerate(releases):
        key = "vu-refresh" if t % cfg.q == 0 else "vu-diff"
        state = algo.apply(state, {key: np.array([v, v, v, u]), "s": np.array([s])})
        assert 0.2 <= state.lam <= 3.0
        assert state.s >= 0.01
        assert np.all(np.isfinite(state.x))


def test_recursive_spider_ledger_events_match_independent_composition(tmp_path):
    data = tiny_data()
    cfg = full_batch_cfg(tmp_path, algorithm="recursive-spider", epsilon=3.0, refresh_batch=12, diff_batch=6,
                         s_batch=8, iterations=5, q=2, delta=1e-5, noise_allocation="ratios")
    result = run(cfg, data)
    events = [json.loads(line) for line in open(tmp_path / "run" / "events.jsonl")]
    assert [(e["iteration"], e["mechanism"]) for e in events] == [
        (t, m) for t in range(5) for m in (("vu-refresh" if t % 2 == 0 else "vu-diff"), "s")]
    counts = {}
    for e in events:
        key = (e["rate"], e["noise_multiplier"])
        counts[key] = counts.get(key, 0) + 1
    assert result.summary["epsilon_spent"] == pytest.approx(epsilon_of(counts, 1e-5), rel=1e-9)
    assert 2.97 <= result.summary["epsilon_spent"] <= 3.0
    z = result.summary["noise_multipliers"]
    assert z["s"] == pytest.approx(cfg.s_noise_ratio * z["vu-refresh"], rel=1e-12)


def test_recursive_spider_reports_lambda_s_and_kl_objective(tmp_path):
    data = tiny_data()
    cfg = full_batch_cfg(tmp_path, algorithm="recursive-spider", rho=0.2, loss_bound=30.0)
    result = run(cfg, data)
    row = result.metrics[-1]
    assert cfg.lambda0 <= row["lambda"] <= cfg.lambda_max and row["s"] >= cfg.s_min
    model = FlatModel(make_model("cnn", K, cfg.seed, torch.float64))
    losses = full_losses(model, torch.as_tensor(result.params), data).detach().numpy()
    lam = row["lambda"]
    expected = lam * math.log(np.mean(np.exp(losses / lam))) + lam * 0.2
    assert row["eval_kl_dro_objective"] == pytest.approx(expected, rel=1e-9)
    assert "lambda" in open(tmp_path / "run" / "metrics.csv").readline()
