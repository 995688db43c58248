"""Evaluation on the nodes (eval-data=nodes): the count vector's sensitivity, the calibrated eval noise, the
metrics and standard errors from noisy counts, the plan's charge, and a run over the in-process transport whose
noise-free node evaluation equals the server's."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import numpy as np
import pytest

from dpdro.common.codec import query_from_dict, query_to_dict
from dpdro.common.config import ConfigError
from dpdro.common.eval_counts import EVAL_SENSITIVITY, count_vector
from dpdro.server import node_evaluation as ne
from dpdro.server.ledger import epsilon_of


def test_one_record_moves_the_count_vector_by_at_most_sqrt2():
    rng = np.random.default_rng(0)
    labels, pred = rng.integers(0, 4, 50), rng.integers(0, 4, 50)
    full = count_vector(pred, labels, 4)
    assert full[4:].sum() == 50 and full[:4].sum() == (pred == labels).sum()
    gaps = [np.linalg.norm(full - count_vector(np.delete(pred, i), np.delete(labels, i), 4)) for i in range(50)]
    assert max(gaps) == pytest.approx(EVAL_SENSITIVITY) and min(gaps) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="labels must lie in"):
        count_vector(np.array([0]), np.array([4]), 4)


def test_eval_noise_spends_eval_epsilon_and_the_plan_charges_every_evaluation(small_config):
    z = ne.eval_noise_multiplier(1.0, 1e-6)
    assert 0.99 <= epsilon_of({(1.0, z): 1}, 1e-6) <= 1.0 and 4.0 < z < 4.5
    cfg = small_config(eval_data="nodes", eval_epsilon=0.5, epsilon=4.0)  # iterations 6, eval-every 3
    (mech, count), = ne.mechanisms(cfg, 1e-5).items()
    assert count == ne.evaluations(6, 3) == 3 and mech.rate == 1.0
    assert mech.fixed_noise == pytest.approx(ne.eval_noise_multiplier(0.5, 1e-5))
    assert ne.mechanisms(small_config(), 1e-5) == {}  # auto with partition iid: the server evaluates
    with pytest.raises(ConfigError, match="eval-every"):
        ne.mechanisms(small_config(eval_data="nodes", eval_epsilon=2.0, epsilon=4.0), 1e-5)


def test_metrics_and_standard_errors_from_noisy_counts():
    counts = np.array([90.0, 40.0, 100.0, 50.0])
    exact = ne.metrics_from_counts(counts, 0.0)
    assert exact["per_class_accuracy"] == [0.9, 0.8] and exact["test_accuracy"] == pytest.approx(130 / 150)
    assert exact["worst_class_accuracy"] == 0.8 and exact["worst_class_accuracy_se"] == 0.0
    noisy = ne.metrics_from_counts(counts, 2.0)
    assert noisy["per_class_accuracy_se"] == pytest.approx([2 * math.sqrt(1.81) / 100, 2 * math.sqrt(1.64) / 50])
    assert math.isnan(ne.metrics_from_counts(np.array([0.2, 5.0, 0.4, 10.0]), 1.0)["per_class_accuracy"][0])
    # the standard error is the spread of the estimate over draws of the noise (delta method)
    rng = np.random.default_rng(1)
    draws = [ne.metrics_from_counts(ne.noisy_counts(counts, 2.0, rng), 2.0)["per_class_accuracy"][1]
             for _ in range(4000)]
    assert np.std(draws) == pytest.approx(noisy["per_class_accuracy_se"][1], rel=0.1)
    assert ne.expected_error(0.1, 1e-6, 1000) == pytest.approx(0.069, abs=0.003)  # the docs' table


def test_the_eval_query_travels_through_the_codec_unchanged():
    q = ne.eval_query(7, 3, np.array([0.1, -0.2, 0.0]))
    assert query_from_dict(query_to_dict(q)) == q and q.points[0].version == -9 and q.sensitivity == EVAL_SENSITIVITY


def test_a_worker_without_held_out_records_says_so(small_config, caplog):
    from dpdro.client.worker import ShardWorker
    from dpdro.common.data import load_from_config

    cfg = small_config(eval_data="nodes")
    train = load_from_config(cfg, True)
    worker = ShardWorker(cfg, train.subset(np.arange(20)), 2)
    q = ne.eval_query(0, train.num_classes, None)
    with caplog.at_level(logging.WARNING):
        reply = worker.answer(q, {q.points[0].version: np.zeros(worker.model.dim)})
    assert reply.count == 0 and not reply.total.any() and "partition 2 holds no held-out records" in caplog.text


def test_a_run_evaluated_on_the_nodes(small_config):
    from dpdro.launch.local import train_local

    common = {"algorithm": "dp-sgd", "q": 5, "diff_batch": 512, "epsilon": math.inf, "reproducible_for_testing": False}
    on_server = train_local(small_config(**common, eval_data="server"))
    on_nodes = train_local(small_config(**common, eval_data="nodes", overwrite=True))
    for a, b in zip(on_server.metrics, on_nodes.metrics, strict=True):  # no noise: the nodes' counts are exact
        assert b["per_class_accuracy"] == pytest.approx(a["per_class_accuracy"], abs=1e-12)
        assert b["test_accuracy"] == pytest.approx(a["test_accuracy"], abs=1e-12) and b["test_accuracy_se"] == 0
    private = train_local(small_config(algorithm="dp-sgd", q=5, diff_batch=512, eval_data="nodes", eval_epsilon=0.5,
                                       overwrite=True))
    s = private.summary
    assert s["releases"]["eval-counts"] == 3 and s["epsilon_spent"] <= s["epsilon_target"]
    assert s["noise_multipliers"]["eval-counts"] == pytest.approx(ne.eval_noise_multiplier(0.5, s["delta"]))
    assert all(row["test_accuracy_se"] > 0 for row in private.metrics)
    assert s["eval_data"] == "nodes" and s["worst_class_accuracy_se"] > 0
    card = (Path(small_config().out_dir) / "MODEL_CARD.md").read_text()
    assert "Evaluated on the nodes' held-out records" in card


def test_a_selection_on_private_counts_is_charged_and_listed():
    from dpdro.common.config import Config
    from dpdro.server.private_selection import choose_privately, selection_noise_multiplier
    from dpdro.server.summary import not_accounted

    good, bad = np.array([950.0, 900.0, 1000.0, 1000.0]), np.array([990.0, 500.0, 1000.0, 1000.0])
    chosen, release = choose_privately([bad, good, bad], 1.0, 1e-6, np.random.default_rng(0))
    assert chosen == 1 and 0.99 <= release.epsilon <= 1.0  # worst class 0.9 against 0.5, noise std ~ 0.01
    assert release.z == pytest.approx(selection_noise_multiplier(3, 1.0, 1e-6))
    assert release.z > ne.eval_noise_multiplier(1.0, 1e-6)  # three releases share the epsilon of one
    assert epsilon_of({(1.0, release.z): 3}, 1e-6) == pytest.approx(release.epsilon)
    cfg = Config.from_mapping({"chosen-on-private-data": "posthoc-tau-noisy"})
    setup = type("Setup", (), {"prior_source": "private"})()
    assert any("from noisy per-class counts" in line for line in not_accounted(cfg, setup))


def test_posthoc_tau_from_noisy_counts_picks_the_clearly_better_tau(monkeypatch):
    """simulations/posthoc_tau.scan_private: every (model, tau) pair's counts released together, the mean noisy
    terms per tau; here tau 1 is far better on the worst class, so it wins at a loose selection epsilon."""
    from types import SimpleNamespace

    from dpdro.server import prediction
    from dpdro.simulations.posthoc_tau import scan_private

    labels = np.repeat(np.arange(2), 2000)

    def fake(model, data, taus):
        assert data == "validation"
        worse = np.where(labels == 1, (np.arange(4000) % 2), labels)  # tau 0: class 1 half right
        return [SimpleNamespace(predicted=worse if t == 0 else labels, labels=labels, scores=np.zeros((4000, 2)))
                for t in taus]

    monkeypatch.setattr(prediction, "predict_posthoc_taus", fake)
    terms, spent = scan_private(["m1", "m2"], [0.0, 1.0], 4.0, 1e-5)
    assert terms[1][0] > 0.9 > 0.6 > terms[0][0] and 0.99 * 4.0 <= spent <= 4.0
