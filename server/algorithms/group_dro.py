"""Group-level DRO in the paper's two frameworks (config dro-level=group; docs/explanation/ALGORITHMS.md 3.3 and 4.3).

The uncertainty set is over groups (the K classes) instead of records: with pi the group frequencies, l_k(x) the
mean loss of group k and r the divergence's reference distribution (dro-reference: r = pi, the paper's centre, the
empirical distribution; or r uniform, 1/K: the balanced centre, as dp-sgda's),

    F(x) = max_{q in simplex_K} sum_k q_k l_k(x) - lambda D_psi(q || r)           (dp-double-spider, group)
    Psi(x, lambda) = lambda log sum_k r_k exp(l_k(x) / lambda) + lambda rho       (recursive-spider, group)

and the gradient in x of either is sum_k q_k grad l_k(x) = (1/n) sum_i w_{y_i} grad l(x; xi_i) with record
weights w_k = q_k / pi_k = r_k v_k / pi_k, v_k = q_k / r_k the likelihood ratios that the weight cap bounds.
Each iteration makes two releases in two rounds, both over independent Poisson batches:

  stage 0, the group losses at x_t: the K-vector m_k = (1/n) sum_{i in k} min(l_i, B) of group loss sums
     ('group-loss' quantity, e_y min(l, B) per record: one record touches one coordinate, norm <= B).
     dp-double-spider estimates m by SPIDER ('group-refresh' every q iterations, clip B; 'group-diff' otherwise,
     the difference at x_t and x_{t-1} clipped at min(C_diff ||x_t - x_{t-1}||, B)) and smooths the estimate by
     an exponential average of weight beta (post-processing); recursive-spider by STORM ('group-storm':
     m_t = noisy mean of e_y (c(l_t) - (1 - beta) c(l_{t-1})) + (1 - beta) m_{t-1}, clip
     min(beta B + C_diff ||x_t - x_{t-1}||, B); t = 0: the plain mean, clip B). dp-double-spider's average is
     bias-corrected (``averaging_weight``): a running mean of the releases while t << 1/beta.
     The group losses are l^_k = min(max(m_k / pi_k, 0), B), pi the class priors of the private histogram
     released (and charged) before training.
  then the weights (public functions of released values only):
     dp-double-spider: v_k = min(psi*'((l^_k - G eta) / lambda), W_cap) with the dual variable eta solved
       exactly, sum_k r_k v_k = 1 (bisection: the left side is non-increasing in eta); the dual's gradient
       G (1 - sum_k r_k v_k) is a public function of l^, so no record is touched for eta.
     recursive-spider: g_k = exp((l^_k - B) / lambda), s = sum_k r_k g_k, v_k = min(g_k / s, W_cap), and the
       lambda step z_lambda = log s + rho + sum_k r_k v_k (B - l^_k) / lambda (the exact d Psi / d lambda).
     The record weights are w_k = r_k v_k / pi_k (= v_k when r = pi).
  stage 1, the model: SPIDER over the weighted gradient, 'x-refresh' (t mod q == 0) or 'x-diff', with the public
     weights of each point ('group-weighted-grad'): dro-clip=product clips w_y grad l at clip-x (sensitivity
     clip-x); dro-clip=weight-after-clip sends w_y clip_{C_x}(grad l), sensitivity C_x max_k w_k (clipped there
     as a guard). A difference is clipped at C_t = min(C_diff W_t ||x_t - x_{t-1}|| + C_x max_k |w_k - w'_k|,
     C_max): the weights change between the two points, and both bounds are public.
     x_{t+1} = x_t - lr-x b_t.

block-order=simultaneous (docs/explanation/ALGORITHMS.md 3.4): stage 1's release at x_t uses the weights w_t computed
from release t - 1 (w_0 = 1) and goes out with stage 0's release at x_t in one round; the weights from release t are
used at x_{t+1}. Same releases and clips, one round per iteration instead of two.

Every per-record vector has a public clip, so each release is a Poisson-subsampled Gaussian mechanism in the
ledger like the record-level releases; the group losses cost a K-dimensional release per iteration.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

from ...common.messages import Point, Query
from ...common.psi import make_psi
from ..allocation import NoiseProfile
from ..ledger import Mechanism
from . import diff_levers as levers
from .base import Algorithm, State


@dataclasses.dataclass
class GroupState(State):
    """x, x_prev: (d,) float64 iterates; b: (d,) SPIDER estimate of the weighted gradient; m: (K,) estimate of the
    group loss sums (per n); m_avg: (K,) its exponential average (dp-double-spider); pi: (K,) group priors (the
    released histogram); w, w_prev: (K,) group weights used at x_t and x_{t-1}; dual: eta (dp-double-spider) or
    lambda (recursive-spider); dual_prev: its previous value; s: the released g estimate (recursive-spider);
    ref: (K,) the divergence's reference distribution r (pi, or uniform 1/K; dro-reference); clip_diff: C_diff of
    clip-diff-rule='private-quantile' (0: the configured clip-diff; diff_levers.py)."""

    x: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))
    x_prev: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))
    b: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))
    m: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))
    m_avg: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))
    pi: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))
    w: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))
    w_prev: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))
    dual: float = 0.0
    dual_prev: float = 0.0
    s: float = 1.0
    ref: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))
    clip_diff: float = 0.0


class GroupDro(Algorithm):
    """The shared machinery of both group-level methods (module docstring): the group-loss estimate (``loss_*``
    hooks), the weights (``weights``) and the SPIDER x block. Subclasses: ``GroupDoubleSpider``,
    ``GroupRecursiveSpider``."""

    # ---- what subclasses define ----
    def loss_query(self, state: GroupState) -> Query:
        raise NotImplementedError

    def absorb_losses(self, state: GroupState, released: dict[str, np.ndarray]) -> GroupState:
        """State with m (and m_avg) from the group-loss release."""
        raise NotImplementedError

    def weights(self, state: GroupState, losses: np.ndarray) -> tuple[np.ndarray, float]:
        """(w (K,), new dual value) from the group losses l^ (K,)."""
        raise NotImplementedError

    def dual_init(self) -> float:
        raise NotImplementedError

    # ---- shared ----
    @property
    def k(self) -> int:
        """The number of groups: the classes, the declared group attribute's G (dro-groups=attribute) or the
        num-clients nodes (dro-groups=node)."""
        return self.cfg.dro_group_count(self.num_classes, self.num_groups)

    @property
    def weight_after_clip(self) -> bool:
        return self.params.dro_clip == "weight-after-clip"

    def mechanisms(self) -> list[Mechanism]:
        c, p = self.cfg, self.params
        quantile = ([Mechanism("x-diff" + levers.QUANTILE_SUFFIX, self.rate(p.diff_batch),
                               p.clip_diff_quantile_noise_ratio)] if levers.quantile_rule(p) else [])
        return [*self.loss_mechanism_list(), Mechanism("x-refresh", self.rate(c.refresh_batch)),
                Mechanism("x-diff", self.rate(p.diff_batch)), *quantile]

    def loss_mechanism_list(self) -> list[Mechanism]:
        raise NotImplementedError

    def plan(self) -> dict[Mechanism, int]:
        T, q = self.cfg.iterations, self.params.q
        refreshes = math.ceil(T / q)
        m = {mech.name: mech for mech in self.mechanisms()}
        out = {m["x-refresh"]: refreshes, m["x-diff"]: T - refreshes}
        if levers.quantile_rule(self.params):
            out[m["x-diff" + levers.QUANTILE_SUFFIX]] = T - refreshes
        out.update(self.loss_plan(m, T, refreshes))
        return out

    def loss_plan(self, m: dict[str, Mechanism], T: int, refreshes: int) -> dict[Mechanism, int]:
        raise NotImplementedError

    def spider_pairs(self) -> list[tuple[str, str]]:
        return [("x-refresh", "x-diff")]

    def init_state(self, x0: np.ndarray) -> GroupState:
        x0 = np.asarray(x0, dtype=np.float64)
        k = self.k
        uniform = np.full(k, 1.0 / k)
        return GroupState(x=x0.copy(), x_prev=x0.copy(), b=np.zeros_like(x0), m=np.zeros(k), m_avg=np.zeros(k),
                          pi=uniform, w=np.ones(k), w_prev=np.ones(k), dual=self.dual_init(),
                          dual_prev=self.dual_init(), ref=uniform.copy(), clip_diff=self.params.clip_diff)

    def start_state(self, x0: np.ndarray, eta0: float | None = None,
                    priors: tuple[float, ...] | None = None) -> GroupState:
        """The initial state with the released group priors pi (G,); ValueError without them (the setup
        releases the histogram for every group-level run, server/setup.py)."""
        if priors is None or len(priors) != self.k:
            raise ValueError(f"dro-level=group needs the {self.k} group priors of the setup release, got {priors!r}")
        state = self.init_state(x0)
        state.pi = np.asarray(priors, dtype=np.float64)
        if self.params.dro_reference == "prior":
            state.ref = state.pi.copy()
        return state

    def versions(self, state: GroupState) -> dict[int, np.ndarray]:
        return {state.t: state.x, state.t - 1: state.x_prev} if state.t > 0 else {0: state.x}

    def group_losses(self, state: GroupState, m: np.ndarray) -> np.ndarray:
        """l^_k = min(max(m_k / pi_k, 0), B) (K,): post-processing of the released sums and priors."""
        return np.clip(m / state.pi, 0.0, self.params.loss_bound)

    @staticmethod
    def record_weights(state: GroupState, v: np.ndarray) -> np.ndarray:
        """The record weights w_k = r_k v_k / pi_k (K,) from the ratios v_k = q_k / r_k: the gradient
        sum_k q_k grad l_k is (1/n) sum_i w_{y_i} grad l_i (docs/explanation/ALGORITHMS.md 3.3). w = v when r = pi."""
        return state.ref * v / state.pi

    def _weight_clip(self, w: np.ndarray) -> float:
        return self.cfg.clip_x * float(np.max(w)) if self.weight_after_clip else self.cfg.clip_x

    def x_query(self, state: GroupState) -> Query:
        return self.x_queries(state)[0]

    def diff_threshold(self, state: GroupState) -> float:
        """The difference clip before its cap: C_diff,t W_t ||x_t - x_{t-1}|| + C_x max_k |w_k - w'_k| (module
        docstring), C_diff,t the one in effect (diff_levers.clip_diff_now); public."""
        dx = float(np.linalg.norm(state.x - state.x_prev))
        w_top = max(float(np.max(state.w)), float(np.max(state.w_prev))) if self.weight_after_clip else 1.0
        dw = float(np.max(np.abs(state.w - state.w_prev)))
        return levers.clip_diff_now(self.params, state.clip_diff) * w_top * dx + self.cfg.clip_x * dw

    def x_queries(self, state: GroupState) -> list[Query]:
        """The x block's release at x_t: 'x-refresh', or 'x-diff' (a SPIDER difference, or a STORM term with
        x-estimator='storm') and with clip-diff-rule='private-quantile' its count release (diff_levers.py)."""
        c, p, t = self.cfg, self.params, state.t
        grad_clip = c.clip(c.clip_x) if self.weight_after_clip else math.inf
        if t % p.q == 0:
            extra = (grad_clip, self.k, *state.w)
            return [Query(t, "x-refresh", "group-weighted-grad", (Point(t, 0.0),), self.rate(c.refresh_batch),
                          c.clip(self._weight_clip(state.w)), self.dim, extra=extra)]
        threshold = self.diff_threshold(state)
        a = levers.storm_a(p)
        clip = c.clip(levers.storm_clip(a, self._weight_clip(state.w), min(threshold, p.clip_diff_max)))
        extra = (grad_clip, self.k, *state.w, *state.w_prev)
        diff = Query(t, "x-diff", "group-weighted-grad", (Point(t, 0.0), Point(t - 1, 1.0)),
                     self.rate(p.diff_batch), clip, self.dim, coefs=levers.storm_coefs(a), extra=extra)
        if not levers.quantile_rule(p):
            return [diff]
        return [diff, levers.quantile_query(diff, threshold, self.rate(p.diff_batch))]

    @property
    def simultaneous(self) -> bool:
        """block-order=simultaneous: the x block at x_t with the weights w_t of release t - 1, sent in the same
        round as the group-loss release at x_t (one round per iteration; w_0 = 1, ERM's first step)."""
        return self.params.block_order == "simultaneous"

    def queries(self, state: GroupState) -> list[Query]:
        if self.simultaneous:
            return [self.loss_query(state), *self.x_queries(state)]
        return [self.loss_query(state)] if state.stage == 0 else self.x_queries(state)

    def apply(self, state: GroupState, released: dict[str, np.ndarray]) -> GroupState:
        if self.simultaneous:  # the x step with the weights it was evaluated at, then the next weights
            return self._reweighted(self._x_step(self.absorb_losses(state, released), released), state)
        if state.stage == 0:
            s = self._reweighted(self.absorb_losses(state, released), state)
            s.stage = 1
            return s
        return self._x_step(state, released)

    def _reweighted(self, s: GroupState, before: GroupState) -> GroupState:
        """``s`` with the weights and dual value from its group-loss estimate; the weights of ``before`` become the
        previous ones (from iteration 1 on; at 0 they stay 1)."""
        w, dual = self.weights(s, self.group_losses(s, s.m_avg))
        if before.t > 0:
            s.w_prev = before.w
        s.w, s.dual_prev, s.dual = w, before.dual, dual
        return s

    def _x_step(self, state: GroupState, released: dict[str, np.ndarray]) -> GroupState:
        """x_{t+1} = x_t - lr-x b_t from the x release; t + 1, stage 0."""
        s = dataclasses.replace(state)
        c, p = self.cfg, self.params
        if "x-refresh" in released:
            s.b = released["x-refresh"]
        else:
            s.b = levers.estimate(state.b, released["x-diff"], levers.storm_a(p))
        count = released.get("x-diff" + levers.QUANTILE_SUFFIX)
        if count is not None:
            s.clip_diff = levers.next_clip_diff(levers.clip_diff_now(p, state.clip_diff), float(count[0]),
                                                p.clip_diff_quantile, p.clip_diff_quantile_lr)
        s.x_prev, s.x = state.x, state.x - c.lr_x * s.b
        s.t, s.stage = state.t + 1, 0
        return s

    def output(self, state: GroupState) -> tuple[np.ndarray, float]:
        return state.x, state.dual

    def diagnostics(self, state: GroupState) -> dict[str, float]:
        out = {"dual": state.dual, "w_max": float(np.max(state.w)), "w_min": float(np.min(state.w)),
               "step_norm": float(np.linalg.norm(state.x - state.x_prev))}
        if levers.quantile_rule(self.params):
            out["clip_diff"] = levers.clip_diff_now(self.params, state.clip_diff)
        return out

    def x_profiles(self) -> dict[str, NoiseProfile]:
        c, p = self.cfg, self.params
        w_nominal = p.weight_cap if self.weight_after_clip and math.isfinite(p.weight_cap) else 1.0
        a = levers.storm_a(p)
        w_ref, w_diff = levers.storm_weights(p.q, a)
        out = {"x-refresh": NoiseProfile(self.dim, c.clip_x * w_nominal, w_ref),
               "x-diff": NoiseProfile(self.dim, levers.storm_clip(a, c.clip_x * w_nominal, p.clip_diff_max), w_diff)}
        if levers.quantile_rule(p):
            out["x-diff" + levers.QUANTILE_SUFFIX] = NoiseProfile(1, 1.0, 1.0)
        return out

    def loss_importance(self) -> float:
        """How much a unit of noise in a released group-loss sum reaches the update, relative to a unit in one
        x coordinate: an error e in m_k moves l^_k by e / pi_k and w_k by about w_k e / (pi_k lambda), which moves
        the update by pi_k that times |grad l_k| <= C_x: (C_x W / lambda)^2 in variance, W the nominal weight
        (server/allocation.py's proxy)."""
        c, p = self.cfg, self.params
        w = p.weight_cap if math.isfinite(p.weight_cap) else 3.0
        return (c.clip_x * w / self.dual_scale()) ** 2

    def dual_scale(self) -> float:
        return self.cfg.lambda_


def averaging_weight(beta: float, t: int) -> float:
    """The weight of release t (t >= 0) in the group losses' exponential average m~_t = m~_{t-1} + beta_t (m_t -
    m~_{t-1}): beta_t = beta / (1 - (1 - beta)^(t + 1)), the average of weight beta with Adam's bias correction
    (Kingma & Ba 2015, sec. 3). beta_0 = 1, so m~_0 = m_0; while t << 1/beta it is about 1/(t + 1) (the running
    mean; beta = 0 is that limit), so the first (noisy) release does not keep the weight (1 - beta)^t that the
    plain average started at m_0 gives it; later it tends to beta. A public function of t and beta
    (post-processing)."""
    if beta == 0.0:  # the limit: the running mean of every release
        return 1.0 / (t + 1)
    return beta / (1.0 - (1.0 - beta) ** (t + 1))


def averaged(average: np.ndarray, release: np.ndarray, beta: float, t: int) -> np.ndarray:
    """The group losses' exponential average after release t: average + beta_t (release - average), beta_t =
    ``averaging_weight(beta, t)``; exactly ``release`` when beta_t = 1 (t = 0, or beta = 1: no averaging), where
    the update form would leave rounding of ~1e-16. Shapes (K,) float64."""
    weight = averaging_weight(beta, t)
    return release.copy() if weight == 1.0 else average + weight * (release - average)


def solve_eta(losses: np.ndarray, pi: np.ndarray, psi, lam: float, eta_scale: float, cap: float) -> float:
    """The dual variable eta with sum_k pi_k min(psi*'((l_k - G eta) / lambda), cap) = 1, by bisection (the sum is
    non-increasing in eta and exceeds 1 for eta low enough when cap > 1; docs/explanation/ALGORITHMS.md 3.3).

    losses, pi: (K,) float64 (pi > 0, sum 1); returns eta (float). Post-processing of public values only."""
    lt = torch.as_tensor(losses, dtype=torch.float64)
    pt = torch.as_tensor(pi, dtype=torch.float64)

    def mass(eta: float) -> float:
        w = psi.weight((lt - eta_scale * eta) / lam)
        return float((pt * torch.clamp(w, max=cap)).sum())

    lo, hi = (float(lt.min()) - lam) / eta_scale, (float(lt.max()) + lam) / eta_scale
    step = lam / eta_scale
    while mass(lo) < 1.0:  # lower until the weights' mass exceeds 1 (it does: cap > 1, psi*' unbounded above)
        lo -= step
        step *= 2
    step = lam / eta_scale
    while mass(hi) > 1.0:
        hi += step
        step *= 2
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if mass(mid) > 1.0:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


class GroupDoubleSpider(GroupDro):
    """dp-double-spider with dro-level=group: SPIDER group-loss sums smoothed by beta, eta solved exactly."""

    def loss_mechanism_list(self) -> list[Mechanism]:
        c, p = self.cfg, self.params
        return [Mechanism("group-refresh", self.rate(c.refresh_batch), p.eta_noise_ratio),
                Mechanism("group-diff", self.rate(p.diff_batch), p.eta_noise_ratio)]

    def loss_plan(self, m, T, refreshes):
        return {m["group-refresh"]: refreshes, m["group-diff"]: T - refreshes}

    def spider_pairs(self) -> list[tuple[str, str]]:
        return [("group-refresh", "group-diff"), ("x-refresh", "x-diff")]

    def noise_profiles(self) -> dict[str, NoiseProfile]:
        # the weights see the averaged sums m~: their noise variance is the release's times beta / (2 - beta), the
        # exponential average's stationary factor for independent noises, so the rule (server/allocation.py) gives
        # the group releases less of the budget the smaller beta is (measured: at beta 0.02 the x-refresh
        # multiplier was 2.96 when the profile ignored the average)
        c, p = self.cfg, self.params
        imp = self.loss_importance() * max(p.beta / (2.0 - p.beta), 1.0 / c.iterations)  # beta 0: the mean of T
        return {"group-refresh": NoiseProfile(self.k, p.loss_bound, p.q * imp),
                "group-diff": NoiseProfile(self.k, p.loss_bound, p.q / 2 * imp), **self.x_profiles()}

    def dual_init(self) -> float:
        return self.params.eta_init

    def loss_query(self, state: GroupState) -> Query:
        c, p, t = self.cfg, self.params, state.t
        extra = (0.0,) * self.k
        if t % p.q == 0:
            return Query(t, "group-refresh", "group-loss", (Point(t, 0.0),), self.rate(c.refresh_batch),
                         c.clip(p.loss_bound), self.k, extra=extra)
        dx = float(np.linalg.norm(state.x - state.x_prev))
        return Query(t, "group-diff", "group-loss", (Point(t, 0.0), Point(t - 1, 0.0)), self.rate(p.diff_batch),
                     c.clip(min(p.clip_diff * dx, p.loss_bound)), self.k, extra=extra)

    def absorb_losses(self, state, released):
        s = dataclasses.replace(state)
        s.m = released["group-refresh"] if "group-refresh" in released else state.m + released["group-diff"]
        s.m_avg = averaged(state.m_avg, s.m, self.params.beta, state.t)
        return s

    def weights(self, state, losses):
        c, p = self.cfg, self.params
        psi = make_psi(c.psi, c.cvar_alpha)
        cap = p.weight_cap if math.isfinite(p.weight_cap) else math.inf
        eta = solve_eta(losses, state.ref, psi, c.lambda_, p.eta_scale, cap)
        v = psi.weight(torch.as_tensor((losses - p.eta_scale * eta) / c.lambda_, dtype=torch.float64)).numpy()
        return self.record_weights(state, np.minimum(v, cap)), eta


class GroupRecursiveSpider(GroupDro):
    """recursive-spider with dro-level=group: STORM group-loss sums, KL weights g_k / s, lambda by its exact
    gradient."""

    def loss_mechanism_list(self) -> list[Mechanism]:
        return [Mechanism("group-storm", self.rate(self.params.s_batch), self.params.s_noise_ratio)]

    def loss_plan(self, m, T, refreshes):
        return {m["group-storm"]: T}

    def noise_profiles(self) -> dict[str, NoiseProfile]:
        c, p = self.cfg, self.params
        storm = 1.0 / (1.0 - (1.0 - p.beta) ** 2) if p.beta > 0 else float(c.iterations)
        return {"group-storm": NoiseProfile(self.k, p.loss_bound, storm * self.loss_importance()),
                **self.x_profiles()}

    def dual_init(self) -> float:
        return self.params.lambda_init

    def dual_scale(self) -> float:
        return self.params.lambda_init

    def loss_query(self, state: GroupState) -> Query:
        c, p, t = self.cfg, self.params, state.t
        extra = (0.0,) * self.k
        if t == 0:
            return Query(t, "group-storm", "group-loss", (Point(t, 0.0),), self.rate(p.s_batch),
                         c.clip(p.loss_bound), self.k, extra=extra)
        dx = float(np.linalg.norm(state.x - state.x_prev))
        clip = c.clip(min(p.beta * p.loss_bound + p.clip_diff * dx, p.loss_bound))
        return Query(t, "group-storm", "group-loss", (Point(t, 0.0), Point(t - 1, 0.0)), self.rate(p.s_batch),
                     clip, self.k, coefs=(1.0, -(1.0 - p.beta)), extra=extra)

    def absorb_losses(self, state, released):
        s = dataclasses.replace(state)
        term = released["group-storm"]
        s.m = term if state.t == 0 else term + (1.0 - self.params.beta) * state.m
        s.m_avg = s.m
        return s

    def weights(self, state, losses):
        p, lam = self.params, state.dual
        g = np.exp((losses - p.loss_bound) / lam)
        s = float(np.dot(state.ref, g))
        v = g / s
        z_lam = math.log(s) + p.rho + float(np.dot(state.ref * v, p.loss_bound - losses)) / lam
        state.s = s
        new_lam = min(max(lam - p.lr_lambda * z_lam, p.lambda0), p.lambda_max)
        cap = p.weight_cap if math.isfinite(p.weight_cap) else math.inf
        return self.record_weights(state, np.minimum(v, cap)), new_lam
