"""A node's local SGD under privacy-unit=node (config key local-epochs; client/local_steps.py, ALGORITHMS.md 5.9):
the update against closed forms, the reply's bound (the release's sensitivity), which releases carry local steps, the
wire form, and the combinations refused before any work."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dpdro.client.local_steps import local_update
from dpdro.client.worker import ShardWorker
from dpdro.common.codec import query_from_dict, query_to_dict
from dpdro.common.config import Config, ConfigError
from dpdro.common.data import ArrayDataset
from dpdro.common.messages import Point, Query

N, K = 24, 10


def _quadratic(targets: torch.Tensor):
    """grad_sum of f_i(x) = ||x - a_i||^2 / 2 (gradient x - a_i) over the rows asked."""
    return lambda x, rows: (x.unsqueeze(0) - targets[torch.as_tensor(rows)]).sum(0)


def test_one_full_batch_epoch_is_one_gradient_step_and_epochs_compose():
    a = torch.randn(7, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    x0 = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    rng = np.random.default_rng(0)
    # one step on the mean gradient x0 - mean(a): the update x0 - x1 is lr (x0 - mean(a))
    one = local_update(x0, 7, _quadratic(a), 1, 0.3, 7, rng)
    assert torch.allclose(one, 0.3 * (x0 - a.mean(0)), rtol=1e-12)
    # three full-batch epochs contract the distance to mean(a) by (1 - lr)^3
    three = local_update(x0, 7, _quadratic(a), 3, 0.3, 100, rng)
    assert torch.allclose(three, (1 - 0.7 ** 3) * (x0 - a.mean(0)), rtol=1e-12)
    # batches of 2 over 7 records: 4 steps per epoch (the last of 1 record), every record visited once an epoch
    seen = []
    local_update(x0, 7, lambda x, rows: seen.append(sorted(rows.tolist())) or torch.zeros(3, dtype=torch.float64),
                 1, 0.3, 2, rng)
    assert [len(r) for r in seen] == [2, 2, 2, 1] and sorted(sum(seen, [])) == list(range(7))


def test_a_node_without_records_sends_zero_and_bad_values_are_refused():
    x0 = torch.ones(4, dtype=torch.float64)
    assert torch.equal(local_update(x0, 0, lambda x, rows: 1 / 0, 2, 0.1, 4, np.random.default_rng(0)),
                       torch.zeros(4, dtype=torch.float64))
    for epochs, lr, batch in ((0, 0.1, 4), (1, 0.0, 4), (1, 0.1, 0)):
        with pytest.raises(ValueError, match="local steps"):
            local_update(x0, 3, _quadratic(torch.zeros(3, 4)), epochs, lr, batch, np.random.default_rng(0))


def _node_worker(**keys) -> ShardWorker:
    g = torch.Generator().manual_seed(1)
    data = ArrayDataset(torch.rand(N, 1, 28, 28, generator=g, dtype=torch.float64) * 2 - 1, torch.arange(N) % K, K,
                        "tiny")
    cfg = Config.from_mapping({"algorithm": "dp-sgd", "privacy-unit": "node", "num-clients": 20, "dtype": "float64",
                               "reproducible": True, "reproducible-for-testing": True, "eval-data": "server", **keys})
    return ShardWorker(cfg, data, 0)


def test_the_reply_is_the_local_update_clipped_as_one_vector():
    """One full-batch local step: the reply is local-lr times the node's unclipped mean gradient (what a node sends
    without local steps when no record is clipped), and with a small clip it is that vector scaled to norm C."""
    worker = _node_worker()
    x0 = worker.model.initial()
    d = x0.numel()
    versions = {0: x0.numpy()}
    mean = Query(0, "grad", "ce-grad", (Point(0, 0.0),), 1.0, 1e6, d)  # the node's mean gradient, nothing clipped
    local = Query(0, "grad", "ce-grad", (Point(0, 0.0),), 1.0, 1e6, d, local=(1.0, 0.05, float(N)))
    g = torch.as_tensor(worker.answer(mean, versions).total)
    update = torch.as_tensor(worker.answer(local, versions).total)
    assert torch.allclose(update, 0.05 * g, rtol=1e-9, atol=1e-15)
    clipped = Query(0, "grad", "ce-grad", (Point(0, 0.0),), 1.0, 1e-3, d, local=(2.0, 0.05, 5.0))
    reply = torch.as_tensor(worker.answer(clipped, versions).total)
    assert float(torch.linalg.vector_norm(update)) > 1e-3 >= float(torch.linalg.vector_norm(reply)) > 0.999e-3
    # the wire form keeps the local steps; a query of two points or of another dimension is refused
    assert query_from_dict(query_to_dict(local)) == local
    with pytest.raises(ValueError, match="one-point gradient"):
        worker.answer(Query(0, "grad", "ce-grad", (Point(0, 0.0), Point(0, 0.0)), 1.0, 1.0, d,
                            local=(1.0, 0.1, 4.0)), versions)


def test_the_releaser_puts_local_steps_on_the_model_gradient_releases_only(tmp_path):
    from dpdro.server.ledger import Ledger, Mechanism
    from dpdro.server.releaser import Releaser
    from dpdro.server.rundir import RunDir

    class Nodes:
        num_clients = 20

    cfg = Config.from_mapping({"algorithm": "dp-sgda", "privacy-unit": "node", "num-clients": 20, "local-epochs": 2,
                               "local-lr": 0.1, "local-batch": 8, "eval-data": "server"})
    plan = {Mechanism("class-stats", 1.0): 1, Mechanism("grad", 1.0): 1}
    releaser = Releaser(cfg, Nodes(), Ledger(plan, {"class-stats": 1.0, "grad": 1.0}, 4.0, 1e-3, "pld"), 100,
                        RunDir(tmp_path))
    grad = releaser.decorate(Query(0, "grad", "class-weighted-grad", (Point(0, 0.0),), 0.5, 1.0, 5))
    stats = releaser.decorate(Query(0, "class-stats", "class-loss-stats", (Point(0, 0.0),), 0.5, 1.0, 20))
    assert grad.local == (2.0, 0.1, 8.0) and stats.local == () and grad.rate == 1.0
    record = Releaser(cfg.with_updates({"privacy-unit": "record", "local-epochs": 0}), Nodes(),
                      Ledger(plan, {"class-stats": 1.0, "grad": 1.0}, 4.0, 1e-3, "pld"), 100, RunDir(tmp_path))
    assert record.decorate(Query(0, "grad", "class-weighted-grad", (Point(0, 0.0),), 0.5, 1.0, 5)).local == ()


def test_combinations_without_a_meaning_are_refused_before_any_work():
    from dpdro.server.run_plan import plan_training

    node = {"privacy-unit": "node", "num-clients": 20, "local-epochs": 1, "eval-data": "server"}
    with pytest.raises(ConfigError, match="'local-epochs': got 1 with privacy-unit='record'"):
        Config.from_mapping({"local-epochs": 1})
    with pytest.raises(ConfigError, match="'local-epochs': got 1 with q = 4; allowed there: q = 1"):
        Config.from_mapping({**node, "algorithm": "dp-double-spider", "q": 4})  # before any data is read
    for keys, match in (({"algorithm": "dp-sgd-dual"}, "algorithm 'dp-sgd-dual'"),
                        ({"algorithm": "recursive-spider", "dro-level": "record", "q": 1}, "dro-level='record'")):
        cfg = Config.from_mapping({**node, **keys})
        with pytest.raises(ConfigError, match=f"'local-epochs'.*{match}"):
            plan_training(cfg, 1000, K, 0, (1, 28, 28))
    # q = 1 plans no SPIDER difference, so the node-level noise check ignores the difference's multiplier
    plan = plan_training(Config.from_mapping({**node, "algorithm": "recursive-spider", "dro-level": "group",
                                              "iterations": 20, "q": 1}), 1000, K, 0, (1, 28, 28))
    assert math.isfinite(plan.noise["x-refresh"])


def test_the_plan_states_the_unit_and_the_local_steps():
    from dpdro.server.run_plan import describe_plan, plan_training

    cfg = Config.from_mapping({"algorithm": "dp-sgd", "privacy-unit": "node", "num-clients": 100,
                               "node-sampling-rate": 0.2, "local-epochs": 2, "local-lr": 0.1, "local-batch": 8,
                               "eval-data": "server", "iterations": 20})
    unit = describe_plan(plan_training(cfg, 1000, K, 0, (1, 28, 28)))["unit"]
    assert unit == {"privacy_unit": "node", "node_sampling_rate": 0.2, "num_clients": 100,
                    "local_steps": {"epochs": 2, "lr": 0.1, "batch": 8, "releases": ["grad"]}}
    record = describe_plan(plan_training(cfg.with_updates({"privacy-unit": "record", "local-epochs": 0}), 1000, K, 0,
                                         (1, 28, 28)))["unit"]
    assert record["privacy_unit"] == "record" and record["local_steps"] is None
