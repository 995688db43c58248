"""What the engine needs from a transport, and what a transport hands back (shared by every transport).

A transport executes queries on all clients and returns their replies; the engine does not know which
transport runs it: ``client/local_transport.py`` runs every client in this process (single-node runs and tests),
``server/flower/transport.py`` runs them over Flower. The launcher (``dpdro`` CLI, ServerApp, simulations)
picks one and hands it to ``train``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from .errors import RunFailed
from .messages import Query, Reply


class ClientFailure(RuntimeError, RunFailed):
    """Clients failed (error, timeout or malformed reply) and the failure policy does not allow going on."""


def under_failure_policy(attempt: Callable[[int], dict[Any, str]], *, policy: str, max_retries: int,
                         min_clients: int, remaining: Callable[[dict[Any, str]], int], where: str,
                         on_discard: Callable[[], None] | None = None) -> dict[Any, str]:
    """Run a round's attempts under the failure policy (config keys on-client-failure, max-retries, min-clients):
    the one loop of every round, the nodes' start-up ('hello', server/flower/transport.py) and each release
    (``server.releaser.collect_round``).

    ``attempt(k)`` runs attempt k = 0, 1, ... and returns its failures, client -> 'who: why' ({} when none
    failed); it keeps what succeeded and logs each failure in its own words. On failures: ``policy`` 'drop' goes
    on without the failed clients if ``remaining(failures)`` >= ``min_clients``; else ``on_discard()`` is called
    (the attempt is discarded) and 'retry' (or 'drop' with too few left) tries again, up to ``max_retries``
    times, while 'fail' gives up at once. Returns {} after an attempt without failure, or the failures the run
    goes on without ('drop'). Raises ClientFailure '<where> failed after N attempt(s) with on-client-failure=P:
    ...' naming every failure of the last attempt (in client order)."""
    for k in range(max_retries + 1):
        failures = attempt(k)
        if not failures:
            return {}
        if policy == "drop" and remaining(failures) >= min_clients:
            return failures
        if on_discard is not None:
            on_discard()
        if policy == "fail":
            break
    raise ClientFailure(f"{where} failed after {k + 1} attempt(s) with on-client-failure={policy}: "
                        + "; ".join(text for _, text in sorted(failures.items())))


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
