"""The '-ST' construction and loaders on the real MNIST / Fashion-MNIST files (ALGORITHMS.md 6.2)."""

from __future__ import annotations

import numpy as np
import pytest

from dpdro.common.data import DataError, even_subset, load_dataset, long_tailed_indices

pytestmark = pytest.mark.data


def test_mnist_st_counts_and_kept_indices():
    full = load_dataset("mnist", train=True)
    st = load_dataset("mnist-st", train=True)
    counts = np.bincount(st.y.numpy(), minlength=10)
    assert counts[:5].tolist() == [119, 135, 120, 123, 117]
    assert counts[5:].tolist() == [5421, 5918, 6265, 5851, 5949]
    assert len(st) == 30_018
    labels = full.y.numpy()
    idx = long_tailed_indices(labels, 10, 0.02)
    for k in range(5):  # the kept records of a reduced class are its last ones in file order
        of_k = np.flatnonzero(labels == k)
        kept = idx[labels[idx] == k]
        assert kept.tolist() == of_k[-len(kept):].tolist()
    assert np.array_equal(st.x.numpy(), full.x[idx].numpy())


def test_fashion_mnist_st_counts():
    st = load_dataset("fashion-mnist-st", train=True)
    counts = np.bincount(st.y.numpy(), minlength=10)
    assert counts.tolist() == [120] * 5 + [6000] * 5
    assert len(st) == 30_600
    test = load_dataset("fashion-mnist-st", train=False)
    assert np.bincount(test.y.numpy()).tolist() == [1000] * 10


def test_inputs_scaled_to_unit_interval_and_test_split_unchanged():
    test = load_dataset("mnist-st", train=False)
    assert len(test) == 10_000
    assert float(test.x.min()) == -1.0 and float(test.x.max()) == 1.0
    assert test.x.shape[1:] == (1, 28, 28)


def test_missing_root_names_where_it_looked(tmp_path):
    with pytest.raises(DataError, match=r"MNIST not found.*data-root"):
        load_dataset("mnist", train=True, data_root=str(tmp_path / "nowhere"), cache_dir=str(tmp_path / "c"))


def test_corrupt_gz_is_refused(tmp_path):
    raw = tmp_path / "root" / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for name in ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", "t10k-images-idx3-ubyte.gz",
                 "t10k-labels-idx1-ubyte.gz"):
        (raw / name).write_bytes(b"not a gzip file")
    with pytest.raises(DataError, match="md5"):
        load_dataset("mnist", train=True, data_root=str(tmp_path / "root"), cache_dir=str(tmp_path / "cache"))


def test_even_subset_is_deterministic_and_spread():
    idx = even_subset(30_018, 3000)
    assert len(idx) == 3000 and idx[0] == 0 and idx[-1] == 30_017
    assert np.array_equal(idx, even_subset(30_018, 3000))
    assert even_subset(10, 0).tolist() == list(range(10))


def test_flower_simulation_refuses_missing_data_before_flower_starts(tmp_path, monkeypatch):
    import subprocess

    from dpdro.common.config import Config
    from dpdro.launch.simulate import run_simulation

    def no_flower(*args, **kwargs):
        raise AssertionError("flwr was started although the data is missing")

    monkeypatch.setattr(subprocess, "run", no_flower)
    cfg = Config.from_mapping({"dataset": "mnist-st", "data-root": str(tmp_path / "empty"),
                               "cache-dir": str(tmp_path / "cache"), "out-dir": str(tmp_path / "run")})
    with pytest.raises(DataError, match="MNIST not found"):
        run_simulation(cfg)


def test_missing_data_under_auto_names_each_place_once_and_why_the_cache(tmp_path, monkeypatch):
    """data-root=auto with $DPDRO_DATA_ROOT unset and no ../shared/datasets resolves to the cache: the error names
    that folder once and says how auto was resolved (a newcomer saw the same folder twice and no reason)."""
    from dpdro.common import data

    monkeypatch.delenv("DPDRO_DATA_ROOT", raising=False)
    monkeypatch.setenv("DPDRO_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(data, "project_root", lambda: tmp_path / "project")
    with pytest.raises(DataError) as e:
        load_dataset("mnist", False)
    text = str(e.value)
    assert text.count(str(tmp_path / "cache" / "MNIST" / "raw")) == 1
    assert f"$DPDRO_DATA_ROOT is unset and {tmp_path / 'shared' / 'datasets'} does not exist, so only the cache" in text
