"""End to end on a real MNIST-ST subset: the single-node engine, the run directory, resume, and the
Flower simulation equal to single-node (ALGORITHMS.md 7)."""

from __future__ import annotations

import csv
import json
import logging

import numpy as np
import pytest
import torch
from conftest import SMALL

from dpdro.client.local_transport import LocalTransport
from dpdro.common.data import load_from_config
from dpdro.server.engine import ResumeError, train

pytestmark = pytest.mark.data


def run_local(cfg, resume=False):
    from dpdro.server.node_evaluation import evaluates_on_nodes

    test = load_from_config(cfg, False)
    held_out = test if evaluates_on_nodes(cfg) else None  # eval-data=nodes: the clients hold the evaluation records
    return train(cfg, LocalTransport(cfg, load_from_config(cfg, True), held_out=held_out), test, resume=resume)


def test_single_node_run_writes_run_directory(small_config):
    cfg = small_config(epsilon=1.0)
    result = run_local(cfg)
    out = result.summary
    for key in ("algorithm", "dataset", "seed", "num_clients", "iterations", "epsilon_target", "epsilon_spent",
                "delta", "noise_multipliers", "test_accuracy", "worst_class_accuracy", "per_class_accuracy",
                "wall_seconds"):
        assert key in out
    assert 0.99 <= out["epsilon_spent"] <= 1.0
    assert out["delta"] == pytest.approx(0.1 / 3000)  # auto: 1/(10 n)
    assert out["releases"] == {"eta-refresh": 2, "eta-diff": 4, "x-refresh": 2, "x-diff": 4}
    run = cfg.out_dir
    saved = json.load(open(f"{run}/summary.json"))
    assert saved["test_accuracy"] == out["test_accuracy"]
    rows = list(csv.DictReader(open(f"{run}/metrics.csv")))
    assert [int(r["iteration"]) for r in rows] == [0, 3, 6]
    assert float(rows[-1]["epsilon_spent"]) == pytest.approx(out["epsilon_spent"], rel=1e-5)
    events = [json.loads(line) for line in open(f"{run}/events.jsonl")]
    assert len(events) == 12 and {e["mechanism"] for e in events} == set(out["releases"])
    assert all(e["noise_multiplier"] > 0 for e in events)
    assert json.load(open(f"{run}/config.json"))["n"] == 3000
    # n is released exactly and costs nothing: the unit (one record replaced with the null record) keeps n and the
    # shard sizes fixed, so they are not listed as unaccounted
    assert not any("shard sizes" in s or s.startswith("n ") for s in out["not_accounted"])


def test_reproducible_runs_are_identical_and_seeds_differ(small_config, tmp_path):
    a = run_local(small_config(out_dir=str(tmp_path / "a")))
    b = run_local(small_config(out_dir=str(tmp_path / "b")))
    c = run_local(small_config(out_dir=str(tmp_path / "c"), seed=8))
    assert np.array_equal(a.params, b.params)
    assert a.metrics[-1]["test_accuracy"] == b.metrics[-1]["test_accuracy"]
    assert not np.allclose(a.params, c.params)


def test_non_private_run_says_so(small_config):
    result = run_local(small_config(epsilon=float("inf")))
    assert result.summary["private"] is False
    assert result.summary["epsilon_spent"] == float("inf")
    assert any("not private" in s for s in result.summary["not_accounted"])
    assert not any(s.startswith("n and the clients' shard sizes") for s in result.summary["not_accounted"])


def test_run_with_noise_from_the_saved_seed_says_not_private_everywhere(small_config, tmp_path, caplog, capsys):
    """A private run with reproducible-for-testing (as SMALL) draws its noise from the seed that summary.json
    saves: the log, the done line, summary.json (private, trust_model, not_accounted) and MODEL_CARD.md say
    'not private: noise derived from the saved seed'; a run with secret seeds says none of it."""
    from dpdro.cli import main
    from dpdro.common.config import SEEDED_NOT_PRIVATE

    run = tmp_path / "seeded"
    keys = {**SMALL, "iterations": 3, "out-dir": str(run)}
    with caplog.at_level(logging.WARNING):
        assert main(["train", "--set", *(f"{k}={v}" for k, v in keys.items())]) == 0
    assert SEEDED_NOT_PRIVATE == "not private: noise derived from the saved seed"
    assert any(SEEDED_NOT_PRIVATE in r.getMessage() and "seed 7" in r.getMessage() for r in caplog.records)
    assert "(NOT PRIVATE: NOISE DERIVED FROM THE SAVED SEED)" in capsys.readouterr().out
    summary = json.loads((run / "summary.json").read_text())
    assert summary["private"] is False and summary["reproducible"] is True and summary["seed"] == 7
    assert 0.99 * 4.0 <= summary["epsilon_spent"] <= 4.0  # the mechanism's figure, were the seed secret
    assert summary["trust_model"].startswith(SEEDED_NOT_PRIVATE)
    assert summary["not_accounted"][0].startswith(f"everything: {SEEDED_NOT_PRIVATE}")
    assert json.loads((run / "model.json").read_text())["private"] is False
    card = (run / "MODEL_CARD.md").read_text()
    assert "**NOT PRIVATE**: reproducible=true for testing" in card and SEEDED_NOT_PRIVATE in card
    caplog.clear()
    secret = run_local(small_config(iterations=3, reproducible=False, out_dir=str(tmp_path / "secret")))
    assert secret.summary["private"] is True
    assert not any(SEEDED_NOT_PRIVATE in r.getMessage() for r in caplog.records)
    assert not any(SEEDED_NOT_PRIVATE in s for s in [secret.summary["trust_model"], *secret.summary["not_accounted"]])
    assert "NOT PRIVATE" not in (tmp_path / "secret" / "MODEL_CARD.md").read_text()


