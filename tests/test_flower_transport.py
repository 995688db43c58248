"""FlowerTransport's reply polling (server/flower/transport.py) against a stand-in Grid: a reply that comes late
costs a few pulls of the SuperLink, not one every 10 ms (on a deployment each pull is an HTTPS request), and is
still seen within the longest poll interval."""

from __future__ import annotations

import time

import numpy as np
import pytest
from flwr.app import ConfigRecord, Message, RecordDict


class SlowGrid:
    """Two nodes; each reply becomes available ``delay`` seconds after its message was pushed. Counts pulls."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.pulls = 0
        self.pushed: dict[str, tuple[float, Message]] = {}

    def get_node_ids(self):
        return [11, 12]

    def push_messages(self, msgs):
        ids = []
        for i, m in enumerate(msgs):
            mid = f"m{len(self.pushed) + i}"
            self.pushed[mid] = (time.monotonic(), m)
            ids.append(mid)
        return ids

    def pull_messages(self, ids):
        self.pulls += 1
        out = []
        for mid in ids:
            t, m = self.pushed[mid]
            if time.monotonic() - t >= self.delay:
                pid = 0 if m.metadata.dst_node_id == 11 else 1
                reply = Message(RecordDict({"hello": ConfigRecord({"partition": pid, "num-records": 5})}),
                                dst_node_id=m.metadata.dst_node_id, message_type=m.metadata.message_type)
                reply.metadata.__dict__["_reply_to_message_id"] = mid
                out.append(reply)
        return out


def test_poll_delay_grows_but_stays_a_small_share_of_the_round():
    from dpdro.server.flower.transport import POLL_MAX_SECONDS, POLL_SECONDS, next_poll_delay

    assert next_poll_delay(POLL_SECONDS, 0.0) == POLL_SECONDS  # never below the shortest poll
    assert next_poll_delay(0.02, 0.2) == pytest.approx(0.02)  # 10 % of a 0.2 s round, not 0.03
    assert next_poll_delay(0.02, 10.0) == pytest.approx(0.03)  # a long round: growth x 1.5
    assert next_poll_delay(0.04, 10.0) == POLL_MAX_SECONDS  # at most 20 pulls a second


def test_a_slow_round_costs_few_pulls_and_is_seen_promptly(monkeypatch):
    from flwr.supercore.task_identity import TaskIdentity

    from dpdro.server.flower.transport import POLL_MAX_SECONDS, FlowerTransport

    monkeypatch.setattr(TaskIdentity, "_run_id", 1)  # a ServerApp's messages belong to a run
    monkeypatch.setattr(TaskIdentity, "_node_id", 0)
    monkeypatch.setattr(TaskIdentity, "_task_id", 1)

    grid = SlowGrid(delay=1.5)
    t0 = time.monotonic()
    transport = FlowerTransport(grid, 2, timeout=30.0)  # the 'hello' round
    waited = time.monotonic() - t0
    assert transport.sizes == {0: 5, 1: 5} and transport.num_records == 10
    # ~47 pulls: 10 ms polls while the round is young (POLL_SHARE), then 20 a second; a fixed 10 ms poll makes ~150
    assert grid.pulls <= 55, f"{grid.pulls} pulls for one 1.5 s round (a fixed 10 ms poll makes ~150)"
    assert 1.5 <= waited <= 1.5 + POLL_MAX_SECONDS + 1.0  # seen within one longest poll (+ slack for a busy machine)


class StartupGrid:
    """Three nodes 11, 12, 13 holding partitions 0, 1, 2 of 5 records each. Node 13's 'hello' fails
    ``failures`` times: with ``error`` in its answer (the ClientApp's report that its shard cannot be built), or
    with a Flower error message when ``flower_error``. Records the nodes each message went to."""

    def __init__(self, failures: int, flower_error: bool = False) -> None:
        self.failures = failures
        self.flower_error = flower_error
        self.sent: list[tuple[str, int]] = []
        self.pushed: dict[str, Message] = {}

    def get_node_ids(self):
        return [11, 12, 13]

    def push_messages(self, msgs):
        ids = []
        for m in msgs:
            mid = f"m{len(self.pushed)}"
            self.pushed[mid] = m
            self.sent.append((m.metadata.message_type, m.metadata.dst_node_id))
            ids.append(mid)
        return ids

    def pull_messages(self, ids):
        out = []
        for mid in ids:
            m = self.pushed.pop(mid)
            nid = m.metadata.dst_node_id
            pid = nid - 11
            answer = {"partition": pid, "num-records": 5}
            if nid == 13 and self.failures > 0:
                self.failures -= 1
                answer = {"partition": pid, "error": "DataError: data-root /site/2/data does not exist"}
            hello = "hello" in m.metadata.message_type
            content = RecordDict({"hello": ConfigRecord(answer)}) if hello else RecordDict()
            reply = Message(content, dst_node_id=nid, message_type=m.metadata.message_type)
            if nid == 13 and self.flower_error and "error" in answer:
                from flwr.app import Error

                reply = Message(Error(0, "ClientApp raised an exception"), reply_to=m)
            reply.metadata.__dict__["_reply_to_message_id"] = mid
            out.append(reply)
        return out


@pytest.fixture
def server_identity(monkeypatch):
    from flwr.supercore.task_identity import TaskIdentity

    monkeypatch.setattr(TaskIdentity, "_run_id", 1)  # a ServerApp's messages belong to a run
    monkeypatch.setattr(TaskIdentity, "_node_id", 0)
    monkeypatch.setattr(TaskIdentity, "_task_id", 1)


def test_a_node_whose_data_cannot_be_loaded_is_dropped_at_start_under_drop(server_identity, caplog):
    """on-client-failure=drop, min-clients=2: the node of partition 2 answers 'hello' that its data cannot be
    loaded; training goes on with partitions 0 and 1 (n = 10, 2 clients) and no later round is sent to it; the
    log names the partition and the node id. (Before: the run failed at 'hello' whatever the policy.)"""
    from dpdro.common.messages import Point, Query
    from dpdro.server.flower.transport import FlowerTransport

    grid = StartupGrid(failures=10)
    transport = FlowerTransport(grid, 3, timeout=30.0, on_client_failure="drop", max_retries=2, min_clients=2)
    assert transport.node_of == {0: 11, 1: 12} and transport.num_clients == 2 and transport.num_records == 10
    assert list(transport.dropped) == [13] and "partition 2 (node 13): DataError" in transport.dropped[13]
    assert "partition 2 (node 13): DataError: data-root /site/2/data does not exist" in caplog.text
    assert sorted(nid for kind, nid in grid.sent) == [11, 12, 13]  # dropped at once: no retry under drop
    grid.sent.clear()
    query = Query(0, "grad", "grad", (Point(0, 0.0),), 0.1, 1.0, 2)
    transport.run([query], {0: np.zeros(2)})
    assert sorted(nid for kind, nid in grid.sent) == [11, 12]


def test_start_up_failure_under_fail_names_the_partition_and_node(server_identity):
    """on-client-failure=fail: one attempt, and the error names partition and node id with the node's reason;
    a node whose ClientApp raised (a Flower error, no partition in it) is named by node id."""
    from dpdro.common.transport import ClientFailure
    from dpdro.server.flower.transport import FlowerTransport

    grid = StartupGrid(failures=1)
    with pytest.raises(ClientFailure, match=r"failed after 1 attempt\(s\) with on-client-failure=fail: partition 2 "
                                            r"\(node 13\): DataError: data-root /site/2/data does not exist"):
        FlowerTransport(grid, 3, timeout=30.0, on_client_failure="fail", max_retries=2)
    with pytest.raises(ClientFailure, match=r"partition unknown \(node 13\): code 0: ClientApp raised"):
        FlowerTransport(StartupGrid(failures=1, flower_error=True), 3, timeout=30.0)


def test_start_up_failure_is_retried_then_fails_or_recovers(server_identity):
    """'retry' (and 'drop' with too few nodes left) asks only the failed node again, up to max-retries times:
    a node that recovers takes part; one that does not fails the run after 1 + max-retries attempts."""
    from dpdro.common.transport import ClientFailure
    from dpdro.server.flower.transport import FlowerTransport

    grid = StartupGrid(failures=1)
    transport = FlowerTransport(grid, 3, timeout=30.0, on_client_failure="retry", max_retries=2)
    assert transport.node_of == {0: 11, 1: 12, 2: 13} and transport.dropped == {}
    assert [nid for kind, nid in grid.sent] == [11, 12, 13, 13]
    grid = StartupGrid(failures=10)
    with pytest.raises(ClientFailure, match=r"after 3 attempt\(s\) with on-client-failure=drop: partition 2 \(node 13"):
        FlowerTransport(grid, 3, timeout=30.0, on_client_failure="drop", max_retries=2, min_clients=3)
    assert [nid for kind, nid in grid.sent] == [11, 12, 13, 13, 13]


def test_hello_of_a_node_whose_data_folder_is_missing_names_its_partition(tmp_path, server_identity):
    """The ClientApp's 'hello' on a node whose data-root (node config) does not exist answers with its partition
    and the error, not a size, so the server applies the failure policy and names the partition. (Before: the
    ClientApp raised, and the server saw only Flower's error for the node id.)"""
    from flwr.app import Context

    from dpdro.client.flower.app import hello

    gone = tmp_path / "site-2-data"
    context = Context(1, 13, {"partition-id": 2, "num-partitions": 3, "data-root": str(gone),
                              "cache-dir": str(tmp_path / "cache")}, RecordDict(), {"num-clients": 3})
    reply = hello(Message(RecordDict(), dst_node_id=13, message_type="query.hello"), context)
    answer = dict(reply.content["hello"])
    assert answer["partition"] == 2 and "num-records" not in answer
    assert answer["error"].startswith("DataError: ") and str(gone) in answer["error"], answer


class FleetGrid:
    """A grid of ``n`` nodes answering 'hello' at once, counting the messages stored but not yet answered and
    pulled: what Flower's simulation engine scans for every node it serves."""

    def __init__(self, n: int):
        self.n, self.stored, self.most_stored = n, {}, 0

    def get_node_ids(self):
        return list(range(100, 100 + self.n))

    def push_messages(self, msgs):
        ids = [f"m{id(m)}" for m in msgs]
        self.stored.update(zip(ids, msgs, strict=True))
        self.most_stored = max(self.most_stored, len(self.stored))
        return ids

    def pull_messages(self, ids):
        out = []
        for mid in ids:
            m = self.stored.pop(mid)
            pid = m.metadata.dst_node_id - 100
            reply = Message(RecordDict({"hello": ConfigRecord({"partition": pid, "num-records": 3})}),
                            dst_node_id=m.metadata.dst_node_id, message_type=m.metadata.message_type)
            reply.metadata.__dict__["_reply_to_message_id"] = mid
            out.append(reply)
        return out


def test_a_fleets_hello_keeps_at_most_a_window_of_messages_stored(monkeypatch):
    from flwr.supercore.task_identity import TaskIdentity

    from dpdro.server.flower.transport import HELLO_WINDOW, FlowerTransport

    monkeypatch.setattr(TaskIdentity, "_run_id", 1)
    monkeypatch.setattr(TaskIdentity, "_node_id", 0)
    monkeypatch.setattr(TaskIdentity, "_task_id", 1)
    grid = FleetGrid(3 * HELLO_WINDOW + 5)
    transport = FlowerTransport(grid, grid.n, timeout=30.0)
    assert transport.sizes == {pid: 3 for pid in range(grid.n)} and transport.num_records == 3 * grid.n
    assert transport.node_of == {pid: 100 + pid for pid in range(grid.n)}
    assert grid.most_stored == HELLO_WINDOW  # never the whole fleet at once
