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
            "count-only": bool(q.count_only), "ddg": [float(x) for x in q.ddg]}


def query_from_dict(c) -> Query:
    """Inverse of ``query_to_dict`` (missing optional fields take their defaults)."""
    points = tuple(Point(int(v), float(s)) for v, s in zip(c["versions"], c["scalars"], strict=False))
    return Query(int(c["iteration"]), str(c["mechanism"]), str(c["quantity"]), points, float(c["rate"]),
                 float(c["clip"]), int(c["dim"]), int(c.get("attempt", 0)),
                 tuple(float(x) for x in c.get("coefs", [])), tuple(float(x) for x in c.get("extra", [])),
                 tuple(float(x) for x in c.get("offset", [])), float(c.get("count-scale", 0.0)),
                 float(c.get("noise-std", 0.0)), bool(c.get("count-only", False)),
                 tuple(float(x) for x in c.get("ddg", [])))


def encode_config(queries: list[Query], version_ids: list[int]) -> dict:
    """FitIns config for a node: the queries and the ids of the model versions carried as parameters."""
    return {"dpdro-queries": json.dumps([query_to_dict(q) for q in queries]),
            "dpdro-versions": json.dumps(version_ids)}


def decode_config(config: dict) -> tuple[list[Query], list[int]]:
    """Inverse of ``encode_config``: (queries, model version ids of the FitIns parameters)."""
    return ([query_from_dict(d) for d in json.loads(str(config["dpdro-queries"]))],
            [int(v) for v in json.loads(str(config["dpdro-versions"]))])


def to_units(queries: list[Query], replies: list[Reply]) -> list[np.ndarray]:
    """A node's FitRes arrays: each noised sum divided by its query's sensitivity."""
    return [np.asarray(r.total, dtype=np.float64) / q.sensitivity for q, r in zip(queries, replies, strict=True)]
