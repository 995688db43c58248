"""What the engine needs from a transport, and what a transport hands back (shared by every transport).

A transport executes queries on all clients and returns their replies; the engine does not know which
transport runs it: ``client/local_transport.py`` runs every client in this process (single-node runs and tests),
``server/flower/transport.py`` runs them over Flower. The launcher (``dpdro`` CLI, ServerApp, simulations)
picks one and hands it to ``train``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from .errors import RunFailed
from .messages import Query, Reply


class ClientFailure(RuntimeError, RunFailed):
    """Clients failed (error, timeout or malformed reply) and the failure policy does not allow going on."""


@dataclass
class RoundResult:
    """Replies per query id, and partition -> reason for every client that failed this round."""

    replies: dict[str, list[Reply]]
    failures: dict[int, str] = field(default_factory=dict)


class Transport(Protocol):
    """What the engine needs from a transport."""

    @property
    def num_records(self) -> int:
        """Total number of training records over all clients (public: the unit of privacy fixes it,
        server/ledger.py)."""

    @property
    def num_clients(self) -> int:
        """Number of clients (partitions)."""

    @property
    def largest_shard(self) -> int:
        """The most training records one client holds (public, as n; it sets the SecAgg+ grid)."""

    def run(self, queries: Sequence[Query], versions: dict[int, np.ndarray]) -> RoundResult:
        """Replies of every client to each query, and the clients that failed (never raises for a client's
        own error; a deadline bounds every wait)."""

    def quantisation_bound(self, query: Query, clients: int) -> float | None:
        """Largest rounding error per coordinate of the last securely aggregated sum of ``clients`` clients for
        ``query`` (SecAgg+ quantises each client's noised sum), or None when the last round was not securely
        aggregated (``LocalTransport``: always None)."""

    def close(self) -> None:
        """Release resources."""
