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

    name = ""

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
