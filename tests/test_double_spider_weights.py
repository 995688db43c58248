"""DP Double-SPIDER's dual variable and DRO weights under clipping (ALGORITHMS.md 3.1).

- eta-clip-rule=weight-bound: with noise 0 and the full batch, eta's fixed point is the exact dual optimum
  (computed non-privately by ``dro_objective`` or an independent bisection), per psi; the fixed clip misses it
  for kl.
- weight-cap: every record's clipped weighted contribution stays within C W_cap, and the releases declare (and
  the run's events record) exactly that sensitivity.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from conftest import PerRecordFromGrads
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import brentq

from dpdro.client.local_transport import LocalTransport
from dpdro.common.config import Config
from dpdro.common.data import ArrayDataset
from dpdro.common.dro import dro_objective
from dpdro.common.per_sample import clip_rows
from dpdro.common.psi import make_psi
from dpdro.common.quantities import QUANTITIES, Problem, dro_weight_bound
from dpdro.server.algorithms import make_algorithm
from dpdro.server.engine import train

DIM = 3


class FixedLosses(PerRecordFromGrads):
    """A model whose per-record losses are fixed and whose loss gradients are the given rows (zeros by
    default): the eta block sees a frozen x."""

    def __init__(self, losses, grads=None) -> None:
        self.l = torch.as_tensor(losses, dtype=torch.float64)
        self.g = torch.zeros(len(losses), DIM, dtype=torch.float64) if grads is None else grads

    def losses(self, flat, x, y, offset=None):
        return self.l.clone()

    def losses_and_grads(self, flat, x, y, offset=None):
        return self.l.clone(), self.g.clone()



def private_cfg(**kw) -> Config:
    values = {"algorithm": "dp-double-spider", "epsilon": 4.0, "lambda": 1.0, "loss-bound": 10.0, "eta-init": 2.0,
              "lr-eta": 0.1, "q": 1, "clip-eta": 1.0}
    values.update(kw)
    return Config.from_mapping(values)


def eta_fixed_point(cfg: Config, losses: np.ndarray, iters: int = 3000) -> float:
    """eta after ``iters`` iterations of the algorithm's own queries and updates, each release the exact
    clipped mean over every record (full batch, noise 0), x frozen (zero loss gradients)."""
    n = len(losses)
    algo = make_algorithm(cfg, n, DIM, 10)
    problem, model = Problem.from_config(cfg), FixedLosses(losses)
    state = algo.init_state(np.zeros(DIM))
    for _ in range(iters):
        released = {}
        for q in algo.queries(state):
            rows = sum(coef * QUANTITIES[q.quantity](model, None, p.scalar, None, None, problem, q.extra)
                       for coef, p in zip(q.point_coefs(), q.points, strict=True))
            released[q.mechanism] = (clip_rows(rows, q.clip).sum(0) / n).numpy()
        state = algo.apply(state, dict(released))
    return state.eta


LOSSES = np.random.default_rng(0).gamma(2.0, 1.0, size=60).clip(0.0, 8.0)  # heavy right tail, all below B = 10


@pytest.mark.parametrize("psi", ["chi2", "kl", "smoothed-cvar"])
@pytest.mark.parametrize("q", [1, 3])
def test_weight_bound_eta_fixed_point_is_the_exact_dual_optimum(psi, q):
    cfg = private_cfg(psi=psi, q=q, **{"eta-clip-rule": "weight-bound", "cvar-alpha": 0.2})
    _, eta_star = dro_objective(LOSSES, make_psi(psi, 0.2), 1.0)
    assert eta_fixed_point(cfg, LOSSES) == pytest.approx(eta_star, abs=1e-6)


def test_fixed_eta_clip_misses_the_kl_dual_optimum():
    """The bias the weight-bound rule removes: clipping G (1 - w) at 1 cuts the high-loss records' pull on eta."""
    _, eta_star = dro_objective(LOSSES, make_psi("kl"), 1.0)
    eta = eta_fixed_point(private_cfg(psi="kl"), LOSSES)
    assert eta_star - eta > 0.5  # 2.89 against 1.95 on these losses


@pytest.mark.parametrize("psi", ["chi2", "kl"])
def test_weight_bound_eta_fixed_point_with_losses_above_the_bound_is_the_clamped_optimum(psi):
    losses = np.concatenate([LOSSES, [12.0, 30.0]])
    cfg = private_cfg(psi=psi, **{"eta-clip-rule": "weight-bound", "loss-bound": 6.0})
    _, eta_star = dro_objective(np.minimum(losses, 6.0), make_psi(psi), 1.0)
    assert eta_fixed_point(cfg, losses) == pytest.approx(eta_star, abs=1e-6)


