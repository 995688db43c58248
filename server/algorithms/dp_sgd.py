"""Baselines that take one plain (not variance-reduced) DP gradient step per iteration
(docs/explanation/ALGORITHMS.md 6.1):

- ``dp-sgd`` (Abadi et al. 2016): ERM with cross-entropy; g_t = noisy mean of clip_{C_x}(grad l(x_t; xi))
  over a Poisson batch of expected size N (refresh-batch); x_{t+1} = x_t - gamma_x g_t.
- ``dp-sgd-dual``: DP-SGD on z = (x, eta) of the psi-divergence dual (section 1): g_t = noisy mean of
  clip_{C_x}([grad_x L ; d_eta L](x_t, eta_t)); x -= gamma_x g^x, eta -= gamma_eta g^eta.

- ``dp-sgd-la``: DP-SGD on the logit-adjusted loss CE(f(x) + tau log pi, y) (Menon et al. 2021, eq. (10)),
  the standard long-tail baseline: pi is the privately released class histogram of server/setup.py (or
  declared public priors); the logit offset travels with every query. Prediction is argmax f(x) (plus the
  optional post-hoc adjustment of config posthoc-tau).

One mechanism 'grad' per iteration.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ...common.messages import Point, Query
from ..ledger import Mechanism
from .base import Algorithm, State
from .registry import register_algorithm


@dataclasses.dataclass
class SgdState(State):
    """x, x_prev: (d,) float64 iterates; eta: dual variable (dp-sgd-dual only)."""

    x: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))
    x_prev: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))
    eta: float = 0.0


@register_algorithm("dp-sgd")
class DpSgd(Algorithm):
    """DP-SGD on ERM (config keys: its AlgorithmSpec in common/algorithm_specs.py)."""

    quantity = "ce-grad"

    def mechanisms(self) -> list[Mechanism]:
        return [Mechanism("grad", self.rate(self.cfg.refresh_batch))]

    def plan(self) -> dict[Mechanism, int]:
        return {self.mechanisms()[0]: self.cfg.iterations}

    def init_state(self, x0: np.ndarray) -> SgdState:
        x0 = np.asarray(x0, dtype=np.float64)
        # the flat cfg: this class also runs dp-sgd and dp-sgd-la, whose params hold no eta keys (dp-sgd-dual's do)
        return SgdState(x=x0.copy(), x_prev=x0.copy(), eta=self.cfg.eta_init)

    def versions(self, state: SgdState) -> dict[int, np.ndarray]:
        return {state.t: state.x}

    def _dim(self) -> int:
        return self.dim

    def queries(self, state: SgdState) -> list[Query]:
        c = self.cfg
        return [Query(state.t, "grad", self.quantity, (Point(state.t, state.eta),), self.rate(c.refresh_batch),
                      c.clip(c.clip_x), self._dim())]

    def apply(self, state: SgdState, released: dict[str, np.ndarray]) -> SgdState:
        g = released["grad"]
        s = dataclasses.replace(state)
        s.x_prev, s.x = state.x, state.x - self.cfg.lr_x * g[: self.dim]
        if len(g) > self.dim:
            s.eta = state.eta - self.cfg.lr_eta * float(g[self.dim])  # dp-sgd-dual only (init_state: why cfg)
        s.t = state.t + 1
        return s

    def output(self, state: SgdState) -> tuple[np.ndarray, float]:
        return state.x, state.eta

    def diagnostics(self, state: SgdState) -> dict[str, float]:
        return {"step_norm": float(np.linalg.norm(state.x - state.x_prev))}


@register_algorithm("dp-sgd-la")
class DpSgdLA(DpSgd):
    """DP-SGD on the logit-adjusted loss (the loss itself is applied by the engine through the query's offset;
    logit-adjust-tau 'auto' = 1)."""



@register_algorithm("dp-sgd-dual")
class DpSgdDual(DpSgd):
    """DP-SGD on z = (x, eta) of the dual DRO objective (clip-x is the joint clip)."""

    quantity = "dual-joint"

    def noise_profiles(self):
        from ..allocation import NoiseProfile

        return {"grad": NoiseProfile(self.dim + 1, self.cfg.clip_x, 1.0)}

    def _dim(self) -> int:
        return self.dim + 1

    def diagnostics(self, state: SgdState) -> dict[str, float]:
        return {"eta": state.eta, **super().diagnostics(state)}
