"""Node sampling (config key ``node-sampling-rate``, p) and the privacy unit (``privacy-unit``): which nodes a
release asks, what a release of a node-sampled round costs, and the checks made before any work.

Sampling (``sample_partitions``). Each release (one query of one round) asks a Poisson sample of the nodes: node k
is asked with probability p, independently of every other node and of every other release (a fresh draw per
(iteration, mechanism), keyed by partition id, never by Flower node id, so the in-process transport and a Flower
simulation ask the same nodes when reproducible). A retry of a release asks the same sample again. p = 1 asks
every node and draws nothing: runs are bit-identical to runs made before the key existed.

Record-level accounting (``privacy-unit = record``; ALGORITHMS.md 5.8). A record is included in a release when its
node is sampled (p) and then the record itself (its node's Poisson sampling at rate r): with probability p r. The
release is *not* a Poisson-subsampled Gaussian at rate p r: the other records of the record's node are included
together with it, so their sum can reveal whether the node was sampled. The dominating pair of one release is the
"revealed mixture" of the record-level pair: with probability 1 - p an atom common to both sides (privacy loss
exactly 0), with probability p the pair of PoissonSampledDpEvent(r, GaussianDpEvent(z)). Its privacy loss
distribution is (1 - p) delta_0 + p PLD_r (``mixed_pld``), its Renyi divergence of order a is
log(1 - p + p exp((a - 1) D_a)) / (a - 1) (``mixed_rdp``); both bound the true release's (data processing: the
release is that pair post-processed) and the bound is attained in the limit of a node whose other records are far
from the rest. So the ledger charges every node-sampled release at (p, r, z) with that event: never less than Poisson
sampling at rate r alone (p = 1), never the (smaller, unsound) Poisson sampling at rate p r.

Node-level accounting (``privacy-unit = node``; ALGORITHMS.md 5.9). The unit is a node: its whole contribution to a
release (the sum of its records' clipped vectors divided by its record count, a mean over its shard) is clipped to C
as one vector (``client.worker.node_contribution``), noise N(0, (z C)^2) is added to the sum over the sampled nodes,
and the release is PoissonSampledDpEvent(p, GaussianDpEvent(z)) over the m nodes (replace one node's data with the
null node, m fixed). A sampled node then uses all of its records (the record rate r would derive from the total record
count, which node-level neighbours change). The released mean divides by the expected number of sampled nodes, p m.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
from dp_accounting.pld import pld_pmf
from dp_accounting.pld import privacy_loss_distribution as pld_lib

from ..common.config import MIN_EXPECTED_NODES, ConfigError  # noqa: F401 - the rule's constant
from ..common.rng import site_rng

# Refused before any work (``Config`` validation, common/config.py): node-sampling-rate outside (0, 1] (the key's
# range), p < 1 with noise-mode=distributed (each node's share is calibrated for a fixed number of shares, and a
# sample may hold fewer), and privacy-unit=node with fewer than MIN_EXPECTED_NODES expected sampled nodes p m;
# after calibration, ``check_node_noise``.


def sample_partitions(reproducible: bool, seed: int, iteration: int, mechanism: str, rate: float,
                      partitions: Iterable[int], num_partitions: int) -> frozenset[int] | None:
    """The partitions asked for release (``iteration``, ``mechanism``): each of ``partitions`` (ids in
    [0, num_partitions)) independently with probability ``rate`` (the node-sampling rate p), drawn from
    ``site_rng(reproducible, seed, 'node-sample', iteration, mechanism)``: one uniform per partition id in
    0..num_partitions-1, so that the draw of a partition does not depend on which others are present. None for
    rate 1 (every node; nothing drawn). ValueError for a rate outside (0, 1] or a partition id out of range."""
    if not 0 < rate <= 1:
        raise ValueError(f"node-sampling rate must be in (0, 1], got {rate}")
    if rate == 1:
        return None
    ids = sorted(partitions)
    if ids and not 0 <= ids[0] <= ids[-1] < num_partitions:
        raise ValueError(f"partition ids {ids} outside 0..{num_partitions - 1}")
    u = site_rng(reproducible, seed, "node-sample", iteration, mechanism).random(num_partitions)
    return frozenset(pid for pid in ids if u[pid] < rate)


def mixed_pld(pld: pld_lib.PrivacyLossDistribution, node_rate: float) -> pld_lib.PrivacyLossDistribution:
    """The PLD (1 - p) delta_0 + p ``pld`` of the revealed mixture (module docstring): with probability 1 - p the
    node was not sampled and the privacy loss is exactly 0. Both the remove and the add PMFs are mixed; the infinity
    mass is scaled by p. Loss 0 is a grid point of every discretisation, so a pessimistic PLD stays pessimistic.
    ``node_rate`` in (0, 1]; 1 returns ``pld`` itself. ValueError otherwise."""
    if not 0 < node_rate <= 1:
        raise ValueError(f"node-sampling rate must be in (0, 1], got {node_rate}")
    if node_rate == 1:
        return pld
    pmfs = [_mixed_pmf(pmf.to_dense_pmf(), node_rate) for pmf in (pld._pmf_remove, pld._pmf_add)]  # noqa: SLF001
    return pld_lib.PrivacyLossDistribution(pmfs[0], pmfs[1])


def _mixed_pmf(pmf: pld_pmf.DensePLDPmf, p: float) -> pld_pmf.DensePLDPmf:
    # dp-accounting 0.6 (pinned <0.7) keeps a dense PMF's grid in these attributes (as server/ledger.py reads them)
    lower, probs = pmf._lower_loss, np.asarray(pmf._probs, dtype=np.float64)  # noqa: SLF001
    lo, hi = min(lower, 0), max(lower + len(probs) - 1, 0)
    out = np.zeros(hi - lo + 1)
    out[lower - lo:lower - lo + len(probs)] = p * probs
    out[-lo] += 1.0 - p
    return pld_pmf.DensePLDPmf(pmf._discretization, lo, out, p * pmf._infinity_mass,  # noqa: SLF001
                               pmf._pessimistic_estimate)  # noqa: SLF001


def mixed_rdp(rdp: Sequence[float], orders: Sequence[float], node_rate: float) -> np.ndarray:
    """Renyi DP of the revealed mixture at each order a: log(1 - p + p exp((a - 1) rdp_a)) / (a - 1), computed
    stably (an infinite ``rdp`` stays infinite; p = 1 returns ``rdp``). Exact for the mixture pair, since the common
    atom has likelihood ratio 1 (E_Q[(P/Q)^a] = 1 - p + p exp((a - 1) D_a))."""
    rdp = np.asarray(rdp, dtype=np.float64)
    if node_rate == 1:
        return rdp
    out = np.empty_like(rdp)
    for i, (a, d) in enumerate(zip(orders, rdp, strict=True)):
        if not math.isfinite(d):
            out[i] = math.inf
            continue
        x = (a - 1) * d  # log(1 - p + p e^x) = x + log(p + (1 - p) e^-x) for x >= 0
        out[i] = (x + math.log(node_rate + (1 - node_rate) * math.exp(-x))) / (a - 1)
    return out


def expected_count(unit: str, node_rate: float, record_rate: float, num_records: int, num_nodes: int) -> float:
    """The expected number of units a release sums, the divisor of its released mean (never the realised count,
    which is private): p r n records (privacy-unit=record) or p m nodes (privacy-unit=node)."""
    if unit == "node":
        return node_rate * num_nodes
    return node_rate * record_rate * num_records if node_rate != 1 else record_rate * num_records


def check_node_noise(noise: dict[str, float], node_rate: float, num_nodes: int) -> None:
    """privacy-unit=node, after calibration and before any release: refuse a plan whose released mean carries more
    noise per coordinate than the largest possible signal, z C / (p m) > C, i.e. a noise multiplier z above the
    expected number of sampled nodes p m (ConfigError naming the mechanism, z and p m)."""
    expected = node_rate * num_nodes
    worst = {name: z for name, z in noise.items() if z > expected}
    if worst:
        what = ", ".join(f"{name} (z = {z:.3g})" for name, z in sorted(worst.items()))
        raise ConfigError(
            f"config key 'privacy-unit': got 'node', and the calibrated noise multipliers of {what} exceed the "
            f"expected number of sampled nodes p m = {expected:.3g}: each released mean would carry noise std above "
            "the clip C in every coordinate (more noise than any signal); use more nodes, a higher "
            "node-sampling-rate, a larger epsilon or fewer iterations")


def ledger_node_rate(unit: str, node_rate: float) -> float:
    """The ``node_rate`` the ledger mixes every release with: p for privacy-unit=record (the revealed mixture), 1 for
    privacy-unit=node (there the node-sampling rate is the release's own Poisson rate: ``unit_plan``)."""
    return node_rate if unit == "record" else 1.0


def unit_plan(plan: Mapping, unit: str, node_rate: float) -> dict:
    """The plan (``ledger.Mechanism`` -> count) as the ledger charges it: unchanged for privacy-unit=record; for
    privacy-unit=node every mechanism at Poisson rate p over the nodes (PoissonSampledDpEvent(p, GaussianDpEvent(z)),
    the unit a node)."""
    if unit == "record":
        return dict(plan)
    return {dataclasses.replace(m, rate=node_rate): c for m, c in plan.items()}


def local_step_mechanisms(cfg) -> tuple[str, ...]:
    """The mechanisms a node answers with its update after local SGD (config key local-epochs > 0 at
    privacy-unit=node; ``client.local_steps``): the algorithm's ``AlgorithmSpec.local_steps``; () otherwise."""
    from ..common.algorithm_specs import ALGORITHM_SPECS

    if cfg.privacy_unit != "node" or cfg.local_epochs == 0:
        return ()
    return ALGORITHM_SPECS[cfg.algorithm].local_steps


def check_local_steps(cfg, mechanisms: Iterable[str]) -> None:
    """local-epochs > 0, before any work: refuse (ConfigError naming the key, the algorithm and what is allowed) a run
    none of whose ``mechanisms`` (the names of its algorithm's releases) a node could answer with a local update, so
    that the key never silently does nothing (e.g. recursive-spider at dro-level=record, whose model release is the
    compositional v/u). (q > 1 with local steps is refused by Config validation.)"""
    from ..common.algorithm_specs import ALGORITHM_SPECS

    if cfg.privacy_unit != "node" or cfg.local_epochs == 0:
        return
    if set(local_step_mechanisms(cfg)) & set(mechanisms):
        return
    allowed = [n for n, s in ALGORITHM_SPECS.items() if s.local_steps]
    raise ConfigError(f"config key 'local-epochs': got {cfg.local_epochs} with algorithm {cfg.algorithm!r}"
                      f"{' at dro-level=' + repr(cfg.params.dro_level) if hasattr(cfg.params, 'dro_level') else ''}, "
                      "which makes no one-point release of the model's gradient that a node's local update could "
                      f"replace; allowed: 0, or one of {', '.join(allowed)} (recursive-spider at dro-level=group)")