def _independent_epsilon(events, delta):
    """Epsilon of every release in ``events`` composed directly with dp-accounting's PLD accountant at a finer
    discretisation than the ledger's (which rounds up): an independent figure the ledger must not undercut."""
    import dp_accounting
    from dp_accounting.pld import pld_privacy_accountant

    acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    for e in events:
        if not e.get("discarded"):
            acc.compose(dp_accounting.PoissonSampledDpEvent(
                e["rate"], dp_accounting.GaussianDpEvent(e["noise_multiplier"])))
    return acc.get_epsilon(delta)


def _dies_after(calls):
    """A LocalTransport class whose run raises Stop (as a crash or kill -9 would end the process, with no
    checkpoint) when asked for its round number ``calls + 1``."""

    class StoppingTransport(LocalTransport):
        made = 0

        def run(self, queries, versions):
            StoppingTransport.made += 1
            if StoppingTransport.made > calls:
                raise Stop
            return super().run(queries, versions)

    return StoppingTransport


class Stop(Exception):
    pass


def test_resume_after_crash_charges_every_release_made(small_config, tmp_path):
    """A crash between checkpoints used to un-charge the releases made since the last checkpoint (the resumed
    run erased their events, restored the ledger and reported the uninterrupted run's epsilon). They are
    now charged: the reported epsilon is at least the independent composition of every release made,
    abandoned ones included, and above the uninterrupted run's."""
    full = run_local(small_config(out_dir=str(tmp_path / "full"), iterations=6, checkpoint_every=2))
    part_cfg = small_config(out_dir=str(tmp_path / "part"), iterations=6, checkpoint_every=2)
    ds_train, ds_test = load_from_config(part_cfg, True), load_from_config(part_cfg, False)
    with pytest.raises(Stop):  # 2 releases per iteration: dies inside iteration 5, one release after the
        train(part_cfg, _dies_after(9)(part_cfg, ds_train), ds_test)  # checkpoint at 4
    resumed = train(part_cfg, LocalTransport(part_cfg, ds_train), ds_test, resume=True)
    assert np.array_equal(resumed.params, full.params)  # reproducible: the same iterates
    events = [json.loads(line) for line in open(tmp_path / "part" / "events.jsonl")]
    assert len(events) == 13 and [e["iteration"] for e in events if e.get("abandoned")] == [4]
    spent, delta = resumed.summary["epsilon_spent"], resumed.summary["delta"]
    independent = _independent_epsilon(events, delta)
    kept = _independent_epsilon([e for e in events if not e.get("abandoned")], delta)
    assert independent > kept  # the lost release (an eta difference: large noise multiplier) costs a little
    assert independent - 1e-9 <= spent <= independent + 0.01
    assert spent > full.summary["epsilon_spent"]
    assert spent <= part_cfg.epsilon  # it fitted: the resume went on within the target
    assert resumed.summary["releases_beyond_plan"] == 1


def test_resume_refuses_when_lost_releases_leave_too_little_budget(small_config, tmp_path):
    """Releases lost to a crash that leave too little budget for the rest of the plan: the resume says so and
    stops before releasing anything; a second attempt, after the first was refused, finds the same releases
    and refuses again (they are charged against the same checkpoint, never forgotten)."""
    cfg = small_config(out_dir=str(tmp_path / "part"), iterations=6, checkpoint_every=0)
    ds_train, ds_test = load_from_config(cfg, True), load_from_config(cfg, False)
    with pytest.raises(Stop):  # checkpoint after iteration 1 only: iterations 1-4 are lost
        train(cfg, _dies_after(10)(cfg, ds_train), ds_test)
    for _ in range(2):
        before = (tmp_path / "part" / "events.jsonl").read_text().count("\n")
        with pytest.raises(ResumeError, match=r"8 release\(s\) of iterations 1-4 .* would spend epsilon"):
            train(cfg, LocalTransport(cfg, ds_train), ds_test, resume=True)
        assert (tmp_path / "part" / "events.jsonl").read_text().count("\n") == before  # nothing released
    assert not (tmp_path / "part" / "summary.json").exists()


