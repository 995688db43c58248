"""DP Double-SPIDER (seed paper, Algorithm 2; ALGORITHMS.md section 3).

Minimises the dual psi-divergence DRO objective (1/n) sum_i L(x, eta; xi_i) jointly in the model x and the
dual variable eta, with one SPIDER estimator per block:

    eta block at (x_t, eta_t):
      t mod q == 0: a_t = (1/N1) [sum_{B1} clip_{C_eta}(d_eta L(x_t, eta_t)) + N(0, (z_1 C_eta)^2)]       'eta-refresh'
      else:         a_t = a_{t-1} + (1/N2) [sum_{B2} clip_{C_t}(d_eta L(x_t, eta_t) - d_eta L(x_{t-1}, eta_{t-1}))
                                            + N(0, (z_2 C_t)^2)]                                          'eta-diff'
      eta_{t+1} = eta_t - gamma_eta a_t
    x block at (x_t, eta_{t+1}):
      t mod q == 0: b_t = (1/N3) [sum_{B3} clip_{C_x}(grad_x L(x_t, eta_{t+1})) + N(0, (z_3 C_x)^2 I)]      'x-refresh'
      else:         b_t = b_{t-1} + (1/N4) [sum_{B4} clip_{C_t}(grad_x L(x_t, eta_{t+1}) - grad_x L(x_{t-1}, eta_t))
                                            + N(0, (z_4 C_t)^2 I)]                                        'x-diff'
      x_{t+1} = x_t - gamma_x b_t

Each mechanism samples its own Poisson batch. The difference clip is C_t = min(C_diff * Delta_t, C_max), with
Delta_t the Euclidean distance between the two (x, eta) points at which that mechanism evaluates each
record; both points are released iterates, so C_t is public. The clip (not a smoothness assumption) bounds
the sensitivity, so privacy holds even where the assumptions fail. Sums are normalised by the expected
batch size N_k (never the realised count). Output: the last iterate, or (key output-iterate=random) the
iterate x_tau with tau drawn uniformly from {0..T-1} by a public coin before training, as in the theory.

Stages: 0 = eta block (needs x_t, x_{t-1}), 1 = x block. Model version id k is the iterate x_k.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from ...common.messages import Point, Query
from ...common.rng import site_rng
from ..ledger import Mechanism
from .base import Algorithm, State


@dataclasses.dataclass
class DoubleSpiderState(State):
    """x, x_prev: (d,) float64 iterates x_t and x_{t-1}; eta, eta_prev: eta_t, eta_{t-1}; eta_next:
    eta_{t+1} once the eta block ran; a: eta estimator; b: (d,) x estimator; tau and x_out/eta_out: the
    output iterate for output-iterate=random; last_clip_diff: C_t of the latest difference release."""

    x: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))
    x_prev: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))
    eta: float = 0.0
    eta_prev: float = 0.0
    eta_next: float = 0.0
    a: float = 0.0
    b: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))
    tau: int = -1
    x_out: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))
    eta_out: float = 0.0


class DoubleSpider(Algorithm):
    """DP Double-SPIDER. Config keys: q, refresh-batch (N1 = N3), diff-batch (N2 = N4), lr-x, lr-eta, clip-x,
    clip-eta, clip-diff, clip-diff-max, eta-noise-ratio, output-iterate, psi, lambda, eta-scale, eta-init."""

    name = "dp-double-spider"

    def mechanisms(self) -> list[Mechanism]:
        c = self.cfg
        ref, diff = self.rate(c.refresh_batch), self.rate(c.diff_batch)
        return [Mechanism("eta-refresh", ref, c.eta_noise_ratio), Mechanism("eta-diff", diff, c.eta_noise_ratio),
                Mechanism("x-refresh", ref, 1.0), Mechanism("x-diff", diff, 1.0)]

    def plan(self) -> dict[Mechanism, int]:
        T, q = self.cfg.iterations, self.cfg.q
        refreshes = math.ceil(T / q)
        m = {mech.name: mech for mech in self.mechanisms()}
        return {m["eta-refresh"]: refreshes, m["eta-diff"]: T - refreshes,
                m["x-refresh"]: refreshes, m["x-diff"]: T - refreshes}

    def init_state(self, x0: np.ndarray) -> DoubleSpiderState:
        c = self.cfg
        tau = -1
        if c.output_iterate == "random":  # public coin, independent of the data
            tau = int(site_rng(c.reproducible, c.seed, "output-iterate").integers(c.iterations))
        x0 = np.asarray(x0, dtype=np.float64)
        return DoubleSpiderState(x=x0.copy(), x_prev=x0.copy(), eta=c.eta_init, eta_prev=c.eta_init,
                                 eta_next=c.eta_init, b=np.zeros_like(x0), tau=tau, x_out=x0.copy(),
                                 eta_out=c.eta_init)

    def versions(self, state: DoubleSpiderState) -> dict[int, np.ndarray]:
        return {state.t: state.x, state.t - 1: state.x_prev} if state.t > 0 else {0: state.x}

    def _diff_clip(self, dx: float, deta: float) -> float:
        if not self.cfg.private:
            return math.inf
        return min(self.cfg.clip_diff * math.hypot(dx, deta), self.cfg.clip_diff_max)

    def queries(self, state: DoubleSpiderState) -> list[Query]:
        c, t = self.cfg, state.t
        refresh = t % c.q == 0
        inf = math.inf
        if state.stage == 0:
            if refresh:
                return [Query(t, "eta-refresh", "dual-eta", (Point(t, state.eta),), self.rate(c.refresh_batch),
                              c.clip_eta if c.private else inf, 1)]
            dx = float(np.linalg.norm(state.x - state.x_prev))
            clip = self._diff_clip(dx, state.eta - state.eta_prev)
            return [Query(t, "eta-diff", "dual-eta", (Point(t, state.eta), Point(t - 1, state.eta_prev)),
                          self.rate(c.diff_batch), clip, 1)]
        if refresh:
            return [Query(t, "x-refresh", "dual-x", (Point(t, state.eta_next),), self.rate(c.refresh_batch),
                          c.clip_x if c.private else inf, self.dim)]
        dx = float(np.linalg.norm(state.x - state.x_prev))
        clip = self._diff_clip(dx, state.eta_next - state.eta)
        return [Query(t, "x-diff", "dual-x", (Point(t, state.eta_next), Point(t - 1, state.eta)),
                      self.rate(c.diff_batch), clip, self.dim)]

    def apply(self, state: DoubleSpiderState, released: dict[str, np.ndarray]) -> DoubleSpiderState:
        c = self.cfg
        s = dataclasses.replace(state)
        if state.stage == 0:
            if "eta-refresh" in released:
                s.a = float(released["eta-refresh"][0])
            else:
                s.a = state.a + float(released["eta-diff"][0])
            s.eta_next = state.eta - c.lr_eta * s.a
            s.stage = 1
            return s
        b = released["x-refresh"] if "x-refresh" in released else state.b + released["x-diff"]
        if state.t == state.tau:
            s.x_out, s.eta_out = state.x.copy(), state.eta
        s.b = b
        s.x_prev, s.x = state.x, state.x - c.lr_x * b
        s.eta_prev, s.eta = state.eta, state.eta_next
        s.t, s.stage = state.t + 1, 0
        return s

    def output(self, state: DoubleSpiderState) -> tuple[np.ndarray, float]:
        if self.cfg.output_iterate == "random" and state.t >= self.cfg.iterations:
            return state.x_out, state.eta_out
        return state.x, state.eta

    def diagnostics(self, state: DoubleSpiderState) -> dict[str, float]:
        return {"eta": state.eta, "step_norm": float(np.linalg.norm(state.x - state.x_prev))}
