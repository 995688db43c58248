"""CIFAR10-ST on fixtures written in torchvision's on-disk format, and the CelebA subset on the real files."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from dpdro.common.data import (
    CIFAR_DIR,
    CIFAR_TEST,
    CIFAR_TRAIN,
    DataError,
    load_dataset,
    stratified_split,
)
from dpdro.server.evaluate import per_group_accuracy


def write_cifar_fixture(root, per_batch=40, seed=0):
    """Five training batches and a test batch in CIFAR-10's python format: labels cycle 0..9 so every
    class has per_batch/10 * 5 = 20 training images; pixel values encode (batch, position)."""
    folder = root / CIFAR_DIR
    folder.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    for b, name in enumerate(CIFAR_TRAIN + CIFAR_TEST):
        labels = [i % 10 for i in range(per_batch)]
        data = rng.integers(0, 256, size=(per_batch, 3072), dtype=np.uint8)
        data[:, 0] = b
        data[:, 1] = np.arange(per_batch)
        with open(folder / name, "wb") as f:
            pickle.dump({b"data": data, b"labels": labels, b"batch_label": name.encode()}, f)
    return folder


def test_cifar10_st_rule_on_fixture(tmp_path):
    write_cifar_fixture(tmp_path)
    full = load_dataset("cifar10", True, data_root=str(tmp_path), cache_dir=str(tmp_path / "c"))
    assert full.x.shape == (200, 3, 32, 32) and len(full) == 200
    st = load_dataset("cifar10-st", True, data_root=str(tmp_path), cache_dir=str(tmp_path / "c"),
                      imbalance_ratio=0.1)
    counts = np.bincount(st.y.numpy(), minlength=10)
    assert counts.tolist() == [2] * 5 + [20] * 5  # ceil(0.1 * 20) of classes 0-4, all of 5-9
    # the kept images of a reduced class are its last ones in file order (batch 5, the last positions)
    raw = ((st.x[:, 0, 0, 0] + 1) / 2 * 255).round().numpy()  # first pixel = batch index
    pos = ((st.x[:, 0, 0, 1] + 1) / 2 * 255).round().numpy()
    labels = st.y.numpy()
    for k in range(5):
        assert raw[labels == k].tolist() == [4.0, 4.0]
        assert pos[labels == k].tolist() == [20 + k, 30 + k]
    test = load_dataset("cifar10-st", False, data_root=str(tmp_path), cache_dir=str(tmp_path / "c"))
    assert len(test) == 40 and np.bincount(test.y.numpy()).tolist() == [4] * 10


def test_cifar10_missing_gives_clear_error(tmp_path):
    with pytest.raises(DataError, match="CIFAR-10 not found.*download=true"):
        load_dataset("cifar10-st", True, data_root=str(tmp_path), cache_dir=str(tmp_path / "c"))


def test_cifar10_corrupt_batch_is_reported(tmp_path):
    folder = write_cifar_fixture(tmp_path)
    (folder / "data_batch_3").write_bytes(b"garbage")
    with pytest.raises(DataError, match="data_batch_3"):
        load_dataset("cifar10", True, data_root=str(tmp_path), cache_dir=str(tmp_path / "c"))


def test_stratified_split_keeps_group_proportions():
    groups = np.repeat([0, 1, 2, 3], [4412, 4136, 1371, 81])
    parts = stratified_split(groups, (0.8, 0.1, 0.1), seed=0)
    assert sum(len(p) for p in parts) == len(groups)
    assert len(np.unique(np.concatenate(parts))) == len(groups)
    counts = [np.bincount(groups[p], minlength=4).tolist() for p in parts]
    assert counts[1] == [441, 413, 137, 8] and counts[2] == [441, 414, 137, 8]
    assert stratified_split(groups, (0.8, 0.1, 0.1), seed=0)[1].tolist() == parts[1].tolist()
    assert stratified_split(groups, (0.8, 0.1, 0.1), seed=1)[1].tolist() != parts[1].tolist()


def test_worst_group_accuracy_on_hand_made_example():
    correct = np.array([1, 1, 0, 1, 0, 0, 1, 1], dtype=bool)
    groups = np.array([0, 0, 0, 1, 1, 2, 3, 3])
    acc = per_group_accuracy(correct, groups, 4)
    assert acc == pytest.approx([2 / 3, 0.5, 0.0, 1.0])
    assert min(acc) == 0.0


@pytest.mark.data
def test_celeba_subset_cells_and_split():
    splits = {s: load_dataset("celeba", s) for s in ("train", "val", "test")}
    totals = np.zeros(4, dtype=int)
    for ds in splits.values():
        assert ds.num_groups == 4 and ds.num_classes == 2
        assert ds.x.shape[1:] == (3, 64, 64)
        g = ds.groups.numpy()
        assert np.array_equal(ds.y.numpy(), g // 2)  # target Blond_Hair is the high bit of the group
        totals += np.bincount(g, minlength=4)
    # (not blond, female), (not blond, male), (blond, female), (blond, male)
    assert totals.tolist() == [4412, 4136, 1371, 81]
    assert np.bincount(splits["val"].groups.numpy(), minlength=4).tolist() == [441, 413, 137, 8]
    assert np.bincount(splits["test"].groups.numpy(), minlength=4).tolist() == [441, 414, 137, 8]
