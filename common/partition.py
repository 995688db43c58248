"""Partitioners: how the training records are split over clients (simulation of many sites).

``PARTITIONS`` holds one ``Partitioner`` per value of config key ``partition``: 'iid' and 'dirichlet' split one
data set centrally; 'node-local' (``NODE_LOCAL``) splits nothing, each Flower node reading its own data
(``is_node_local``). The splits are deterministic given the seed, return a list of ``num_clients`` int64 index
arrays that together hold every record exactly once, and never produce NaN: a client may receive no record, which
the protocol handles (its Poisson sample is simply empty).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .config_schema import ConfigError
from .registry import Registry
from .rng import derived_rng


def iid_partition(n: int, num_clients: int, seed: int) -> list[np.ndarray]:
    """A seeded random permutation of range(n) cut into ``num_clients`` near-equal parts (sorted)."""
    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients}")
    perm = derived_rng(seed, "partition-iid").permutation(n)
    return [np.sort(part).astype(np.int64) for part in np.array_split(perm, num_clients)]


def dirichlet_partition(labels: np.ndarray, num_clients: int, alpha: float, seed: int) -> list[np.ndarray]:
    """Dirichlet-by-label split (Hsu et al. 2019): for each class, shares ~ Dirichlet(alpha 1_m) over the
    clients, and the class's records (shuffled) are cut by those shares.

    Class k's shares are drawn from their own generator (seed, k), apart from the shuffles, so they depend on the
    seed, the class, m and alpha only: a training and an evaluation split cut with one seed give node j the same
    label mix (server/evaluate.node_of_records relies on it for per-node accuracy). Small alpha can make every
    Gamma draw underflow to 0 (a Dirichlet sample of NaN); such a class then goes wholly to one client drawn
    uniformly, which is the alpha -> 0 limit of the Dirichlet. Classes with no record are skipped. Raises
    ValueError for alpha <= 0.
    """
    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients}")
    if not alpha > 0:
        raise ValueError(f"dirichlet alpha must be > 0, got {alpha}")
    labels = np.asarray(labels)
    rng = derived_rng(seed, "partition-dirichlet")
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for k in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == k))
        shares = _class_shares(derived_rng(seed, "partition-dirichlet-shares", int(k)), num_clients, alpha)
        cuts = np.round(np.cumsum(shares)[:-1] * len(idx)).astype(np.int64)
        for c, piece in enumerate(np.split(idx, cuts)):
            parts[c].append(piece)
    return [np.sort(np.concatenate(p)).astype(np.int64) if p else np.zeros(0, np.int64) for p in parts]


def _class_shares(rng: np.random.Generator, num_clients: int, alpha: float) -> np.ndarray:
    """One class's shares (m,) ~ Dirichlet(alpha 1_m) from Gamma draws; all of it to one uniform client when every
    draw underflows (the alpha -> 0 limit)."""
    g = rng.standard_gamma(np.full(num_clients, alpha))
    total = g.sum()
    if total > 0 and np.isfinite(total):
        return g / total
    shares = np.zeros(num_clients)
    shares[rng.integers(num_clients)] = 1.0
    return shares


def site_of(node, num_clients: int, num_sites: int):
    """Node ``node``'s site in [0, num_sites): floor(node * num_sites / num_clients), so that nodes are numbered site
    by site and each site holds floor or ceil(num_clients / num_sites) nodes (config key num-sites: a public label,
    not a function of any record). ``node`` an int, or an int array (then elementwise)."""
    return node * num_sites // num_clients


def site_dirichlet_partition(labels: np.ndarray, num_clients: int, num_sites: int, alpha: float,
                             seed: int) -> list[np.ndarray]:
    """Label skew by site: ``dirichlet_partition`` over the ``num_sites`` sites, then each site's records, shuffled,
    cut into near-equal parts over its nodes (``site_of``), so that a site's nodes share its label mix (hospitals
    whose wards differ by chance, not by kind). Index arrays of the ``num_clients`` nodes, sorted; ValueError for
    num_sites outside [1, num_clients] or alpha <= 0."""
    if not 1 <= num_sites <= num_clients:
        raise ValueError(f"num_sites must be in [1, num_clients = {num_clients}], got {num_sites}")
    sites = dirichlet_partition(labels, num_sites, alpha, seed)
    rng = derived_rng(seed, "partition-site-nodes")
    nodes = site_of(np.arange(num_clients), num_clients, num_sites)
    parts: list[np.ndarray] = [np.zeros(0, np.int64)] * num_clients
    for site, idx in enumerate(sites):
        members = np.flatnonzero(nodes == site)
        for node, piece in zip(members, np.array_split(rng.permutation(idx), len(members)), strict=True):
            parts[node] = np.sort(piece).astype(np.int64)
    return parts


def _dirichlet(data, labels: np.ndarray) -> list[np.ndarray]:
    """partition='dirichlet': by node, or by site when the data section sets num-sites."""
    if data.num_sites:
        return site_dirichlet_partition(labels, data.num_clients, data.num_sites, data.dirichlet_alpha, data.seed)
    return dirichlet_partition(labels, data.num_clients, data.dirichlet_alpha, data.seed)


@dataclass(frozen=True)
class Partitioner:
    """One value of config key ``partition``: ``split(data, labels)`` -> the index arrays of the clients (``data``:
    a Config's data section: num-clients, dirichlet-alpha, num-sites, seed; ``labels``: (n,) int64 of the training
    split), or None when nothing is split centrally because each node reads its own data (node-local)."""

    split: Callable[[Any, np.ndarray], list[np.ndarray]] | None


PARTITIONS: Registry[Partitioner] = Registry("partition")
PARTITIONS.register("iid", Partitioner(lambda data, labels: iid_partition(len(labels), data.num_clients, data.seed)))
PARTITIONS.register("dirichlet", Partitioner(_dirichlet))
NODE_LOCAL = "node-local"  # each Flower node trains on the data its node config points at
PARTITIONS.register(NODE_LOCAL, Partitioner(None))

NODE_LOCAL_ONLY_DEPLOYED = (
    "config key 'partition': got 'node-local'; allowed here: 'iid' or 'dirichlet'. Node-local data needs a Flower "
    "deployment (dpdro deploy --node-data-root DIR ..., or SuperNodes started with --node-config "
    "\"data-root='/site/data'\"): single-node training and the simulation hold one data set in one place")


def is_node_local(partition: str) -> bool:
    """Whether config value ``partition`` leaves each node its own data (no central split: deployments only)."""
    return PARTITIONS.get_entry(partition).split is None


def refuse_node_local(partition: str) -> None:
    """ConfigError (``NODE_LOCAL_ONLY_DEPLOYED``) for a node-local ``partition`` where the clients share one data
    set (single-node training, the simulation), before any work."""
    if is_node_local(partition):
        raise ConfigError(NODE_LOCAL_ONLY_DEPLOYED)


def make_partition(data, labels: np.ndarray) -> list[np.ndarray]:
    """The partition described by a Config's ``data`` section (keys partition, num-clients, dirichlet-alpha, seed).
    ConfigError for partition='node-local': there each node reads its own data and nothing is partitioned
    centrally."""
    refuse_node_local(data.partition)
    return PARTITIONS.get_entry(data.partition).split(data, labels)
