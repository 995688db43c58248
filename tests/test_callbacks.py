"""The engine's callbacks (server/callbacks.py): a run's plan is made before any work, a user's callback sees every
point of the loop, a stop request leaves a resumable checkpoint, and config key tensorboard writes the metrics as
TensorBoard scalars equal to metrics.csv's."""

from __future__ import annotations

import csv
import sys

import numpy as np
import pytest

from dpdro.client.local_transport import LocalTransport
from dpdro.common.config import ConfigError
from dpdro.common.data import load_from_config
from dpdro.server.callbacks import Callback
from dpdro.server.engine import TrainingStopped, train
from dpdro.server.run_plan import plan_training

pytestmark = pytest.mark.data


def _train(cfg, **kw):
    train_set, test_set = load_from_config(cfg, True), load_from_config(cfg, False)
    return train(cfg, LocalTransport(cfg, train_set), test_set, **kw)


class Recorder(Callback):
    """Records the hooks called, with the iteration; asks to stop at ``stop_at``."""

    def __init__(self, stop_at: int = 0) -> None:
        self.calls: list[tuple[str, int]] = []
        self.stop_at = stop_at

    def on_start(self, run):
        self.calls.append(("start", run.state.t))

    def on_eval(self, run, row):
        self.calls.append(("eval", row["iteration"]))

    def stop_requested(self, run):
        return run.state.t == self.stop_at

    def on_iteration_end(self, run, done, stop):
        self.calls.append(("end-stop" if stop else "end-done" if done else "end", run.state.t))

    def on_end(self, run):
        self.calls.append(("finished", int(run.summary["iterations"])))

    def close(self):
        self.calls.append(("close", -1))


def test_plan_training_calibrates_what_train_then_spends(small_config):
    cfg = small_config(algorithm="dp-sgd", q=5, diff_batch=512)
    train_set = load_from_config(cfg, True)
    plan = plan_training(cfg, len(train_set.y), train_set.num_classes, train_set.num_groups,
                         tuple(train_set.x.shape[1:]))
    assert {m.name: k for m, k in plan.releases.items()} == {"grad": cfg.iterations}
    assert plan.noise["grad"] > 0 and plan.model.dim == plan.algo.dim and plan.delta == pytest.approx(1 / 30_000)
    result = _train(cfg)
    assert result.summary["noise_multipliers"] == pytest.approx(plan.noise, rel=1e-12)


def test_a_callback_sees_each_point_and_can_stop_the_run_resumably(small_config):
    cfg = small_config(algorithm="dp-sgd", q=5, diff_batch=512)
    seen = Recorder()
    result = _train(cfg, callbacks=[seen])
    assert seen.calls == [("start", 0), ("eval", 0), ("end", 1), ("end", 2), ("eval", 3), ("end", 3), ("end", 4),
                          ("end", 5), ("eval", 6), ("end-done", 6), ("finished", 6), ("close", -1)]
    stopper = Recorder(stop_at=2)
    with pytest.raises(TrainingStopped, match="stopped at iteration 2 of 6"):
        _train(small_config(algorithm="dp-sgd", q=5, diff_batch=512, overwrite=True), callbacks=[stopper])
    assert stopper.calls[-2:] == [("end-stop", 2), ("close", -1)]
    resumed = _train(small_config(algorithm="dp-sgd", q=5, diff_batch=512), resume=True)
    assert np.array_equal(resumed.params, result.params)  # reproducible: the stop and resume change nothing


def test_tensorboard_scalars_equal_the_metrics_file(small_config):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = small_config(algorithm="dp-sgd", q=5, diff_batch=512, tensorboard=True)
    plain = _train(small_config(algorithm="dp-sgd", q=5, diff_batch=512, out_dir=cfg.out_dir + "-plain"))
    result = _train(cfg)
    assert np.array_equal(result.params, plain.params)  # a callback changes no released value
    events = EventAccumulator(f"{cfg.out_dir}/tensorboard")
    events.Reload()
    with open(f"{cfg.out_dir}/metrics.csv") as f:
        rows = list(csv.DictReader(f))
    for key in ("test_accuracy", "epsilon_spent", "worst_class_accuracy"):
        got = [(e.step, e.value) for e in events.Scalars(key)]
        assert [s for s, _ in got] == [int(r["iteration"]) for r in rows] == [0, 3, 6]
        assert [v for _, v in got] == pytest.approx([float(r[key]) for r in rows], rel=1e-5)  # csv: 6 digits


def test_tensorboard_without_the_package_is_a_config_error_before_any_work(small_config, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails
    cfg = small_config(algorithm="dp-sgd", q=5, diff_batch=512, tensorboard=True)
    with pytest.raises(ConfigError, match="config key 'tensorboard': got true, but TensorBoard cannot be imported"):
        _train(cfg)
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())
