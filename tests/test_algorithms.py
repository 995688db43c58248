"""Every algorithm against an independent reference: non-private full-batch runs (rate 1, no clipping, no
noise) must reproduce plain gradient methods computed here with autograd; DP Recursive-Spider's formulas
against autograd of Psi(w); STORM recursion, projections and floors; ledger event structure."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch
from conftest import counting
from hypothesis import given, settings
from hypothesis import strategies as st

from dpdro.client.local_transport import LocalTransport
from dpdro.common.config import Config
from dpdro.common.data import ArrayDataset
from dpdro.common.dro import dual_loss
from dpdro.common.models import make_model
from dpdro.common.per_sample import FlatModel
from dpdro.common.psi import make_psi
from dpdro.common.quantities import Problem, clamped_loss, kl_g, kl_vu
from dpdro.server.algorithms import make_algorithm
from dpdro.server.algorithms.base import warmup_factor
from dpdro.server.algorithms.recursive_spider import RecursiveSpiderState
from dpdro.server.allocation import variance_rule
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
              "out-dir": str(tmp_path / "run"), "lr-x": 0.3, "lr-eta": 0.2, "seed": 3,
              "reproducible-for-testing": True}  # for the callers that set a finite epsilon
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


def test_double_spider_simultaneous_full_batch_is_simultaneous_gradient_descent(tmp_path):
    """block-order=simultaneous: eta and x both at (x_t, eta_t) (ALGORITHMS.md 3.4), one round per iteration
    (the transport is called T times instead of 2 T), and the ledger is the sequential order's."""
    data = tiny_data()
    keys = dict(algorithm="dp-double-spider", psi="chi2", lambda_=1.5, eta_init=0.5, eta_scale=2.0)
    cfg = full_batch_cfg(tmp_path, block_order="simultaneous", **keys)
    model, x = setup_model(cfg, data)
    psi = make_psi("chi2")
    eta = torch.tensor(cfg.eta_init, dtype=torch.float64)
    for _ in range(cfg.iterations):
        xx, e = x.detach().requires_grad_(True), eta.clone().requires_grad_(True)
        gx, ge = torch.autograd.grad(dual_loss(full_losses(model, xx, data), e, psi, 1.5, 2.0).mean(), (xx, e))
        x, eta = x - cfg.lr_x * gx, eta - cfg.lr_eta * ge
    transport = counting(LocalTransport(cfg, data))
    np.testing.assert_allclose(train(cfg, transport, data).params, x.detach().numpy(), rtol=1e-9, atol=1e-11)
    assert transport.calls == [2] * cfg.iterations
    sequential = run(full_batch_cfg(tmp_path / "seq", **keys), data).params
    assert np.abs(sequential - x.detach().numpy()).max() > 1e-6  # the orders differ: the test can tell them apart


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

def psi_kl(model, flat, lam, data, bound, rho, soft=False):
    losses = full_losses(model, flat, data)
    clamped = bound - torch.nn.functional.softplus(bound - losses) if soft else torch.clamp(losses, max=bound)
    g = torch.exp((clamped - bound) / lam)
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


# ---- loss-clamp=soft: losses above B keep their gradient ----

def test_soft_loss_clamp_is_bounded_increasing_and_equals_hard_clamp_well_below_the_bound():
    bound = 10.0
    losses = torch.linspace(0.0, 30.0, 301, dtype=torch.float64, requires_grad=True)
    soft = clamped_loss(losses, bound, soft=True)
    (slope,) = torch.autograd.grad(soft.sum(), losses)
    assert torch.all(soft < bound) and torch.all(torch.diff(soft) > 0)
    assert torch.all(slope > 0) and float(slope[losses.detach() > bound].min()) > 0  # never vanishes beyond B
    g = torch.exp((soft - bound) / 0.5)
    assert torch.all((g > 0) & (g <= 1))  # the sensitivity argument of g~ in (0, 1] holds
    below = losses.detach() <= bound - 10.0
    hard = clamped_loss(losses.detach(), bound)
    torch.testing.assert_close(soft.detach()[below], hard[below], rtol=0, atol=math.exp(-10.0))
    assert float((hard - soft.detach())[losses.detach() > bound].min()) > 0  # the two differ above B


