"""dro-groups=node (docs/explanation/ALGORITHMS.md 3.3, "The nodes as groups"): the group level of dp-double-spider,
recursive-spider and dp-sgda with each record's group its node's index: the groups, the released per-node loss
vector (its clip, noise and charge), the full-batch objective computed independently, privacy-unit=node, the per-node
accuracy figures and the refusals; dro-groups=site, the nodes' public site labels (num-sites) as the groups."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from test_group_dro import K, N, cfg_of, kl_double_spider_weights, reference, tiny_data

from dpdro.client.local_transport import LocalTransport
from dpdro.common.config import Config, ConfigError
from dpdro.common.messages import Point, Query
from dpdro.common.models import make_model
from dpdro.common.partition import make_partition
from dpdro.common.per_sample import FlatModel
from dpdro.server import releaser as releaser_module
from dpdro.server.engine import train
from dpdro.server.evaluate import node_metrics, node_of_records
from dpdro.server.release import sum_rounding_factor

NODES = {"dro-groups": "node", "num-clients": 3, "partition": "dirichlet", "dirichlet-alpha": 0.5}


def node_ids(cfg, data) -> torch.Tensor:
    """Each training record's node (N,), from the partition itself (independent of the worker's code)."""
    out = torch.full((len(data.y),), -1, dtype=torch.int64)
    for j, idx in enumerate(make_partition(cfg.data, data.y.numpy())):
        out[torch.as_tensor(idx)] = j
    return out


def test_each_record_s_group_is_its_node_s_index(tmp_path):
    cfg = cfg_of(tmp_path, algorithm="recursive-spider", **NODES)
    transport = LocalTransport(cfg, tiny_data())
    assert transport.partitions == [0, 1, 2]
    for w in transport.workers:
        assert w.num_records > 0 and torch.equal(w._groups(w.problem), torch.full((w.num_records,), w.partition))
    # the class groups are untouched
    by_class = cfg_of(tmp_path, algorithm="recursive-spider", **{**NODES, "dro-groups": "class"})
    w = LocalTransport(by_class, tiny_data()).workers[1]
    assert torch.equal(w._groups(w.problem), w.y)


def test_a_node_s_group_loss_reply_is_its_bounded_loss_sum_in_its_own_coordinate(tmp_path):
    """Full batch, no noise: node j's reply to the group-loss query is e_j sum_{i in j} min(l_i, B)."""
    data = tiny_data()
    cfg = cfg_of(tmp_path, algorithm="recursive-spider", **NODES)
    transport = LocalTransport(cfg, data)
    model = FlatModel(make_model("cnn", K, cfg.seed, torch.float64))
    x0 = model.initial().numpy()
    q = Query(0, "group-storm", "group-loss", (Point(0, 0.0),), 1.0, math.inf, 3, extra=(0.0,) * 3)
    nodes = node_ids(cfg, data)
    with torch.no_grad():
        clamped = torch.clamp(model.losses(torch.as_tensor(x0), data.x, data.y), max=cfg.loss_bound)
    for w in transport.workers:
        want = np.zeros(3)
        want[w.partition] = float(clamped[nodes == w.partition].sum())
        np.testing.assert_allclose(w.answer(q, {0: x0}).total, want, rtol=1e-12)


