"""The noise modes of config key noise-mode, one ``NoiseMode`` object each, and their registry ``NOISE_MODES``.

A released sum carries N(0, (z S)^2) per coordinate, z the noise multiplier and S the query's sensitivity (every
std below is already multiplied by the float64 rounding factor, ``server.release.sum_rounding_factor``). A noise
mode says where that noise is drawn and whom the resulting epsilon holds against:

- ``central``: the server adds all of it to the sum of the clients' clipped sums (a trusted server);
- ``distributed``: each client adds N(0, (z S)^2 / m_min) to its own sum, m_min the fewest shares a release may sum
  (``min_shares``), and the server only sees their (SecAgg+) total; any release of k >= m_min shares carries
  variance (k / m_min) (z S)^2 >= (z S)^2, against the server too;
- ``local``: each client adds the full N(0, (z S)^2) (private even against the server; the released sum carries
  m times the variance);
- ``distributed-discrete``: the distributed discrete Gaussian (``common.ddg``; Kairouz, Liu and Steinke 2021) in
  place of the Gaussian: integer shares summed modulo 2^bits, the ledger charging that mechanism's own epsilon.

Each mode answers the same questions (``NoiseMode``): the std a client adds, the std the server adds, the noise
multiplier that protects a record against the server itself, whether the transport must aggregate securely, the
trust statement of summary.json, what its accounting leaves out, and the checks it needs before a run. The server
(``server.release``, ``server.releaser``, ``server.summary``) and the Flower adapters ask the registry instead of
testing the mode's name. A new mode is one subclass registered here plus its entry in config key noise-mode's
choices (a test checks that the two agree).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from .config_schema import ConfigError

# The SecAgg+ grid (server/flower/secagg.py): stochastic rounding of a share y to a grid of step s returns
# floor or ceil with the probabilities that make it unbiased, so its error has mean 0 and variance
# p (1 - p) s^2 <= s^2 / 4 per coordinate. The Gaussian accounting does not model it (it is not Gaussian, and the
# rounded shares' sum is not a function of their exact sum), so the grid must keep it a negligible part of
# the noise: step <= SECAGG_STEP_OVER_SHARE_STD x the share's std sigma bounds the rounding's variance by
# (0.1 / 2)^2 = 1/400 of the share's noise variance (its std by 0.125 %), for every share and so for every sum.
SECAGG_STEP_OVER_SHARE_STD = 0.1
SECAGG_MODULUS_BITS = 32


def min_shares(on_client_failure: str, min_clients: int, num_clients: int) -> int:
    """m_min, the fewest client shares a release may sum (config keys on-client-failure, min-clients,
    num-clients): min-clients with 'drop' (``releaser.collect_round`` releases no fewer), else num-clients (an
    attempt that misses a client is discarded). Distributed mode calibrates each client's share for m_min, as
    TensorFlow Federated's ``DistributedDpSumFactory`` calibrates for its expected number of clients.
    Raises ConfigError unless 1 <= min-clients <= num-clients."""
    if not 1 <= min_clients <= num_clients:
        raise ConfigError(f"config key 'min-clients': got {min_clients}; allowed: 1 to num-clients ({num_clients})")
    return min_clients if on_client_failure == "drop" else num_clients


def secagg_grid(largest_shard: int, share_std: float, nodes: int) -> tuple[float, int]:
    """(R, Q) of a SecAgg+ round: the clipping range R = largest_shard + 1 + 10 share_std and the
    quantisation range Q = 2^(31 - ceil(log2 max(nodes, 2))), so that nodes x Q <= 2^31 and the modular sum
    cannot wrap. ``share_std``: the largest noise share of the round in units of the queries' sensitivity S;
    R covers any clipped sum (each coordinate at most S times the node's record count) plus that share except
    with probability < 1e-22 per coordinate. The grid step is 2 R / Q, in units of S."""
    r = float(largest_shard + 1) + 10.0 * share_std
    q = 2 ** (SECAGG_MODULUS_BITS - 1 - max(1, math.ceil(math.log2(max(nodes, 2)))))
    return r, q


def check_secagg_grid(noise: Mapping[str, float], shares: int, nodes: int, largest_shard: int) -> float:
    """Refuse a distributed-mode run whose SecAgg+ grid step is not small against a client's noise share.

    ``noise``: mechanism -> calibrated noise multiplier z; ``shares``: m_min (``min_shares``); ``nodes``: the
    number of clients m; ``largest_shard``: the most training records one client holds (public, as n). The
    worst case over the run: the grid of a round whose largest share is z_max / sqrt(m_min) against the
    smallest share z_min / sqrt(m_min). Returns step / share std (at most ``SECAGG_STEP_OVER_SHARE_STD``);
    raises ConfigError, before any work, when it is larger."""
    zs = [z for z in noise.values() if z > 0 and math.isfinite(z)]
    if not zs:
        return 0.0
    smallest, largest = min(zs) / math.sqrt(shares), max(zs) / math.sqrt(shares)
    r, q = secagg_grid(largest_shard, largest, nodes)
    ratio = 2.0 * r / q / smallest
    if ratio > SECAGG_STEP_OVER_SHARE_STD:
        raise ConfigError(
            f"config key 'noise-mode': got 'distributed'; its SecAgg+ grid step 2 R / Q = {2 * r / q:.3g} (R = "
            f"largest shard {largest_shard} + 1 + 10 share stds, Q = {q} for num-clients {nodes}; units of a "
            f"release's sensitivity) is {ratio:.3g} x the smallest client noise share's std z / sqrt(m_min) = "
            f"{min(zs):.4g} / sqrt({shares}) = {smallest:.3g}; allowed: at most {SECAGG_STEP_OVER_SHARE_STD:g} x, so "
            "that stochastic rounding (variance <= step^2 / 4 per coordinate, not modelled by the accounting) stays "
            "below 1/400 of a share's noise variance. Use fewer records per client (smaller shards), a smaller "
            "min-clients with on-client-failure=drop (larger shares), a smaller epsilon, or noise-mode=central "
            "or local")
    return ratio


def _noised(noise_multiplier: float, sensitivity: float) -> bool:
    """Whether a release adds noise at all: z > 0 and a finite sensitivity (a non-private run has neither)."""
    return noise_multiplier > 0 and math.isfinite(sensitivity)


@dataclass(frozen=True)
class NoiseMode:
    """Where one noise mode draws a release's N(0, (z S)^2) and whom its epsilon holds against.

    Arguments shared by the methods: ``noise_multiplier`` z (calibrated by the ledger), ``sensitivity`` S f(n) (a
    query's sensitivity times the float64 rounding factor; inf when not private), ``shares`` m_min
    (``min_shares``), ``replied`` k, the number of client shares in the released sum. Stds are per coordinate, in
    the units of the summed vector."""

    name: ClassVar[str] = ""
    #: the transport must sum the clients' replies by secure aggregation (SecAgg+ on Flower)
    secure_aggregation: ClassVar[bool] = False
    #: the server sees the clients' clipped sums without noise (epsilon against the server is inf)
    trusts_server: ClassVar[bool] = False
    #: the clients encode discrete shares (``Query.ddg``; the distributed discrete Gaussian) instead of Gaussian noise
    discrete: ClassVar[bool] = False

    def client_noise_std(self, noise_multiplier: float, sensitivity: float, shares: int) -> float:
        """Std each client adds to its own sum."""
        raise NotImplementedError

    def server_noise_std(self, noise_multiplier: float, sensitivity: float, shares: int, replied: int) -> float:
        """Std the server adds to the summed replies."""
        raise NotImplementedError

    def released_noise_std(self, noise_multiplier: float, sensitivity: float, shares: int, replied: int) -> float:
        """Std of the noise in a released sum of ``replied`` clients' replies, the server's part included:
        sqrt(k client_std^2 + server_std^2)."""
        if not _noised(noise_multiplier, sensitivity):
            return 0.0
        share = self.client_noise_std(noise_multiplier, sensitivity, shares)
        top_up = self.server_noise_std(noise_multiplier, sensitivity, shares, replied)
        return math.sqrt(replied * share**2 + top_up**2)

    def server_view_multiplier(self, noise_multiplier: float, shares: int, replied: int) -> float:
        """The noise multiplier that protects a record against the server itself (0: none)."""
        raise NotImplementedError

    def trust_statement(self, transport_name: str) -> str:
        """Who a private run's epsilon holds against, for summary.json's trust_model (docs/explanation/privacy.md,
        'Noise mode'); ``transport_name``: 'local' or 'flower'."""
        raise NotImplementedError

    def not_accounted(self) -> list[str]:
        """What this mode's accounting does not model (summary.json's not_accounted), one sentence each."""
        return []

    def check(self, cfg, noise: Mapping[str, float], largest_shard: int, plan=None) -> list[str]:
        """Check a private run in this mode before any work: ``cfg`` its configuration (``common.config.Config``),
        ``noise`` mechanism -> calibrated multiplier, ``largest_shard`` the most records one client holds, ``plan``
        the run's ``server.run_plan.RunPlan`` (None where not at hand). Raises
        ConfigError for a run the mode cannot carry out; returns warnings."""
        return []


@dataclass(frozen=True)
class Central(NoiseMode):
    """The server adds all the noise to the sum of clipped sums: a trusted server."""

    name: ClassVar[str] = "central"
    trusts_server: ClassVar[bool] = True

    def client_noise_std(self, noise_multiplier: float, sensitivity: float, shares: int) -> float:
        """0: clients send clipped sums without noise."""
        return 0.0

    def server_noise_std(self, noise_multiplier: float, sensitivity: float, shares: int, replied: int) -> float:
        """z S."""
        return noise_multiplier * sensitivity if _noised(noise_multiplier, sensitivity) else 0.0

    def server_view_multiplier(self, noise_multiplier: float, shares: int, replied: int) -> float:
        """0: the server saw the clipped sums."""
        return 0.0

    def trust_statement(self, transport_name: str) -> str:
        """The server is trusted."""
        return ("central: the server saw every client's clipped sum without noise (trusted); epsilon holds for "
                "everything it released")


@dataclass(frozen=True)
class Distributed(NoiseMode):
    """Each client adds N(0, (z S)^2 / m_min); the server sees only the SecAgg+ sum of the noised sums."""

    name: ClassVar[str] = "distributed"
    secure_aggregation: ClassVar[bool] = True

    def client_noise_std(self, noise_multiplier: float, sensitivity: float, shares: int) -> float:
        """z S / sqrt(m_min)."""
        return noise_multiplier * sensitivity / math.sqrt(shares) if _noised(noise_multiplier, sensitivity) else 0.0

    def server_noise_std(self, noise_multiplier: float, sensitivity: float, shares: int, replied: int) -> float:
        """The top-up z S sqrt((m_min - k) / m_min) when only k < m_min shares arrived; 0 for k >= m_min, which is
        every release ``releaser.collect_round`` lets through (against the server only the shares protect)."""
        if not _noised(noise_multiplier, sensitivity):
            return 0.0
        return noise_multiplier * sensitivity * math.sqrt(max(shares - replied, 0) / shares)

    def server_view_multiplier(self, noise_multiplier: float, shares: int, replied: int) -> float:
        """z sqrt(k / m_min): only the k shares in the sum are unknown to the server (>= z for every released
        sum); inf for an empty sum."""
        return noise_multiplier * math.sqrt(replied / shares) if replied else math.inf

    def trust_statement(self, transport_name: str) -> str:
        """Against the server only the shares protect; in-process runs say that no SecAgg+ took place."""
        where = ("the server saw only SecAgg+ sums of the clients' noised sums" if transport_name == "flower" else
                 "in-process run: noise placed as in distributed mode, but no secure aggregation took place")
        return (f"distributed: {where}; epsilon holds for everything released, epsilon_against_server against the "
                "server itself (every released sum has at least the planned noise; discarded partial sums count)")

    def not_accounted(self) -> list[str]:
        """The SecAgg+ quantisation."""
        return ["SecAgg+ quantisation: the rounding of each client's noised sum (grid step at most "
                f"{SECAGG_STEP_OVER_SHARE_STD:g} x a share's noise std, checked before the run; bounded and "
                "reported per release) is not modelled by the Gaussian accounting"]

    def check(self, cfg, noise: Mapping[str, float], largest_shard: int, plan=None) -> list[str]:
        """ConfigError from ``min_shares`` or ``check_secagg_grid``; returns warnings (a share calibrated for fewer
        clients than there are: every release of all m clients then carries m / m_min times the planned
        variance)."""
        shares = min_shares(cfg.on_client_failure, cfg.min_clients, cfg.num_clients)
        check_secagg_grid(noise, shares, cfg.num_clients, largest_shard)
        if shares == cfg.num_clients:
            return []
        return [f"noise-mode=distributed with on-client-failure=drop and min-clients={shares} of num-clients="
                f"{cfg.num_clients}: each client adds N(0, (z S)^2 / {shares}) so that any release of at least "
                f"{shares} shares carries the planned noise, also against the server; a release of all "
                f"{cfg.num_clients} carries {cfg.num_clients / shares:.3g} x the planned variance (more privacy, less "
                "accuracy); raise min-clients to add less noise and tolerate fewer failures"]


@dataclass(frozen=True)
class Local(NoiseMode):
    """Each client adds the full N(0, (z S)^2): private even against the server."""

    name: ClassVar[str] = "local"

    def client_noise_std(self, noise_multiplier: float, sensitivity: float, shares: int) -> float:
        """z S."""
        return noise_multiplier * sensitivity if _noised(noise_multiplier, sensitivity) else 0.0

    def server_noise_std(self, noise_multiplier: float, sensitivity: float, shares: int, replied: int) -> float:
        """0: every reply is already noised."""
        return 0.0

    def server_view_multiplier(self, noise_multiplier: float, shares: int, replied: int) -> float:
        """z: every reply carries the full noise."""
        return noise_multiplier

    def trust_statement(self, transport_name: str) -> str:
        """Against everyone."""
        return "local: every client noised its own sum; epsilon holds against everyone, the server included"


@dataclass(frozen=True)
class DistributedDiscrete(NoiseMode):
    """The distributed discrete Gaussian (Kairouz, Liu and Steinke, ICML 2021; ``common.ddg``): each client
    rounds its records' clipped vectors to an integer grid after a public random rotation and adds a discrete
    Gaussian share of std sigma = z c' / sqrt(m) grid steps (m = num-clients, the shares each is calibrated for);
    the server sees only the sum of the shares modulo 2^bits and decodes it. The ledger charges this mechanism's
    own epsilon (``ddg.DdgGeometry``: KLS Proposition 14 with Zhu and Wang's subsampling bound), not the
    continuous Gaussian's; no Gaussian noise is drawn (``client_noise_std`` and ``server_noise_std`` are 0: the
    client's noise travels in ``Query.ddg``). A sum of k < m shares (dropouts) is refused or charged at
    z sqrt(k / m), config key ddg-shortfall."""

    name: ClassVar[str] = "distributed-discrete"
    secure_aggregation: ClassVar[bool] = True
    #: the release carries discrete shares in ``Query.ddg`` instead of Gaussian ``noise_std``
    discrete: ClassVar[bool] = True

    def client_noise_std(self, noise_multiplier: float, sensitivity: float, shares: int) -> float:
        """0: the client's noise is a discrete Gaussian share (``Query.ddg``), not a Gaussian."""
        return 0.0

    def server_noise_std(self, noise_multiplier: float, sensitivity: float, shares: int, replied: int) -> float:
        """0: the server adds nothing (a shortfall is refused or charged, never topped up)."""
        return 0.0

    def released_noise_std(self, noise_multiplier: float, sensitivity: float, shares: int, replied: int) -> float:
        """The shares' noise std in the released sum, z S sqrt(k / m) (each share's variance (z S)^2 / m in the
        units of the sum; the rounding's variance, at most 1/4 grid step^2 per record, not included)."""
        if not _noised(noise_multiplier, sensitivity):
            return 0.0
        return noise_multiplier * sensitivity * math.sqrt(replied / shares)

    def server_view_multiplier(self, noise_multiplier: float, shares: int, replied: int) -> float:
        """z sqrt(min(k, m) / m) (``ddg.DdgGeometry.shortfall_multiplier``), read by the DDG accounting; inf for
        an empty sum."""
        return noise_multiplier * math.sqrt(min(replied, shares) / shares) if replied else math.inf

    def trust_statement(self, transport_name: str) -> str:
        """Against the server only the shares protect; in-process runs say that no secure aggregation took place."""
        where = ("the server saw only the modular sums of the clients' discrete shares" if transport_name == "flower"
                 else "in-process run: discrete shares encoded and summed modulo 2^bits as in the distributed "
                 "discrete Gaussian, but no secure aggregation took place")
        return (f"distributed-discrete: {where}; epsilon is the distributed discrete Gaussian's (Kairouz, Liu and "
                "Steinke 2021) and holds for everything released, epsilon_against_server against the server itself")

    def not_accounted(self) -> list[str]:
        """The sampler's float acceptance test; wrap-around is accuracy, not privacy."""
        return ["distributed discrete Gaussian: the sampler's acceptance test is computed in float64, not in exact "
                "rational arithmetic (Canonne, Kamath and Steinke 2020, Algorithm 3); a modular wrap-around "
                "(probability at most ddg-wrap-probability per release) costs accuracy, not privacy"]

    def check(self, cfg, noise: Mapping[str, float], largest_shard: int, plan=None) -> list[str]:
        """ConfigError when a set ddg-bits is below what a training release of the model's dimension needs at its
        wrap probability (``plan``: the ``server.run_plan.RunPlan``, whose ``ddg`` geometry and ``n`` it reads;
        releases of other dimensions are checked when decorated, before any client is asked). No warnings."""
        if plan is None or plan.ddg is None:
            return []
        from .ddg import release_bits

        g = plan.ddg
        for mech in plan.releases:
            z = noise.get(mech.name, 0.0)
            if z <= 0 or not math.isfinite(z) or mech.rate >= 1:
                continue
            need = release_bits(g.dim, plan.n, mech.rate, g.c_over_gamma, g.sigma(z), g.shares,
                                cfg.ddg_wrap_probability)
            check_ddg_bits(cfg, need, mech.name)
        return []


def check_ddg_bits(cfg, needed: int, mechanism: str) -> int:
    """The bits a DDG release of ``mechanism`` uses: config key ddg-bits, or ``needed`` (the fewest for the wrap
    probability, ``ddg.release_bits``) when 'auto'. ConfigError for a set value below ``needed``."""
    if cfg.ddg_bits == "auto":
        return needed
    if int(cfg.ddg_bits) < needed:
        raise ConfigError(f"config key 'ddg-bits': got {cfg.ddg_bits}; release '{mechanism}' needs at least {needed} "
                          f"bits per coordinate for a wrap-around probability of at most {cfg.ddg_wrap_probability:g} "
                          f"(config key ddg-wrap-probability); allowed: {needed} to 52, or 'auto'")
    return int(cfg.ddg_bits)


#: name -> NoiseMode, in the order of config key noise-mode's choices
NOISE_MODES: dict[str, NoiseMode] = {m.name: m for m in (Central(), Distributed(), Local(), DistributedDiscrete())}


def noise_mode(name: str) -> NoiseMode:
    """The registered NoiseMode called ``name``; ValueError naming the allowed ones otherwise."""
    try:
        return NOISE_MODES[name]
    except KeyError:
        raise ValueError(f"unknown noise mode {name!r}; allowed: {', '.join(NOISE_MODES)}") from None
