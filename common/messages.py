"""The message schema between the server's engine and the clients, independent of any transport.

A ``Query`` asks every client for the sum of clipped per-record quantities over its own Poisson sample;
a ``Reply`` carries that sum. Only clipped sums (and the realised count, used by the trusted server to
check the reply and never released) leave a client.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Point:
    """A parameter point: a model version id (the flat vector is held by the version store) and a scalar
    (the dual variable eta, or lambda for KL-DRO)."""

    version: int
    scalar: float


@dataclass(frozen=True)
class Query:
    """One sampled release.

    Attributes:
        iteration: t of the algorithm (with ``mechanism`` it identifies the release).
        mechanism: release name, e.g. 'x-refresh'; a key of the ledger and of the sampling seed.
        quantity: per-record function (``common.quantities.QUANTITIES``).
        points: one point (refresh: value) or two (difference: value at points[0] minus at points[1]).
        coefs: per-point coefficients of the per-record combination sum_j coefs[j] f(points[j]); empty means
            (1,) for one point and (1, -1) for two (STORM uses (1, -(1 - beta))).
        extra: public per-query constants a quantity needs (e.g. DP-SGDA's class weights p).
        rate: Poisson sampling rate in (0, 1].
        clip: L2 clipping norm of each per-record vector (inf: no clipping, non-private runs).
        dim: length D of the summed vector.
        attempt: 0 for the first try of a release, k for its k-th retry after a client failure.
        offset: public logit offset (K,) of the logit-adjusted loss, tau log(pi); empty: plain cross-entropy.
        count_scale: c > 0 appends one coordinate c * clip * 1[record clipped] to every per-record vector, so
            that the noisy release also estimates the clipped fraction (config clip-count-scale); the joint
            vector's norm is <= clip sqrt(1 + c^2), the ``sensitivity``. 0: no such coordinate.
        noise_std: std of the Gaussian noise each client adds to its own sum before replying (distributed and
            local noise modes); 0 in central mode, where the server adds the noise.
        count_only: True asks not for the clipped sum but for one coordinate, the number of sampled records whose
            combined vector has norm <= ``clip`` (its upper bound ``per_sample.norm_upper_bound``): each record
            adds 1 or 0, the null record 0, so the sensitivity is 1 (the private quantile of the difference clip,
            Andrew et al. 2021, "Differentially private learning with adaptive clipping", NeurIPS, Algorithm 1;
            server/algorithms/diff_levers.py). ``count_scale`` does not apply.
        ddg: noise-mode=distributed-discrete: the public spec of the client's share
            (``common.ddg.ShareSpec.to_tuple``: c', sigma, bits, bound, rotation seed); the reply is then the share
            modulo 2^bits, (d',) with d' the power of two >= ``out_dim``, its values integers as float64. Empty
            otherwise.
        local: privacy-unit=node with config key local-epochs > 0, on a refresh of the model's gradient: (epochs, lr,
            batch) of the local SGD a node runs from ``points[0]``; the node then sends its update x_0 - x_K clipped to
            ``clip`` as one vector (``client.local_steps``). Empty: the per-record quantity as above.
        feature_norm: feature-norm=private: the channel means and inverse standard deviations (2C,) released before
            training, with which the node's model normalises its inputs (``common.feature_norm.apply_stats``).
            Empty: the model's own normalisation.
    """

    iteration: int
    mechanism: str
    quantity: str
    points: tuple[Point, ...]
    rate: float
    clip: float
    dim: int
    attempt: int = 0
    coefs: tuple[float, ...] = ()
    extra: tuple[float, ...] = ()
    offset: tuple[float, ...] = ()
    count_scale: float = 0.0
    noise_std: float = 0.0
    count_only: bool = False
    ddg: tuple[float, ...] = ()
    local: tuple[float, ...] = ()
    feature_norm: tuple[float, ...] = ()

    @property
    def out_dim(self) -> int:
        """Length of a reply's vector: 1 for a count-only query, else ``dim`` plus the clipped-count coordinate if
        ``count_scale`` > 0."""
        if self.count_only:
            return 1
        return self.dim + (1 if self.count_scale > 0 else 0)

    @property
    def sensitivity(self) -> float:
        """L2 bound of one record's contribution to the reply: clip, or clip sqrt(1 + c^2) with the
        clipped-count coordinate (inf in non-private runs); 1 for a count-only query."""
        if self.count_only:
            return 1.0
        return self.clip * math.sqrt(1.0 + self.count_scale**2) if self.count_scale > 0 else self.clip

    def point_coefs(self) -> tuple[float, ...]:
        """Coefficient of each point's gradient in the reply: ``coefs`` if given, else (1,) for one point and
        (1, -1) for a SPIDER difference (new minus old)."""
        if self.coefs:
            return self.coefs
        return (1.0,) if len(self.points) == 1 else (1.0, -1.0)

    @property
    def qid(self) -> str:
        """Query id '<iteration>:<mechanism>', unique within a run."""
        return f"{self.iteration}:{self.mechanism}"

    @property
    def versions(self) -> tuple[int, ...]:
        """Model versions the query reads, one per point."""
        return tuple(p.version for p in self.points)


# The declared dtype of a reply's total on every transport (the server rejects any other, float16 included:
# a narrower float would lose the precision the server's norm check and the release rely on).
REPLY_DTYPE = np.dtype(np.float64)
SECURE_SUM = -1  # Reply.partition of a securely aggregated reply (SecAgg+: the sum of several clients' replies)
UNDISCLOSED = -1  # Reply.count of a client that noised its sum (the server is not trusted with the count)


@dataclass(frozen=True)
class Reply:
    """A client's answer to a query: ``total`` (D,) float64 sum of clipped vectors over ``count`` sampled
    records of partition ``partition`` (count ``UNDISCLOSED`` when the client noised its sum). A securely
    aggregated reply (SecAgg+) has partition ``SECURE_SUM`` and sums the replies of ``clients`` clients."""

    qid: str
    partition: int
    total: np.ndarray
    count: int
    clients: int = 1

    @property
    def securely_aggregated(self) -> bool:
        """Whether this reply is a SecAgg+ sum of several clients' replies (partition ``SECURE_SUM``)."""
        return self.partition == SECURE_SUM
