"""The in-process transport: every client's shard lives in this process (single-node runs and tests).

A transport executes queries on all clients and returns their replies; the engine does not know which
transport runs it (``server/flower_transport.py`` is the Flower one).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from ..client.worker import ShardWorker
from ..common.data import ArrayDataset
from ..common.messages import Query, Reply
from ..common.partition import make_partition

log = logging.getLogger(__name__)


class ClientFailure(RuntimeError):
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
        """Total number of training records over all clients (treated as public)."""

    @property
    def num_clients(self) -> int:
        """Number of clients (partitions)."""

    def run(self, queries: Sequence[Query], versions: dict[int, np.ndarray]) -> RoundResult:
        """Replies of every client to each query, and the clients that failed (never raises for a client's
        own error; a deadline bounds every wait)."""

    def close(self) -> None:
        """Release resources."""


class LocalTransport:
    """Runs every client's ``ShardWorker`` in this process, partitioned exactly as the Flower clients."""

    def __init__(self, cfg, train: ArrayDataset) -> None:
        parts = make_partition(cfg, train.y.numpy())
        self.workers = [ShardWorker(cfg, train.subset(idx), pid) for pid, idx in enumerate(parts)]

    @property
    def num_records(self) -> int:
        return sum(w.num_records for w in self.workers)

    @property
    def num_clients(self) -> int:
        return len(self.workers)

    def run(self, queries: Sequence[Query], versions: dict[int, np.ndarray]) -> RoundResult:
        result = RoundResult({q.qid: [] for q in queries})
        for w in self.workers:
            try:
                replies = [w.answer(q, versions) for q in queries]
            except Exception as e:  # noqa: BLE001 - a client's error becomes a reported failure
                result.failures[w.partition] = f"{type(e).__name__}: {e}"
                continue
            for q, r in zip(queries, replies, strict=False):
                result.replies[q.qid].append(r)
        return result

    def close(self) -> None:
        self.workers = []
