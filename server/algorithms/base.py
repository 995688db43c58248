"""The interface every algorithm implements: a server-side state machine over released values.

An algorithm never sees records, clients or transports. At each stage it says which releases it needs
(``queries``), and updates its state from the released, noised means (``apply``, pure post-processing).
It declares its whole schedule of releases up front (``plan``) so that noise can be calibrated before
training (docs/explanation/ARCHITECTURE.md section 3).
"""

from __future__ import annotations

import dataclasses
import json
from abc import ABC, abstractmethod
from contextlib import contextmanager
from typing import Any

import numpy as np

from ..allocation import NoiseProfile
from ..diagnostics import planned_phase_ratio
from ..ledger import Mechanism


@dataclasses.dataclass
class State:
    """Base of algorithm states: iteration ``t`` and ``stage`` (for algorithms with several sequential
    releases per iteration). Subclasses add floats and numpy arrays only, so a state serialises to a
    checkpoint with ``to_arrays``/``from_arrays``."""

    t: int = 0
    stage: int = 0
    velocity: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))  # (d,) heavy-ball m_t; (0,): none yet
    x_average: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))  # (d,) ema-decay's a_t; (0,): none

    def to_arrays(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """(arrays, JSON scalars) of every field."""
        arrays, scalars = {}, {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, np.ndarray):
                arrays[f.name] = v
            else:
                scalars[f.name] = v
        return arrays, scalars

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray], scalars: dict[str, Any]) -> State:
        values = {**{k: np.array(v) for k, v in arrays.items()}, **scalars}
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in names})

    def scalars_json(self) -> str:
        return json.dumps(self.to_arrays()[1], sort_keys=True)


# The step sizes the warm-up scales: every config key that is a step size of some algorithm.
STEP_SIZE_KEYS = ("lr-x", "lr-eta", "lr-lambda", "lr-p")


def warmup_factor(t: int, warmup_iterations: int) -> float:
    """The step-size factor of iteration t (0-based) under a linear warm-up over W = ``warmup_iterations``
    (docs/explanation/ALGORITHMS.md 5.5):
    (t + 1) / W for t < W, 1 afterwards and when W = 0 (off). Depends on t and W only (public), so scaling
    the steps is post-processing of released values and costs no privacy. ValueError for t or W < 0."""
    if t < 0 or warmup_iterations < 0:
        raise ValueError(f"warmup_factor: t and warmup-iterations must be >= 0, got {t} and {warmup_iterations}")
    return min(1.0, (t + 1) / warmup_iterations) if warmup_iterations else 1.0


def with_momentum(state: State, new: State, mu: float) -> State:
    """``new`` with heavy-ball momentum mu on its model step (docs/explanation/ALGORITHMS.md 5.10): when ``new``
    completes an iteration (new.t = state.t + 1, the stage whose ``apply`` moved x from state.x to new.x), the step
    d = new.x - state.x becomes m = mu m_prev + d and x = state.x + m, the displacement form of Polyak's heavy
    ball x_{t+1} = x_t - lr g_t + mu (x_t - x_{t-1}). x_prev stays state.x, so the SPIDER differences and their clip
    C_t = clip-diff * ||x_t - x_{t-1}|| follow the step actually taken. A function of released values and public
    mu only: post-processing, no privacy cost. mu = 0 returns ``new`` unchanged (m stays unset)."""
    if mu == 0.0 or new.t != state.t + 1:
        return new
    step = new.x - state.x
    velocity = step if state.velocity.size == 0 else mu * state.velocity + step
    return dataclasses.replace(new, x=state.x + velocity, velocity=velocity)


def average_weight(t: int, decay: float) -> float:
    """b_t of the iterate average a_t = b_t a_{t-1} + (1 - b_t) x_t after iteration t >= 1 (config key ema-decay,
    docs/explanation/ALGORITHMS.md 5.11): min(decay, (t - 1) / t), so a_1 = x_1 and a_t is the plain mean of
    x_1..x_t until t reaches 1 / (1 - decay), an exponential moving average (De et al. 2022, section 3.1) after.
    Public (t and decay only). ValueError for t < 1 or decay outside [0, 1)."""
    if t < 1 or not 0.0 <= decay < 1.0:
        raise ValueError(f"average_weight: need t >= 1 and ema-decay in [0, 1), got t={t}, ema-decay={decay}")
    return min(decay, (t - 1) / t)


def with_average(state: State, decay: float) -> State:
    """``state`` with its iterate average updated, when ``state`` just completed iteration t = state.t and
    ``decay`` (config key ema-decay) is > 0: a_t = b_t a_{t-1} + (1 - b_t) x_t (``average_weight``). A function of
    released iterates and public constants: post-processing, no privacy cost. decay = 0 returns ``state``."""
    if decay == 0.0 or state.t < 1:
        return state
    b = average_weight(state.t, decay)
    previous = state.x_average if state.x_average.size else state.x
    return dataclasses.replace(state, x_average=b * previous + (1.0 - b) * state.x)


