"""The interface every algorithm implements: a server-side state machine over released values.

An algorithm never sees records, clients or transports. At each stage it says which releases it needs
(``queries``), and updates its state from the released, noised means (``apply``, pure post-processing).
It declares its whole schedule of releases up front (``plan``) so that noise can be calibrated before
training (ARCHITECTURE.md section 3).
"""

from __future__ import annotations

import dataclasses
import json
from abc import ABC, abstractmethod
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


class Algorithm(ABC):
    """Base class. Args: cfg (Config), n (number of training records, public), dim (model parameters),
    num_classes (K of the classification task)."""

    name = ""  # set by ``register_algorithm``, with ``spec`` (its common.algorithm_specs.AlgorithmSpec)
    spec = None

    def __init__(self, cfg, n: int, dim: int, num_classes: int = 10) -> None:
        self.cfg = cfg
        self.n = n
        self.dim = dim
        self.num_classes = num_classes

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

    def start_state(self, x0: np.ndarray, eta0: float | None = None) -> State:
        """``init_state(x0)`` with the dual variable (every eta field: eta, eta_prev, eta_next, eta_out) set to
        ``eta0`` when given (the private eta initialisation of server/setup.py)."""
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
        for ref, diff in self.spider_pairs():
            ratio = planned_phase_ratio(c.q, noise[diff], c.clip_diff_max, c.diff_batch, noise[ref],
                                        profiles[ref].clip, c.refresh_batch)
            if ratio > 1.0:
                out.append(f"{diff}: at the clip cap clip-diff-max={c.clip_diff_max:g}, the {c.q - 1} differences of a "
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
