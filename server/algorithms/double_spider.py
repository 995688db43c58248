"""DP Double-SPIDER (seed paper, Algorithm 2; docs/explanation/ALGORITHMS.md section 3).

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

block-order=simultaneous (docs/explanation/ALGORITHMS.md 3.4): the x block is evaluated at (x_t, eta_t) and its
difference against (x_{t-1}, eta_{t-1}), the points of the eta block, so both releases go out in one round (stage 0
only); the releases, clips and sensitivities are those above with eta_{t+1} replaced by eta_t (Jacobi instead of
Gauss-Seidel order).

dro-clip=weight-after-clip (docs/explanation/ALGORITHMS.md 5.4) replaces the per-record x quantity clip_C(w grad l) by
w~ clip_C(grad l), w~ the weight of the loss clamped at the public bound B: the weights survive clipping. Its
refresh clips at (and adds noise for) the sensitivity C W_t, W_t = psi*'((B - G eta_{t+1}) / lambda) the public
bound of w~ at the released eta_{t+1}; its differences keep the clip C_t; the eta block uses the same clamped
weights.

eta-clip-rule=weight-bound (docs/explanation/ALGORITHMS.md 3.1): the fixed clip C_eta of G (1 - w) biases eta wherever
some weight exceeds 1 + C_eta / G (the high-loss records' pull on eta is cut, eta sinks, every weight grows: for kl,
lambda 1 the fixed point was eta 0.056 against the dual optimum 3.97). Instead the weights are those of
min(l, B) (capped at weight-cap), so 0 <= w <= W_t = min(psi*'((B - G eta_t) / lambda), W_cap), and the
eta-refresh clips at its public range bound C_eta,t = G max(1, W_t - 1): it clips nothing, its sensitivity is
C_eta,t, and with noise 0 and the full batch eta's fixed point is the exact dual optimum of the clamped
(capped) losses. The x block then uses the same weights.

weight-cap = W_cap < inf: every weight is min(w, W_cap) in both blocks (the divergence with likelihood ratios
<= W_cap). With weight-after-clip the x-refresh's sensitivity becomes C min(W_t, W_cap): a small public cap
(2-3) instead of the worst-case bound W_t.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from ...common.messages import Point, Query
from ...common.psi import make_psi
from ...common.quantities import dro_weight_bound
from ...common.rng import site_rng
from ..allocation import NoiseProfile
from ..ledger import Mechanism
from . import diff_levers as levers
from .base import Algorithm, State
from .group_dro import GroupDoubleSpider
from .registry import register_algorithm


@dataclasses.dataclass
class DoubleSpiderState(State):
    """x, x_prev: (d,) float64 iterates x_t and x_{t-1}; eta, eta_prev: eta_t, eta_{t-1}; eta_next:
    eta_{t+1} once the eta block ran; a: eta estimator; b: (d,) x estimator; tau and x_out/eta_out: the
    output iterate for output-iterate=random; clip_diff: the x block's C_diff under clip-diff-rule='private-quantile'
    (0: the configured clip-diff; diff_levers.py)."""

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
    clip_diff: float = 0.0


@register_algorithm("dp-double-spider")
class DoubleSpider(Algorithm):
    """DP Double-SPIDER: refresh-batch is N1 = N3, diff-batch N2 = N4 (config keys: its AlgorithmSpec in
    common/algorithm_specs.py)."""


    @classmethod
    def variant_for(cls, cfg) -> type[Algorithm]:
        """dro-level=group runs ``GroupDoubleSpider`` (server/algorithms/group_dro.py)."""
        return GroupDoubleSpider if cfg.dro_level == "group" else cls

    def mechanisms(self) -> list[Mechanism]:
        c, p = self.cfg, self.params
        ref, diff = self.rate(c.refresh_batch), self.rate(p.diff_batch)
        quantile = ([Mechanism("x-diff" + levers.QUANTILE_SUFFIX, diff, p.clip_diff_quantile_noise_ratio)]
                    if levers.quantile_rule(p) else [])
        return [Mechanism("eta-refresh", ref, p.eta_noise_ratio), Mechanism("eta-diff", diff, p.eta_noise_ratio),
                Mechanism("x-refresh", ref, 1.0), Mechanism("x-diff", diff, 1.0), *quantile]

    def plan(self) -> dict[Mechanism, int]:
        T, q = self.cfg.iterations, self.params.q
        refreshes = math.ceil(T / q)
        m = {mech.name: mech for mech in self.mechanisms()}
        out = {m["eta-refresh"]: refreshes, m["eta-diff"]: T - refreshes,
               m["x-refresh"]: refreshes, m["x-diff"]: T - refreshes}
        if levers.quantile_rule(self.params):
            out[m["x-diff" + levers.QUANTILE_SUFFIX]] = T - refreshes
        return out

    def init_state(self, x0: np.ndarray) -> DoubleSpiderState:
        c, p = self.cfg, self.params
        tau = -1
        if p.output_iterate == "random":  # public coin, independent of the data
            tau = int(site_rng(c.reproducible, c.seed, "output-iterate").integers(c.iterations))
        x0 = np.asarray(x0, dtype=np.float64)
        return DoubleSpiderState(x=x0.copy(), x_prev=x0.copy(), eta=p.eta_init, eta_prev=p.eta_init,
                                 eta_next=p.eta_init, b=np.zeros_like(x0), tau=tau, x_out=x0.copy(),
                                 eta_out=p.eta_init, clip_diff=p.clip_diff)

    def versions(self, state: DoubleSpiderState) -> dict[int, np.ndarray]:
        return {state.t: state.x, state.t - 1: state.x_prev} if state.t > 0 else {0: state.x}

    def noise_profiles(self) -> dict[str, NoiseProfile]:
        c, p, q = self.cfg, self.params, self.params.q
        # Nominal clips (a proxy, fixed before training): the data-free bounds at the public eta-init.
        x_clip = c.clip_x * p.weight_cap if self.weight_after_clip and math.isfinite(p.weight_cap) else c.clip_x
        a = levers.storm_a(p)
        w_ref, w_diff = levers.storm_weights(q, a)
        out = {"eta-refresh": NoiseProfile(1, self.eta_clip(p.eta_init), q),
               "eta-diff": NoiseProfile(1, p.clip_diff_max, q / 2),
               "x-refresh": NoiseProfile(self.dim, x_clip, w_ref),
               "x-diff": NoiseProfile(self.dim, levers.storm_clip(a, x_clip, p.clip_diff_max), w_diff)}
        if levers.quantile_rule(p):
            out["x-diff" + levers.QUANTILE_SUFFIX] = NoiseProfile(1, 1.0, 1.0)
        return out

    def spider_pairs(self) -> list[tuple[str, str]]:
        return [("eta-refresh", "eta-diff"), ("x-refresh", "x-diff")]

    @property
    def weight_after_clip(self) -> bool:
        return self.params.dro_clip == "weight-after-clip"

    @property
    def eta_clip_from_bound(self) -> bool:
        return self.params.eta_clip_rule == "weight-bound"

    def weight_bound(self, eta: float) -> float:
        """W = min(psi*'((B - G eta) / lambda), W_cap), the public bound of the clamped-loss (capped) DRO
        weight at eta."""
        c, p = self.cfg, self.params
        return dro_weight_bound(make_psi(c.psi, c.cvar_alpha), eta, c.lambda_, p.eta_scale, p.loss_bound,
                                p.weight_cap)

    def eta_clip(self, eta: float) -> float:
        """Nominal clip of the eta-refresh evaluated at eta: clip-eta ('fixed'), or G max(1, W - 1) with
        W = ``weight_bound(eta)`` ('weight-bound'): the range bound of G (1 - w) for 0 <= w <= W, so no record
        is clipped and the release's sensitivity is that bound."""
        p = self.params
        if not self.eta_clip_from_bound:
            return p.clip_eta
        return p.eta_scale * max(1.0, self.weight_bound(eta) - 1.0)

    def _x_query(self, t: int, mechanism: str, points: tuple[Point, ...], rate: float, clip: float) -> Query:
        c = self.cfg
        if not self.weight_after_clip:
            return Query(t, mechanism, "dual-x", points, rate, clip, self.dim)
        grad_clip = c.clip(c.clip_x)
        if mechanism == "x-refresh" and c.private:
            clip = c.clip_x * self.weight_bound(points[0].scalar)
        return Query(t, mechanism, "dual-x-wac", points, rate, clip, self.dim, extra=(grad_clip,))

    def _diff_clip(self, dx: float, deta: float) -> float:
        return self.cfg.clip(min(self.params.clip_diff * math.hypot(dx, deta), self.params.clip_diff_max))

    @property
    def simultaneous(self) -> bool:
        """block-order=simultaneous: both blocks at (x_t, eta_t), one round per iteration
        (docs/explanation/ALGORITHMS.md 3.4)."""
        return self.params.block_order == "simultaneous"

    def _eta_query(self, state: DoubleSpiderState) -> Query:
        c, p, t = self.cfg, self.params, state.t
        if t % p.q == 0:
            return Query(t, "eta-refresh", "dual-eta", (Point(t, state.eta),), self.rate(c.refresh_batch),
                         c.clip(self.eta_clip(state.eta)), 1)
        dx = float(np.linalg.norm(state.x - state.x_prev))
        clip = self._diff_clip(dx, state.eta - state.eta_prev)
        return Query(t, "eta-diff", "dual-eta", (Point(t, state.eta), Point(t - 1, state.eta_prev)),
                     self.rate(p.diff_batch), clip, 1)

    def _x_block_query(self, state: DoubleSpiderState, eta: float, eta_prev: float) -> list[Query]:
        """The x block's release at (x_t, eta), its difference (or STORM term, x-estimator='storm') against
        (x_{t-1}, eta_prev), and with clip-diff-rule='private-quantile' the difference's count release
        (diff_levers.py: C_diff of this block follows the private quantile; the eta block keeps clip-diff)."""
        c, p, t = self.cfg, self.params, state.t
        if t % p.q == 0:
            return [self._x_query(t, "x-refresh", (Point(t, eta),), self.rate(c.refresh_batch), c.clip(c.clip_x))]
        dist = math.hypot(float(np.linalg.norm(state.x - state.x_prev)), eta - eta_prev)
        threshold = levers.clip_diff_now(p, state.clip_diff) * dist
        a = levers.storm_a(p)
        ref_clip = c.clip_x * self.weight_bound(eta) if self.weight_after_clip else c.clip_x
        clip = c.clip(levers.storm_clip(a, ref_clip, min(threshold, p.clip_diff_max)))
        diff = dataclasses.replace(self._x_query(t, "x-diff", (Point(t, eta), Point(t - 1, eta_prev)),
                                                 self.rate(p.diff_batch), clip), coefs=levers.storm_coefs(a))
        if not levers.quantile_rule(p):
            return [diff]
        return [diff, levers.quantile_query(diff, threshold, self.rate(p.diff_batch))]

    def queries(self, state: DoubleSpiderState) -> list[Query]:
        if self.simultaneous:
            return [self._eta_query(state), *self._x_block_query(state, state.eta, state.eta_prev)]
        if state.stage == 0:
            return [self._eta_query(state)]
        return self._x_block_query(state, state.eta_next, state.eta)

    def apply(self, state: DoubleSpiderState, released: dict[str, np.ndarray]) -> DoubleSpiderState:
        c, p = self.cfg, self.params
        s = dataclasses.replace(state)
        if state.stage == 0:
            if "eta-refresh" in released:
                s.a = float(released["eta-refresh"][0])
            else:
                s.a = state.a + float(released["eta-diff"][0])
            s.eta_next = state.eta - p.lr_eta * s.a
            s.stage = 1
            if not self.simultaneous:
                return s
        if "x-refresh" in released:
            b = released["x-refresh"]
        else:
            b = levers.estimate(state.b, released["x-diff"], levers.storm_a(p))
        count = released.get("x-diff" + levers.QUANTILE_SUFFIX)
        if count is not None:
            s.clip_diff = levers.next_clip_diff(levers.clip_diff_now(p, state.clip_diff), float(count[0]),
                                                p.clip_diff_quantile, p.clip_diff_quantile_lr)
        if state.t == state.tau:
            s.x_out, s.eta_out = state.x.copy(), state.eta
        s.b = b
        s.x_prev, s.x = state.x, state.x - c.lr_x * b
        s.eta_prev, s.eta = state.eta, s.eta_next
        s.t, s.stage = state.t + 1, 0
        return s

    def output(self, state: DoubleSpiderState) -> tuple[np.ndarray, float]:
        if self.params.output_iterate == "random" and state.t >= self.cfg.iterations:
            return state.x_out, state.eta_out
        return state.x, state.eta

    def diagnostics(self, state: DoubleSpiderState) -> dict[str, float]:
        out = {"eta": state.eta, "step_norm": float(np.linalg.norm(state.x - state.x_prev))}
        if self.weight_after_clip or self.eta_clip_from_bound:
            out["weight_bound"] = self.weight_bound(state.eta)
        if self.eta_clip_from_bound:
            out["eta_clip"] = self.eta_clip(state.eta)
        if levers.quantile_rule(self.params):
            out["clip_diff"] = levers.clip_diff_now(self.params, state.clip_diff)
        return out
