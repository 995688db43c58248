"""The in-process transport: every client's shard lives in this process (single-node runs and tests).

It satisfies ``common.transport.Transport``; the engine receives it from the launcher and never imports it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..common.data import ArrayDataset
from ..common.messages import Query
from ..common.partition import make_partition
from ..common.transport import RoundResult
from .worker import ShardWorker


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
