"""Heavy-ball momentum (key ``momentum``, docs/explanation/ALGORITHMS.md 5.10): the displacement form of Polyak's
step, applied once for every algorithm in Algorithm.advance, post-processing only."""

import dataclasses

import numpy as np
import pytest

from dpdro.common.config import Config
from dpdro.server.algorithms.base import State, with_momentum
from dpdro.server.algorithms.registry import make_algorithm


@dataclasses.dataclass
class _S(State):
    x: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))


def test_with_momentum_is_heavy_ball_in_displacement_form():
    # steps d_t of a plain method: x_{t+1} = x_t + m_{t+1}, m_{t+1} = mu m_t + d_t, m_1 = d_0
    mu, steps = 0.9, [np.array([1.0, -2.0]), np.array([0.5, 0.5]), np.array([-1.0, 0.0])]
    s = _S(t=0, x=np.zeros(2))
    expected_x, m = np.zeros(2), np.zeros(2)
    for d in steps:
        m = mu * m + d
        expected_x = expected_x + m
        s = with_momentum(s, dataclasses.replace(s, t=s.t + 1, x=s.x + d), mu)
        np.testing.assert_allclose(s.x, expected_x)
        np.testing.assert_allclose(s.velocity, m)
    # x_3 = d0 + (mu d0 + d1) + (mu^2 d0 + mu d1 + d2)
    np.testing.assert_allclose(s.x, (1 + mu + mu**2) * steps[0] + (1 + mu) * steps[1] + steps[2])


def test_with_momentum_off_or_mid_iteration_returns_the_plain_state():
    s = _S(t=3, x=np.ones(2), velocity=np.ones(2))
    moved = dataclasses.replace(s, t=4, x=np.zeros(2))
    assert with_momentum(s, moved, 0.0) is moved
    same_iteration = dataclasses.replace(s, stage=1)  # a stage that does not complete the iteration
    assert with_momentum(s, same_iteration, 0.9) is same_iteration


@pytest.mark.parametrize("algorithm", ["dp-sgd", "dp-double-spider", "recursive-spider", "dp-sgda",
                                       "dp-spiderboost"])
def test_every_algorithm_takes_momentum_steps_with_the_same_queries(algorithm):
    # two iterations with fixed released values: with mu the second step is d_1 + mu d_0, the queries unchanged
    def run(mu):
        cfg = Config.from_mapping({"algorithm": algorithm, "momentum": mu, "iterations": 4, "q": 2}
                                  if algorithm in ("dp-double-spider", "recursive-spider", "dp-spiderboost")
                                  else {"algorithm": algorithm, "momentum": mu, "iterations": 4})
        alg = make_algorithm(cfg, n=1000, dim=3, num_classes=2)
        state = alg.start_state(np.zeros(3))
        rng = np.random.default_rng(0)
        xs, names = [state.x.copy()], []
        while state.t < 2:
            qs = alg.queries(state)
            names.append(sorted(q.mechanism for q in qs))
            released = {q.mechanism: rng.normal(size=q.dim) * 0.1 for q in qs}
            state = alg.advance(state, released)
            if state.stage == 0:
                xs.append(state.x.copy())
        return xs, names

    (x0, x1, x2), names_plain = run(0.0)
    (y0, y1, y2), names_mom = run(0.5)
    assert names_plain == names_mom
    np.testing.assert_allclose(y1, x1)  # the first step has no momentum yet
    # the second plain step d_1 is taken from the same point x_1 with the same released values, so
    # y_2 = y_1 + d_1 + mu d_0 whenever the algorithm's step does not depend on x itself
    d0, d1 = x1 - x0, x2 - x1
    np.testing.assert_allclose(y2, y1 + d1 + 0.5 * d0, rtol=1e-6, atol=1e-9)


def test_momentum_range_is_checked_before_work():
    with pytest.raises(Exception, match="momentum"):
        Config.from_mapping({"momentum": 1.0})
