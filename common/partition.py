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

    Small alpha can make every Gamma draw underflow to 0 (a Dirichlet sample of NaN); such a class then goes
    wholly to one client drawn uniformly, which is the alpha -> 0 limit of the Dirichlet. Classes with no
    record are skipped. Raises ValueError for alpha <= 0.
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
        g = rng.standard_gamma(np.full(num_clients, alpha))
        total = g.sum()
        if total > 0 and np.isfinite(total):
            shares = g / total
        else:
            shares = np.zeros(num_clients)
            shares[rng.integers(num_clients)] = 1.0
        cuts = np.round(np.cumsum(shares)[:-1] * len(idx)).astype(np.int64)
        for c, piece in enumerate(np.split(idx, cuts)):
            parts[c].append(piece)
    return [np.sort(np.concatenate(p)).astype(np.int64) if p else np.zeros(0, np.int64) for p in parts]


@dataclass(frozen=True)
class Partitioner:
    """One value of config key ``partition``: ``split(data, labels)`` -> the index arrays of the clients (``data``:
    a Config's data section: num-clients, dirichlet-alpha, seed; ``labels``: (n,) int64 of the training split),
    or None when nothing is split centrally because each node reads its own data (node-local)."""

    split: Callable[[Any, np.ndarray], list[np.ndarray]] | None


PARTITIONS: Registry[Partitioner] = Registry("partition")
PARTITIONS.register("iid", Partitioner(lambda data, labels: iid_partition(len(labels), data.num_clients, data.seed)))
PARTITIONS.register("dirichlet", Partitioner(
    lambda data, labels: dirichlet_partition(labels, data.num_clients, data.dirichlet_alpha, data.seed)))
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
