"""The releases of a run: decorate each query, collect the clients' replies under the failure policy, charge the
ledger, add the server's noise and record the event (``Releaser``); the engine's training loop and the setup
stage both release through it. The privacy contract of a release: docs/explanation/ALGORITHMS.md 5.2-5.3.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Sequence

import numpy as np

from ..common import ddg
from ..common.config import Config
from ..common.errors import RunFailed
from ..common.eval_counts import EVAL_QUANTITY
from ..common.faults import active_fault
from ..common.messages import Query, Reply
from ..common.noise_modes import check_ddg_bits, noise_mode
from ..common.rng import site_rng
from ..common.transport import Transport, under_failure_policy
from .diagnostics import NoiseMonitor
from .ledger import Ledger, PrivacyBudgetExceeded
from .node_sampling import expected_count, local_step_mechanisms, sample_partitions
from .release import aggregate, min_shares, noisy_mean, split_valid, sum_rounding_factor
from .rundir import RunDir

log = logging.getLogger(__name__)


def collect_round(cfg: Config, transport: Transport, queries: Sequence[Query],
                  versions: dict[int, np.ndarray],
                  on_discard: Callable[[Query, list[Reply]], None] | None = None) -> dict[str, list[Reply]]:
    """Run ``queries`` on every client and return the valid replies, applying the failure policy.

    A client fails when it raises, times out or sends a malformed reply (``release.check_reply``); all its
    replies of the round are then discarded and it is logged by partition. Policy (config
    ``on-client-failure``): 'fail' raises ClientFailure at once; 'retry' repeats the round (attempt k) up to
    ``max-retries`` times; 'drop' goes on without the failed clients if at least ``min-clients`` remain,
    else retries like 'retry'. Nothing is released or charged for a discarded attempt; ``on_discard(query,
    replies)`` is called with the valid replies of every discarded attempt (in distributed and local noise
    modes the server has seen those noised values, which counts against the server).

    A retry never depends on record values: an honest client's reply always passes ``check_reply`` (clipping
    never overshoots its bound and the check allows the rounding of the working dtype), so only transport
    failures, timeouts, a client's own error or a faulty client discard an attempt.

    Node sampling (config key node-sampling-rate p < 1; server/node_sampling.py): each query asks its own Poisson
    sample of the clients (the same one on every attempt), and 'drop' needs min(min-clients, clients asked) of the
    clients asked to remain. With p = 1 every client is asked and nothing is drawn.
    """
    sampled = node_samples(cfg, transport, queries)
    asked = set().union(*sampled.values()) if sampled is not None else set()
    last: dict = {}  # the latest attempt: its queries and valid replies

    def attempt(k: int) -> dict[int, str]:
        tries = [dataclasses.replace(q, attempt=k) for q in queries]
        result = transport.run(tries, versions) if sampled is None else transport.run(tries, versions, sampled=sampled)
        failures = dict(result.failures)
        for q in tries:
            _, rejected = split_valid(q, result.replies[q.qid], cfg.dtype)
            failures.update(rejected)
        for pid, reason in sorted(failures.items()):
            log.warning("iteration %d, attempt %d: client %d failed: %s", queries[0].iteration, k, pid, reason)
        last.update(tries=tries, valid={qid: [r for r in rs if r.partition not in failures]
                                        for qid, rs in result.replies.items()})
        return {pid: f"client {pid}: {reason}" for pid, reason in failures.items()}

    def discarded() -> None:
        for q in last["tries"]:
            if on_discard is not None and last["valid"][q.qid]:
                on_discard(q, last["valid"][q.qid])

    if sampled is None:
        needed = cfg.min_clients

        def remaining(failures: dict) -> int:
            return transport.num_clients - len(failures)
    else:  # node sampling: min(min-clients, nodes asked) of the nodes asked must remain
        needed = min(cfg.min_clients, len(asked))

        def remaining(failures: dict) -> int:
            return len(asked - set(failures))

    dropped = under_failure_policy(
        attempt, policy=cfg.on_client_failure, max_retries=cfg.max_retries, min_clients=needed,
        remaining=remaining, on_discard=discarded,
        where=f"iteration {queries[0].iteration} ({', '.join(q.mechanism for q in queries)})")
    if dropped:
        log.warning("releasing without client(s) %s (%d remain)", sorted(dropped), remaining(dropped))
    return last["valid"]


def node_samples(cfg: Config, transport: Transport, queries: Sequence[Query]) -> dict[str, frozenset[int]] | None:
    """Mechanism -> the partitions asked for it (``node_sampling.sample_partitions``, one independent sample per
    query), or None when node-sampling-rate is 1 (every client; nothing drawn)."""
    if cfg.node_sampling_rate == 1:
        return None
    present = list(getattr(transport, "partitions", range(transport.num_clients)))
    return {q.mechanism: sample_partitions(cfg.reproducible, cfg.seed, q.iteration, q.mechanism, cfg.node_sampling_rate,
                                           present, max(cfg.num_clients, max(present, default=-1) + 1))
            for q in queries}


class Releaser:
    """Executes the releases of a run: decorates each query (logit offset, clipped-count coordinate, client
    noise share), collects the replies under the failure policy, charges the ledger, adds the server's
    noise, normalises and records the event. One instance per run; shared by the setup and training stages.

    ``server_ledger`` is a second ``Ledger`` that records every release as the server itself saw it, at the
    multiplier ``NoiseMode.server_view_multiplier`` (the guarantee against the server in distributed and local noise
    modes; in central mode the server saw unnoised sums: multiplier 0, epsilon inf). Outside central mode it
    guards too (``_check_server_view``): a release that would take the epsilon against the server past the target
    is refused. In distributed mode each client's share is calibrated for ``shares`` = m_min
    (``release.min_shares``), so every released sum (at least m_min shares) protects against the server with at
    least the planned multiplier.

    Every noise std is z S f, S the query's sensitivity and f = ``release.sum_rounding_factor(n)`` (the float64
    rounding of the sums, for n records): ``noise_sensitivity``.
    """

    def __init__(self, cfg: Config, transport: Transport, ledger: Ledger, n: int, rd: RunDir) -> None:
        self.cfg, self.transport, self.ledger, self.n, self.rd = cfg, transport, ledger, n, rd
        self.sum_factor = sum_rounding_factor(n)
        self.offset: tuple[float, ...] = ()
        self.feature_norm: tuple[float, ...] = ()  # feature-norm=private: the released channel statistics
        self.monitor = NoiseMonitor()
        self.server_ledger = Ledger(ledger.plan, ledger.noise, ledger.epsilon, ledger.delta, ledger.accountant,
                                    ledger.node_rate, ledger.ddg)
        self.mode = noise_mode(cfg.noise_mode)  # where the noise is drawn (common/noise_modes.py)
        self.node_unit = cfg.privacy_unit == "node"
        # the releases a node answers with its update after local SGD (config key local-epochs; privacy-unit=node)
        self.local_mechanisms = frozenset(local_step_mechanisms(cfg))
        if self.node_unit:  # the unit is a node: sums over at most m clipped node vectors (ALGORITHMS.md 5.9)
            self.sum_factor = sum_rounding_factor(max(cfg.num_clients, transport.num_clients))
        self.shares = min_shares(cfg.on_client_failure, cfg.min_clients, transport.num_clients)
        if ledger.ddg is not None:  # distributed-discrete: every share is calibrated for the geometry's m clients
            self.shares = ledger.ddg.shares
        self.ddg_bits: dict[str, int] = {}  # mechanism -> bits per coordinate of its DDG releases (the largest)
        self.quantisation_ratio = 0.0  # largest SecAgg+ rounding bound / noise std of a released sum
        fault = active_fault()
        # test hook only ($DPDRO_INJECT_FAULT kind 'leak', common/faults.py): (partition, first iteration) whose
        # replies are kept, so that the memory tests can show they catch a leak of one reply per round
        self.leak = fault[:2] if fault and fault[2] == "leak" else None
        self.leaked: list[np.ndarray] = []

    def decorate(self, q: Query, *, diagnostics: bool = True) -> Query:
        """``q`` with the run's logit offset and feature statistics, the clipped-count coordinate (private training
        releases) and the noise std each client adds in this noise mode."""
        cfg = self.cfg
        diagnostics = diagnostics and q.quantity != EVAL_QUANTITY  # a node evaluation's counts are never clipped
        counted = cfg.private and diagnostics and math.isfinite(q.clip) and not q.count_only
        count_scale = cfg.clip_count_scale if counted else 0.0
        if self.node_unit:  # no clipped-count coordinate; the release is charged at the node-sampling rate
            count_scale = 0.0
            q = dataclasses.replace(q, rate=cfg.node_sampling_rate)
            if q.mechanism in self.local_mechanisms and len(q.points) == 1:  # local-epochs > 0 (ALGORITHMS.md 5.9)
                q = dataclasses.replace(q, local=(float(cfg.local_epochs), cfg.local_lr, float(cfg.local_batch)))
        q = dataclasses.replace(q, offset=self.offset, count_scale=count_scale, feature_norm=self.feature_norm)
        z = self.ledger.noise_multiplier(q.mechanism) if cfg.private else 0.0
        share = self.mode.client_noise_std(z, self.noise_sensitivity(q), self.shares)
        if self.ledger.ddg is not None and z > 0:
            q = dataclasses.replace(q, ddg=self.share_spec(q, z).to_tuple())
        return dataclasses.replace(q, noise_std=share)

    def share_spec(self, q: Query, z: float) -> ddg.ShareSpec:
        """The public spec of the clients' DDG shares of ``q`` at noise multiplier z (noise-mode=
        distributed-discrete): the run's granularity, sigma = z c' / sqrt(m), the bits per coordinate
        (``noise_modes.check_ddg_bits``: ConfigError for a set ddg-bits below the need, before any client is
        asked), the rounding bound of its padded dimension and a fresh rotation seed (public; from the seed when
        reproducible). RunFailed for a release longer than the geometry's dimension."""
        g = self.ledger.ddg
        dim = ddg.padded_dim(q.out_dim)
        if dim > g.dim:
            raise RunFailed(f"release '{q.mechanism}' has {q.out_dim} coordinates, more than the distributed "
                            f"discrete Gaussian's planned dimension {g.dim}")
        sigma = g.sigma(z)
        need = ddg.release_bits(q.out_dim, self.n, q.rate, g.c_over_gamma, sigma, g.shares,
                                self.cfg.ddg_wrap_probability)
        bits = check_ddg_bits(self.cfg, need, q.mechanism)
        rotation = int(site_rng(self.cfg.reproducible, self.cfg.seed, "ddg-rotation", q.iteration,
                                q.mechanism).integers(2**53))
        return ddg.ShareSpec(g.c_over_gamma, sigma, bits, ddg.rounded_l2_bound(g.c_over_gamma, dim, g.beta), rotation)

    def _ddg_total(self, q: Query, got: list[Reply], clients: int, z: float) -> tuple[np.ndarray, dict]:
        """The released sum (q.out_dim,) of a DDG release in the query's units and its event fields: the shares
        (or their secure sum) summed modulo 2^bits and decoded (``ddg.ShareSpec.decode``). Fewer than m shares
        (config key ddg-shortfall): 'refuse' journals what the server saw and raises ``ddg.ShareShortfall``
        (nothing released); 'charge' charges the ledger at z sqrt(k / m) (``Ledger.charge_at``). Otherwise the
        planned charge."""
        spec = ddg.ShareSpec.from_tuple(q.ddg)
        g = self.ledger.ddg
        if clients < g.shares and self.cfg.ddg_shortfall == "refuse":
            self._seen_by_server(q, got, discarded=True)
        present = ddg.check_shares(g.shares, clients, self.cfg.ddg_shortfall)
        charged = g.shortfall_multiplier(z, present)
        self.ledger.charge_at(q.mechanism, q.rate, charged)  # raises before anything is released if it would overspend
        modulus = 1 << spec.bits
        total = np.zeros(ddg.padded_dim(q.out_dim), dtype=np.int64)
        for r in got:
            total = (total + np.asarray(r.total).astype(np.int64)) % modulus
        self.ddg_bits[q.mechanism] = max(self.ddg_bits.get(q.mechanism, 0), spec.bits)
        return spec.decode(total, q.out_dim) * q.sensitivity, {"ddg_bits": spec.bits, "ddg_shares": clients,
                                                               "charged_noise_multiplier": charged}

    def noise_sensitivity(self, q: Query) -> float:
        """The sensitivity the noise of ``q`` is calibrated to: its per-record bound times the float64 rounding
        factor of a sum of n records, S f(n) (``release.sum_rounding_factor``)."""
        return q.sensitivity * self.sum_factor

    def run(self, raw: Sequence[Query], versions: dict[int, np.ndarray], *, setup: bool = False
            ) -> dict[str, np.ndarray]:
        """Release every query of one round; returns mechanism -> released mean (D,) float64."""
        queries = [self.decorate(q, diagnostics=not setup) for q in raw]
        for q in queries:  # refuse before anything leaves a client if the plan would be overspent
            self.ledger.check(q.mechanism, q.rate)
            self._check_server_view(q)
        replies = collect_round(self.cfg, self.transport, queries, versions,
                                lambda q, got: self._seen_by_server(q, got, discarded=True))
        if self.leak and queries[0].iteration >= self.leak[1]:
            self.leaked += [np.array(r.total) for r in replies[queries[0].qid] if r.partition == self.leak[0]]
        released, events = {}, []
        for q in queries:
            got = replies[q.qid]
            clients = sum(r.clients for r in got)
            z = self.ledger.noise_multiplier(q.mechanism)
            discrete: dict = {}
            if q.ddg:  # distributed discrete Gaussian: shares modulo 2^bits, charged by ddg-shortfall
                seen = None if clients < self.shares and self.cfg.ddg_shortfall == "refuse" else \
                    self._seen_by_server(q, got)
                self._check_server_view()
                total, discrete = self._ddg_total(q, got, clients, z)
            else:
                total = aggregate(q, got)
                seen = self._seen_by_server(q, got)
                self._check_server_view()
                self.ledger.charge(q.mechanism, q.rate)  # raises before anything is released if it would overspend
            mode, trusted = self.mode.name, self.mode.trusts_server
            rng = site_rng(self.cfg.reproducible, self.cfg.seed, "noise", q.iteration, q.mechanism)
            std = self.mode.server_noise_std(z, self.noise_sensitivity(q), self.shares, clients)
            expected = self.expected(q)
            mean = noisy_mean(q, total, std, self.n, rng, secure=self.cfg.secure_noise, expected=expected)
            event = {"iteration": q.iteration, "mechanism": q.mechanism, "rate": q.rate, "noise_multiplier": z,
                     "clip": q.clip, "expected_batch": expected, "clients": clients, "noise_mode": mode,
                     "noise_std_of_mean": z * self.noise_sensitivity(q) / expected, **discrete}
            if not trusted and seen is not None:
                event["server_view_multiplier"] = seen
            if not trusted and z > 0:
                event["server_topup_std"] = std
                event["released_noise_std_of_mean"] = self.mode.released_noise_std(
                    z, self.noise_sensitivity(q), self.shares, clients) / expected
                secure = got and got[0].securely_aggregated and not q.ddg  # DDG shares are carried exactly
                bound = self.transport.quantisation_bound(q, clients) if secure else None
                if bound is not None:
                    event["quantisation_bound"] = bound
                    self.quantisation_ratio = max(self.quantisation_ratio, bound / (z * self.noise_sensitivity(q)))
            if setup:
                event["phase"] = "setup"
            if q.count_scale > 0:
                event["clipped_fraction"] = float(mean[-1] / (q.count_scale * q.clip))
                mean = mean[:-1]
            released[q.mechanism] = mean
            events.append(self.monitor.observe(event))
        self.rd.append_events(events)
        return released

    def expected(self, q: Query) -> float:
        """The expected number of units a release of ``q`` sums, the divisor of its mean: q.rate n records, p q.rate n
        with node sampling, p m nodes with privacy-unit=node (``node_sampling.expected_count``)."""
        if self.cfg.node_sampling_rate == 1 and not self.node_unit:
            return q.rate * self.n
        return expected_count(self.cfg.privacy_unit, self.cfg.node_sampling_rate, q.rate, self.n,
                              self.transport.num_clients)

    def _seen_by_server(self, q: Query, replies: list[Reply], discarded: bool = False) -> float | None:
        """Count a set of replies the server has seen (released or discarded) against the server; returns the noise
        multiplier it saw them at (None when there were none). In distributed and local noise modes a discarded
        attempt's replies are journalled at once (an event marked ``discarded``, no release), so that a resumed
        run charges them against the server even if the run stops before its next checkpoint."""
        if not replies:
            return None
        z = self.ledger.noise_multiplier(q.mechanism) if self.cfg.private else 0.0
        clients = sum(r.clients for r in replies)
        seen = self.mode.server_view_multiplier(z, self.shares, clients)
        self.server_ledger.record_seen(q.mechanism, q.rate, seen)
        if discarded and not self.mode.trusts_server:
            self.rd.append_events([{"iteration": q.iteration, "mechanism": q.mechanism, "rate": q.rate,
                                    "attempt": q.attempt, "clients": clients, "discarded": True,
                                    "server_view_multiplier": seen}])
        return seen

    def _check_server_view(self, q: Query | None = None) -> None:
        """Refuse (PrivacyBudgetExceeded) what would take the epsilon against the server past the target: one
        more release of ``q`` at its planned multiplier (before any client is asked), or, without ``q``, what the
        server has seen so far (before releasing). Not in central mode, where the server is trusted."""
        if self.mode.trusts_server or not self.cfg.private:
            return
        try:
            if q is None:
                self.server_ledger.check_spent("seen by the server")
            else:
                self.server_ledger.check(q.mechanism, q.rate)
        except PrivacyBudgetExceeded as e:
            raise PrivacyBudgetExceeded(f"against the server (noise-mode={self.cfg.noise_mode}): {e}") from None

    def epsilon_against_server(self) -> float:
        """Epsilon against the server itself of every release so far (inf in central mode and when not private)."""
        return self.server_ledger.epsilon_spent()