def test_resumed_run_writes_the_events_summary_and_progress_of_an_uninterrupted_one(small_config, tmp_path):
    """After --resume the first difference events lacked noise_ratio_to_refresh,
    spider_noise.phases undercounted and the progress bar restarted at 0. The noise monitor is now
    checkpointed and the progress starts at the checkpoint's iteration."""
    from dpdro.server.engine import Progress

    keys = {"iterations": 9, "q": 3, "checkpoint_every": 2, "eval_every": 3}
    full_cfg = small_config(out_dir=str(tmp_path / "full"), **keys)
    full = run_local(full_cfg)
    part_cfg = small_config(out_dir=str(tmp_path / "part"), **keys)
    ds_train, ds_test = load_from_config(part_cfg, True), load_from_config(part_cfg, False)

    # 2 releases per iteration: dies as iteration 4 starts, right after the checkpoint at 4, with a phase (refresh
    # at 3) still open; nothing is lost (losses are charged: test_resume_after_crash_charges_every_release_made)
    with pytest.raises(Stop):
        train(part_cfg, _dies_after(8)(part_cfg, ds_train), ds_test)
    starts = []
    resumed = train(part_cfg, LocalTransport(part_cfg, ds_train), ds_test, resume=True,
                    progress=Progress(on_start=starts.append))
    assert starts == [4]

    def events(cfg):
        return [json.loads(line) for line in open(f"{cfg.out_dir}/events.jsonl")]

    assert events(part_cfg) == events(full_cfg)
    assert sum("noise_ratio_to_refresh" in e for e in events(part_cfg)) == 12  # every difference release
    assert resumed.summary["spider_noise"] == full.summary["spider_noise"]
    assert resumed.summary["spider_noise"]["phases"] == 6  # 3 phases each of x and eta
    timing = ("wall_seconds", "server_rss_mb", "server_heap_mb")  # measured, not computed
    strip = [{k: v for k, v in row.items() if k not in timing} for row in resumed.metrics]
    assert strip == [{k: v for k, v in row.items() if k not in timing} for row in full.metrics]
    assert {k: v for k, v in resumed.summary.items() if k not in timing} == \
        {k: v for k, v in full.summary.items() if k not in timing}


def test_iterate_average_is_what_the_run_returns_and_survives_a_resume(small_config, tmp_path):
    """ema-decay (ALGORITHMS.md 5.11): the run returns the average of its iterates (here the plain mean of x_1..x_6,
    decay 0.9), trains along the same iterates as without it, and a resumed run returns the same average."""
    keys = {"iterations": 6, "q": 3, "checkpoint_every": 2, "eval_every": 3}
    plain = run_local(small_config(out_dir=str(tmp_path / "plain"), **keys))
    full_cfg = small_config(out_dir=str(tmp_path / "full"), ema_decay=0.9, **keys)
    full = run_local(full_cfg)
    assert not np.allclose(full.params, plain.params)
    assert full.summary["releases"] == plain.summary["releases"]
    # each row also evaluates the last iterate: the plain run's model, on the same trajectory
    assert [r["last_iterate_accuracy"] for r in full.metrics] == [r["test_accuracy"] for r in plain.metrics]
    assert [r["last_iterate_worst_class_accuracy"] for r in full.metrics] == \
        [r["worst_class_accuracy"] for r in plain.metrics]
    assert "last_iterate_accuracy" not in plain.metrics[-1]
    part_cfg = small_config(out_dir=str(tmp_path / "part"), ema_decay=0.9, **keys)
    ds_train, ds_test = load_from_config(part_cfg, True), load_from_config(part_cfg, False)
    with pytest.raises(Stop):
        train(part_cfg, _dies_after(4)(part_cfg, ds_train), ds_test)  # dies right after the checkpoint at 2
    resumed = train(part_cfg, LocalTransport(part_cfg, ds_train), ds_test, resume=True)
    np.testing.assert_array_equal(resumed.params, full.params)
    assert resumed.summary["test_accuracy"] == full.summary["test_accuracy"]