@pytest.mark.parametrize("cap", [math.inf, 1.5])
def test_double_spider_over_nodes_is_gradient_descent_on_the_node_kl_dro(tmp_path, cap):
    """q = 2, beta = 1, no noise: the group level over the m = 3 nodes takes the exact steps of KL-DRO over the
    nodes' mean losses with the nodes' record shares as the centre (agnostic federated learning with a
    divergence penalty); the priors come from the charged node-size histogram, not from the classes."""
    data = tiny_data()
    cfg = cfg_of(tmp_path, algorithm="dp-double-spider", psi="kl", **{"lambda": 0.7, "weight-cap": cap, **NODES})
    nodes = node_ids(cfg, data)
    expected = reference(data, cfg, kl_double_spider_weights(cfg), 0.0, groups=nodes, k_groups=3)
    result = train(cfg, LocalTransport(cfg, data), data)
    np.testing.assert_allclose(result.params, expected, rtol=1e-7, atol=1e-9)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["group_counts"] == [float(c) for c in np.bincount(nodes.numpy(), minlength=3)]
    by_class = train(cfg_of(tmp_path / "c", algorithm="dp-double-spider", psi="kl",
                            **{"lambda": 0.7, "weight-cap": cap, **NODES, "dro-groups": "class"}),
                     LocalTransport(cfg, data), data)
    assert np.abs(by_class.params - result.params).max() > 1e-6


def test_dp_sgda_over_nodes_reads_the_node_index(tmp_path, monkeypatch):
    """dp-sgda keeps one weight per node: its class-stats release is 2m long, and at rate 1 without noise its
    second half is the node sizes."""
    data = tiny_data()
    cfg = cfg_of(tmp_path, algorithm="dp-sgda", **{**NODES, "num-clients": 4, "lr-p": 0.5, "lambda": 0.2})
    seen = spy_releases(monkeypatch)
    train(cfg, LocalTransport(cfg, data), data)
    stats = [total for q, total, _ in seen if q.mechanism == "class-stats"]
    sizes = np.bincount(node_ids(cfg, data).numpy(), minlength=4)
    assert len(stats) == cfg.iterations and all(t.shape == (8,) for t in stats)
    for total in stats:
        np.testing.assert_array_equal(total[4:], sizes)


def spy_releases(monkeypatch) -> list:
    """The (query, exact total, noise std) of every release the releaser makes from now on."""
    seen = []
    real = releaser_module.noisy_mean

    def spy(query, total, noise_std, n, rng, **kw):
        seen.append((query, np.array(total), noise_std))
        return real(query, total, noise_std, n, rng, **kw)

    monkeypatch.setattr(releaser_module, "noisy_mean", spy)
    return seen


def test_the_per_node_loss_release_is_charged_at_sensitivity_b_with_its_noise(tmp_path, monkeypatch):
    """A private run: every released per-node loss vector is m long (plus the clipped-count coordinate), clipped at
    C <= B (B at t = 0), noised at std z C f(n) with z the ledger's multiplier, and charged: the ledger holds the
    node histogram once (sensitivity 1, prior-noise-multiplier) and T group-storm releases. The clipped-count
    coordinate c C of the release (config clip-count-scale) raises the sensitivity to C sqrt(1 + c^2)."""
    data = tiny_data()
    cfg = cfg_of(tmp_path, algorithm="recursive-spider", epsilon=2.0, **NODES,
                 **{"lambda-init": 0.8, "s-batch": 20, "refresh-batch": 20, "diff-batch": 20})
    seen = spy_releases(monkeypatch)
    train(cfg, LocalTransport(cfg, data), data)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    z = summary["noise_multipliers"]["group-storm"]
    storm = [(q, total, std) for q, total, std in seen if q.mechanism == "group-storm"]
    assert len(storm) == cfg.iterations == summary["releases"]["group-storm"]
    assert summary["releases"]["group-histogram"] == 1
    assert 0.99 * 2.0 <= summary["epsilon_spent"] <= 2.0
    for q, total, std in storm:
        assert q.dim == 3 and total.shape == (4,) and q.clip <= cfg.loss_bound
        # the sensitivity of the vector with its clipped-count coordinate c C: C sqrt(1 + c^2) (messages.Query)
        sensitivity = q.clip * math.sqrt(1.0 + q.count_scale**2)
        assert q.sensitivity == sensitivity and std == pytest.approx(z * sensitivity * sum_rounding_factor(N),
                                                                     rel=1e-12)
    assert storm[0][0].clip == cfg.loss_bound and 0 < z < math.inf
    (hist,) = [(q, std) for q, _, std in seen if q.mechanism == "group-histogram"]
    assert hist[0].dim == 3 and hist[0].clip == 1.0
    assert hist[1] == pytest.approx(cfg.prior_noise_multiplier * sum_rounding_factor(N), rel=1e-12)


