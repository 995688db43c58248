"""A toy algorithm in one file (CONTRIBUTING.md): private gradient descent with momentum on the cross-entropy,
with its own per-record quantity and its own config key (toy-beta). Registering it takes the two decorators below;
tests/test_plugins.py trains it.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from dpdro.common.algorithm_specs import AlgorithmSpec
from dpdro.common.config_schema import param
from dpdro.common.messages import Point, Query
from dpdro.common.quantities import register_quantity
from dpdro.server.algorithms import Algorithm, State, register_algorithm
from dpdro.server.ledger import Mechanism


@register_quantity("toy-ce-grad")
def toy_ce_grad(model, flat, scalar, x, y, problem, extra=()):
    """grad_x l(x; xi) of the cross-entropy per record, (B, d)."""
    return model.losses_and_grads(flat, x, y, problem.offset)[1]


@dataclasses.dataclass
class ToyState(State):
    """x: (d,) float64 iterate; m: (d,) momentum."""

    x: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))
    m: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))


MOMENTUM = param("toy-beta", "float", 0.5, "Weight of the past in toy-momentum's m <- toy-beta m + g.", low=0.0,
                 high=1.0, high_open=True)


@register_algorithm(AlgorithmSpec("toy-momentum", keys=("refresh-batch", "clip-x", "lr-x", "toy-beta"),
                                  quantities=("toy-ce-grad",), params=(MOMENTUM,)))
class ToyMomentum(Algorithm):
    """x <- x - lr (m <- toy-beta m + g), g the noisy mean of clipped per-record gradients: one release per step."""

    def mechanisms(self) -> list[Mechanism]:
        return [Mechanism("grad", self.rate(self.cfg.refresh_batch))]

    def plan(self) -> dict[Mechanism, int]:
        return {self.mechanisms()[0]: self.cfg.iterations}

    def init_state(self, x0: np.ndarray) -> ToyState:
        return ToyState(x=np.asarray(x0, dtype=np.float64).copy(), m=np.zeros(len(x0)))

    def queries(self, state: ToyState) -> list[Query]:
        c = self.cfg
        return [Query(state.t, "grad", "toy-ce-grad", (Point(state.t, 0.0),), self.rate(c.refresh_batch),
                      c.clip(c.clip_x), self.dim)]

    def apply(self, state: ToyState, released: dict[str, np.ndarray]) -> ToyState:
        m = self.params.toy_beta * state.m + released["grad"]
        return ToyState(t=state.t + 1, x=state.x - self.cfg.lr_x * m, m=m)

    def versions(self, state: ToyState) -> dict[int, np.ndarray]:
        return {state.t: state.x}

    def output(self, state: ToyState) -> tuple[np.ndarray, float]:
        return state.x, 0.0