def test_resume_with_other_config_is_refused(small_config, tmp_path):
    cfg = small_config(out_dir=str(tmp_path / "r"))
    run_local(cfg)
    other = small_config(out_dir=str(tmp_path / "r"), lr_x=0.123)
    with pytest.raises(ResumeError, match="lr-x"):
        run_local(other, resume=True)


# the group level in one round per iteration: two releases per message (ALGORITHMS.md 3.4)
ONE_ROUND = {"dro_level": "group", "block_order": "simultaneous"}


@pytest.mark.flower
@pytest.mark.parametrize(("algorithm", "keys"), [
    ("dp-double-spider", {}), ("dp-double-spider", ONE_ROUND), ("recursive-spider", {}), ("dp-sgd", {}),
    ("dp-sgd-dual", {}), ("dp-spiderboost", {}), ("dp-sgda", {}),
    ("dp-sgd", {"eval_data": "nodes", "eval_epsilon": 0.5}),  # the nodes evaluate their held-out records
    ("dp-sgd", {"checkpoint_select": "private-best", "eval_split": "validation", "validation_fraction": 0.2,
                "eval_epsilon": 0.5}),  # the checkpoint chosen by the nodes' noisy validation counts
    ("dp-double-spider", {"node_sampling_rate": 0.5}),  # the same seeded node sample on both transports
    # node-level privacy, each node's update after a local epoch of SGD (local-epochs; seeded shuffles)
    ("dp-sgd", {"privacy_unit": "node", "num_clients": 10, "local_epochs": 1, "local_batch": 64,
                "max_train_records": 600, "epsilon": 8.0, "eval_data": "server"}),
    # the nodes as the groups (dro-groups=node): each node answers with its partition id as every record's group
    ("recursive-spider", {"dro_level": "group", "dro_groups": "node", "partition": "dirichlet",
                          "dirichlet_alpha": 0.3}),
    # the sites as the groups (dro-groups=site): each node answers with its site (num-sites) as every group
    ("recursive-spider", {"dro_level": "group", "dro_groups": "site", "num_sites": 2, "num_clients": 4,
                          "partition": "dirichlet", "dirichlet_alpha": 0.3})])
def test_flower_simulation_equals_single_node(small_config, tmp_path, flower_superlink, algorithm, keys):
    from dpdro.launch.simulate import run_simulation

    local = run_local(small_config(out_dir=str(tmp_path / "local"), algorithm=algorithm, **keys))
    cfg = small_config(out_dir=str(tmp_path / "flower"), algorithm=algorithm, **keys)
    summary = run_simulation(cfg, stream=False, keep_superlink=True)
    flower_params = np.load(tmp_path / "flower" / "final_params.npy")
    assert summary["transport"] == "flower"
    assert np.max(np.abs(flower_params - local.params)) <= 1e-6
    assert summary["epsilon_spent"] == pytest.approx(local.summary["epsilon_spent"], rel=1e-12)
    assert summary["test_accuracy"] == local.summary["test_accuracy"]
    assert summary["releases"] == local.summary["releases"]
    assert summary["checkpoint_returned"] == local.summary["checkpoint_returned"]
    if keys.get("dro_groups") == "node":  # the per-node figures of the node-partitioned test split
        assert summary["per_node_accuracy"] == local.summary["per_node_accuracy"]
        assert len(summary["per_node_accuracy"]) == cfg.num_clients
    # the ServerApp writes the same usable model files as a single-node run
    from dpdro.server.model_files import load_model

    model, spec = load_model(tmp_path / "flower")
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
    assert np.array_equal(flat, flower_params) and spec.factory == "cnn"
    assert (tmp_path / "flower" / "MODEL_CARD.md").is_file() and (tmp_path / "flower" / "plots").is_dir()


def test_plan_prints_the_calibrated_noise_a_run_then_uses(small_config, capsys):
    """`dpdro plan` prints what `dpdro train` will release: the same noise multipliers and delta, and a
    planned epsilon within 1% below the target under the run's accountant."""
    from dpdro.cli import main

    cfg = small_config(epsilon=2.0)
    keys = [f"{k}={v}" for k, v in SMALL.items()] + ["epsilon=2.0", f"out-dir={cfg.out_dir}"]
    assert main(["plan", "--set", *keys]) == 0
    out = capsys.readouterr().out
    assert "n = 3000 training records" in out and "delta 3.33e-05" in out  # auto: 1/(10 n)
    planned = float(out.split("planned epsilon: pld ")[1].split(",")[0])
    assert 0.99 * 2.0 <= planned <= 2.0
    summary = run_local(cfg).summary
    for name, z in summary["noise_multipliers"].items():
        assert f"{z:.4f}" in out, name