class Algorithm(ABC):
    """Base class. Args: cfg (Config), n (number of training records, public), dim (model parameters),
    num_classes (K of the classification task)."""

    num_groups = 0  # G of the data set's declared group attribute (set by ``make_algorithm``; 0: none)
    name = ""  # set by ``register_algorithm``, with ``spec`` (its common.algorithm_specs.AlgorithmSpec)
    spec = None

    def __init__(self, cfg, n: int, dim: int, num_classes: int = 10) -> None:
        self.cfg = cfg
        self.n = n
        self.dim = dim
        self.num_classes = num_classes

    @property
    def params(self):
        """The algorithm's own config keys, typed (``Config.params``: its ``AlgorithmSpec.params`` and the keys of
        other algorithms' specs it reads), e.g. ``self.params.q``."""
        return self.cfg.params

    @classmethod
    def variant_for(cls, cfg) -> type[Algorithm]:
        """The class that runs ``cfg`` (this one; an algorithm with variants, such as dro-level=group, returns
        the variant's class)."""
        return cls

    def rate(self, expected_batch: int) -> float:
        """Poisson sampling rate for an expected batch size (capped at 1)."""
        return min(1.0, expected_batch / self.n)

    @abstractmethod
    def mechanisms(self) -> list[Mechanism]:
        """Every kind of release this algorithm makes."""

    @abstractmethod
    def plan(self) -> dict[Mechanism, int]:
        """Number of releases of each mechanism over the configured iterations."""

    @abstractmethod
    def init_state(self, x0: np.ndarray) -> State:
        """Initial state from the initial flat parameters x0 (d,) float64 (public initialisation)."""

    def start_state(self, x0: np.ndarray, eta0: float | None = None,
                    priors: tuple[float, ...] | None = None) -> State:
        """``init_state(x0)`` with the dual variable (every eta field: eta, eta_prev, eta_next, eta_out) set to
        ``eta0`` when given (the private eta initialisation of server/setup.py). ``priors`` (K,): the class priors
        of the setup, for algorithms that need them (group-level DRO); unused here."""
        state = self.init_state(x0)
        if eta0 is None:
            return state
        names = {f.name for f in dataclasses.fields(state)} & {"eta", "eta_prev", "eta_next", "eta_out"}
        return dataclasses.replace(state, **{k: float(eta0) for k in names})

    def noise_profiles(self) -> dict[str, NoiseProfile]:
        """Per mechanism: coordinates, nominal clip and update weight for noise-allocation='variance'
        (server/allocation.py). Default: every mechanism a d-dim release with clip-x and weight 1."""
        return {m.name: NoiseProfile(self.dim, self.cfg.clip_x, 1.0) for m in self.mechanisms()}

    def spider_pairs(self) -> list[tuple[str, str]]:
        """(refresh, difference) mechanism pairs of a SPIDER-type algorithm (empty otherwise)."""
        return []

    def regime_warnings(self, noise: dict[str, float]) -> list[str]:
        """Warnings, before training, for each SPIDER block whose q - 1 differences at the clip cap C_max would
        add more noise than its refresh (server/diagnostics.py): then the differences can only add noise."""
        c, out = self.cfg, []
        if not c.private:
            return out
        profiles = self.noise_profiles()
        for ref, diff in self.spider_pairs():  # SPIDER-type algorithms: their own keys q, clip-diff-max, diff-batch
            p = self.params
            ratio = planned_phase_ratio(p.q, noise[diff], p.clip_diff_max, p.diff_batch, noise[ref],
                                        profiles[ref].clip, c.refresh_batch)
            if ratio > 1.0:
                out.append(f"{diff}: at the clip cap clip-diff-max={p.clip_diff_max:g}, the {p.q - 1} differences of a "
                           f"phase add {ratio:.2f}x the noise std of '{ref}'; SPIDER then only adds noise unless "
                           "the step length keeps C_t = clip-diff * Delta_t well below the cap (lower q or "
                           "clip-diff-max, or raise diff-batch)")
        return out

    @abstractmethod
    def queries(self, state: State) -> list:
        """The releases (``common.messages.Query``) needed to advance ``state`` by one stage."""

    @abstractmethod
    def apply(self, state: State, released: dict[str, np.ndarray]) -> State:
        """The next state from the released noisy means (mechanism name -> (D,) float64)."""

    def advance(self, state: State, released: dict[str, np.ndarray]) -> State:
        """``apply`` with every step size (``STEP_SIZE_KEYS``) scaled by ``warmup_factor(state.t,
        warmup-iterations)``: the one implementation of the warm-up, shared by every algorithm (the engine calls
        this, never ``apply``). Only step sizes change, so queries, clips and the plan are those without warm-up."""
        factor = warmup_factor(state.t, self.cfg.warmup_iterations)
        if factor == 1.0:
            new = self.apply(state, released)
        else:
            with self._scaled_step_sizes(factor):
                new = self.apply(state, released)
        new = with_momentum(state, new, self.cfg.momentum)
        return with_average(new, self.cfg.ema_decay) if new.t == state.t + 1 else new

    def returned(self, state: State) -> tuple[np.ndarray, float]:
        """What an evaluation and the finished run use: ``output(state)`` with its parameters replaced by the
        iterate average when config key ema-decay > 0 (``with_average``; the dual scalar stays ``output``'s).
        (d,) float64 and a float."""
        x, eta = self.output(state)
        if self.cfg.ema_decay > 0.0 and state.x_average.size:
            return state.x_average, eta
        return x, eta

    @contextmanager
    def _scaled_step_sizes(self, factor: float):
        # apply() reads its step sizes from self.cfg: swap in a copy with scaled steps for this one call
        base = self.cfg
        attrs = [k.replace("-", "_") for k in STEP_SIZE_KEYS]
        self.cfg = base.scaled({a: getattr(base, a) * factor for a in attrs})
        try:
            yield
        finally:
            self.cfg = base

    @abstractmethod
    def versions(self, state: State) -> dict[int, np.ndarray]:
        """Model versions (id -> flat parameters) that the current queries reference."""

    @abstractmethod
    def output(self, state: State) -> tuple[np.ndarray, float]:
        """The parameters (d,) and dual scalar to evaluate or return at this point."""

    def diagnostics(self, state: State) -> dict[str, float]:
        """Public per-iteration values worth logging (computed from released values only)."""
        return {}

    def eval_extras(self, state: State, losses: np.ndarray) -> dict[str, float]:
        """Algorithm-specific metrics from the evaluation set's per-record losses (public data)."""
        return {}