@pytest.mark.parametrize("psi", ["chi2", "kl"])
def test_capped_weights_eta_fixed_point_solves_mean_capped_weight_one(psi):
    """weight-cap 2.5: the dual optimum of the capped divergence is the root of mean(min(psi*'(l - eta), 2.5)) = 1
    (independent bisection), and the weight-bound clip G max(1, 2.5 - 1) leaves it unbiased."""
    w = make_psi(psi).weight
    cfg = private_cfg(psi=psi, **{"eta-clip-rule": "weight-bound", "weight-cap": 2.5})

    def excess(eta: float) -> float:
        return float(torch.clamp(w(torch.as_tensor(LOSSES - eta)), max=2.5).mean()) - 1.0

    eta_star = brentq(excess, -20.0, 20.0, xtol=1e-12)
    assert eta_fixed_point(cfg, LOSSES) == pytest.approx(eta_star, abs=1e-6)
    assert make_algorithm(cfg, 60, DIM).eta_clip(eta_star - 5.0) == pytest.approx(1.5)


@settings(max_examples=60, deadline=None)
@given(losses=st.lists(st.floats(0.0, 50.0), min_size=1, max_size=8), eta=st.floats(-5.0, 5.0),
       lam=st.floats(0.1, 5.0), scale=st.floats(0.1, 3.0), cap=st.one_of(st.just(math.inf), st.floats(1.01, 5.0)),
       psi=st.sampled_from(["chi2", "kl", "smoothed-cvar", "cvar"]))
def test_eta_rows_never_exceed_the_weight_bound_clip(losses, eta, lam, scale, cap, psi):
    """|G (1 - w)| <= G max(1, W - 1) for every record: the weight-bound clip clips nothing."""
    cfg = private_cfg(psi=psi, **{"lambda": lam, "eta-scale": scale, "loss-bound": 4.0,
                                               "eta-clip-rule": "weight-bound", "weight-cap": cap})
    algo = make_algorithm(cfg, 100, DIM)
    rows = QUANTITIES["dual-eta"](FixedLosses(losses), None, eta, None, None, Problem.from_config(cfg))
    assert float(rows.abs().max()) <= algo.eta_clip(eta) * (1 + 1e-12)


@settings(max_examples=60, deadline=None)
@given(losses=st.lists(st.floats(0.0, 50.0), min_size=1, max_size=8), gscale=st.floats(1e-3, 1e3),
       eta=st.floats(-5.0, 5.0), clip=st.floats(0.05, 5.0), cap=st.floats(1.01, 3.0),
       psi=st.sampled_from(["chi2", "kl", "smoothed-cvar", "cvar"]))
def test_capped_weight_after_clip_rows_stay_within_c_times_cap(losses, gscale, eta, clip, cap, psi):
    grads = torch.randn(len(losses), DIM, generator=torch.Generator().manual_seed(len(losses)),
                        dtype=torch.float64) * gscale
    problem = Problem(make_psi(psi, 0.3), 1.0, 1.0, loss_bound=4.0, clamp_weights=True, weight_cap=cap)
    rows = QUANTITIES["dual-x-wac"](FixedLosses(losses, grads), None, eta, None, None, problem, (clip,))
    assert float(torch.linalg.vector_norm(rows, dim=1).max()) <= clip * cap * (1 + 1e-12)


def test_capped_weights_keep_their_ratios_below_the_cap():
    """chi2, eta 0: weights 1 + l = 1.5, 2.0, 4.0 (the last capped at 2.5); gradients of norm 10 clipped to 1."""
    grads = torch.full((3, DIM), 10.0, dtype=torch.float64)
    problem = Problem(make_psi("chi2"), 1.0, 1.0, loss_bound=4.0, clamp_weights=True, weight_cap=2.5)
    rows = QUANTITIES["dual-x-wac"](FixedLosses([0.5, 1.0, 3.0], grads), None, 0.0, None, None, problem, (1.0,))
    np.testing.assert_allclose(torch.linalg.vector_norm(rows, dim=1).numpy(), [1.5, 2.0, 2.5], rtol=1e-12)


