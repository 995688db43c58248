"""The Flower-free wire form of queries and replies, shared by the server and the nodes.

``query_to_dict``/``query_from_dict``: a query as a flat mapping of scalars and lists (the content of a Flower
ConfigRecord, or JSON). ``encode_config``/``decode_config``/``to_units``: what a SecAgg+ round carries in the
legacy FitIns config and FitRes arrays (server/flower/secagg.py drives the round; client/flower/app.py answers
it). Nothing here imports Flower, so both sides' cores and tests can use it.
"""

from __future__ import annotations

import json

import numpy as np

from .messages import Point, Query, Reply


def query_to_dict(q: Query) -> dict:
    """A query as a flat mapping of scalars and lists (a ConfigRecord's or JSON's content)."""
    return {"iteration": q.iteration, "mechanism": q.mechanism, "quantity": q.quantity, "rate": q.rate,
            "clip": q.clip, "dim": q.dim, "attempt": q.attempt, "coefs": [float(c) for c in q.coefs],
            "extra": [float(e) for e in q.extra], "versions": [p.version for p in q.points],
            "scalars": [float(p.scalar) for p in q.points], "offset": [float(o) for o in q.offset],
            "count-scale": float(q.count_scale), "noise-std": float(q.noise_std),
            "count-only": bool(q.count_only), "ddg": [float(x) for x in q.ddg],
            "local": [float(x) for x in q.local], "feature-norm": [float(x) for x in q.feature_norm]}


def query_from_dict(c) -> Query:
    """Inverse of ``query_to_dict`` (missing optional fields take their defaults)."""
    points = tuple(Point(int(v), float(s)) for v, s in zip(c["versions"], c["scalars"], strict=False))
    return Query(int(c["iteration"]), str(c["mechanism"]), str(c["quantity"]), points, float(c["rate"]),
                 float(c["clip"]), int(c["dim"]), int(c.get("attempt", 0)),
                 tuple(float(x) for x in c.get("coefs", [])), tuple(float(x) for x in c.get("extra", [])),
                 tuple(float(x) for x in c.get("offset", [])), float(c.get("count-scale", 0.0)),
                 float(c.get("noise-std", 0.0)), bool(c.get("count-only", False)),
                 tuple(float(x) for x in c.get("ddg", [])), tuple(float(x) for x in c.get("local", [])),
                 tuple(float(x) for x in c.get("feature-norm", [])))


def encode_config(queries: list[Query], version_ids: list[int]) -> dict:
    """FitIns config for a node: the queries and the ids of the model versions carried as parameters."""
    return {"dpdro-queries": json.dumps([query_to_dict(q) for q in queries]),
            "dpdro-versions": json.dumps(version_ids)}


def decode_config(config: dict) -> tuple[list[Query], list[int]]:
    """Inverse of ``encode_config``: (queries, model version ids of the FitIns parameters)."""
    return ([query_from_dict(d) for d in json.loads(str(config["dpdro-queries"]))],
            [int(v) for v in json.loads(str(config["dpdro-versions"]))])


def to_units(queries: list[Query], replies: list[Reply]) -> list[np.ndarray]:
    """A node's FitRes arrays: each noised sum divided by its query's sensitivity; a DDG share (``Query.ddg``)
    shifted by -2^(b-1) (``ddg_round_bits``: b the round's largest bits), which the SecAgg+ grid of
    ``server.flower.secagg.SecAggRange.for_round`` maps back to the share itself, exactly."""
    half = 2.0 ** (ddg_round_bits(queries) - 1)
    return [np.asarray(r.total, dtype=np.float64) - half if q.ddg else
            np.asarray(r.total, dtype=np.float64) / q.sensitivity for q, r in zip(queries, replies, strict=True)]


def ddg_round_bits(queries: list[Query]) -> int:
    """The most bits per coordinate of the DDG queries of one SecAgg+ round (0 when none is one): the round's
    modulus is 2^b times room for the nodes (``SecAggRange.for_round``)."""
    return max((int(q.ddg[2]) for q in queries if q.ddg), default=0)


def ddg_share_sum(mean: np.ndarray, nodes: int, round_bits: int, bits: int) -> np.ndarray:
    """The sum modulo 2^bits of ``nodes`` DDG shares from SecAgg+'s dequantised mean (the workflow returns
    (S - k 2^(b-1)) / k for the integer sum S of the nodes' shares, b = ``round_bits``; ``to_units``): S rounded to
    the nearest integer, then reduced modulo 2^bits (2^bits divides 2^b, so the modular sum is exact). float64
    (d',) of integers."""
    total = np.rint(np.asarray(mean, dtype=np.float64) * nodes + nodes * 2.0 ** (round_bits - 1))
    return np.mod(total, 2.0**bits)