@pytest.mark.parametrize("clamp", ["hard", "soft"])
def test_kl_formulas_equal_autograd_of_psi_with_losses_above_the_bound(clamp):
    """With B at the median loss, half the records are above it: the soft clamp gives them a gradient, the hard
    one zeroes it; both v/u formulas are the exact gradient of their Psi."""
    data = tiny_data(1)
    model = FlatModel(make_model("cnn", K, 0, torch.float64))
    flat = model.initial().clone()
    lam, rho = 0.7, 0.3
    losses = full_losses(model, flat, data).detach()
    ordered = torch.sort(losses).values
    bound = float(ordered[N // 2 - 1] + ordered[N // 2]) / 2  # between two losses: no record exactly at B
    prob = Problem(make_psi("kl"), 1.0, 1.0, loss_bound=bound, u_scale=1.0, soft_clamp=clamp == "soft")
    rows = kl_vu(model, flat, lam, data.x, data.y, prob)
    above = losses > bound
    assert int(above.sum()) >= N // 3
    x_norms = torch.linalg.vector_norm(rows[:, :-1], dim=1)
    if clamp == "soft":
        assert float(x_norms[above].min()) > 0
    else:
        assert float(x_norms[above].max()) == 0.0
    vu, s = rows.mean(0), kl_g(model, flat, lam, data.x, data.y, prob).mean()
    f = flat.clone().requires_grad_(True)
    lt = torch.tensor(lam, dtype=torch.float64, requires_grad=True)
    gx, gl = torch.autograd.grad(psi_kl(model, f, lt, data, bound, rho, soft=clamp == "soft"), (f, lt))
    torch.testing.assert_close(lam * vu[:-1] / s, gx, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(torch.log(s) + rho + lam * vu[-1] / s, gl, rtol=1e-9, atol=1e-12)


# ---- s-clip-units=relative: the STORM term of s in units of s_{t-1} ----

def test_relative_s_release_scales_by_the_previous_s_and_restores_its_units(tmp_path):
    cfg, algo = rs_algo(tmp_path, s_clip_units="relative", beta=0.3, s_min=1e-9, loss_bound=10.0, clip_s=2.0,
                        epsilon=4.0)
    state = algo.init_state(np.zeros(3))
    prior = math.exp((math.log(10) - 10.0) / cfg.lambda_init)  # g~ at the loss log K of a uniform prediction
    assert state.s == pytest.approx(prior, rel=1e-12) and algo.s_prior() == pytest.approx(prior, rel=1e-12)
    s_query = algo.queries(state)[1]
    assert s_query.extra == pytest.approx((1 / prior,), rel=1e-12) and s_query.clip == 2.0
    assert s_query.point_coefs() == (1.0,)
    state = algo.apply(state, {"vu-refresh": np.zeros(4), "s": np.array([0.9])})
    s0 = 0.9 * prior
    assert state.s == pytest.approx(s0, rel=1e-12)
    s_query = algo.queries(state)[1]
    assert s_query.extra == pytest.approx((1 / s0,), rel=1e-12) and s_query.coefs == pytest.approx((1.0, -0.7))
    state = algo.apply(state, {"vu-diff": np.zeros(4), "s": np.array([0.6])})
    assert state.s == pytest.approx(0.7 * s0 + 0.6 * s0, rel=1e-12)
    absolute = make_algorithm(cfg.with_updates({"s-clip-units": "absolute"}), 1000, 3, 10)
    assert absolute.init_state(np.zeros(3)).s == 1.0 and absolute.queries(state)[1].extra == ()


def test_relative_s_query_clips_the_scaled_storm_term_per_record(tmp_path):
    """The released quantity: sum_i clip_C(k (g~_i(w_t) - (1 - beta) g~_i(w_{t-1}))), k = 1 / s_{t-1}."""
    from dpdro.client.worker import ShardWorker
    from dpdro.common.messages import Point, Query

    data = tiny_data(2)
    cfg = Config.from_mapping({"algorithm": "recursive-spider", "reproducible": True,
                               "reproducible-for-testing": True, "dtype": "float64",
                               "loss-bound": 3.0, "s-clip-units": "relative"})
    worker = ShardWorker(cfg, data, 0)
    x0 = worker.model.initial().clone()
    x1 = x0 + 0.05 * torch.randn(x0.shape, generator=torch.Generator().manual_seed(1), dtype=x0.dtype)
    lam, k, clip = 0.8, 7.0, 1.5
    q = Query(1, "s", "kl-g", (Point(1, lam), Point(0, lam)), 1.0, clip, 1, coefs=(1.0, -0.5), extra=(k,))
    reply = worker.answer(q, {1: x1.numpy(), 0: x0.numpy()})

    def g(x):
        return torch.exp((torch.clamp(worker.model.losses(x, worker.x, worker.y), max=3.0) - 3.0) / lam)

    terms = k * (g(x1) - 0.5 * g(x0))
    assert float(terms.abs().max()) > clip > float(terms.abs().min())  # the clip binds for some records only
    assert float(reply.total[0]) == pytest.approx(float(torch.clamp(terms, -clip, clip).sum()), rel=1e-9)


def test_relative_s_units_keep_the_plan_and_weight_s_by_its_effect_on_the_update(tmp_path):
    cfg, rel = rs_algo(tmp_path, s_clip_units="relative", clip_x=2.0, beta=0.5, epsilon=4.0)
    absolute = make_algorithm(cfg.with_updates({"s-clip-units": "absolute"}), 1000, 3, 10)
    assert rel.plan() == absolute.plan() and rel.mechanisms() == absolute.mechanisms()
    storm = 1.0 / (1.0 - 0.25)
    assert absolute.noise_profiles()["s"].weight == pytest.approx(storm)
    assert rel.noise_profiles()["s"].weight == pytest.approx(storm * (1 + 2.0**2))
    rates = {m.name: m.rate for m in rel.mechanisms()}
    z_rel, z_abs = variance_rule(rates, rel.noise_profiles()), variance_rule(rates, absolute.noise_profiles())
    assert (z_rel["s"] / z_rel["vu-refresh"]) / (z_abs["s"] / z_abs["vu-refresh"]) == pytest.approx(5.0**-0.25)


# ---- warmup-iterations: one linear warm-up of every step size ----

def test_warmup_factor_is_linear_then_one():
    assert [warmup_factor(t, 4) for t in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert warmup_factor(0, 0) == 1.0 and warmup_factor(7, 0) == 1.0
    with pytest.raises(ValueError, match="warmup"):
        warmup_factor(0, -1)


def test_warmup_full_batch_dp_sgd_is_gradient_descent_with_warmed_up_steps(tmp_path):
    data = tiny_data()
    cfg = full_batch_cfg(tmp_path, algorithm="dp-sgd", warmup_iterations=3)
    model, x = setup_model(cfg, data)
    for t in range(cfg.iterations):
        x = x.detach().requires_grad_(True)
        (g,) = torch.autograd.grad(full_losses(model, x, data).mean(), x)
        x = x - cfg.lr_x * min(1.0, (t + 1) / 3) * g
    np.testing.assert_allclose(run(cfg, data).params, x.detach().numpy(), rtol=1e-9, atol=1e-11)


def test_warmup_scales_every_step_size_of_an_algorithm_and_restores_its_config(tmp_path):
    cfg, algo = rs_algo(tmp_path, warmup_iterations=4, lr_x=2.0, lr_lambda=0.5, s_min=1e-6)
    _, plain = rs_algo(tmp_path, lr_x=0.5, lr_lambda=0.125, s_min=1e-6)  # the steps of iteration 0: 1/4 of each
    released = {"vu-refresh": np.array([0.1, -0.2, 0.3, 0.05]), "s": np.array([0.4])}
    warmed = algo.advance(algo.init_state(np.zeros(3)), released)
    expected = plain.apply(plain.init_state(np.zeros(3)), released)
    np.testing.assert_allclose(warmed.x, expected.x, rtol=1e-15)
    assert warmed.lam == pytest.approx(expected.lam, rel=1e-15) and warmed.lam != 1.0
    assert algo.cfg is cfg and algo.cfg.lr_x == 2.0
    late = dataclasses.replace(warmed, t=4)
    np.testing.assert_allclose(algo.advance(late, released).x, algo.apply(late, released).x, rtol=0)