def test_capped_x_refresh_declares_c_times_cap():
    cfg = private_cfg(**{"dro-clip": "weight-after-clip", "loss-bound": 3.0, "lambda": 0.5, "clip-x": 0.7,
                         "weight-cap": 2.5})
    algo = make_algorithm(cfg, 1000, 50, 10)
    state = algo.init_state(np.zeros(50))
    state.stage, state.eta_next = 1, 0.4  # uncapped bound 1 + (3 - 0.4) / 0.5 = 6.2 > 2.5
    [q] = algo.queries(state)
    assert q.quantity == "dual-x-wac" and q.extra == (0.7,) and q.clip == pytest.approx(0.7 * 2.5, rel=1e-12)
    state.eta_next = 2.8  # bound 1.4 < 2.5: the data-free bound W_t itself
    assert algo.queries(state)[0].clip == pytest.approx(0.7 * 1.4, rel=1e-12)
    assert dro_weight_bound(make_psi("chi2"), 0.4, 0.5, 1.0, 3.0, 2.5) == 2.5


def test_run_events_record_the_capped_sensitivity(tmp_path):
    """A private run with weight-after-clip, weight-cap 2 and eta-clip-rule weight-bound: every x-refresh event
    records clip C_x W_t <= C_x W_cap and a noise std z x clip x sqrt(1 + c^2) / N, every eta-refresh event
    G max(1, W_t - 1) at the eta it evaluated."""
    n, k = 24, 10
    g = torch.Generator().manual_seed(0)
    data = ArrayDataset(torch.rand(n, 1, 28, 28, generator=g, dtype=torch.float64), torch.arange(n) % k, k, "tiny")
    cfg = Config.from_mapping({
        "algorithm": "dp-double-spider", "epsilon": 50.0, "delta": 1e-3, "refresh-batch": 12, "diff-batch": 12,
        "num-clients": 2, "dtype": "float64", "reproducible": True, "reproducible-for-testing": True,
        "iterations": 3, "q": 1, "eval-every": 3,
        "dro-clip": "weight-after-clip", "weight-cap": 2.0, "eta-clip-rule": "weight-bound", "clip-x": 0.5,
        "eta-init": 0.0, "loss-bound": 4.0, "out-dir": str(tmp_path / "run"), "seed": 1})
    train(cfg, LocalTransport(cfg, data), data)
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    events = [e for e in events if e.get("mechanism") in ("x-refresh", "eta-refresh")]
    assert {e["mechanism"] for e in events} == {"x-refresh", "eta-refresh"}
    for e in events:
        assert e["noise_std_of_mean"] == pytest.approx(
            e["noise_multiplier"] * e["clip"] * math.sqrt(1 + cfg.clip_count_scale**2) / e["expected_batch"])
        if e["mechanism"] == "x-refresh":
            # chi2, lambda 1, B 4: W_t = 5 - eta_t > 2 while eta_t < 3, so the cap decides
            assert e["clip"] == pytest.approx(0.5 * 2.0, rel=1e-12)
        else:
            assert e["clip"] == pytest.approx(1.0, rel=1e-12)  # G max(1, 2 - 1)


def test_double_spider_honours_the_generic_warmup_in_both_blocks():
    """warmup-iterations 4: iteration 0 moves eta and x by 1/4 of the steps of the same releases without it (the
    engine calls ``advance``; DSS reads lr-eta and lr-x at apply time, so the generic warm-up reaches both)."""
    warm = make_algorithm(private_cfg(**{"warmup-iterations": 4, "lr-x": 2.0, "lr-eta": 0.4}), 100, DIM)
    plain = make_algorithm(private_cfg(**{"lr-x": 0.5, "lr-eta": 0.1}), 100, DIM)
    s_warm, s_plain = warm.init_state(np.zeros(DIM)), plain.init_state(np.zeros(DIM))
    for released in ({"eta-refresh": np.array([-0.7])}, {"x-refresh": np.array([0.3, -0.1, 0.2])}):
        s_warm, s_plain = warm.advance(s_warm, released), plain.apply(s_plain, released)
    assert s_warm.eta == pytest.approx(s_plain.eta, rel=1e-15) and s_warm.eta == pytest.approx(2.0 + 0.07)
    np.testing.assert_allclose(s_warm.x, s_plain.x, rtol=1e-15)
    np.testing.assert_allclose(s_warm.x, [-0.15, 0.05, -0.1], rtol=1e-15)
