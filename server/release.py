"""From client replies to a released value: validate, sum, add Gaussian noise, normalise.

The sum is taken in partition order so that the result does not depend on the order replies arrive in.
The released sum carries N(0, (z S)^2) per coordinate, S the query's sensitivity (its clip, or
clip sqrt(1 + c^2) with the clipped-count coordinate); where that noise is drawn depends on the noise mode
(config ``noise-mode``):

- central: the server adds all of it to the sum of the clients' clipped sums (a trusted server);
- distributed: each of the m clients of the release adds N(0, (z S)^2 / m) to its own sum, and the server only
  sees their (securely aggregated) total; if k of them drop out, the server tops up N(0, k (z S)^2 / m), so
  the released std is unchanged (against the server itself, only the survivors' shares protect: see
  ``server_view_multiplier``);
- local: each client adds the full N(0, (z S)^2) (private even against the server; the released sum then
  carries m times the variance).

The result is divided by the expected batch size rate * n, never by the realised count (which is private).
"""

from __future__ import annotations

import logging
import math

import numpy as np

from ..common.messages import REPLY_DTYPE, Query, Reply

log = logging.getLogger(__name__)


class ReplyError(ValueError):
    """A client's reply is malformed and was not aggregated; the message names the partition and why."""


def reply_tolerance(dtype: str, count: int, dim: int) -> float:
    """Relative slack of an honest reply's norm over sensitivity x count, for a client computing in ``dtype``
    (config key dtype: 'float32' or 'float64') that summed ``count`` clipped vectors of length ``dim``.

    Each clipped vector has exact norm <= the sensitivity (``per_sample.clip_scales`` clips with a safety
    margin), so only the summation can overshoot: a sum of count terms in a dtype of unit roundoff u errs by at
    most gamma_count = count u / (1 - count u) times the sum of the terms' norms (Higham 2002, sec. 3.1;
    any summation order); the float64 sum over chunks, the count coordinate and the server's own norm add
    gamma_{count + dim + 8} in float64. Example: count 1 in float32 gives 6e-8, count 1000 gives 6e-5."""
    u = float(np.finfo(np.dtype(dtype)).eps) / 2
    u64 = float(np.finfo(np.float64).eps) / 2

    def gamma(terms: int, unit: float) -> float:
        return terms * unit / (1.0 - terms * unit)

    return gamma(count, u) + gamma(count + dim + 8, u64)


def check_reply(query: Query, reply: Reply, dtype: str) -> None:
    """Raise ReplyError unless ``reply`` answers ``query`` with a finite (D,) float64 (``REPLY_DTYPE``) sum
    whose norm is possible for the reported count of records, ``dtype`` being the clients' compute dtype
    (config key dtype; it sets the rounding slack, ``reply_tolerance``).

    An honest client's reply always passes: its clipped vectors never exceed the clip (``clip_scales``) and
    the slack covers the worst-case rounding of their sum. So a rejection (and the retry it may cause) never
    depends on which records were sampled, only on a faulty or dishonest client."""
    where = f"reply of partition {reply.partition} to {query.qid}"
    if reply.qid != query.qid:
        raise ReplyError(f"{where}: answers {reply.qid!r}")
    total = np.asarray(reply.total)
    if total.shape != (query.out_dim,):
        raise ReplyError(f"{where}: shape {total.shape}, expected ({query.out_dim},)")
    if total.dtype != REPLY_DTYPE:
        raise ReplyError(f"{where}: dtype {total.dtype}, expected {REPLY_DTYPE} (the declared dtype of a reply)")
    if not np.all(np.isfinite(total)):
        raise ReplyError(f"{where}: contains NaN or Inf")
    if query.noise_std > 0:  # noised by the client, which keeps its count: nothing more to check
        return
    if reply.count < 0:
        raise ReplyError(f"{where}: negative count {reply.count}")
    if math.isfinite(query.clip):
        bound = query.sensitivity * reply.count * (1.0 + reply_tolerance(dtype, reply.count, query.out_dim))
        norm = float(np.linalg.norm(total))
        if norm > bound:
            raise ReplyError(f"{where}: norm {norm:.9g} exceeds sensitivity {query.sensitivity:.9g} x count "
                             f"{reply.count} (clip {query.clip:.6g}, {dtype} rounding slack included)")


def split_valid(query: Query, replies: list[Reply], dtype: str) -> tuple[list[Reply], dict[int, str]]:
    """(valid replies, partition -> reason for each rejected one); ``dtype`` as in ``check_reply``."""
    valid, rejected = [], {}
    for r in replies:
        try:
            check_reply(query, r, dtype)
            valid.append(r)
        except ReplyError as e:
            rejected[r.partition] = str(e)
    return valid, rejected


def aggregate(query: Query, replies: list[Reply]) -> np.ndarray:
    """Sum (query.out_dim,) float64 of (already validated) replies, in partition order."""
    total = np.zeros(query.out_dim, dtype=np.float64)
    for r in sorted(replies, key=lambda r: r.partition):
        total += np.asarray(r.total, dtype=np.float64)
    return total


NOISE_MODES = ("central", "distributed", "local")


def client_noise_std(mode: str, noise_multiplier: float, sensitivity: float, clients: int) -> float:
    """Std each client adds to its own sum: 0 (central), z S / sqrt(m) (distributed), z S (local)."""
    if noise_multiplier <= 0 or not math.isfinite(sensitivity):
        return 0.0
    if mode == "central":
        return 0.0
    if mode == "distributed":
        return noise_multiplier * sensitivity / math.sqrt(clients)
    if mode == "local":
        return noise_multiplier * sensitivity
    raise ValueError(f"unknown noise mode {mode!r}; allowed: {', '.join(NOISE_MODES)}")


def server_noise_std(mode: str, noise_multiplier: float, sensitivity: float, clients: int, replied: int) -> float:
    """Std the server adds to the summed replies: z S (central), the top-up z S sqrt((m - k') / m) for the
    m - k' clients whose share is missing (distributed), 0 (local)."""
    if noise_multiplier <= 0 or not math.isfinite(sensitivity):
        return 0.0
    if mode == "central":
        return noise_multiplier * sensitivity
    if mode == "distributed":
        return noise_multiplier * sensitivity * math.sqrt(max(clients - replied, 0) / clients)
    if mode == "local":
        return 0.0
    raise ValueError(f"unknown noise mode {mode!r}; allowed: {', '.join(NOISE_MODES)}")


def server_view_multiplier(mode: str, noise_multiplier: float, clients: int, replied: int) -> float:
    """The noise multiplier that protects a record against the server itself: 0 in central mode (it sees
    clipped sums), z sqrt(k' / m) in distributed mode (only the k' surviving shares are unknown to it; its
    own top-up is not), z in local mode (every reply carries the full noise)."""
    if mode == "central":
        return 0.0
    if mode == "distributed":
        return noise_multiplier * math.sqrt(replied / clients) if replied else math.inf
    return noise_multiplier


def noisy_mean(query: Query, total: np.ndarray, noise_std: float, n: int, rng: np.random.Generator) -> np.ndarray:
    """(total + N(0, noise_std^2 I)) / (rate n): the released mean. noise_std = 0 adds no noise (non-private
    runs, local mode, or distributed mode with every share present)."""
    out = np.array(total, dtype=np.float64)
    if noise_std > 0:
        out += rng.normal(0.0, noise_std, size=out.shape)
    return out / (query.rate * n)
