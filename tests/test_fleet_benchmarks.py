"""The fleet benchmarks' own machinery (simulations/node_scale.py, simulations/dp_fedavg.py and its Flower app):
what they measure and what they build, checked without running a fleet."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dpdro.common.config import Config
from dpdro.simulations import dp_fedavg, node_scale


def test_tree_memory_sees_a_child_process_holding_memory():
    hold = "import time; b = bytearray(150 * 2**20); b[::4096] = b'x' * len(b[::4096]); time.sleep(3)"
    with node_scale.TreeMemory(period=0.2) as memory:
        child = subprocess.Popen([sys.executable, "-c", hold])
        child.wait()
    assert memory.peak_mb >= 140, memory.peak_mb  # the child's 150 MiB, touched page by page
    assert node_scale.TreeMemory.descendants_rss_mb(child.pid) == 0  # no descendants of an ended process


def test_every_scale_row_releases_the_same_expected_records_per_round():
    rows = {n: node_scale.scale_config(n, 20, Path("/tmp/x")) for n in (30, 100, 1000)}
    assert rows[30].privacy.node_sampling_rate == 1.0 and rows[1000].privacy.node_sampling_rate == 0.03
    for cfg in rows.values():
        expected = cfg.privacy.node_sampling_rate * cfg.refresh_batch
        assert expected == pytest.approx(node_scale.EXPECTED_RECORDS, rel=0.01), cfg.num_clients
        assert cfg.partition == "dirichlet" and cfg.iterations == 20


def test_the_scale_table_prints_each_row_and_the_largest_fleet_against_30_nodes():
    def row(n, p, s):
        return {"nodes": n, "node_sampling_rate": p, "startup_seconds": 60.0, "seconds_per_round": s,
                "server_rss_mb": 1000.0, "peak_tree_rss_mb": 3000.0, "ledger_seconds": 0.3, "epsilon_spent": 4.0,
                "load_average": 2.0}

    lines = node_scale.table([row(30, 1.0, 2.0), row(1000, 0.03, 2.5)])
    assert lines[2].startswith("| 30 | 1 | 30 | 60.0 | 2.000 |") and lines[3].startswith("| 1,000 | 0.03 | 30 |")
    assert lines[-1] == "Round time, 1,000 nodes at p = 0.03 against 30 nodes all asked: 1.25x."


def test_the_anchor_starts_from_the_model_a_dpdro_run_starts_from():
    from dpdro.server.run_plan import plan_training

    cfg = Config.from_mapping({"dataset": "mnist-st", "num-clients": 40, "partition": "dirichlet", "seed": 3,
                               "iterations": 2, "epsilon": "inf"})  # not private: no calibration to wait for
    anchor = dp_fedavg.flat_model(cfg, 10, (1, 28, 28)).initial()
    plan = plan_training(cfg, 30_000, 10, 0, (1, 28, 28))
    assert torch.equal(anchor, plan.model.initial())
    other = dp_fedavg.flat_model(cfg.with_updates({"seed": 4}), 10, (1, 28, 28)).initial()
    assert not torch.equal(anchor, other)


def test_the_anchor_config_travels_through_the_run_config_unchanged():
    import json

    cfg = Config.from_mapping({"dataset": "mnist-st", "num-clients": 1000, "partition": "dirichlet",
                               "dirichlet-alpha": 0.3, "privacy-unit": "node", "node-sampling-rate": 0.03})
    back = dp_fedavg.anchor_config({"dpdro-config": json.dumps(cfg.to_dict(), default=str)})
    assert back.to_dict() == cfg.to_dict()


@pytest.mark.data
def test_an_anchor_node_holds_the_records_that_node_holds_in_a_dpdro_run():
    from dpdro.common.data import load_from_config
    from dpdro.common.partition import make_partition

    cfg = Config.from_mapping({"dataset": "mnist-st", "num-clients": 50, "partition": "dirichlet",
                               "dirichlet-alpha": 0.3, "seed": 0})
    train = load_from_config(cfg, True)
    parts = make_partition(cfg.data, train.y.numpy())
    for k in (0, 17, 49):
        x, y, _ = dp_fedavg.node_shard(cfg, k)
        assert torch.equal(y, train.y[torch.as_tensor(parts[k])]) and len(y) == len(parts[k])
        assert np.allclose(x.numpy(), train.x[torch.as_tensor(parts[k])].float().numpy())


def test_the_fleet_document_reports_growth_and_the_goal_from_the_rows():
    def row(n, p, startup, s, mem):
        return {"nodes": n, "node_sampling_rate": p, "startup_seconds": startup, "seconds_per_round": s,
                "server_rss_mb": 1000.0, "peak_tree_rss_mb": mem, "ledger_seconds": 0.3, "epsilon_spent": 4.0,
                "load_average": 2.0}

    rows = [row(30, 1.0, 60.0, 2.0, 3000.0), row(100, 0.03, 60.0, 1.0, 3000.0), row(1000, 0.03, 600.0, 4.0, 6000.0)]
    text = node_scale.document(rows, "python -m dpdro.simulations.node_scale")
    assert ("- 100 to 1,000 nodes (10.0x; nodes asked per round 10.0x): start-up 10.00x, seconds per round 4.00x, "
            "peak memory of all processes 2.00x, ServerApp memory 1.00x.") in text
    assert "at most 1.5 times a round with 30 nodes all sampled: 2.00x, **not met**." in text
    rows[2]["seconds_per_round"] = 2.5
    assert "1.25x, **met**." in node_scale.document(rows, "x")


def test_the_fleet_document_compares_start_up_with_earlier_rows():
    def row(n, startup):
        return {"nodes": n, "node_sampling_rate": 0.03, "startup_seconds": startup, "seconds_per_round": 1.0,
                "server_rss_mb": 1000.0, "peak_tree_rss_mb": 3000.0, "ledger_seconds": 0.3, "epsilon_spent": 4.0,
                "load_average": 2.0}

    text = node_scale.document([row(300, 200.0), row(1000, 700.0)], "x", before=[row(1000, 1500.0), row(50, 9.0)])
    assert "start-up (s): 1,000 nodes 1500.0 (now 700.0)." in text and "50 nodes" not in text
    assert "Before the hello window" not in node_scale.document([row(300, 200.0)], "x")


def test_the_seeds_table_gives_means_and_decides_by_the_interval_rule():
    def row(name, acc, p10, per_node):
        return {"row": name, "epsilon": 4.0, "test_accuracy": acc, "worst_class_accuracy": 0.0,
                "worst_node_accuracy": 0.0, "node_accuracy_p10": p10, "per_node_accuracy": per_node}

    local, flower = "dpdro dp-sgd, local epochs 1", "Flower DP-FedAvg (local lr 0.05)"
    groups = "dpdro recursive-spider, dro-groups = node, local epochs 1"
    by_seed = {s: [row(local, 0.44 + 0.01 * s, 0.08, [0.2, 0.4, float("nan"), 0.6]),
                   row(groups, 0.40 + 0.01 * s, 0.05, [0.3, 0.3, 0.3]),
                   row(flower, 0.30 + 0.01 * s, 0.08 + 0.001 * s, [0.1, 0.2, 0.3])] for s in (0, 1, 2)}
    lines = dp_fedavg.seeds_table(by_seed)
    assert lines[2] == (f"| {local} | 3 | 4.000 | 0.450 +/- 0.010 | 0.000 +/- 0.000 | 0.000 +/- 0.000 | "
                        "0.080 +/- 0.000 | 0.400 +/- 0.000 |")  # the median over the nodes with test records
    verdicts = [line for line in lines if line.startswith("- ")]
    assert verdicts[0].startswith(f"- {local} against {flower}, accuracy: better, 95% interval [+0.1")
    assert any(line.startswith(f"- {groups} against {local}, 10th-percentile node: worse") for line in verdicts)
    assert len(verdicts) == 8  # 4 columns (all but worst class) for each of the two comparisons


def test_the_seeds_table_adds_the_worst_site_and_the_site_groups_comparison():
    """With --sites every row carries worst_site_accuracy: the table gets its column and the site-group row is
    compared with dp-sgd on every column but the worst class (and node groups too, on the worst site as well)."""
    def row(name, acc, site):
        return {"row": name, "epsilon": 4.0, "test_accuracy": acc, "worst_class_accuracy": 0.0,
                "worst_node_accuracy": 0.0, "node_accuracy_p10": 0.1, "per_node_accuracy": [0.5],
                "worst_site_accuracy": site}

    local, sites = "dpdro dp-sgd, local epochs 1", "dpdro recursive-spider, dro-groups = site, local epochs 1"
    by_seed = {s: [row(local, 0.44 + 0.01 * s, 0.20 + 0.01 * s), row(sites, 0.43 + 0.01 * s, 0.30 + 0.01 * s)]
               for s in (0, 1, 2)}
    lines = dp_fedavg.seeds_table(by_seed)
    assert lines[0].endswith("| median node | worst site |")
    assert lines[3] == (f"| {sites} | 3 | 4.000 | 0.440 +/- 0.010 | 0.000 +/- 0.000 | 0.000 +/- 0.000 | "
                        "0.100 +/- 0.000 | 0.500 +/- 0.000 | 0.310 +/- 0.010 |")
    verdicts = [line for line in lines if line.startswith("- ")]
    assert len(verdicts) == 5 and verdicts[-1].startswith(f"- {sites} against {local}, worst site: better")
    assert dp_fedavg.table([{**row(local, 0.4, 0.2), "seconds": 1.0, "noise_multiplier": 1.0,
                             "node_accuracy_spread": 0.5}])[0].endswith("| worst site | seconds |")
