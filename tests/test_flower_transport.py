"""FlowerTransport's reply polling (server/flower/transport.py) against a stand-in Grid: a reply that comes late
costs a few pulls of the SuperLink, not one every 10 ms (on a deployment each pull is an HTTPS request), and is
still seen within the longest poll interval."""

from __future__ import annotations

import time

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
