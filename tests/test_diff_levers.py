"""The levers of a gradient-difference release (server/algorithms/diff_levers.py): the private quantile of the
difference clip (Andrew et al. 2021) and the STORM estimator for x (Cutkosky & Orabona 2019)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from test_group_dro import cfg_of, kl_double_spider_weights, reference, tiny_data

from dpdro.client.local_transport import LocalTransport
from dpdro.client.worker import ShardWorker
from dpdro.common.codec import query_from_dict, query_to_dict
from dpdro.common.config import ConfigError
from dpdro.common.messages import Point, Query
from dpdro.common.models import make_model
from dpdro.common.per_sample import FlatModel
from dpdro.server.algorithms import diff_levers as levers
from dpdro.server.algorithms import make_algorithm
from dpdro.server.engine import train


@pytest.mark.parametrize("noise", [0.0, 5.0])
def test_private_quantile_converges_to_the_quantile_of_synthetic_norms(noise):
    """Andrew et al.'s geometric update on a noisy count of Poisson-sampled norms (expected batch 2,000, count noise
    std ``noise`` records) settles within 5 % of the target quantile of the norms, from a start 20x too small."""
    rng = np.random.default_rng(0)
    norms = rng.lognormal(mean=1.0, sigma=0.8, size=20_000)
    gamma, lr, rate = 0.7, 0.2, 0.1
    clip, tail = 0.1 * np.exp(1.0) / 10, []
    for step in range(400):
        sample = norms[rng.random(norms.size) < rate]
        fraction = (np.count_nonzero(sample <= clip) + rng.normal(0.0, noise)) / (rate * norms.size)
        clip = levers.next_clip_diff(clip, fraction, gamma, lr)
        if step >= 300:
            tail.append(clip)
    assert np.mean(tail) == pytest.approx(np.quantile(norms, gamma), rel=0.05)


def test_storm_weights_are_spiders_at_zero_and_a_refresh_at_one():
    assert levers.storm_weights(4, 0.0) == (4.0, 2.0)
    assert levers.storm_weights(4, 1.0) == (1.0, 1.0)
    ref, diff = levers.storm_weights(3, 0.5)  # rho = 1/4: refresh 1 + 1/4 + 1/16, differences (1 + 1/4 + 1) / 2
    assert (ref, diff) == pytest.approx((1.3125, 1.125))
    assert levers.storm_clip(0.0, math.inf, 0.2) == 0.2 and levers.storm_clip(0.25, 1.0, 0.2) == pytest.approx(0.4)


def _diff_query(tmp_path, a: float, **kw):
    """The x-diff query of a private group-level dp-double-spider at t = 1 after a step (x-storm-a ``a``)."""
    cfg = cfg_of(tmp_path, algorithm="dp-double-spider", epsilon=4.0, **{"x-estimator": "storm", "x-storm-a": a,
                                                                        "clip-x": 0.5, **kw})
    algo = make_algorithm(cfg, 30, 5, 10)
    state = algo.init_state(np.zeros(5))
    state.pi = np.full(10, 0.1)
    state.t, state.x, state.w_prev = 1, np.full(5, 0.01), np.ones(10)
    return cfg, algo, state


@pytest.mark.parametrize("a", [0.0, 0.3, 1.0])
def test_storm_term_clips_at_a_refresh_plus_one_minus_a_difference(tmp_path, a):
    """a = 0: SPIDER's query (coefs (1, -1), clip C_t); a = 1: the refresh's gradient alone (coefs (1, 0), clip
    C_x); between, S_t = a C_x + (1 - a) C_t."""
    cfg, algo, state = _diff_query(tmp_path, a)
    (q,) = algo.queries(dataclass_stage(state, 1))
    c_t = min(cfg.clip_diff * float(np.linalg.norm(state.x)), cfg.clip_diff_max)
    assert q.mechanism == "x-diff"
    assert q.clip == pytest.approx(a * 0.5 + (1 - a) * c_t)
    assert q.point_coefs() == ((1.0, -1.0) if a == 0 else (1.0, -(1.0 - a)))
    b = algo.apply(dataclass_stage(state, 1), {"x-diff": np.ones(5)}).b
    np.testing.assert_allclose(b, np.ones(5) + (1 - a) * state.b)


def dataclass_stage(state, stage):
    import dataclasses
    return dataclasses.replace(state, stage=stage)


@pytest.mark.parametrize("a", [0.0, 0.5, 1.0])
def test_storm_at_zero_noise_and_full_batch_is_the_exact_gradient(tmp_path, a):
    """Full batch, no noise: d_t = g_t + (1 - a)(d_{t-1} - g'_t) with d_{t-1} = g'_t is g_t for every a (a = 1:
    the plain gradient, a = 0: SPIDER's telescoping), so group-level dp-double-spider with x-estimator=storm makes
    the exact gradient steps of the group KL-DRO."""
    data = tiny_data()
    cfg = cfg_of(tmp_path, algorithm="dp-double-spider", psi="kl", q=3,
                 **{"lambda": 0.7, "x-estimator": "storm", "x-storm-a": a})
    expected = reference(data, cfg, kl_double_spider_weights(cfg), 0.0)
    np.testing.assert_allclose(train(cfg, LocalTransport(cfg, data), data).params, expected, rtol=1e-7, atol=1e-9)


def test_storm_at_zero_is_spiders_recursion_at_the_record_level(tmp_path):
    """Record-level dp-double-spider, private (same seeds, same noise draws): x-storm-a = 0 releases exactly what
    x-estimator=spider releases."""
    data = tiny_data()
    keys = {"algorithm": "dp-double-spider", "dro-level": "record", "epsilon": 8.0, "refresh-batch": 15,
            "diff-batch": 10, "q": 3, "iterations": 4}
    spider = train(cfg_of(tmp_path / "a", **keys), LocalTransport(cfg_of(tmp_path / "a", **keys), data), data)
    storm_cfg = cfg_of(tmp_path / "b", **keys, **{"x-estimator": "storm", "x-storm-a": 0.0})
    storm = train(storm_cfg, LocalTransport(storm_cfg, data), data)
    np.testing.assert_array_equal(storm.params, spider.params)


def test_count_only_query_counts_the_records_under_the_clip_and_travels(tmp_path):
    """A count-only query's reply is the number of records whose difference vector has norm <= clip (sensitivity
    1, one coordinate); the wire form keeps the flag."""
    data = tiny_data()
    cfg = cfg_of(tmp_path, algorithm="dp-double-spider", **{"dro-level": "record"})
    worker = ShardWorker(cfg, data, 0)
    model = FlatModel(make_model("cnn", 10, cfg.seed, torch.float64))
    x0 = model.initial()
    x1 = x0 + 0.01 * torch.randn(x0.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    diffs = model.losses_and_grads(x1, data.x, data.y)[1] - model.losses_and_grads(x0, data.x, data.y)[1]
    norms = diffs.norm(dim=1).numpy()
    threshold = float(np.median(norms))
    q = Query(1, "x-diff-quantile", "ce-grad", (Point(1, 0.0), Point(0, 0.0)), 1.0, threshold, x0.numel(),
              count_only=True)
    assert q.sensitivity == 1.0 and q.out_dim == 1 and query_from_dict(query_to_dict(q)) == q
    reply = worker.answer(q, {1: x1.numpy(), 0: x0.numpy()})
    assert reply.total.shape == (1,)
    assert reply.total[0] == np.count_nonzero(norms <= threshold * (1 - 1e-9))


@pytest.mark.parametrize("level", ["record", "group"])
def test_private_quantile_is_its_own_charged_mechanism(tmp_path, level):
    """clip-diff-rule=private-quantile: one 'x-diff-quantile' count release per difference iteration, in the plan
    and the events at its own multiplier (clip-diff-quantile-noise-ratio x the x releases'), the x-diff clip
    at the capped threshold, epsilon within the target."""
    data = tiny_data()
    cfg = cfg_of(tmp_path, algorithm="dp-double-spider", psi="kl", epsilon=4.0, iterations=6, q=3,
                 **{"dro-level": level, "clip-x": 0.5, "clip-diff": 50.0, "clip-diff-max": 1e3,
                    "clip-diff-rule": "private-quantile", "clip-diff-quantile-noise-ratio": 3.0,
                    "clip-diff-quantile-lr": 1.0, "noise-allocation": "ratios"})
    algo = make_algorithm(cfg, 30, 10, 10)
    assert {m.name: n for m, n in algo.plan().items()}["x-diff-quantile"] == 4
    result = train(cfg, LocalTransport(cfg, data), data)
    events = [json.loads(line) for line in open(tmp_path / "run" / "events.jsonl")]
    quantile = [e for e in events if e["mechanism"] == "x-diff-quantile"]
    diffs = [e for e in events if e["mechanism"] == "x-diff"]
    assert len(quantile) == len(diffs) == 4
    assert [e["iteration"] for e in quantile] == [e["iteration"] for e in diffs]
    assert quantile[0]["noise_multiplier"] == pytest.approx(3.0 * diffs[0]["noise_multiplier"])
    assert result.summary["epsilon_spent"] <= 4.0 + 1e-9
    # C_t = min(C_diff,t Delta_t, C_max) with C_diff,t moved by the released counts: the ratio clip / C_t(fixed)
    # changes within a phase (it is 1 throughout under the fixed rule)
    # the count's threshold is C_diff,t Delta_t, the x-diff clip the same capped at clip-diff-max
    assert [d["clip"] for d in diffs] == pytest.approx([min(q["clip"], 1e3) for q in quantile])


def test_released_fraction_moves_the_difference_clip_geometrically(tmp_path):
    """C_diff,t+1 = C_diff,t exp(-eta_C (b_t - gamma)) from the released fraction b_t, and the next difference
    clips at C_diff,t+1 Delta_t (SPIDER, below the cap)."""
    cfg, algo, state = _diff_query(tmp_path, 0.0, **{"clip-diff-rule": "private-quantile", "clip-diff": 2.0,
                                                     "clip-diff-quantile": 0.5, "clip-diff-quantile-lr": 0.2,
                                                     "clip-diff-max": 1e3})
    diff, count = algo.queries(dataclass_stage(state, 1))
    assert count.count_only and count.mechanism == "x-diff-quantile" and count.clip == pytest.approx(diff.clip)
    assert diff.clip == pytest.approx(2.0 * float(np.linalg.norm(state.x)))
    after = algo.apply(dataclass_stage(state, 1), {"x-diff": np.zeros(5), "x-diff-quantile": np.array([0.9])})
    assert after.clip_diff == pytest.approx(2.0 * math.exp(-0.2 * (0.9 - 0.5)))


def test_levers_are_refused_for_record_level_recursive_spider(tmp_path):
    with pytest.raises(ConfigError, match="x-estimator"):
        cfg_of(tmp_path, algorithm="recursive-spider", **{"dro-level": "record", "x-estimator": "storm"})


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_ghost_norms_of_a_two_point_difference_match_torch_func(bias, dtype):
    """OuterDiffRows (per_sample.py): a linear layer at two points whose inputs differ; the per-record norm of
    a1 g1 h1^T - a2 g2 h2^T from the formula and the clipped sum from two products match torch.func's per-sample
    gradients (the dense rows, float64) to 1e-5, the norm bound never below the exact norm."""
    from torch.func import functional_call, grad, vmap

    from dpdro.common.per_sample import OuterDiffRows, OuterRows, clip_rows, clipped_sum_and_count, combine_outer

    gen = torch.Generator().manual_seed(0)
    n_in, k, b = 40, 7, 33
    layer = torch.nn.Linear(n_in, k, bias=bias).to(torch.float64)
    h1 = torch.randn(b, n_in, generator=gen, dtype=torch.float64)
    h2 = h1 + 0.05 * torch.randn(b, n_in, generator=gen, dtype=torch.float64)  # the input moved with the point
    y = torch.randint(0, k, (b,), generator=gen)
    p1 = {n: p.detach().clone() for n, p in layer.named_parameters()}
    p2 = {n: p + 0.02 * torch.randn(p.shape, generator=gen, dtype=torch.float64) for n, p in p1.items()}

    def per_sample(params, h):
        def loss(prm, hi, yi):
            out = functional_call(layer, prm, (hi.unsqueeze(0),))
            return torch.nn.functional.cross_entropy(out, yi.unsqueeze(0))
        grads = vmap(grad(loss), in_dims=(None, 0, 0))(params, h, y)
        return torch.cat([grads[n].reshape(b, -1) for n in p1], dim=1)

    def outer(params, h):
        logits = functional_call(layer, params, (h,))
        g = torch.softmax(logits, 1) - torch.nn.functional.one_hot(y, k).to(torch.float64)
        return OuterRows(g.to(dtype), h.to(dtype), bias, torch.full((b,), 0.5, dtype=dtype))

    dense = 0.5 * (per_sample(p1, h1) - per_sample(p2, h2))
    rows = combine_outer([outer(p1, h1), outer(p2, h2)], (1.0, -1.0))
    assert isinstance(rows, OuterDiffRows)
    exact = dense.norm(dim=1)
    tol = 1e-5 if dtype == torch.float32 else 1e-9
    np.testing.assert_allclose(rows.norm_upper_bound().numpy(), exact.numpy(), rtol=tol)
    assert bool((rows.norm_upper_bound() >= exact * (1 - 1e-6 if dtype == torch.float32 else 1.0)).all())
    bound = float(exact.median())
    total, clipped = clipped_sum_and_count(rows, bound)
    np.testing.assert_allclose(total.numpy(), clip_rows(dense, bound).sum(0).numpy(), rtol=tol, atol=tol * bound)
    assert clipped == int((rows.norm_upper_bound() > bound).sum()) and 0 < clipped < b
    # the dense form (float32: the cancellation of the two terms' rounding, ~1e-7 absolute)
    np.testing.assert_allclose(torch.cat(rows.blocks, 1).numpy(), dense.numpy(), rtol=tol, atol=1e-6)


def test_estimator_terms_weight_storm_releases_geometrically():
    """simulations/estimator.py: with decay 1 - a the estimate is sum_j decay^(k - j) X_j, so its noise (and
    sampling) terms are weighted by decay^(2 (k - j)); decay 1 is SPIDER's plain sum."""
    from dpdro.simulations.estimator import ReleaseStats, estimate_terms

    def stats(value, z_rate=0.5):
        return ReleaseStats(np.array([value]), 1.0, 0.0, math.nan, 1.0, z_rate, 1, 1.0)

    ref, d1, d2, target = stats(1.0), stats(0.5), stats(0.25), stats(2.0)
    spider = estimate_terms(ref, [d1, d2], target, 100, 2.0, 2.0)
    storm = estimate_terms(ref, [d1, d2], target, 100, 2.0, 2.0, decay=0.5)
    assert spider["clip_bias"] == pytest.approx((1.75 - 2.0) ** 2)
    assert storm["clip_bias"] == pytest.approx((0.25 * 1.0 + 0.5 * 0.5 + 0.25 - 2.0) ** 2)
    one = (2.0 * 1.0 / 50) ** 2  # z S / N for one release
    assert spider["noise"] == pytest.approx(3 * one)
    assert storm["noise"] == pytest.approx((0.0625 + 0.25 + 1.0) * one)
