"""The Flower transport: executes queries on the nodes of a Flower Grid (simulation or deployment).

- Nodes are matched to partitions by a 'hello' round (partition id from each node's node_config; never the
  Flower node id, which changes between runs). Shard sizes reported there give n, treated as public.
- Each model version is sent to a node once; a node keeps the newest few in its ``context.state``. A node
  that lost them (restart) answers 'missing model versions' and gets every version again.
- Messages are pushed and pulled with a short poll interval and a deadline (``round-timeout``), not
  ``send_and_receive``'s fixed 3 s poll of deployment (FLOWER.md section 6); no wait is unbounded.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import numpy as np
from flwr.app import Message, RecordDict
from flwr.serverapp import Grid

from ..common.messages import Query, Reply
from ..common.wire import HELLO, RELEASE, pack_queries, unpack_replies

log = logging.getLogger(__name__)
POLL_SECONDS = 0.01


class ClientFailure(RuntimeError):
    """A node answered with an error or did not answer in time; the message names the partition/node."""


class FlowerTransport:
    """Args: grid (Flower Grid), num_clients (nodes expected), timeout (seconds per round)."""

    def __init__(self, grid: Grid, num_clients: int, timeout: float) -> None:
        self.grid = grid
        self.timeout = timeout
        nodes = self._wait_for_nodes(num_clients)
        replies = self._exchange({nid: RecordDict() for nid in nodes}, HELLO)
        self.node_of: dict[int, int] = {}
        self.sizes: dict[int, int] = {}
        for nid, content in replies.items():
            pid = int(content["hello"]["partition"])
            if pid in self.node_of:
                raise ClientFailure(f"nodes {self.node_of[pid]} and {nid} both claim partition {pid}")
            self.node_of[pid] = nid
            self.sizes[pid] = int(content["hello"]["num-records"])
        if sorted(self.node_of) != list(range(num_clients)):
            raise ClientFailure(f"partitions {sorted(self.node_of)} do not cover 0..{num_clients - 1}")
        self.held: dict[int, set[int]] = {nid: set() for nid in nodes}

    @property
    def num_records(self) -> int:
        return sum(self.sizes.values())

    def _wait_for_nodes(self, k: int) -> list[int]:
        deadline = time.monotonic() + self.timeout
        while True:  # simulated nodes may register after the ServerApp starts (FLOWER.md pitfall 5)
            nodes = sorted(self.grid.get_node_ids())
            if len(nodes) >= k:
                return nodes[:k] if len(nodes) == k else nodes
            if time.monotonic() > deadline:
                raise ClientFailure(f"only {len(nodes)} of {k} nodes connected within {self.timeout:g} s")
            time.sleep(0.05)

    def _exchange(self, contents: dict[int, RecordDict], message_type: str) -> dict[int, RecordDict]:
        """Send one message to each node and wait (bounded) for every reply; raise ClientFailure on errors."""
        msgs = [Message(content, dst_node_id=nid, message_type=message_type, ttl=max(self.timeout, 10.0))
                for nid, content in contents.items()]
        ids = {mid: m.metadata.dst_node_id for mid, m in zip(self.grid.push_messages(msgs), msgs) if mid}
        if len(ids) != len(msgs):
            raise ClientFailure(f"only {len(ids)} of {len(msgs)} messages could be pushed to the SuperLink")
        out: dict[int, RecordDict] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + self.timeout
        pending = set(ids)
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
                raise ClientFailure(f"no reply from node(s) {sorted(ids[m] for m in pending)} within "
                                    f"{self.timeout:g} s ({message_type})")
            if pending:
                time.sleep(POLL_SECONDS)
        if errors:
            self._errors = errors
            raise ClientFailure("; ".join(f"node {nid}: {reason[-500:]}" for nid, reason in errors.items()))
        return out

    def run(self, queries: Sequence[Query], versions: dict[int, np.ndarray]) -> dict[str, list[Reply]]:
        needed = {v for q in queries for v in q.versions}
        contents = {}
        for nid in self.node_of.values():
            send = {v: versions[v] for v in sorted(needed - self.held[nid])}
            contents[nid] = pack_queries(list(queries), send)
        try:
            replies = self._exchange(contents, RELEASE)
        except ClientFailure as e:
            if "missing model versions" not in str(e):
                raise
            for nid in self.node_of.values():  # a node lost its versions: resend everything once
                self.held[nid] = set()
            contents = {nid: pack_queries(list(queries), {v: versions[v] for v in needed})
                        for nid in self.node_of.values()}
            replies = self._exchange(contents, RELEASE)
        for nid in self.node_of.values():
            self.held[nid] = (self.held[nid] | needed) & set(versions)
        out: dict[str, list[Reply]] = {q.qid: [] for q in queries}
        for content in replies.values():
            for r in unpack_replies(content):
                if r.qid in out:
                    out[r.qid].append(r)
        return out

    def close(self) -> None:
        pass
