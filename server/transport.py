"""The in-process transport: every client's shard lives in this process (single-node runs and tests).

A transport executes queries on all clients and returns their replies; the engine does not know which
transport runs it (``server/flower_transport.py`` is the Flower one).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from ..client.worker import ShardWorker
from ..common.data import ArrayDataset
from ..common.messages import Query, Reply
from ..common.partition import make_partition


class Transport(Protocol):
    """What the engine needs from a transport."""

    @property
    def num_records(self) -> int:
        """Total number of training records over all clients (treated as public)."""

    def run(self, queries: Sequence[Query], versions: dict[int, np.ndarray]) -> dict[str, list[Reply]]:
        """Replies of every client to each query (qid -> replies)."""

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

    def run(self, queries: Sequence[Query], versions: dict[int, np.ndarray]) -> dict[str, list[Reply]]:
        return {q.qid: [w.answer(q, versions) for w in self.workers] for q in queries}

    def close(self) -> None:
        self.workers = []
