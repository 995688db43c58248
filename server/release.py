"""From client replies to a released value: validate, sum, add Gaussian noise, normalise (central mode).

The sum is taken in partition order so that the result does not depend on the order replies arrive in.
Noise N(0, (z C)^2) per coordinate is added once to the global sum; the result is divided by the expected
batch size rate * n, never by the realised count (which is private).
"""

from __future__ import annotations

import logging
import math

import numpy as np

from ..common.messages import Query, Reply

log = logging.getLogger(__name__)


class ReplyError(ValueError):
    """A client's reply is malformed and was not aggregated; the message names the partition and why."""


def check_reply(query: Query, reply: Reply) -> None:
    """Raise ReplyError unless ``reply`` answers ``query`` with a finite (D,) sum whose norm is possible
    for the reported count of clipped records."""
    where = f"reply of partition {reply.partition} to {query.qid}"
    if reply.qid != query.qid:
        raise ReplyError(f"{where}: answers {reply.qid!r}")
    total = np.asarray(reply.total)
    if total.shape != (query.dim,):
        raise ReplyError(f"{where}: shape {total.shape}, expected ({query.dim},)")
    if not np.issubdtype(total.dtype, np.floating):
        raise ReplyError(f"{where}: dtype {total.dtype}, expected a float")
    if not np.all(np.isfinite(total)):
        raise ReplyError(f"{where}: contains NaN or Inf")
    if reply.count < 0:
        raise ReplyError(f"{where}: negative count {reply.count}")
    if math.isfinite(query.clip):
        bound = query.clip * reply.count * (1 + 1e-6) + 1e-9
        norm = float(np.linalg.norm(total))
        if norm > bound:
            raise ReplyError(f"{where}: norm {norm:.6g} exceeds clip {query.clip:.6g} x count {reply.count}")


def split_valid(query: Query, replies: list[Reply]) -> tuple[list[Reply], dict[int, str]]:
    """(valid replies, partition -> reason for each rejected one)."""
    valid, rejected = [], {}
    for r in replies:
        try:
            check_reply(query, r)
            valid.append(r)
        except ReplyError as e:
            rejected[r.partition] = str(e)
    return valid, rejected


def aggregate(query: Query, replies: list[Reply]) -> np.ndarray:
    """Sum (D,) float64 of (already validated) replies, in partition order."""
    total = np.zeros(query.dim, dtype=np.float64)
    for r in sorted(replies, key=lambda r: r.partition):
        total += np.asarray(r.total, dtype=np.float64)
    return total


def noisy_mean(query: Query, total: np.ndarray, noise_multiplier: float, n: int,
               rng: np.random.Generator) -> np.ndarray:
    """(total + N(0, (z C)^2 I)) / (rate n). With z = 0 (non-private run) no noise is added."""
    out = np.array(total, dtype=np.float64)
    if noise_multiplier > 0 and query.clip > 0:
        out += rng.normal(0.0, noise_multiplier * query.clip, size=out.shape)
    return out / (query.rate * n)
