"""From client replies to a released value: validate, sum, add Gaussian noise, normalise.

The sum is taken in partition order so that the result does not depend on the order replies arrive in.
The released sum carries N(0, (z S)^2) per coordinate, S the query's sensitivity (its clip, or
clip sqrt(1 + c^2) with the clipped-count coordinate); where that noise is drawn depends on the noise mode
(config ``noise-mode``; one ``common.noise_modes.NoiseMode`` object per mode, which the functions below ask):

- central: the server adds all of it to the sum of the clients' clipped sums (a trusted server);
- distributed: each client adds N(0, (z S)^2 / m_min) to its own sum, m_min the fewest shares a release may sum
  (``min_shares``: min-clients with on-client-failure=drop, else every client), and the server only sees their
  (securely aggregated) total. Any release of k >= m_min shares carries variance (k / m_min) (z S)^2 >= (z S)^2,
  against the server too (``server_view_multiplier``): more noise than planned when k > m_min, which only adds
  privacy. Fewer than m_min shares are never released (the server would top up the missing variance for the
  public, ``server_noise_std``, but against the server only the shares protect);
- local: each client adds the full N(0, (z S)^2) (private even against the server; the released sum then
  carries m times the variance).

The result is divided by the expected batch size rate * n, never by the realised count (which is private).

The sums are float64 (clients: ``per_sample.sum64``; server: ``aggregate``), and their rounding is part of the
sensitivity: every noise std above is z S f(n), f(n) = ``sum_rounding_factor(n)`` (1 + 8.0e-7 for n = 60,000).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping

import numpy as np

from ..common.config import Config
from ..common.errors import RunFailed
from ..common.messages import REPLY_DTYPE, Query, Reply
from ..common.noise_modes import (  # noqa: F401 - the SecAgg+ grid and m_min, re-exported for the server's callers
    NOISE_MODES,
    SECAGG_MODULUS_BITS,
    SECAGG_STEP_OVER_SHARE_STD,
    check_secagg_grid,
    min_shares,
    noise_mode,
    secagg_grid,
)
from ..common.rng import gaussian_noise

log = logging.getLogger(__name__)


class ReplyError(ValueError, RunFailed):
    """A client's reply is malformed and was not aggregated; the message names the partition and why."""


U64 = 2.0**-53  # unit roundoff of float64


def gamma(terms: int, unit: float = U64) -> float:
    """gamma_k = k u / (1 - k u), the bound on the relative error of k roundings of unit roundoff u (Higham 2002,
    Lemma 3.1). ValueError unless 0 <= k u < 1/2."""
    if not 0 <= terms * unit < 0.5:
        raise ValueError(f"gamma_k needs 0 <= k u < 1/2; got k = {terms}, u = {unit:g}")
    return terms * unit / (1.0 - terms * unit)


def sum_rounding_factor(n: int) -> float:
    """f(n) = 1 + 2 (n + 16) gamma_{n + 16} in float64 (u = 2^-53), for a data set of n records (public): the
    sensitivity of a released sum, float64 rounding included, is at most f(n) S for records of norm <= S, so
    every release's noise std is z S f(n). 1 + 8.0e-7 for n = 60,000, 1 + 2.2e-4 for n = 10^6 (it grows as
    2 n^2 u). It depends on n only, never on the data. ValueError for n < 0.

    Proof. The clipped vectors y_i have exact norm <= S (``per_sample.clip_margin``). Clients and server sum them
    in float64 (``per_sample.sum64``, ``client.worker.clipped_total``, ``aggregate``): each coordinate is a sum
    over the L <= n sampled records in which every term goes through one product and at most L - 1 additions
    (adding an exact zero is exact), so it is within gamma_n sum_i |y_ij| of the exact sum, whatever the order
    (Higham 2002, Lemma 3.1 and eq. (3.5)); in L2 norm that is <= gamma_n L S. Two neighbouring data sets (one
    record replaced by the null record, which contributes the zero vector; ledger module docstring) give, on the
    same sample, exact sums at most S apart, so computed sums at most S (1 + 2 n gamma_n) apart. The extra 16
    roundings cover the float computation of S, of the clipped-count constant, of f and of the noise stds:
    (1 + 2 n gamma_n)(1 + gamma_16) <= f(n), since gamma_a + gamma_b + gamma_a gamma_b <= gamma_{a + b}
    (Higham, Lemma 3.3). The rounding of adding the noise is the floating-point sampling caveat (Mironov
    2012), which this does not cover. In float32 the same bound (u = 2^-24) would exceed 3 for n above 4,080:
    a float32 sum's rounding, which changes when one record changes, is outside any useful sensitivity
    (Casacuberta et al., CCS 2022)."""
    if n < 0:
        raise ValueError(f"n must be >= 0 records, got {n}")
    return 1.0 + 2.0 * (n + 16) * gamma(n + 16)


