"""Private SpiderBoost (Arora et al. 2023) on z = (x, eta) of the psi-divergence dual, z treated as one
variable: one SPIDER estimator, one clip and one Poisson batch per release (docs/explanation/ALGORITHMS.md 6.1 (c)); the
contrast with DP Double-SPIDER, which has separate estimators, clips and batches for x and eta.

    t mod q == 0: g_t = noisy mean of clip_{C_x}(grad_z L(z_t))                                'refresh'
    otherwise:    g_t = g_{t-1} + noisy mean of clip_{C_t}(grad_z L(z_t) - grad_z L(z_{t-1}))  'diff'
                  C_t = min(C_diff ||z_t - z_{t-1}||, C_max)
    x -= gamma_x g^x, eta -= gamma_eta g^eta
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from ...common.messages import Point, Query
from ..allocation import NoiseProfile
from ..ledger import Mechanism
from .base import Algorithm
from .dp_sgd import SgdState
from .registry import register_algorithm


@dataclasses.dataclass
class SpiderBoostState(SgdState):
    """Adds eta_prev and the estimator g (d + 1,)."""

    eta_prev: float = 0.0
    g: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))


@register_algorithm("dp-spiderboost")
class DpSpiderBoost(Algorithm):
    """DP-SpiderBoost on z = (x, eta) (config keys: its AlgorithmSpec in common/algorithm_specs.py)."""


    def mechanisms(self) -> list[Mechanism]:
        c, p = self.cfg, self.params
        return [Mechanism("refresh", self.rate(c.refresh_batch)), Mechanism("diff", self.rate(p.diff_batch))]

    def plan(self) -> dict[Mechanism, int]:
        refreshes = math.ceil(self.cfg.iterations / self.params.q)
        ref, diff = self.mechanisms()
        return {ref: refreshes, diff: self.cfg.iterations - refreshes}

    def init_state(self, x0: np.ndarray) -> SpiderBoostState:
        x0 = np.asarray(x0, dtype=np.float64)
        e = self.params.eta_init
        return SpiderBoostState(x=x0.copy(), x_prev=x0.copy(), eta=e, eta_prev=e, g=np.zeros(len(x0) + 1))

    def noise_profiles(self) -> dict[str, NoiseProfile]:
        c, p = self.cfg, self.params
        return {"refresh": NoiseProfile(self.dim + 1, c.clip_x, p.q),
                "diff": NoiseProfile(self.dim + 1, p.clip_diff_max, p.q / 2)}

    def spider_pairs(self) -> list[tuple[str, str]]:
        return [("refresh", "diff")]

    def versions(self, state: SpiderBoostState) -> dict[int, np.ndarray]:
        return {state.t: state.x, state.t - 1: state.x_prev} if state.t > 0 else {0: state.x}

    def queries(self, state: SpiderBoostState) -> list[Query]:
        c, p, t = self.cfg, self.params, state.t
        now = Point(t, state.eta)
        if t % p.q == 0:
            return [Query(t, "refresh", "dual-joint", (now,), self.rate(c.refresh_batch),
                          c.clip(c.clip_x), self.dim + 1)]
        dist = math.hypot(float(np.linalg.norm(state.x - state.x_prev)), state.eta - state.eta_prev)
        clip = c.clip(min(p.clip_diff * dist, p.clip_diff_max))
        return [Query(t, "diff", "dual-joint", (now, Point(t - 1, state.eta_prev)), self.rate(p.diff_batch), clip,
                      self.dim + 1)]

    def apply(self, state: SpiderBoostState, released: dict[str, np.ndarray]) -> SpiderBoostState:
        g = released["refresh"] if "refresh" in released else state.g + released["diff"]
        s = dataclasses.replace(state)
        s.g = g
        s.x_prev, s.x = state.x, state.x - self.cfg.lr_x * g[: self.dim]
        s.eta_prev, s.eta = state.eta, state.eta - self.params.lr_eta * float(g[self.dim])
        s.t = state.t + 1
        return s

    def output(self, state: SpiderBoostState) -> tuple[np.ndarray, float]:
        return state.x, state.eta

    def diagnostics(self, state: SpiderBoostState) -> dict[str, float]:
        return {"eta": state.eta, "step_norm": float(np.linalg.norm(state.x - state.x_prev))}
