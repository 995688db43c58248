"""The parts engine.py was split into: one counter codec, the server's view as a second Ledger, the
Transport protocol's quantisation bound and the named Reply markers."""

from __future__ import annotations

import json
import math
from collections import Counter

import numpy as np

from dpdro.common.messages import SECURE_SUM, UNDISCLOSED, Reply
from dpdro.server.ledger import Ledger, Mechanism, counts_from_json, counts_to_json, epsilon_of


def test_counter_codec_round_trips_through_json_with_infinite_multipliers():
    counts = Counter({(0.01, 1.3): 5, (1.0, math.inf): 2, (0.5, 0.0): 1})
    text = json.dumps(counts_to_json(counts), allow_nan=False)  # strict JSON: no Infinity literal
    assert counts_from_json(json.loads(text)) == counts


def test_server_view_ledger_records_without_guard_and_reports_its_epsilon():
    plan = {Mechanism("grad", 0.01): 10}
    main = Ledger(plan, {"grad": 1.1}, 2.0, 1e-5, "rdp")
    server = Ledger({}, {}, main.epsilon, main.delta, main.accountant)
    assert server.epsilon_spent() == 0.0
    for _ in range(10):
        server.record(0.01, 2.2)  # a weaker-than-planned view is recorded, never refused
    assert server.epsilon_spent() == epsilon_of({(0.01, 2.2): 10}, 1e-5, "rdp")
    restored = Ledger({}, {}, main.epsilon, main.delta, main.accountant)
    restored.load_state(json.loads(json.dumps(server.state())))
    assert restored.extra == server.extra and restored.epsilon_spent() == server.epsilon_spent()
    server.record(0.01, 0.0)  # one unnoised sum seen by the server: nothing holds against it any more
    assert server.epsilon_spent() == math.inf
    assert Ledger({}, {}, math.inf, 1e-5).epsilon_spent() == math.inf  # not private


def test_reply_markers_and_the_local_transport_quantisation_bound():
    from dpdro.client.local_transport import LocalTransport

    secure = Reply("q", SECURE_SUM, np.zeros(2), UNDISCLOSED, clients=3)
    assert secure.securely_aggregated and not Reply("q", 0, np.zeros(2), 4).securely_aggregated
    assert LocalTransport.quantisation_bound(object.__new__(LocalTransport), None, 3) is None
