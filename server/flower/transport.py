"""The Flower transport: executes queries on the nodes of a Flower Grid (simulation or deployment).

- Nodes are matched to partitions by a 'hello' round (partition id from each node's node_config; never the
  Flower node id, which changes between runs). Shard sizes reported there give n (public: the unit of privacy
  fixes both, server/ledger.py). A node that fails there (e.g. its data folder is missing) is handled by config
  key on-client-failure like a failed release; a dropped node takes no part in the run. Failures are named by
  partition and node id.
- Each model version is sent to a node once; a node keeps the newest few in its ``context.state``. A node
  that lost them (restart) answers 'missing model versions' and gets every version again.
- Messages are pushed and pulled with a short poll interval (10 ms, backing off to 0.05 s) and a deadline
  (``round-timeout``), not ``send_and_receive``'s fixed 3 s poll of deployment
  (docs/explanation/FLOWER.md section 6); no wait is unbounded.
- With ``secure=True`` (noise-mode=distributed) a round whose queries carry client noise goes through SecAgg+
  (server/flower/secagg.py): the server receives only the sum of the nodes' noised sums, as one reply per query
  (partition -1) counting the nodes in it; nodes that dropped out are reported as failed partitions.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence, Set

import numpy as np
from flwr.app import Message, RecordDict
from flwr.serverapp import Grid

from ...common.codec import encode_config
from ...common.flower.wire import HELLO, RELEASE, pack_queries, unpack_replies
from ...common.messages import SECURE_SUM, UNDISCLOSED, Query, Reply
from ...common.transport import ClientFailure, RoundResult, under_failure_policy
from .secagg import SecAggRange, SecureRound

log = logging.getLogger(__name__)
# Reply polls back off from POLL_SECONDS to POLL_MAX_SECONDS (x POLL_GROWTH each empty pull), and never wait
# longer than POLL_SHARE of the time the round has taken so far: a fast round is seen within ~10 ms, a simulated
# round of 0.2 s within ~20 ms (the wait adds at most ~10 % to a round), and a deployment round of several seconds
# costs at most 20 HTTPS pulls of the SuperLink per second instead of 100 (CPU the SuperLink and ServerApp take from
# a small machine's nodes; not measured apart).
# The 'hello' asks a fleet's nodes HELLO_WINDOW at a time. Flower's simulation engine hands messages to its workers by
# asking its in-memory state, every 0.1 s, for each node's next message, and each such query scans every stored
# message (flwr 1.42: superlink/fleet/vce/vce_api.py add_messages_to_queue, in_memory_linkstate.get_message_ins), so a
# round with a message for each of N nodes costs O(N^2) per sweep; measured, the start-up of 1,000 simulated nodes
# took 6.2 times that of 300 (docs/research/FLEETS.md). Windows keep the stored messages at most HELLO_WINDOW.
HELLO_WINDOW = 64
POLL_SECONDS = 0.01
POLL_MAX_SECONDS = 0.05
POLL_GROWTH = 1.5
POLL_SHARE = 0.1


def next_poll_delay(delay: float, elapsed: float) -> float:
    """Seconds to sleep before the next pull of a round's replies, after an empty pull that waited ``delay``, the
    round having run ``elapsed`` seconds: delay x POLL_GROWTH, at most POLL_MAX_SECONDS and POLL_SHARE x elapsed,
    at least POLL_SECONDS."""
    return max(POLL_SECONDS, min(delay * POLL_GROWTH, POLL_MAX_SECONDS, POLL_SHARE * elapsed))


class FlowerTransport:
    """Args: grid (Flower Grid), num_clients (nodes expected), timeout (seconds per round); for secure
    aggregation also ``context`` (the ServerApp's Context), ``secure`` and the SecAgg+ share fractions; the
    failure policy of the 'hello' round (``_hello``): ``on_client_failure``, ``max_retries``, ``min_clients``
    (config keys of the same names). Raises ClientFailure when the nodes' start-up fails under that policy."""

    def __init__(self, grid: Grid, num_clients: int, timeout: float, *, context=None, secure: bool = False,
                 num_shares: float = 1.0, threshold: float = 0.5, on_client_failure: str = "fail",
                 max_retries: int = 0, min_clients: int = 1) -> None:
        self.grid = grid
        self.timeout = timeout
        self.secure = secure
        if secure and context is None:
            raise ValueError("secure aggregation needs the ServerApp's context")
        self.secure_round = SecureRound(grid, context, timeout, num_shares, threshold, None) if secure else None
        self.ranges: SecAggRange | None = None
        nodes = self._wait_for_nodes(num_clients, on_client_failure, min_clients)
        self.node_of: dict[int, int] = {}
        self.sizes: dict[int, int] = {}
        self.dropped: dict[int, str] = self._hello(nodes, num_clients, on_client_failure, max_retries, min_clients)
        self.held: dict[int, set[int]] = {nid: set() for nid in self.node_of.values()}

    def _hello(self, nodes: list[int], num_clients: int, policy: str, max_retries: int, min_clients: int
               ) -> dict[int, str]:
        """The 'hello' round: each node's partition id and shard size into ``node_of`` and ``sizes``, under the
        failure policy of every other round (``releaser.collect_round``): a node that fails (raises, times out, or
        answers that its shard cannot be built, e.g. its data folder is missing) fails the run with
        ``policy='fail'``; 'retry' asks the failed nodes again up to ``max_retries`` times; 'drop' goes on without
        them if at least ``min_clients`` nodes answered, else retries like 'retry'. A dropped node takes no part
        in the run: its records are not in n. Returns node id -> reason of each dropped node (logged by partition
        and node id). Raises ClientFailure naming each failed node's partition and node id."""
        pending = list(nodes)

        def attempt(k: int) -> dict[int, str]:  # asks the nodes still pending; keeps those that answered
            nonlocal pending
            replies, errors = {}, {}
            for start in range(0, len(pending), HELLO_WINDOW):  # a fleet's hello, HELLO_WINDOW nodes at a time
                got, lost = self._exchange({nid: RecordDict() for nid in pending[start:start + HELLO_WINDOW]}, HELLO)
                replies |= got
                errors |= lost
            failed = {nid: f"partition unknown (node {nid}): {reason[-500:]}" for nid, reason in errors.items()}
            for nid, content in replies.items():
                hello = content["hello"]
                pid = int(hello["partition"])
                if "error" in hello:
                    name = f"partition {pid}" if pid >= 0 else "partition unknown"
                    failed[nid] = f"{name} (node {nid}): {str(hello['error'])[-500:]}"
                elif pid in self.node_of:
                    raise ClientFailure(f"nodes {self.node_of[pid]} and {nid} both claim partition {pid}")
                else:
                    self.node_of[pid] = nid
                    self.sizes[pid] = int(hello["num-records"])
            for reason in failed.values():
                log.warning("start-up ('hello'), attempt %d: %s", k, reason)
            pending = sorted(failed)
            return failed

        failed = under_failure_policy(attempt, policy=policy, max_retries=max_retries, min_clients=min_clients,
                                      remaining=lambda _: len(self.node_of), where="start-up ('hello')")
        if failed:
            log.warning("training without %s (%d of %d nodes remain; their records are not in n)",
                        ", ".join(r.split(":", 1)[0] for r in failed.values()), len(self.node_of), len(nodes))
        if not set(self.node_of) <= set(range(num_clients)):  # distinct (checked above) and in range: all, or drops
            raise ClientFailure(f"partitions {sorted(self.node_of)} do not cover 0..{num_clients - 1}")
        return failed

    @property
    def num_records(self) -> int:
        return sum(self.sizes.values())

    @property
    def largest_shard(self) -> int:
        return max(self.sizes.values(), default=0)

    def _wait_for_nodes(self, k: int, policy: str, min_clients: int) -> list[int]:
        """The ids of the connected nodes once ``k`` have connected; after ``timeout`` seconds, those connected
        when ``policy`` is 'drop' and at least ``min_clients`` are, else ClientFailure."""
        deadline = time.monotonic() + self.timeout
        while True:  # simulated nodes may register after the ServerApp starts (docs/explanation/FLOWER.md pitfall 5)
            nodes = sorted(self.grid.get_node_ids())
            if len(nodes) >= k:
                return nodes[:k] if len(nodes) == k else nodes
            if time.monotonic() > deadline:
                if policy == "drop" and len(nodes) >= min_clients:
                    log.warning("only %d of %d nodes connected within %g s: training without the others",
                                len(nodes), k, self.timeout)
                    return nodes
                raise ClientFailure(f"only {len(nodes)} of {k} nodes connected within {self.timeout:g} s "
                                    f"(on-client-failure={policy}, min-clients={min_clients})")
            time.sleep(0.05)

    def _exchange(self, contents: dict[int, RecordDict], message_type: str
                  ) -> tuple[dict[int, RecordDict], dict[int, str]]:
        """Send one message to each node and wait (bounded) for every reply.
        Returns (node -> reply content, node -> error reason or timeout)."""
        msgs = [Message(content, dst_node_id=nid, message_type=message_type, ttl=max(self.timeout, 10.0))
                for nid, content in contents.items()]
        ids = {mid: m.metadata.dst_node_id for mid, m in zip(self.grid.push_messages(msgs), msgs, strict=False) if mid}
        if len(ids) != len(msgs):
            raise ClientFailure(f"only {len(ids)} of {len(msgs)} messages could be pushed to the SuperLink")
        out: dict[int, RecordDict] = {}
        errors: dict[int, str] = {}
        started = time.monotonic()
        deadline = started + self.timeout
        pending = set(ids)
        delay = POLL_SECONDS
        while pending:
            for r in self.grid.pull_messages(list(pending)):
                mid = r.metadata.reply_to_message_id
                if mid not in pending:
                    continue
                pending.discard(mid)
                if r.has_error():
                    errors[ids[mid]] = f"code {r.error.code}: {r.error.reason}"
                else:
                    out[ids[mid]] = r.content
            if pending and time.monotonic() > deadline:
                for m in pending:
                    errors[ids[m]] = f"no reply within {self.timeout:g} s ({message_type})"
                break
            if pending:
                time.sleep(delay)
                delay = next_poll_delay(delay, time.monotonic() - started)
        return out, errors

    @property
    def num_clients(self) -> int:
        return len(self.node_of)

    def quantisation_bound(self, query: Query, clients: int) -> float | None:
        """Largest quantisation error per coordinate of the last secure sum of ``clients`` nodes (None if the
        last round was not secure)."""
        return self.ranges.bound(clients, query.sensitivity) if self.ranges is not None else None

    @property
    def partitions(self) -> list[int]:
        """The partition ids of the nodes taking part (node sampling draws among them)."""
        return sorted(self.node_of)

    def run(self, queries: Sequence[Query], versions: dict[int, np.ndarray],
            sampled: Mapping[str, Set[int]] | None = None) -> RoundResult:
        """Every node's replies to ``queries``; with ``sampled`` (mechanism -> partitions; node sampling, never with
        secure aggregation) a node gets only the queries it was sampled for, and one sampled for none gets no
        message."""
        if self.secure and any(q.noise_std > 0 or q.ddg for q in queries):
            if sampled is not None:
                raise ValueError("node sampling with secure aggregation: refused by config validation")
            return self._run_secure(list(queries), versions)
        self.ranges = None
        mine = {nid: [q for q in queries if sampled is None or pid in sampled[q.mechanism]]
                for pid, nid in self.node_of.items()}
        mine = {nid: qs for nid, qs in mine.items() if qs}
        contents = {nid: pack_queries(qs, {v: versions[v] for v in sorted({v for q in qs for v in q.versions}
                                                                              - self.held[nid])})
                    for nid, qs in mine.items()}
        replies, errors = self._exchange(contents, RELEASE)
        lost = [nid for nid, reason in errors.items() if "missing model versions" in reason]
        if lost:  # those nodes lost their cached versions (restart): resend everything to them once
            again, errors2 = self._exchange({nid: pack_queries(mine[nid], {v: versions[v] for v in sorted(
                {v for q in mine[nid] for v in q.versions})}) for nid in lost}, RELEASE)
            replies.update(again)
            errors = {**{k: v for k, v in errors.items() if k not in lost}, **errors2}
        for nid in replies:
            self.held[nid] = (self.held[nid] | {v for q in mine[nid] for v in q.versions}) & set(versions)
        for nid in errors:
            self.held[nid] = set()  # unknown state: send everything next time
        partition_of = {nid: pid for pid, nid in self.node_of.items()}
        result = RoundResult({q.qid: [] for q in queries},
                             {partition_of[nid]: f"node {nid}: {reason[-800:]}" for nid, reason in errors.items()})
        for content in replies.values():
            for r in unpack_replies(content):
                if r.qid in result.replies:
                    result.replies[r.qid].append(r)
        return result

    def _run_secure(self, queries: list[Query], versions: dict[int, np.ndarray]) -> RoundResult:
        needed = {v for q in queries for v in q.versions}
        contents = {}
        for nid in self.node_of.values():
            send = sorted(needed - self.held[nid])
            contents[nid] = ([np.ascontiguousarray(versions[v]) for v in send], encode_config(queries, send))
        self.ranges = SecAggRange.for_round(queries, max(self.sizes.values()), self.num_clients)
        self.secure_round.ranges = self.ranges
        partition_of = {nid: pid for pid, nid in self.node_of.items()}
        try:
            sums, k, dropped = self.secure_round.run(queries, contents)
        except RuntimeError as e:
            for nid in self.held:
                self.held[nid] = set()
            return RoundResult({q.qid: [] for q in queries}, {pid: str(e) for pid in self.node_of})
        for nid in contents:
            self.held[nid] = set() if nid in dropped else (self.held[nid] | needed) & set(versions)
        replies = {q.qid: [Reply(q.qid, SECURE_SUM, sums[q.qid], UNDISCLOSED, k)] for q in queries}
        return RoundResult(replies, {partition_of[nid]: f"node {nid} dropped out of SecAgg+" for nid in dropped})

    def close(self) -> None:
        pass
