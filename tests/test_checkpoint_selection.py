"""checkpoint-select=private-best (server/checkpoint_selection.py): the noisy validation score and its choice, bad
input refused before any work, the ledger charging exactly the planned evaluations, the returned parameters being
the evaluated iterate with the best noisy score, and resuming keeping the choice."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from dpdro.client.local_transport import LocalTransport
from dpdro.common.config import ConfigError
from dpdro.common.data import load_from_config
from dpdro.server import checkpoint_selection as cs
from dpdro.server import node_evaluation as ne
from dpdro.server.callbacks import Callback
from dpdro.server.engine import ResumeError, TrainingStopped, train
from dpdro.server.ledger import epsilon_of

PRIVATE_BEST = {"algorithm": "dp-sgd", "q": 5, "diff_batch": 512, "checkpoint_select": "private-best",
                "eval_split": "validation", "validation_fraction": 0.2, "eval_every": 2, "eval_epsilon": 0.3}


def _row(t, per_class, acc=None):
    acc = float(np.mean(per_class)) if acc is None else acc
    return {"iteration": t, "per_class_accuracy": per_class, "test_accuracy": acc,
            "worst_class_accuracy": float(np.nanmin(per_class)) if not all(map(math.isnan, per_class)) else math.nan}


def test_the_score_is_the_noisy_worst_class_and_the_first_best_wins():
    rows = [_row(0, [0.2, 0.9]), _row(2, [0.6, 0.7]), _row(4, [0.9, 0.6]), _row(6, [0.6, 0.7]),
            _row(8, [math.nan, math.nan], math.nan)]
    assert cs.score(rows[1]) == pytest.approx(0.6, abs=1e-4) and cs.score(rows[4]) == -math.inf
    # rows 1, 2 and 3 tie on the worst class (0.6) and the two-lowest mean; row 2's accuracy 0.75 > 0.65
    assert cs.score(rows[2]) > cs.score(rows[1]) == cs.score(rows[3])
    best = None
    for r in rows:
        best = cs.offer(best, r, np.full(3, float(r["iteration"])))
    assert best.iteration == 4 and np.array_equal(best.params, np.full(3, 4.0)) and cs.best_index(rows) == 2
    tie = cs.offer(cs.offer(None, rows[1], np.zeros(3)), rows[3], np.ones(3))
    assert tie.iteration == 2 and not tie.params.any()  # the first of equal scores


def test_a_checkpoint_whose_choice_disagrees_with_its_rows_is_refused():
    rows = [_row(0, [0.2, 0.9]), _row(2, [0.6, 0.7])]
    meta = cs.checkpoint_meta(cs.Selected(2, cs.score(rows[1]), np.ones(3)))
    assert cs.from_checkpoint(np.ones(3), meta, rows, "c").iteration == 2
    assert cs.from_checkpoint(None, {}, [], "c") is None  # stopped before the first evaluation
    with pytest.raises(cs.SelectionResumeError, match="metric rows choose iteration 2"):
        cs.from_checkpoint(np.ones(3), {cs.META_KEY: {"iteration": 0}}, rows, "c")
    with pytest.raises(cs.SelectionResumeError, match="holds no chosen iterate"):
        cs.from_checkpoint(None, {}, rows, "c")


def test_bad_input_is_refused_before_any_work(small_config):
    with pytest.raises(ConfigError, match="'checkpoint-select': got 'private-best' with eval-data='server'"):
        small_config(**{**PRIVATE_BEST, "eval_data": "server"})
    with pytest.raises(ConfigError, match="'checkpoint-select': got 'private-best' with eval-split='test'"):
        small_config(**{**PRIVATE_BEST, "eval_split": "test"})
    with pytest.raises(ConfigError, match="'eval-split': got 'validation'; allowed only with validation-fraction"):
        small_config(**{**PRIVATE_BEST, "validation_fraction": 0.0})
    with pytest.raises(ConfigError, match="eval-every"):
        small_config(**{**PRIVATE_BEST, "eval_every": 0})
    with pytest.raises(ConfigError, match="checkpoint-select"):
        small_config(checkpoint_select="best")
    # evaluations alone spending most of the budget: refused when planned (node_evaluation.mechanisms)
    with pytest.raises(ConfigError, match="eval-every"):
        ne.mechanisms(small_config(**{**PRIVATE_BEST, "eval_epsilon": 2.0}), 1e-5)
    cfg = small_config(**PRIVATE_BEST)
    assert ne.evaluates_on_nodes(cfg) and not ne.evaluates_on_nodes(small_config())  # auto follows the selection


class Iterates(Callback):
    """Records the iterate evaluated at each evaluation (iteration -> (d,) copy); asks to stop at ``stop_at``."""

    def __init__(self, stop_at: int = 0) -> None:
        self.x: dict[int, np.ndarray] = {}
        self.stop_at = stop_at

    def on_eval(self, run, row):
        self.x[int(row["iteration"])] = np.array(run.plan.algo.output(run.state)[0], copy=True)

    def stop_requested(self, run):
        return run.state.t == self.stop_at


def _train(cfg, **kw):
    train_set, val = load_from_config(cfg, True), load_from_config(cfg, False)
    return train(cfg, LocalTransport(cfg, train_set, held_out=val), val, **kw)


@pytest.mark.data
def test_private_best_charges_the_planned_evaluations_and_returns_the_best_noisy_iterate(small_config):
    from dpdro.cli.plan import privacy_plan

    cfg = small_config(**PRIVATE_BEST)  # iterations 6, eval-every 2: evaluations at 0, 2, 4, 6
    planned = privacy_plan(cfg)
    split = planned["epsilon_split"]
    assert split["checkpoint_select"] == "private-best" and split["evaluations_count"] == ne.evaluations(6, 2) == 4
    assert max(split["evaluations"], split["training"]) < planned["planned_epsilon"]["pld"] <= cfg.epsilon
    seen = Iterates()
    result = _train(cfg, callbacks=[seen])
    s, rows = result.summary, result.metrics
    events = [json.loads(line) for line in open(f"{cfg.out_dir}/events.jsonl")]
    assert s["releases"]["eval-counts"] == sum(e["mechanism"] == "eval-counts" for e in events) == 4
    assert [r["iteration"] for r in rows] == [0, 2, 4, 6] and s["epsilon_spent"] <= cfg.epsilon
    z = s["noise_multipliers"]["eval-counts"]
    assert z == pytest.approx(ne.eval_noise_multiplier(0.3, s["delta"]))
    i = int(np.argmax([cs.score(r) for r in rows]))
    returned = s["checkpoint_returned"]
    assert returned["iteration"] == rows[i]["iteration"] and returned["candidates"] == 4 and returned["accounted"]
    assert returned["evaluations_epsilon"] == pytest.approx(epsilon_of({(1.0, z): 4}, s["delta"]))
    assert returned["evaluations_epsilon"] == pytest.approx(split["evaluations"], rel=1e-6)
    assert np.array_equal(result.params, seen.x[rows[i]["iteration"]])
    assert np.array_equal(np.load(f"{cfg.out_dir}/final_params.npy"), result.params)
    assert s["worst_class_accuracy"] == rows[i]["worst_class_accuracy"]  # the chosen evaluation's noisy figures
    assert not any("validation metrics" in line for line in s["not_accounted"])  # charged: not listed
    card = open(f"{cfg.out_dir}/MODEL_CARD.md").read()
    assert f"- Returned: the iterate of iteration {returned['iteration']} of 6, chosen among 4 evaluations" in card


@pytest.mark.data
def test_the_returned_iterate_is_the_chosen_one_not_the_last_and_resuming_keeps_it(small_config, monkeypatch):
    # a score that prefers iteration 2 (the run's own noisy scores mostly rise to the end): the wiring, not the score
    monkeypatch.setattr(cs, "score", lambda row: -abs(int(row["iteration"]) - 2))
    cfg = small_config(**PRIVATE_BEST)
    seen = Iterates()
    whole = _train(cfg, callbacks=[seen])
    assert whole.summary["checkpoint_returned"]["iteration"] == 2 and np.array_equal(whole.params, seen.x[2])
    assert not np.array_equal(whole.params, seen.x[6])
    with pytest.raises(TrainingStopped, match="stopped at iteration 3 of 6"):
        _train(small_config(**PRIVATE_BEST, overwrite=True), callbacks=[Iterates(stop_at=3)])
    with pytest.raises(ResumeError, match="'eval-every': got 3; the run .* was planned with eval-every = 2"):
        _train(small_config(**{**PRIVATE_BEST, "eval_every": 3}), resume=True)
    monkeypatch.setattr(cs, "score", lambda row: -abs(int(row["iteration"]) - 2) if row["iteration"] <= 3 else -9)
    resumed = _train(small_config(**PRIVATE_BEST), resume=True)
    assert resumed.summary["checkpoint_returned"]["iteration"] == 2  # chosen before the stop, kept over it
    assert np.array_equal(resumed.params, whole.params)  # reproducible: the stop and resume change nothing
    assert resumed.summary["releases"]["eval-counts"] == 4
