"""The in-process transport: every client's shard lives in this process (single-node runs and tests).

It satisfies ``common.transport.Transport``; the engine receives it from the launcher and never imports it.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence, Set

import numpy as np

from ..common.data import ArrayDataset
from ..common.messages import Query, Reply
from ..common.partition import make_partition
from ..common.transport import RoundResult
from .worker import ShardWorker

# Name prefix of the threads that run a client's work on a round (``busy_client_threads``).
CLIENT_THREAD = "dpdro-client"


def busy_client_threads() -> list[threading.Thread]:
    """The client threads still running: a round interrupted by Ctrl-C in the main thread, or a client abandoned
    after its round-timeout. Such a thread may be inside torch's C++ code; if the interpreter shuts down around it,
    the thread is unwound through C++ frames that cannot be unwound and the process aborts ("terminate called
    without an active exception"), so a command-line process with one alive leaves with ``os._exit``."""
    return [t for t in threading.enumerate() if t.name.startswith(CLIENT_THREAD) and t.is_alive()]


class LocalTransport:
    """Runs every client's ``ShardWorker`` in this process, partitioned exactly as the Flower clients.

    Each client's work on a round runs in a daemon thread and must finish within ``round-timeout`` seconds,
    as on Flower: a client that hangs becomes a reported failure ("no reply within ...") and the engine's
    ``on-client-failure`` policy decides, instead of the run hanging. Python cannot stop a thread, so a
    timed-out client's thread is abandoned (it ends with the process) and its late result is ignored.
    """

    def __init__(self, cfg, train: ArrayDataset, module=None, held_out: ArrayDataset | None = None) -> None:
        """``module``: a model object for every worker instead of config key ``model`` (``ShardWorker``).
        ``held_out``: evaluation records the clients hold (eval-data=nodes), partitioned over them as the training
        records are (``make_partition`` on their labels), so that each client evaluates on its own part."""
        parts = make_partition(cfg.data, train.y.numpy())
        held = ([held_out.subset(idx) for idx in make_partition(cfg.data, held_out.y.numpy())]
                if held_out is not None else [None] * len(parts))
        self.workers = [ShardWorker(cfg, train.subset(idx), pid, module, held[pid]) for pid, idx in enumerate(parts)]
        self.timeout = float(cfg.round_timeout)

    @property
    def num_records(self) -> int:
        return sum(w.num_records for w in self.workers)

    @property
    def num_clients(self) -> int:
        return len(self.workers)

    @property
    def largest_shard(self) -> int:
        return max((w.num_records for w in self.workers), default=0)

    @property
    def partitions(self) -> list[int]:
        """The partition ids of the clients (node sampling draws among them)."""
        return [w.partition for w in self.workers]

    def run(self, queries: Sequence[Query], versions: dict[int, np.ndarray],
            sampled: Mapping[str, Set[int]] | None = None) -> RoundResult:
        """Every client's replies to ``queries``; with ``sampled`` (mechanism -> partitions; node sampling) a client
        answers only the queries it was sampled for, and one sampled for none does no work."""
        result = RoundResult({q.qid: [] for q in queries})
        for w in self.workers:
            mine = list(queries) if sampled is None else [q for q in queries if w.partition in sampled[q.mechanism]]
            if not mine:
                continue
            try:
                replies = self._answer_within_timeout(w, mine, versions)
            except Exception as e:  # noqa: BLE001 - a client's error becomes a reported failure
                result.failures[w.partition] = f"{type(e).__name__}: {e}"
                continue
            for q, r in zip(mine, replies, strict=False):
                result.replies[q.qid].append(r)
        return result

    def _answer_within_timeout(self, worker: ShardWorker, queries: Sequence[Query],
                               versions: dict[int, np.ndarray]) -> list[Reply]:
        """``worker``'s replies to ``queries``; raises its error, or TimeoutError after ``self.timeout`` s."""
        outcome: dict[str, object] = {}

        def work() -> None:
            try:
                outcome["replies"] = [worker.answer(q, versions) for q in queries]
            except BaseException as e:  # noqa: BLE001 - handed to the calling thread
                outcome["error"] = e

        thread = threading.Thread(target=work, name=f"{CLIENT_THREAD}-{worker.partition}", daemon=True)
        thread.start()
        thread.join(self.timeout)
        if thread.is_alive():
            raise TimeoutError(f"no reply within {self.timeout:g} s (round-timeout)")
        if "error" in outcome:
            raise outcome["error"]  # type: ignore[misc]
        return outcome["replies"]  # type: ignore[return-value]

    def quantisation_bound(self, query: Query, clients: int) -> None:
        """None: the clients' sums are added in this process, unquantised."""
        return None

    def close(self) -> None:
        self.workers = []
