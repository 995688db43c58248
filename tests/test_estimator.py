"""The estimator diagnostics (simulations/estimator.py): exactness at full batch without noise or clipping, the
noise term against its formula, the clipping-bias term at huge and tiny difference clips, the sampling term against
Poisson draws of the clients' own code, and equal-epsilon calibration across q. Tiny synthetic records, the real
CNN, float64."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from dpdro.client.worker import ShardWorker
from dpdro.common.config import Config, ConfigError
from dpdro.common.data import ArrayDataset
from dpdro.common.dro import dual_loss
from dpdro.common.models import make_model
from dpdro.common.per_sample import FlatModel
from dpdro.common.psi import make_psi
from dpdro.server.algorithms import make_algorithm
from dpdro.server.engine import plan_run
from dpdro.server.ledger import Ledger
from dpdro.server.release import sum_rounding_factor
from dpdro.simulations.estimator import (
    DIFF,
    REFRESH,
    check_request,
    diagnose,
    estimate_terms,
    noise_plan,
    phase_mean_variance,
    release_stats,
    release_variance,
    window_variance,
)

N = 40


@pytest.fixture(scope="module")
def records() -> ArrayDataset:
    g = torch.Generator().manual_seed(3)
    return ArrayDataset(torch.rand(N, 1, 28, 28, generator=g) * 2 - 1, torch.arange(N) % 10, 10, "synthetic")


def keys(**over) -> dict:
    base = {"algorithm": "dp-double-spider", "dataset": "mnist-st", "model": "cnn", "dtype": "float64",
            "threads": 1, "iterations": 12, "refresh-batch": N, "diff-batch": N, "lr-x": 0.5, "num-clients": 2}
    return {**base, **{k.replace("_", "-"): v for k, v in over.items()}}


def full_gradient(cfg: Config, data: ArrayDataset, x: np.ndarray, eta: float) -> np.ndarray:
    """grad_x (1/n) sum_i L(x, eta; xi_i) by autograd of the dual loss (common/dro.py), independently of the
    per-record quantities."""
    model = FlatModel(make_model("cnn", 10, cfg.seed, torch.float64, (1, 28, 28)))
    flat = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    losses = model.losses(flat, data.x.double(), data.y)
    loss = dual_loss(losses, eta, make_psi(cfg.psi, cfg.cvar_alpha), cfg.lambda_, cfg.eta_scale).mean()
    return torch.autograd.grad(loss, flat)[0].numpy()


def rows_of(d, block: str, q: int) -> list[dict]:
    return sorted((r for r in d.rows if r["block"] == block and r["q"] == q), key=lambda r: r["t"])


def test_full_batch_without_noise_or_clipping_is_exact(records):
    # epsilon inf: no clip, no noise; every batch is every record (rate 1); the trajectory itself runs at q = 4
    d = diagnose(keys(epsilon=math.inf), records, qs=(1, 4), measure=8, target_records=0, trajectory_q=4)
    for r in d.rows:
        assert r["sampling"] == 0.0 and r["noise"] == 0.0
        assert r["mse"] <= 1e-20 * r["target_sq"], r
    assert {r["kind"] for r in rows_of(d, "x", 4)} == {REFRESH, DIFF}
    # the product's own SPIDER estimate b_t (refreshes at t = 0, 4, differences between) is the exact gradient
    cfg = Config.from_mapping(keys(epsilon=math.inf))
    after = [s for s in d.trajectory.states if s.stage == 0 and s.t > 0]
    assert len(after) == 7
    for s in after:  # b_{t-1} was evaluated at (x_{t-1}, eta_t)
        exact = full_gradient(cfg, records, s.x_prev, s.eta)
        np.testing.assert_allclose(s.b, exact, rtol=1e-9, atol=1e-12 * np.abs(exact).max())


def test_noise_term_is_the_analytic_value(records):
    d = diagnose(keys(epsilon=2.0), records, qs=(1, 4), measure=8, target_records=0)
    cfg = Config.from_mapping(keys(epsilon=2.0))
    noise, _ = noise_plan(Config.from_mapping(keys(epsilon=2.0, q=4)), N, d.trajectory.dim, 10, 0, d.trajectory.delta)
    scale = math.sqrt(1.0 + cfg.clip_count_scale**2) * sum_rounding_factor(N)
    rows = rows_of(d, "x", 4)
    clip = {r["t"]: r["clip"] for r in rows}
    assert all(clip[t] == cfg.clip_x for t in (0, 4))
    for r in rows:
        t0 = r["t"] - r["t"] % 4
        std = [noise["x-refresh"] * clip[t0] * scale / N] + [noise["x-diff"] * clip[k] * scale / N
                                                           for k in range(t0 + 1, r["t"] + 1)]
        assert r["noise"] == pytest.approx(d.trajectory.dim * sum(s**2 for s in std), rel=1e-12)
    assert rows[1]["noise"] > rows[0]["noise"] > 0
    # the window (W = 4 iterations): at q = 1 the per-release variance / W, averaged over the iterations
    q1 = rows_of(d, "x", 1)
    summary = {r["q"]: r for r in d.summary if r["block"] == "x"}
    assert summary[1]["window_var"] == pytest.approx(np.mean([r["noise"] + r["sampling"] for r in q1]) / 4)
    assert summary[1]["window_vs_q1"] == 1.0
    assert summary[4]["window_vs_q1"] == pytest.approx(summary[4]["window_var"] / summary[1]["window_var"])


def _stats(noise_var: float, sampling_var: float, n: int = 100) -> tuple:
    """(ReleaseStats, z) of one coordinate whose release has the given noise and sampling variances (rate 1/2)."""
    from dpdro.simulations.estimator import ReleaseStats

    rate = 0.5
    mean_sq = sampling_var * rate * n / (1 - rate)
    return ReleaseStats(np.zeros(1), mean_sq, 0.0, math.nan, 1.0, rate, 1, 1.0), math.sqrt(noise_var) * rate * n


def test_window_variance_counts_how_often_each_release_is_reused():
    """A refresh R (variance a) and a difference D (variance b) in a phase of q = 2: the mean of the phase's two
    estimates R and R + D is R + D/2, variance a + b/4; with STORM's decay 0.5 the estimates are R and 0.5 R + D,
    mean 0.75 R + 0.5 D. Fresh releases every iteration (q = 1) average: the window of 2 halves the variance."""
    refresh, diff = _stats(3.0, 1.0), _stats(0.5, 0.3)
    assert sum(release_variance(*refresh, 100)) == pytest.approx(4.0)
    assert phase_mean_variance([refresh, diff], 100) == pytest.approx(4.0 + 0.8 / 4)
    assert phase_mean_variance([refresh, diff], 100, decay=0.5) == pytest.approx(0.75**2 * 4.0 + 0.25 * 0.8)
    assert window_variance([phase_mean_variance([refresh], 100)] * 2, q=1, window=2) == pytest.approx(2.0)
    assert window_variance([4.2], q=2, window=2) == pytest.approx(4.2)
    assert math.isnan(window_variance([], q=4, window=4))


def test_clip_bias_vanishes_with_huge_clips_and_is_the_cut_with_tiny_ones(records):
    # tiny steps keep the trajectory finite under the noise of a clip-x of 1e6
    common = {"epsilon": 2.0, "clip-x": 1e6, "clip-eta": 1e6, "lr-x": 1e-8, "lr-eta": 1e-3}
    huge = diagnose(keys(**common, clip_diff=1e6, clip_diff_max=1e6), records, qs=(1, 4), measure=8,
                    target_records=0)
    for r in huge.rows:
        assert r["clip_bias"] <= 1e-20 * r["target_sq"], r
        assert r["kind"] == REFRESH or r["clip_fraction"] == 0.0
    tiny = diagnose(keys(**common, clip_diff=1e-6, clip_diff_max=1e-6), records, qs=(1, 4), measure=8,
                    target_records=0)
    assert all(r["clip_bias"] == 0.0 for r in rows_of(tiny, "x", 1))
    cfg = Config.from_mapping(keys(**common))
    stage1 = {s.t: s for s in tiny.trajectory.states if s.stage == 1}
    grads = {t: full_gradient(cfg, records, s.x, s.eta_next) for t, s in stage1.items()}
    for r in rows_of(tiny, "x", 4):
        t0 = r["t"] - r["t"] % 4
        if r["t"] == t0:
            assert r["clip_bias"] == 0.0
            continue
        assert r["clip_fraction"] == 1.0 and r["clip_ratio"] > 1e3
        # the differences are cut to norm <= 1e-6: the estimate stays at the refresh, its bias the gradient's change
        drift = float(np.sum((grads[r["t"]] - grads[t0]) ** 2))
        assert r["clip_bias"] == pytest.approx(drift, rel=1e-3)
        assert r["clip_bias"] > 0


def test_sampling_term_matches_poisson_draws_of_the_client(records):
    cfg = Config.from_mapping({**keys(epsilon=2.0), "reproducible": True, "reproducible-for-testing": True})
    d = diagnose(keys(epsilon=2.0), records, qs=(1,), measure=2, target_records=0)
    state = d.trajectory.states[-1]
    query = dataclasses.replace(d.trajectory.algo.queries(state)[0], rate=0.3)
    versions = d.trajectory.algo.versions(state)
    worker = ShardWorker(cfg, records, 0)
    stats = release_stats(worker, query, versions, sensitivity=1.0)
    whole = worker.answer(dataclasses.replace(query, rate=1.0), versions).total / N  # the clients' own sum
    np.testing.assert_allclose(stats.mean, whole, rtol=1e-12, atol=1e-15)
    draws = np.array([worker.answer(dataclasses.replace(query, iteration=i), versions).total / (0.3 * N)
                      for i in range(400)])
    empirical = float(np.mean(np.sum((draws - stats.mean) ** 2, axis=1)))
    terms = estimate_terms(stats, [], stats, N, 0.0, 0.0)  # a refresh alone: no noise, no bias
    assert terms["sampling"] == pytest.approx(empirical, rel=0.2)
    assert terms["mse"] == terms["sampling"] and terms["clip_bias"] == 0.0


def test_equal_epsilon_for_every_q():
    n, dim, delta = 30018, 26106, 1 / (10 * 30018)
    spent = {}
    for q in (1, 2, 4, 8, 16):
        cfg = Config.from_mapping(keys(epsilon=1.0, q=q, iterations=64, refresh_batch=2048, diff_batch=1024))
        noise, eps = noise_plan(cfg, n, dim, 10, 0, delta)
        # a ledger of the product's plan at those multipliers, charged with every planned release, spends the same
        plan, _, _ = plan_run(cfg, make_algorithm(cfg, n, dim, 10), n, delta)
        ledger = Ledger(plan, noise, 1.0, delta)
        for m, count in plan.items():
            for _ in range(count):
                ledger.charge(m.name, m.rate)
        assert ledger.epsilon_spent() == pytest.approx(eps, rel=1e-9)
        assert 0.99 <= eps <= 1.0
        spent[q] = (eps, noise["x-refresh"], noise["x-diff"])
    assert spent[1][1] != spent[16][1]  # each q is calibrated for its own plan


def test_group_level_blocks(records):
    d = diagnose(keys(epsilon=2.0, dro_level="group", posthoc_tau=0.0), records, qs=(1, 2), measure=4,
                 target_records=20)
    assert {r["block"] for r in d.rows} == {"group", "x"}
    assert d.facts["target_records"] == 20
    for r in d.rows:
        assert all(r[k] >= 0 and math.isfinite(r[k]) for k in ("mse", "sampling", "noise", "clip_bias"))
        assert r["mse"] == pytest.approx(r["sampling"] + r["noise"] + r["clip_bias"])
        if r["q"] == 1:
            assert r["clip_bias"] == 0.0


@pytest.mark.parametrize(("args", "word"), [
    ({"qs": ()}, "q"), ({"qs": (1, 0)}, "q"), ({"skip": 3, "qs": (1, 2, 4)}, "skip"), ({"measure": 0}, "measure"),
    ({"skip": 16, "measure": 16}, "iterations"), ({"target_records": -1}, "target-records"),
])
def test_bad_requests_are_refused_naming_the_argument(args, word):
    cfg = Config.from_mapping(keys(epsilon=2.0, iterations=24))
    request = {"qs": (1, 2), "measure": 8, "skip": 0, "target_records": 10, "trajectory_q": 1, **args}
    with pytest.raises(ValueError, match=word):
        check_request(cfg, **request)


def test_a_method_without_differences_is_refused(records):
    with pytest.raises(ConfigError, match="algorithm"):
        diagnose({**keys(epsilon=2.0), "algorithm": "dp-sgd"}, records, qs=(1,), measure=2)