def reply_tolerance(dtype: str, count: int, dim: int) -> float:
    """Relative slack of an honest reply's norm over sensitivity x count, for a client computing in ``dtype``
    (config key dtype: 'float32' or 'float64') that summed ``count`` clipped vectors of length ``dim``.

    Each clipped vector has exact norm <= the sensitivity (``per_sample.clip_scales`` clips with a safety
    margin), so only the summation can overshoot. The slack is that of a sum of count terms in ``dtype``:
    gamma_count = count u / (1 - count u) (u the dtype's unit roundoff) times the sum of the terms' norms
    (Higham 2002, sec. 3.1; any summation order), plus gamma_{count + dim + 8} in float64 for the float64 sum
    over chunks, the count coordinate and the server's own norm. Our clients sum in float64
    (``per_sample.sum64``: within gamma_count in float64), well inside it. Example: count 1 in float32 gives
    6e-8, count 1000 gives 6e-5."""
    u = float(np.finfo(np.dtype(dtype)).eps) / 2
    return gamma(count, u) + gamma(count + dim + 8)


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
    if query.ddg:
        check_share(query, reply, where)
        return
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


def check_share(query: Query, reply: Reply, where: str) -> None:
    """A DDG share (noise-mode=distributed-discrete, ``Query.ddg``): (d',) float64 of integers in [0, 2^bits),
    d' the power of two >= the query's out_dim; ReplyError otherwise. Any such vector is a possible share (the
    noise covers the whole range), so nothing more can be checked."""
    from ..common.ddg import ShareSpec, padded_dim

    bits = ShareSpec.from_tuple(query.ddg).bits
    total = np.asarray(reply.total)
    want = (padded_dim(query.out_dim),)
    if total.shape != want or total.dtype != REPLY_DTYPE:
        raise ReplyError(f"{where}: {total.dtype} {total.shape}, expected a {REPLY_DTYPE} share of shape {want}")
    if not (np.all(np.isfinite(total)) and np.all(total == np.floor(total)) and total.min(initial=0) >= 0
            and total.max(initial=0) < 2.0**bits):
        raise ReplyError(f"{where}: not a share modulo 2^{bits} (integers in [0, 2^{bits}))")


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
    """Sum (query.out_dim,) float64 of (already validated) replies, in partition order (its rounding is part of
    ``sum_rounding_factor``)."""
    total = np.zeros(query.out_dim, dtype=np.float64)
    for r in sorted(replies, key=lambda r: r.partition):
        total += np.asarray(r.total, dtype=np.float64)
    return total


def client_noise_std(mode: str, noise_multiplier: float, sensitivity: float, shares: int) -> float:
    """Std each client adds to its own sum in noise mode ``mode`` (``NoiseMode.client_noise_std``): 0 (central),
    z S / sqrt(m_min) (distributed, ``shares`` = m_min of ``min_shares``), z S (local). ValueError for an unknown
    mode."""
    return noise_mode(mode).client_noise_std(noise_multiplier, sensitivity, shares)


def server_noise_std(mode: str, noise_multiplier: float, sensitivity: float, shares: int, replied: int) -> float:
    """Std the server adds to the summed replies (``NoiseMode.server_noise_std``): z S (central), the top-up
    z S sqrt((m_min - k) / m_min) when only k < m_min shares arrived (distributed), 0 (local)."""
    return noise_mode(mode).server_noise_std(noise_multiplier, sensitivity, shares, replied)


def released_noise_std(mode: str, noise_multiplier: float, sensitivity: float, shares: int, replied: int) -> float:
    """Std of the noise in a released sum of ``replied`` clients' replies, the server's part included
    (``NoiseMode.released_noise_std``): z S (central), z S sqrt(max(k, m_min) / m_min) (distributed), z S sqrt(k)
    (local)."""
    return noise_mode(mode).released_noise_std(noise_multiplier, sensitivity, shares, replied)


def server_view_multiplier(mode: str, noise_multiplier: float, shares: int, replied: int) -> float:
    """The noise multiplier that protects a record against the server itself (``NoiseMode.server_view_multiplier``):
    0 (central), z sqrt(k / m_min) (distributed), z (local)."""
    return noise_mode(mode).server_view_multiplier(noise_multiplier, shares, replied)


def check_distributed(cfg: Config, noise: Mapping[str, float], largest_shard: int) -> list[str]:
    """Check a private noise-mode=distributed run before any work (``Distributed.check``): ConfigError from
    ``min_shares`` or ``check_secagg_grid``; returns warnings."""
    return NOISE_MODES["distributed"].check(cfg, noise, largest_shard)


def noisy_mean(query: Query, total: np.ndarray, noise_std: float, n: int, rng: np.random.Generator, *,
               secure: bool = False, expected: float | None = None) -> np.ndarray:
    """(total + N(0, noise_std^2 I)) / (rate n): the released mean. noise_std = 0 adds no noise (non-private
    runs, local mode, or distributed mode with every share present). ``secure`` (config key secure-noise): the
    noise comes from ``common.rng.secure_gaussian`` (OS CSPRNG, sum of 4 draws) instead of ``rng``. ``expected``:
    another divisor, the expected number of units summed (node sampling: server/node_sampling.py
    ``expected_count``); default rate n."""
    out = np.array(total, dtype=np.float64)
    if noise_std > 0:
        out += gaussian_noise(noise_std, out.shape, rng, secure=secure)
    return out / (query.rate * n if expected is None else expected)
