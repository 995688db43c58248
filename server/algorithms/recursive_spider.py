"""DP Recursive-Spider (seed paper, Algorithm 3; docs/explanation/ALGORITHMS.md sections 2 and 4).

KL-constrained DRO as a compositional problem over w = (x, lambda):

    min_{x, lambda in [lambda0, lambda_max]} Psi(w) = lambda log g2~(w) + B + lambda rho,
    g2~(w) = (1/n) sum_i g~(w; xi_i),  g~ = exp((min(l, B) - B) / lambda) in (0, 1]

(the public loss bound B removes the overflow of exp(l / lambda) without any data-dependent shift). Per
iteration t, two releases on independent Poisson batches, sent in one round:

    'vu-refresh' (t mod q == 0): [v_t ; c_u u_t] = noisy mean of clip_C([grad_x g~(w_t) ; c_u d_lambda g~(w_t)])
    'vu-diff'    (otherwise):    [v_t ; c_u u_t] = [v_{t-1} ; c_u u_{t-1}] + noisy mean of
                                 clip_{C_t}([.](w_t) - [.](w_{t-1})),  C_t = min(C_diff ||w_t - w_{t-1}||, C_max)
    's'          (every t):      s_t = noisy mean of clip(g~(w_t) - (1 - beta) g~(w_{t-1})) + (1 - beta) s_{t-1}
                                 (STORM, Cutkosky & Orabona 2019; at t = 0 the plain mean), then
                                 s_t <- max(s_t, s_min)

Update (post-processing of released values; simultaneous, both at w_t):

    z^x_t = lambda_t v_t / s_t,   z^lambda_t = log s_t + rho + lambda_t u_t / s_t
    x_{t+1} = x_t - gamma_x z^x_t,   lambda_{t+1} = clip(lambda_t - gamma_lambda z^lambda_t, lambda0, lambda_max)

The v/u release of one batch is one sampled Gaussian event (joint clip); the s release is its own event.

rs-clip-units=relative (docs/explanation/ALGORITHMS.md 5.4): each record's v/u vector is multiplied by k_t = lambda_t /
s_{t-1} (public: both released) before the clip and the released mean is divided by k_t, so that clip-x, clip-diff
and clip-diff-max bound a record's contribution to the update z = lambda v / s itself, whatever the scale of
g~ (which can be e^{-B/lambda}, far below 1). s_{-1} = 1.

s-clip-units=relative (docs/explanation/ALGORITHMS.md 2.5): the STORM term of s is released in units of the
previous estimate,

    m_t = noisy mean of clip_{C_s}((g~(w_t) - (1 - beta) g~(w_{t-1})) / s_{t-1}),
    s_t = (1 - beta) s_{t-1} + s_{t-1} m_t          (t = 0: s_0 = s_{-1} m_0, m_0 of g~(w_0) / s_{-1}),

so clip-s bounds a record's relative change of s and the noise std in s is z C_s s_{t-1} / N_s, a fixed
fraction of s, instead of z C_s / N_s against an s of order e^{-B / lambda}. s_{t-1} is a released value
(public), so this is the same sampled Gaussian mechanism with sensitivity C_s (post-processing of the scale).
s_{-1} is then the public guess ``s_prior`` (g~ at the loss log K of a uniform prediction), not 1, and so is
the unit of the first v/u release with rs-clip-units=relative.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from ...common.messages import Point, Query
from ..allocation import NoiseProfile
from ..ledger import Mechanism
from .base import Algorithm, State
from .group_dro import GroupRecursiveSpider
from .registry import register_algorithm


@dataclasses.dataclass
class RecursiveSpiderState(State):
    """x, x_prev: (d,) float64; lam, lam_prev: lambda_t, lambda_{t-1}; v: (d,) estimate of grad_x g2~;
    u: estimate of d_lambda g2~; s: STORM estimate of g2~ (floored); s_raw: s before the floor."""

    x: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))
    x_prev: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))
    lam: float = 1.0
    lam_prev: float = 1.0
    v: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))
    u: float = 0.0
    s: float = 1.0
    s_raw: float = 1.0


@register_algorithm("recursive-spider")
class RecursiveSpider(Algorithm):
    """DP Recursive-Spider: clip-x is the joint v/u refresh clip, loss-bound B, u-scale c_u (config keys: its
    AlgorithmSpec in common/algorithm_specs.py)."""


    @classmethod
    def variant_for(cls, cfg) -> type[Algorithm]:
        """dro-level=group runs ``GroupRecursiveSpider`` (server/algorithms/group_dro.py)."""
        return GroupRecursiveSpider if cfg.dro_level == "group" else cls

    def mechanisms(self) -> list[Mechanism]:
        c, p = self.cfg, self.params
        return [Mechanism("vu-refresh", self.rate(c.refresh_batch)), Mechanism("vu-diff", self.rate(p.diff_batch)),
                Mechanism("s", self.rate(p.s_batch), p.s_noise_ratio)]

    def plan(self) -> dict[Mechanism, int]:
        T, q = self.cfg.iterations, self.params.q
        refreshes = math.ceil(T / q)
        m = {mech.name: mech for mech in self.mechanisms()}
        return {m["vu-refresh"]: refreshes, m["vu-diff"]: T - refreshes, m["s"]: T}

    def init_state(self, x0: np.ndarray) -> RecursiveSpiderState:
        x0 = np.asarray(x0, dtype=np.float64)
        lam = self.params.lambda_init
        s0 = self.s_prior() if self.params.s_clip_units == "relative" else 1.0
        return RecursiveSpiderState(x=x0.copy(), x_prev=x0.copy(), lam=lam, lam_prev=lam, v=np.zeros_like(x0),
                                    s=s0, s_raw=s0)

    def s_prior(self) -> float:
        """s_{-1} with s-clip-units=relative: g~ = exp((min(log K, B) - B) / lambda_init), the KL term of a
        record at the loss log K of a uniform prediction over the K classes. A public constant (K, B and
        lambda-init are configuration), used only as the unit of the first releases; STORM forgets it at the
        rate (1 - beta)^t."""
        p = self.params
        return math.exp((min(math.log(self.num_classes), p.loss_bound) - p.loss_bound) / p.lambda_init)

    def versions(self, state: RecursiveSpiderState) -> dict[int, np.ndarray]:
        return {state.t: state.x, state.t - 1: state.x_prev} if state.t > 0 else {0: state.x}

    def noise_profiles(self) -> dict[str, NoiseProfile]:
        """v/u: d + 1 coordinates. s with s-clip-units=absolute: one coordinate of weight w_storm (its geometric
        tail). With s-clip-units=relative its noise is a relative error delta of s (std z C_s / N_s), and
        delta reaches the update twice: it shifts z_lambda = log s + ... by delta and scales the model step
        z_x = lambda v / s by (1 - delta), an error of norm delta |z_x| <= delta C_x when the v/u clips are in
        the update's units too (rs-clip-units=relative); so its weight is w_storm (1 + C_x^2)
        (server/allocation.py)."""
        c, p = self.cfg, self.params
        storm = 1.0 / (1.0 - (1.0 - p.beta) ** 2) if p.beta > 0 else float(c.iterations)
        s_weight = storm * (1.0 + c.clip_x**2) if p.s_clip_units == "relative" else storm
        return {"vu-refresh": NoiseProfile(self.dim + 1, c.clip_x, p.q),
                "vu-diff": NoiseProfile(self.dim + 1, p.clip_diff_max, p.q / 2),
                "s": NoiseProfile(1, p.clip_s, s_weight)}

    def spider_pairs(self) -> list[tuple[str, str]]:
        return [("vu-refresh", "vu-diff")]

    def vu_scale(self, state: RecursiveSpiderState) -> float:
        """k_t of the v/u release: lambda_t / s_{t-1} with rs-clip-units=relative, else 1."""
        return state.lam / state.s if self.params.rs_clip_units == "relative" else 1.0

    def s_scale(self, state: RecursiveSpiderState) -> float:
        """The public scale of the s release's per-record term: 1 / s_{t-1} with s-clip-units=relative, else 1."""
        return 1.0 / state.s if self.params.s_clip_units == "relative" else 1.0

    def queries(self, state: RecursiveSpiderState) -> list[Query]:
        c, p, t = self.cfg, self.params, state.t
        now, before = Point(t, state.lam), Point(t - 1, state.lam_prev)
        k = self.vu_scale(state)
        extra = (k,) if k != 1.0 else ()
        if t % p.q == 0:
            vu = Query(t, "vu-refresh", "kl-vu", (now,), self.rate(c.refresh_batch), c.clip(c.clip_x),
                       self.dim + 1, extra=extra)
        else:
            dist = math.hypot(float(np.linalg.norm(state.x - state.x_prev)), state.lam - state.lam_prev)
            clip = c.clip(min(p.clip_diff * dist, p.clip_diff_max))
            vu = Query(t, "vu-diff", "kl-vu", (now, before), self.rate(p.diff_batch), clip, self.dim + 1, extra=extra)
        clip_s = c.clip(p.clip_s)
        ks = self.s_scale(state)
        s_extra = (ks,) if ks != 1.0 else ()
        if t == 0:
            s = Query(t, "s", "kl-g", (now,), self.rate(p.s_batch), clip_s, 1, extra=s_extra)
        else:
            s = Query(t, "s", "kl-g", (now, before), self.rate(p.s_batch), clip_s, 1, coefs=(1.0, -(1.0 - p.beta)),
                      extra=s_extra)
        return [vu, s]

    def apply(self, state: RecursiveSpiderState, released: dict[str, np.ndarray]) -> RecursiveSpiderState:
        c, p = self.cfg, self.params
        s = dataclasses.replace(state)
        k = self.vu_scale(state)
        if "vu-refresh" in released:
            vu = released["vu-refresh"] / k
            v, cu = vu[:-1], vu[-1]
        else:
            vu = released["vu-diff"] / k
            v, cu = state.v + vu[:-1], state.u * p.u_scale + vu[-1]
        u = float(cu) / p.u_scale
        # the released STORM term, back in the units of s (s_scale is 1 / s_{t-1} in relative units)
        term = float(released["s"][0]) / self.s_scale(state)
        s_raw = term + (0.0 if state.t == 0 else (1.0 - p.beta) * state.s)
        s_t = max(s_raw, p.s_min)
        z_x = state.lam * v / s_t
        z_lam = math.log(s_t) + p.rho + state.lam * u / s_t
        s.v, s.u, s.s, s.s_raw = v, u, s_t, s_raw
        s.x_prev, s.x = state.x, state.x - c.lr_x * z_x
        s.lam_prev = state.lam
        s.lam = min(max(state.lam - p.lr_lambda * z_lam, p.lambda0), p.lambda_max)
        s.t = state.t + 1
        return s

    def output(self, state: RecursiveSpiderState) -> tuple[np.ndarray, float]:
        return state.x, state.lam

    def diagnostics(self, state: RecursiveSpiderState) -> dict[str, float]:
        return {"lambda": state.lam, "s": state.s, "step_norm": float(np.linalg.norm(state.x - state.x_prev))}

    def eval_extras(self, state: RecursiveSpiderState, losses: np.ndarray) -> dict[str, float]:
        """The exact KL-DRO objective Psi(w) = lambda log mean exp(l / lambda) + lambda rho on the evaluation
        losses (unclamped, float64, computed stably)."""
        lam = state.lam
        m = float(np.max(losses))
        psi = m + lam * math.log(float(np.mean(np.exp((losses - m) / lam)))) + lam * self.params.rho
        return {"eval_kl_dro_objective": psi}
