"""Partitioners: every record exactly once, deterministic in the seed, no NaN for tiny Dirichlet alpha."""

from __future__ import annotations

import numpy as np
import pytest

from dpdro.common.config import Config
from dpdro.common.partition import dirichlet_partition, iid_partition, make_partition


def assert_exact_cover(parts: list[np.ndarray], n: int, num_clients: int) -> None:
    assert len(parts) == num_clients
    for p in parts:
        assert p.dtype == np.int64 and p.ndim == 1
        assert np.all(np.diff(p) > 0)  # sorted, no duplicates within a shard
    allidx = np.concatenate(parts)
    assert len(allidx) == n
    assert np.array_equal(np.sort(allidx), np.arange(n))


def labels_long_tailed(seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.choice(10, size=500, p=np.array([30, 20, 15, 10, 8, 6, 5, 3, 2, 1]) / 100)


@pytest.mark.parametrize("n,m", [(0, 3), (1, 1), (7, 3), (100, 4), (10, 16), (1001, 7)])
def test_iid_covers_exactly_once(n, m):
    parts = iid_partition(n, m, seed=5)
    assert_exact_cover(parts, n, m)
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1  # near-equal parts
    if n < m:
        assert min(sizes) == 0  # empty shards allowed


def test_iid_deterministic_and_seed_dependent():
    a = iid_partition(200, 4, seed=1)
    b = iid_partition(200, 4, seed=1)
    c = iid_partition(200, 4, seed=2)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c, strict=True))
    # a random split, not contiguous blocks
    assert not np.array_equal(a[0], np.arange(50))
    with pytest.raises(ValueError):
        iid_partition(10, 0, seed=0)


@pytest.mark.parametrize("alpha", [0.05, 0.5, 5.0, 1e4])
@pytest.mark.parametrize("m", [1, 3, 10])
def test_dirichlet_covers_exactly_once(alpha, m):
    labels = labels_long_tailed()
    parts = dirichlet_partition(labels, m, alpha, seed=3)
    assert_exact_cover(parts, len(labels), m)


def test_dirichlet_deterministic_and_seed_dependent():
    labels = labels_long_tailed()
    a = dirichlet_partition(labels, 5, 0.5, seed=11)
    b = dirichlet_partition(labels, 5, 0.5, seed=11)
    c = dirichlet_partition(labels, 5, 0.5, seed=12)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c, strict=True))


def test_dirichlet_alpha_controls_heterogeneity():
    labels = np.repeat(np.arange(10), 100)

    def mean_label_entropy(alpha):
        ents = []
        for seed in range(5):
            for p in dirichlet_partition(labels, 5, alpha, seed=seed):
                if len(p) == 0:
                    continue
                freq = np.bincount(labels[p], minlength=10) / len(p)
                ents.append(-(freq[freq > 0] * np.log(freq[freq > 0])).sum())
        return np.mean(ents)

    low, high = mean_label_entropy(0.05), mean_label_entropy(1e4)
    assert high > np.log(10) - 0.05  # near uniform label mix per client
    assert low < high - 0.5


@pytest.mark.parametrize("seed", range(10))
def test_dirichlet_tiny_alpha_small_imbalanced_no_nan(seed):
    # 30 labels: class 0 has 20 records, class 1 has 9, class 2 a single record
    labels = np.array([0] * 20 + [1] * 9 + [2])
    np.random.default_rng(seed).shuffle(labels)
    with np.errstate(all="raise"):  # a 0/0 share would raise here
        parts = dirichlet_partition(labels, 4, 1e-4, seed=seed)
    assert_exact_cover(parts, 30, 4)
    # the single record of class 2 is somewhere, exactly once
    where = [c for c, p in enumerate(parts) if np.any(labels[p] == 2)]
    assert len(where) == 1


def test_dirichlet_tiny_alpha_is_most_heterogeneous():
    """Dirichlet(alpha 1) tends to a random vertex as alpha -> 0: each class should go (almost) entirely to
    one client, as it already does at alpha = 0.01."""
    labels = np.repeat(np.arange(10), 40)

    def top_share(alpha):
        shares = []
        for k in range(10):
            counts = [np.sum(labels[p] == k) for p in dirichlet_partition(labels, 4, alpha, seed=0)]
            shares.append(max(counts) / 40)
        return float(np.mean(shares))

    assert top_share(0.01) > 0.9
    assert top_share(1e-4) > 0.9


def test_dirichlet_all_gammas_underflow_gives_each_class_to_one_client():
    # alpha = 1e-300: every Gamma draw underflows to 0, so each class goes wholly to one client
    labels = np.repeat(np.arange(3), 8)
    parts = dirichlet_partition(labels, 4, 1e-300, seed=0)
    assert_exact_cover(parts, 24, 4)
    for k in range(3):
        holders = [c for c, p in enumerate(parts) if np.any(labels[p] == k)]
        assert len(holders) == 1 and np.sum(labels[parts[holders[0]]] == k) == 8


def test_dirichlet_more_clients_than_records_and_bad_alpha():
    labels = np.array([0, 1, 1])
    parts = dirichlet_partition(labels, 8, 0.5, seed=0)
    assert_exact_cover(parts, 3, 8)
    assert sum(len(p) == 0 for p in parts) >= 5
    assert_exact_cover(dirichlet_partition(np.zeros(0, np.int64), 3, 0.5, seed=0), 0, 3)
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError):
            dirichlet_partition(labels, 2, bad, seed=0)
    with pytest.raises(ValueError):
        dirichlet_partition(labels, 0, 0.5, seed=0)


def test_make_partition_follows_config():
    labels = labels_long_tailed()
    cfg = Config.from_mapping({"num-clients": 3, "seed": 4})
    got = make_partition(cfg, labels)
    assert all(np.array_equal(x, y) for x, y in zip(got, iid_partition(len(labels), 3, 4), strict=True))
    cfg = Config.from_mapping({"num-clients": 6, "seed": 4, "partition": "dirichlet", "dirichlet-alpha": 0.3})
    got = make_partition(cfg, labels)
    assert all(np.array_equal(x, y) for x, y in zip(got, dirichlet_partition(labels, 6, 0.3, 4), strict=True))
    assert_exact_cover(got, len(labels), 6)