def test_at_privacy_unit_node_each_node_weighs_alike(tmp_path):
    """privacy-unit=node: a node's contribution is the mean of its records' vectors clipped as one, so every node
    weighs alike and the group priors are public (1/m per node, nodes of the site / m per site): no group histogram
    is released or charged (a noisy one, made by the sampled nodes and scaled by 1/p, was pure noise at 1,000
    nodes), while the record level still releases it; the per-node loss vector's sensitivity is one node's clipped
    mean, <= B."""
    from dpdro.server.setup import mechanisms, public_group_priors

    data = tiny_data()
    keys = {**NODES, "num-clients": 10, "partition": "iid", "privacy-unit": "node"}
    private = cfg_of(tmp_path / "p", algorithm="recursive-spider", epsilon=4.0, **keys)
    assert public_group_priors(private) == (0.1,) * 10
    assert "group-histogram" not in {m.name for m in mechanisms(private)}
    train(private, LocalTransport(private, data), data)
    out = json.loads((tmp_path / "p" / "run" / "summary.json").read_text())
    assert out["privacy_unit"] == "node" and 0.99 * 4.0 <= out["epsilon_spent"] <= 4.0
    assert out["releases"]["group-storm"] == private.iterations and "group-histogram" not in out["releases"]
    assert "group_counts" not in out
    sites = cfg_of(tmp_path / "s", algorithm="recursive-spider", **{**keys, "dro-groups": "site", "num-sites": 3})
    assert public_group_priors(sites) == pytest.approx((0.4, 0.3, 0.3))  # nodes 0-3, 4-6, 7-9
    record = cfg_of(tmp_path / "r", algorithm="recursive-spider", epsilon=4.0, **{**keys, "privacy-unit": "record"})
    assert public_group_priors(record) is None
    assert "group-histogram" in {m.name for m in mechanisms(record)}


def test_per_node_accuracy_figures():
    correct = np.array([1, 1, 0, 1, 0, 0, 1], dtype=bool)
    node_of = np.array([0, 0, 0, 1, 1, 2, 2])
    got = node_metrics(correct, node_of, 4)
    assert got["per_node_accuracy"][:3] == [2 / 3, 0.5, 0.5] and math.isnan(got["per_node_accuracy"][3])
    assert got["worst_node_accuracy"] == 0.5 and got["node_accuracy_spread"] == pytest.approx(2 / 3 - 0.5)
    cfg = Config.from_mapping({"num-clients": 3, "partition": "dirichlet", "dirichlet-alpha": 0.3, "seed": 2})
    labels = np.repeat(np.arange(10), 20)
    node_of = node_of_records(cfg.data, labels)
    for j, idx in enumerate(make_partition(cfg.data, labels)):
        assert (node_of[idx] == j).all()
    assert (node_of >= 0).all()


SITES = {**NODES, "dro-groups": "site", "num-clients": 4, "num-sites": 2}


