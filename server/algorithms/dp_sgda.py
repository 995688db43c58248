"""DP stochastic gradient descent-ascent on the class-level DRO min-max (docs/explanation/ALGORITHMS.md 6.1 (d)):

    min_x max_{p in simplex_K} sum_k p_k l_k(x) - lambda KL(p || uniform_K),  l_k = mean loss of class k.

The K groups are the classes, or with dro-groups=attribute the data set's declared group attribute (e.g. CelebA's
4 cells 2 * Blond_Hair + Male): the same information the group-level paper methods get
(docs/explanation/ALGORITHMS.md 3.3).

Per iteration, two releases on independent Poisson batches (one round), both at x_t:
  'class-stats': noisy sums of clip_{C_s}([e_y min(l, B) ; e_y]) -> per-class loss sums and counts;
  'grad':        noisy mean of clip_{C_x}(w_y grad l) with public weights w_k = p_k / pi_k, pi the running
                 estimate of class frequencies from earlier released counts (so the mean estimates
                 sum_k p_k grad l_k).
Ascent (exponentiated gradient): p_k <- p_k exp(gamma_p (l^_k - lambda log(K p_k))) / Z, l^_k the noisy class
loss; descent: x <- x - gamma_x g. Keys: refresh-batch (both batches), clip-x, clip-stats, loss-bound, lr-x,
lr-p, lambda.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ...common.messages import Point, Query
from ..allocation import NoiseProfile
from ..ledger import Mechanism
from .base import Algorithm
from .dp_sgd import SgdState
from .registry import register_algorithm

PRIOR_DECAY = 0.9  # weight of the past in the running class-frequency estimate


@dataclasses.dataclass
class SgdaState(SgdState):
    """Adds p (K,) class weights and pi (K,) running class-frequency estimate (both from released values)."""

    p: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))
    pi: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))


@register_algorithm("dp-sgda")
class DpSgda(Algorithm):

    def mechanisms(self) -> list[Mechanism]:
        r = self.rate(self.cfg.refresh_batch)
        return [Mechanism("class-stats", r), Mechanism("grad", r)]

    def plan(self) -> dict[Mechanism, int]:
        return {m: self.cfg.iterations for m in self.mechanisms()}

    @property
    def k(self) -> int:
        """The number of groups: the K classes, the declared group attribute's G (dro-groups=attribute) or the
        num-clients nodes (dro-groups=node)."""
        return self.cfg.dro_group_count(self.num_classes, self.num_groups)

    def noise_profiles(self) -> dict[str, NoiseProfile]:
        return {"class-stats": NoiseProfile(2 * self.k, self.params.clip_stats, 1.0),
                "grad": NoiseProfile(self.dim, self.cfg.clip_x, 1.0)}

    def init_state(self, x0: np.ndarray) -> SgdaState:
        x0 = np.asarray(x0, dtype=np.float64)
        k = self.k
        return SgdaState(x=x0.copy(), x_prev=x0.copy(), p=np.full(k, 1.0 / k), pi=np.full(k, 1.0 / k))

    def versions(self, state: SgdaState) -> dict[int, np.ndarray]:
        return {state.t: state.x}

    def queries(self, state: SgdaState) -> list[Query]:
        c, p, t, k = self.cfg, self.params, state.t, self.k
        r = self.rate(c.refresh_batch)
        weights = tuple(float(w) for w in state.p / state.pi)
        return [Query(t, "class-stats", "class-loss-stats", (Point(t, 0.0),), r, c.clip(p.clip_stats),
                      2 * k, extra=(0.0,) * k),
                Query(t, "grad", "class-weighted-grad", (Point(t, 0.0),), r, c.clip(c.clip_x), self.dim,
                      extra=weights)]

    def apply(self, state: SgdaState, released: dict[str, np.ndarray]) -> SgdaState:
        c, pr, k = self.cfg, self.params, self.k
        expected = self.rate(c.refresh_batch) * self.n  # released means are sums / expected batch
        sums, counts = released["class-stats"][:k] * expected, released["class-stats"][k:] * expected
        counts = np.maximum(counts, 1.0)
        class_loss = np.clip(sums / counts, 0.0, pr.loss_bound)
        s = dataclasses.replace(state)
        logits = np.log(state.p) + pr.lr_p * (class_loss - c.lambda_ * np.log(k * state.p))
        p = np.exp(logits - logits.max())
        s.p = np.maximum(p / p.sum(), 1e-12)
        freq = counts / counts.sum()
        s.pi = PRIOR_DECAY * state.pi + (1 - PRIOR_DECAY) * freq
        s.x_prev, s.x = state.x, state.x - c.lr_x * released["grad"]
        s.t = state.t + 1
        return s

    def output(self, state: SgdaState) -> tuple[np.ndarray, float]:
        return state.x, 0.0

    def diagnostics(self, state: SgdaState) -> dict[str, float]:
        return {"step_norm": float(np.linalg.norm(state.x - state.x_prev)), "p_max": float(state.p.max()),
                "p_min": float(state.p.min())}
