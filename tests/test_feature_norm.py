"""feature-norm=private (common/feature_norm.py, models.ScatterNorm, the 'feature-moments' setup release): the
moments and statistics against closed forms, the layer before and after its statistics are fixed, old model files,
the release charged and exact without noise, the statistics reaching the nodes, and the refusals before any work."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn

from dpdro.common.codec import query_from_dict, query_to_dict
from dpdro.common.config import Config, ConfigError
from dpdro.common.data import ArrayDataset
from dpdro.common.feature_norm import EPS, apply_stats, channel_moments, stats_from_moments
from dpdro.common.messages import Point, Query
from dpdro.common.models import ScatterNorm, make_model

SHAPE = (81, 7, 7)


def test_moments_and_statistics_follow_their_closed_forms():
    x = torch.arange(2 * 2 * 2 * 2, dtype=torch.float64).reshape(2, 2, 2, 2)  # 2 records, 2 channels, 2x2
    assert torch.equal(channel_moments(x)[0], torch.tensor([1.5, 5.5, 3.5, 31.5], dtype=torch.float64))
    stats = stats_from_moments(np.array([1.0, 2.0, 5.0, 3.0]))  # var 4 and -1 (noise): the second clamps to 0
    assert stats == pytest.approx((1.0, 2.0, 1 / np.sqrt(4 + EPS), 1 / np.sqrt(EPS)), rel=1e-12)
    with pytest.raises(ValueError, match="expected \\(2C,\\)"):
        stats_from_moments(np.zeros(3))


def test_the_layer_is_groupnorm_until_fixed_and_old_model_files_load():
    layer = ScatterNorm(81)
    x = torch.randn(3, *SHAPE, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(layer(x), nn.GroupNorm(27, 81, affine=False)(x), atol=1e-6)
    mean, inv_std = torch.linspace(-1, 1, 81), torch.linspace(0.5, 2, 81)
    model = make_model("scatter-linear", 10, 0, input_shape=SHAPE)
    apply_stats(model, tuple(torch.cat([mean, inv_std]).tolist()))
    assert torch.allclose(model.norm(x), (x - mean.view(1, -1, 1, 1)) * inv_std.view(1, -1, 1, 1), atol=1e-6)
    # a state dict saved before the buffers existed (GroupNorm) loads strictly, with GroupNorm's behaviour
    fresh = make_model("scatter-linear", 10, 0, input_shape=SHAPE)
    fresh.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("norm.")}, strict=True)
    assert not bool(fresh.norm.fixed) and torch.allclose(fresh.norm(x), layer(x), atol=1e-6)
    fresh.load_state_dict(model.state_dict())  # a model file with statistics predicts with them
    assert torch.equal(fresh(x), model(x))
    with pytest.raises(ValueError, match="no ScatterNorm"):
        apply_stats(nn.Linear(2, 2), (0.0, 1.0))
    with pytest.raises(ValueError, match="statistics of 2 channels for a layer of 81"):
        apply_stats(model, (0.0, 0.0, 1.0, 1.0))


def _features(n: int, seed: int) -> ArrayDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, *SHAPE, generator=g, dtype=torch.float64) * torch.linspace(0.1, 2, 81).view(1, -1, 1, 1)
    return ArrayDataset(x, torch.arange(n) % 10, 10, "scattered")


def _cfg(tmp_path, **keys) -> Config:
    return Config.from_mapping({"dataset": "mnist-st", "features": "scatternet", "model": "scatter-linear",
                                "algorithm": "dp-sgd", "iterations": 2, "eval-every": 2, "refresh-batch": 40,
                                "num-clients": 2, "dtype": "float64", "feature-norm": "private",
                                "out-dir": str(tmp_path / "run"), "reproducible": True,
                                "reproducible-for-testing": True, **keys})


def test_without_noise_the_released_statistics_are_the_training_records_and_reach_the_model_file(tmp_path):
    from dpdro.client.local_transport import LocalTransport
    from dpdro.server.engine import train
    from dpdro.server.model_files import load_model

    train_set, test_set = _features(120, 0), _features(40, 1)
    cfg = _cfg(tmp_path, epsilon="inf")
    train(cfg, LocalTransport(cfg, train_set), test_set)
    model, _ = load_model(tmp_path / "run")
    x = train_set.x
    mean = x.mean(dim=(0, 2, 3))
    var = (x * x).mean(dim=(0, 2, 3)) - mean * mean
    assert bool(model.norm.fixed)
    assert torch.allclose(model.norm.mean, mean, rtol=1e-10)
    assert torch.allclose(model.norm.inv_std, 1 / torch.sqrt(var + EPS), rtol=1e-8)


def test_the_private_release_is_charged_at_its_fixed_multiplier(tmp_path):
    from dpdro.client.local_transport import LocalTransport
    from dpdro.server.engine import train

    train_set = _features(200, 0)
    cfg = _cfg(tmp_path, epsilon=8.0, **{"feature-norm-noise-multiplier": 6.0, "feature-norm-clip": 0.5})
    summary = train(cfg, LocalTransport(cfg, train_set), _features(40, 1)).summary
    events = [json.loads(line) for line in open(tmp_path / "run" / "events.jsonl")]
    [moments] = [e for e in events if e["mechanism"] == "feature-moments"]
    assert moments["noise_multiplier"] == 6.0 and moments["clip"] == 0.5 and moments["phase"] == "setup"
    assert summary["noise_multipliers"]["feature-moments"] == 6.0 and 0.99 * 8 <= summary["epsilon_spent"] <= 8


def test_a_node_normalises_with_the_statistics_its_query_carries(tmp_path):
    from dpdro.client.worker import ShardWorker

    worker = ShardWorker(_cfg(tmp_path), _features(20, 0), 0)
    x0 = worker.model.initial()
    stats = tuple(torch.cat([torch.full((81,), 0.5), torch.full((81,), 3.0)]).tolist())
    query = Query(0, "grad", "ce-grad", (Point(0, 0.0),), 1.0, 1e6, x0.numel(), feature_norm=stats)
    assert query_from_dict(query_to_dict(query)) == query
    plain = worker.answer(Query(0, "grad", "ce-grad", (Point(0, 0.0),), 1.0, 1e6, x0.numel()), {0: x0.numpy()})
    fixed = worker.answer(query, {0: x0.numpy()})
    assert bool(worker.model.module.norm.fixed) and not np.allclose(plain.total, fixed.total)
    expected = make_model("scatter-linear", 10, worker.cfg.seed, torch.float64, SHAPE)
    apply_stats(expected, stats)
    logits = expected(worker.x)
    loss = nn.functional.cross_entropy(logits, worker.y, reduction="sum")
    grads = torch.autograd.grad(loss, [p for p in expected.parameters()])
    assert np.allclose(fixed.total, torch.cat([g.reshape(-1) for g in grads]).numpy(), rtol=1e-9, atol=1e-12)


def test_private_statistics_without_a_place_to_go_are_refused_before_any_work():
    from dpdro.server.run_plan import plan_training

    with pytest.raises(ConfigError, match="'feature-norm': got 'private' with features='none'"):
        Config.from_mapping({"feature-norm": "private"})
    cfg = Config.from_mapping({"features": "scatternet", "model": "scatter-linear", "feature-norm": "private",
                               "epsilon": "inf", "iterations": 2})
    with pytest.raises(ConfigError, match="no ScatterNorm input layer"):
        plan_training(cfg, 100, 10, 0, SHAPE, module=nn.Sequential(nn.Flatten(), nn.Linear(81 * 49, 10)))
