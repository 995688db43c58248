"""Partitioners: every record exactly once, deterministic in the seed, no NaN for tiny Dirichlet alpha; a training
and an evaluation split cut alike give each node one label mix; sites (num-sites) share their label mix."""

from __future__ import annotations

import numpy as np
import pytest

from dpdro.common.config import Config, ConfigError
from dpdro.common.partition import (
    dirichlet_partition,
    iid_partition,
    make_partition,
    site_dirichlet_partition,
    site_of,
)


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


def _mixes(labels: np.ndarray, parts: list[np.ndarray]) -> np.ndarray:
    return np.stack([np.bincount(labels[p], minlength=10) / max(len(p), 1) for p in parts])


def test_dirichlet_gives_a_node_one_label_mix_on_every_split():
    """The shares depend on the seed and the class only, not on the records: a 30,000-record training split and a
    10,000-record test split give each of 10 nodes label mixes within 0.02 of each other (rounding of the cuts),
    where draws that followed the record counts gave unrelated mixes (differences near 0.5)."""
    rng = np.random.default_rng(1)
    train, test = rng.integers(0, 10, 30_000), rng.integers(0, 10, 10_000)
    a = _mixes(train, dirichlet_partition(train, 10, 0.3, seed=0))
    b = _mixes(test, dirichlet_partition(test, 10, 0.3, seed=0))
    assert np.abs(a - b).max() < 0.02
    assert np.abs(a - a.mean(0)).max() > 0.2  # and the mixes are skewed (alpha 0.3)


def test_site_of_numbers_nodes_site_by_site():
    assert [site_of(j, 10, 3) for j in range(10)] == [0, 0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert [site_of(j, 4, 4) for j in range(4)] == [0, 1, 2, 3]


def test_site_partition_cover_and_shared_mix():
    """Every record once; the nodes of one site hold near-equal shares of the site's records, with the site's
    label mix (within sampling error), while sites differ; deterministic in the seed; bad sizes raise."""
    labels = np.random.default_rng(2).integers(0, 10, 20_000)
    parts = site_dirichlet_partition(labels, 40, 4, 0.3, seed=5)
    assert_exact_cover(parts, len(labels), 40)
    sites = dirichlet_partition(labels, 4, 0.3, seed=5)
    mixes = _mixes(labels, parts)
    for s, idx in enumerate(sites):
        members = [j for j in range(40) if site_of(j, 40, 4) == s]
        assert np.array_equal(np.sort(np.concatenate([parts[j] for j in members])), idx)
        sizes = [len(parts[j]) for j in members]
        assert max(sizes) - min(sizes) <= 1
        site_mix = _mixes(labels, [idx])[0]
        assert np.abs(mixes[members] - site_mix).max() < 0.08
    assert np.abs(_mixes(labels, sites) - _mixes(labels, sites).mean(0)).max() > 0.2
    again = site_dirichlet_partition(labels, 40, 4, 0.3, seed=5)
    assert all(np.array_equal(x, y) for x, y in zip(parts, again, strict=True))
    for bad in (0, 41):
        with pytest.raises(ValueError, match="num_sites"):
            site_dirichlet_partition(labels, 40, bad, 0.3, seed=5)


def test_num_sites_config_and_dro_groups_site():
    """partition='dirichlet' with num-sites cuts by site; num-sites outside {0} and [2, num-clients] and
    dro-groups='site' without sites are refused before any work, naming the key and the value."""
    labels = labels_long_tailed()
    cfg = Config.from_mapping({"num-clients": 6, "seed": 4, "partition": "dirichlet", "dirichlet-alpha": 0.3,
                               "num-sites": 2})
    got = make_partition(cfg, labels)
    want = site_dirichlet_partition(labels, 6, 2, 0.3, 4)
    assert all(np.array_equal(x, y) for x, y in zip(got, want, strict=True))
    for bad in (1, 7):
        with pytest.raises(ConfigError, match=f"'num-sites': got {bad}"):
            Config.from_mapping({"num-clients": 6, "num-sites": bad})
    group = {"algorithm": "recursive-spider", "dro-level": "group", "dro-groups": "site", "num-clients": 6}
    with pytest.raises(ConfigError, match="'dro-groups': got 'site' with num-sites 0"):
        Config.from_mapping(group)
    cfg = Config.from_mapping({**group, "num-sites": 3})
    assert cfg.dro_group_count(10, 0) == 3 and cfg.uses_group_priors and cfg.node_groups
    with pytest.raises(ConfigError, match="'dro-groups': got 'site' with algorithm 'dp-sgd'"):
        Config.from_mapping({**group, "algorithm": "dp-sgd", "num-sites": 3})
