"""Packing of queries, replies and model versions into Flower records (the only Flower-aware schema code;
the Flower-free dict form of a query is ``common/codec.py``).

A release message (type 'query.release') holds one ConfigRecord per query ('q0', 'q1', ...) and an
ArrayRecord 'versions' with the model versions the node does not hold yet. The reply holds one
ConfigRecord 'r<i>' (qid, partition, count) and one ArrayRecord 'totals' with an Array 'r<i>' per query.
"""

from __future__ import annotations

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from ..codec import query_from_dict, query_to_dict
from ..messages import Query, Reply

HELLO = "query.hello"
RELEASE = "query.release"


def pack_queries(queries: list[Query], versions: dict[int, np.ndarray]) -> RecordDict:
    """Flower RecordDict of one round's queries (ConfigRecords q0, q1, ...) and the model versions they
    read (ArrayRecord 'versions': version -> flat float array (P,)). Inverse: ``unpack_queries``."""
    rd = RecordDict()
    for i, q in enumerate(queries):
        rd[f"q{i}"] = ConfigRecord(query_to_dict(q))
    rd["versions"] = ArrayRecord({str(k): Array(np.ascontiguousarray(v)) for k, v in versions.items()})
    return rd


def unpack_queries(rd: RecordDict) -> tuple[list[Query], dict[int, np.ndarray]]:
    """(queries in order, version -> flat parameters) from a RecordDict written by ``pack_queries``."""
    queries = []
    i = 0
    while f"q{i}" in rd:
        queries.append(query_from_dict(rd[f"q{i}"]))
        i += 1
    versions = {int(k): a.numpy() for k, a in rd["versions"].items()} if "versions" in rd else {}
    return queries, versions


def pack_replies(replies: list[Reply]) -> RecordDict:
    """Flower RecordDict of a client's replies: ConfigRecords r0, r1, ... (qid, partition, count) and the
    float64 totals (D,) in ArrayRecord 'totals'. Inverse: ``unpack_replies``."""
    rd = RecordDict()
    totals = {}
    for i, r in enumerate(replies):
        rd[f"r{i}"] = ConfigRecord({"qid": r.qid, "partition": r.partition, "count": r.count})
        totals[f"r{i}"] = Array(np.ascontiguousarray(r.total))
    rd["totals"] = ArrayRecord(totals)
    return rd


def unpack_replies(rd: RecordDict) -> list[Reply]:
    """The replies, in order, from a RecordDict written by ``pack_replies``."""
    out = []
    i = 0
    while f"r{i}" in rd:
        c = rd[f"r{i}"]
        out.append(Reply(str(c["qid"]), int(c["partition"]), rd["totals"][f"r{i}"].numpy(), int(c["count"])))
        i += 1
    return out