def test_each_record_s_group_is_its_node_s_site(tmp_path):
    """Nodes 0, 1 form site 0 and nodes 2, 3 site 1 (site_of); the group histogram has num-sites entries."""
    cfg = cfg_of(tmp_path, algorithm="recursive-spider", **SITES)
    transport = LocalTransport(cfg, tiny_data())
    for w in transport.workers:
        want = torch.full((w.num_records,), w.partition // 2)
        assert w.num_records > 0 and torch.equal(w._groups(w.problem), want)
    assert cfg.dro_group_count(K, 0) == 2


def test_a_site_group_run_reports_its_worst_site_and_node(tmp_path):
    """The summary's per-site accuracy is the accuracy over the test records of each site's nodes, computed here
    from per-record predictions independently of the engine's figures."""
    data = tiny_data()
    cfg = cfg_of(tmp_path, algorithm="recursive-spider", **SITES)
    train(cfg, LocalTransport(cfg, data), data)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert len(summary["per_node_accuracy"]) == 4 and len(summary["per_site_accuracy"]) == 2
    assert summary["worst_site_accuracy"] == min(summary["per_site_accuracy"])
    correct = np.array([1, 0, 1, 1, 0, 1], dtype=bool)
    got = node_metrics(correct, np.array([0, 1, 1, 2, 3, 3]), 4, num_sites=2)
    assert got["per_site_accuracy"] == [2 / 3, 2 / 3] and got["worst_site_accuracy"] == 2 / 3
    got = node_metrics(correct, np.array([0, 0, 1, 2, 2, 3]), 4, num_sites=2)
    assert got["per_site_accuracy"] == [2 / 3, 2 / 3]
    got = node_metrics(correct, np.array([0, 2, 0, 0, 3, 2]), 4, num_sites=2)
    assert got["per_site_accuracy"] == [1.0, 1 / 3] and got["worst_site_accuracy"] == 1 / 3


def test_a_node_group_run_reports_its_worst_node(tmp_path):
    data = tiny_data()
    cfg = cfg_of(tmp_path, algorithm="recursive-spider", **NODES)
    train(cfg, LocalTransport(cfg, data), data)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    per_node = summary["per_node_accuracy"]
    assert len(per_node) == 3 and summary["worst_node_accuracy"] == min(per_node)
    assert summary["node_accuracy_spread"] == pytest.approx(max(per_node) - min(per_node))
    by_class = cfg_of(tmp_path / "c", algorithm="recursive-spider", **{**NODES, "dro-groups": "class"})
    train(by_class, LocalTransport(by_class, data), data)
    assert "worst_node_accuracy" not in json.loads((tmp_path / "c" / "run" / "summary.json").read_text())


@pytest.mark.parametrize(("keys", "message"), [
    ({"algorithm": "dp-sgd"}, "algorithm 'dp-sgd', which has no group level"),
    ({"algorithm": "dp-double-spider", "dro-level": "record"}, "allowed only with dro-level='group'"),
    ({"algorithm": "recursive-spider", "dro-level": "group", "num-clients": 1}, "num-clients >= 2"),
])
def test_bad_node_groups_are_refused_before_any_work(keys, message):
    with pytest.raises(ConfigError, match=f"config key 'dro-groups': got 'node'.*{message}"):
        Config.from_mapping({"dro-groups": "node", **keys})


def test_the_benchmark_s_two_group_runs_differ_only_in_their_groups(tmp_path):
    """simulations/node_groups.py: dp-sgd, then the method with the class groups and with the node groups, all on
    the same Dirichlet partition, epsilon and seed; the two group runs' keys differ in dro-groups and out-dir only."""
    from dpdro.simulations.node_groups import configs

    (_, sgd), (_, by_class), (_, by_node) = configs(tmp_path, "recursive-spider", 12, 0.3, 40, 4.0, 5)
    for keys in (sgd, by_class, by_node):
        cfg = Config.from_mapping(keys)
        assert (cfg.num_clients, cfg.partition, cfg.dirichlet_alpha, cfg.epsilon, cfg.seed, cfg.iterations) == (
            12, "dirichlet", 0.3, 4.0, 5, 40)
    assert sgd["algorithm"] == "dp-sgd" and "dro-groups" not in sgd
    differ = {k for k in by_class.keys() | by_node.keys() if by_class.get(k) != by_node.get(k)}
    assert differ == {"dro-groups", "out-dir"} and by_node["dro-groups"] == "node"
    assert Config.from_mapping(by_node).node_groups and not Config.from_mapping(by_class).node_groups
