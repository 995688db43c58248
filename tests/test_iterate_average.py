"""The iterate average (key ``ema-decay``, docs/explanation/ALGORITHMS.md 5.11): an exponential moving average of the
model's iterates, what evaluations and the run return; training steps from the iterates themselves."""

import dataclasses

import numpy as np
import pytest

from dpdro.common.config import Config, ConfigError
from dpdro.server.algorithms.base import State, average_weight, with_average
from dpdro.server.algorithms.registry import make_algorithm


@dataclasses.dataclass
class _S(State):
    x: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))


def test_average_is_the_plain_mean_then_an_exponential_average():
    decay = 0.75  # 1 / (1 - decay) = 4: the plain mean over x_1..x_4, then a_t = 0.75 a_{t-1} + 0.25 x_t
    xs = [np.array([float(v), -2.0 * v]) for v in (3, 1, 4, 1, 5, 9)]
    s = _S(t=0, x=np.zeros(2))
    for t, x in enumerate(xs, start=1):
        s = with_average(dataclasses.replace(s, t=t, x=x), decay)
        if t <= 4:
            np.testing.assert_allclose(s.x_average, np.mean(xs[:t], axis=0))
    a4 = np.mean(xs[:4], axis=0)
    np.testing.assert_allclose(s.x_average, 0.75 * (0.75 * a4 + 0.25 * xs[4]) + 0.25 * xs[5])


@pytest.mark.parametrize(("t", "decay", "expected"), [(1, 0.9, 0.0), (2, 0.9, 0.5), (10, 0.9, 0.9), (100, 0.9, 0.9),
                                                      (5, 0.0, 0.0)])
def test_average_weight(t, decay, expected):
    assert average_weight(t, decay) == pytest.approx(expected)


@pytest.mark.parametrize(("t", "decay"), [(0, 0.5), (3, 1.0), (3, -0.1)])
def test_average_weight_refuses_what_it_cannot_mean(t, decay):
    with pytest.raises(ValueError, match="ema-decay"):
        average_weight(t, decay)


def test_average_off_returns_the_state_itself():
    s = _S(t=3, x=np.ones(2))
    assert with_average(s, 0.0) is s


@pytest.mark.parametrize("algorithm", ["dp-sgd", "dp-double-spider", "recursive-spider", "dp-sgda",
                                       "dp-spiderboost"])
def test_every_algorithm_returns_the_average_and_steps_from_the_iterates(algorithm):
    # the same released values with and without the average: the iterates and queries are identical, and
    # ``returned`` gives the mean of the iterates x_1..x_3 (decay 0.9: still the plain mean at t = 3)
    def run(decay):
        keys = {"algorithm": algorithm, "ema-decay": decay, "iterations": 4}
        if algorithm in ("dp-double-spider", "recursive-spider", "dp-spiderboost"):
            keys["q"] = 2
        alg = make_algorithm(Config.from_mapping(keys), n=1000, dim=3, num_classes=2)
        state = alg.start_state(np.zeros(3))
        rng = np.random.default_rng(0)
        xs, names = [], []
        while state.t < 3:
            qs = alg.queries(state)
            names.append(sorted(q.mechanism for q in qs))
            state = alg.advance(state, {q.mechanism: rng.normal(size=q.dim) * 0.1 for q in qs})
            if state.stage == 0:
                xs.append(state.x.copy())
        return alg, state, xs, names

    _, plain_state, plain_xs, plain_names = run(0.0)
    alg, state, xs, names = run(0.9)
    assert names == plain_names
    np.testing.assert_allclose(np.array(xs), np.array(plain_xs))
    np.testing.assert_allclose(alg.returned(state)[0], np.mean(xs, axis=0), atol=1e-12)
    assert alg.returned(state)[1] == alg.output(state)[1]
    np.testing.assert_allclose(make_algorithm(Config.from_mapping({"algorithm": algorithm}), n=1000, dim=3,
                                              num_classes=2).returned(plain_state)[0], plain_xs[-1])


def test_average_survives_a_checkpoint():
    s = with_average(_S(t=1, x=np.array([1.0, 2.0])), 0.9)
    arrays, scalars = s.to_arrays()
    back = _S.from_arrays(arrays, scalars)
    np.testing.assert_allclose(back.x_average, s.x_average)


@pytest.mark.parametrize("value", [-0.1, 1.0])
def test_ema_decay_range_is_checked_before_work(value):
    with pytest.raises(ConfigError, match="ema-decay"):
        Config.from_mapping({"ema-decay": value})


def test_ema_decay_with_a_random_output_iterate_is_refused():
    with pytest.raises(ConfigError, match="ema-decay.*output-iterate"):
        Config.from_mapping({"algorithm": "dp-double-spider", "ema-decay": 0.9, "output-iterate": "random"})


def _run_dir(path, rows):
    import csv

    path.mkdir()
    with (path / "metrics.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return path


def test_average_gain_is_the_paired_difference_of_the_final_rows(tmp_path):
    from dpdro.simulations.average_gain import main, paired_lines

    runs = [_run_dir(tmp_path / f"r{i}", [
        {"iteration": 0, "test_accuracy": 0.1, "worst_class_accuracy": 0.0, "last_iterate_accuracy": 0.1,
         "last_iterate_worst_class_accuracy": 0.0},
        {"iteration": 10, "test_accuracy": 0.9, "worst_class_accuracy": w, "last_iterate_accuracy": 0.88,
         "last_iterate_worst_class_accuracy": w - d}]) for i, (w, d) in enumerate([(0.8, 0.02), (0.7, 0.04)])]
    lines = paired_lines(runs)
    assert "| r0 | 10 | 0.800 | 0.780 | 0.900 | 0.880 |" in lines
    worst = next(x for x in lines if x.startswith("- worst class"))
    assert "+0.030 +/- 0.014 over 2 runs" in worst  # mean of 0.02 and 0.04, sd 0.0141
    accuracy = next(x for x in lines if x.startswith("- accuracy"))
    assert "+0.020 +/- 0.000" in accuracy and "better" in accuracy
    plain = _run_dir(tmp_path / "plain", [{"iteration": 0, "test_accuracy": 0.5, "worst_class_accuracy": 0.1}])
    assert main([str(runs[0]), str(plain)]) == 2
