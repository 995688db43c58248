"""CIFAR10-ST on fixtures written in torchvision's on-disk format, and the CelebA subset on the real files."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from dpdro.common.data import (
    CIFAR_DIR,
    CIFAR_TEST,
    CIFAR_TRAIN,
    DataError,
    load_dataset,
    stratified_split,
)
from dpdro.server.evaluate import group_metrics, per_group_accuracy, worst_group_words


def write_cifar_fixture(root, monkeypatch, per_batch=40, seed=0):
    """Five training batches, a test batch and batches.meta in CIFAR-10's python format: labels cycle 0..9 so
    every class has per_batch/10 * 5 = 20 training images; pixel values encode (batch, position). torchvision's
    md5 list is pointed at these files for the test (the loader's integrity check is torchvision's)."""
    from torchvision.datasets import CIFAR10
    from torchvision.datasets.utils import calculate_md5

    folder = root / CIFAR_DIR
    folder.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    for b, name in enumerate(CIFAR_TRAIN + CIFAR_TEST):
        labels = [i % 10 for i in range(per_batch)]
        data = rng.integers(0, 256, size=(per_batch, 3072), dtype=np.uint8)
        data[:, 0] = b
        data[:, 1] = np.arange(per_batch)
        with open(folder / name, "wb") as f:
            pickle.dump({"data": data, "labels": labels, "batch_label": name}, f)  # str keys, as torchvision reads them
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({"label_names": [f"class{k}" for k in range(10)]}, f)
    md5 = {p.name: calculate_md5(str(p)) for p in folder.iterdir()}
    monkeypatch.setattr(CIFAR10, "train_list", [[n, md5[n]] for n in CIFAR_TRAIN])
    monkeypatch.setattr(CIFAR10, "test_list", [[n, md5[n]] for n in CIFAR_TEST])
    monkeypatch.setattr(CIFAR10, "meta", {**CIFAR10.meta, "md5": md5["batches.meta"]})
    return folder


def test_cifar10_st_rule_on_fixture(tmp_path, monkeypatch):
    write_cifar_fixture(tmp_path, monkeypatch)
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


def test_cifar10_corrupt_batch_is_reported(tmp_path, monkeypatch):
    folder = write_cifar_fixture(tmp_path, monkeypatch)
    (folder / "data_batch_3").write_bytes(b"garbage")
    with pytest.raises(DataError, match="data_batch_3 does not match torchvision's md5") as e:
        load_dataset("cifar10", True, data_root=str(tmp_path), cache_dir=str(tmp_path / "c"))
    assert "data_batch_1" not in str(e.value)  # only the damaged file is named


def test_cifar10_same_size_damage_is_caught_by_md5(tmp_path, monkeypatch):
    # a flipped byte keeps the pickle readable: only torchvision's md5 check can see it
    folder = write_cifar_fixture(tmp_path, monkeypatch)
    with open(folder / "test_batch", "rb") as f:
        entry = pickle.load(f)
    entry["data"][3, 100] ^= 1
    with open(folder / "test_batch", "wb") as f:
        pickle.dump(entry, f)
    with pytest.raises(DataError, match="test_batch does not match"):
        load_dataset("cifar10", False, data_root=str(tmp_path), cache_dir=str(tmp_path / "c"))


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


def test_group_metrics_name_the_records_behind_the_worst_group():
    correct = np.array([1, 1, 0, 1, 0, 0, 1, 1, 0, 0], dtype=bool)
    groups = np.array([0, 0, 0, 1, 1, 2, 3, 3, 4, 4])
    m = group_metrics(correct, groups, 6)  # group 5 is empty: NaN, not the worst
    assert m["per_group_records"] == [3, 2, 1, 2, 2, 0] and m["worst_group_accuracy"] == 0.0
    assert m["worst_group_records"] == 1  # groups 2 (1 record) and 4 (2 records) tie at 0: the fewer
    assert worst_group_words(m) == ", worst-group accuracy 0.0000 (1 records)"
    assert worst_group_words({"worst_group_accuracy": 0.5}) == ", worst-group accuracy 0.5000"  # older summaries
    assert worst_group_words({"test_accuracy": 0.5}) == ""


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


# First and last kept training index (original order: data_batch_1 row 0 = 0, data_batch_5 row 9999 = 49999) of
# each class in CIFAR10-ST, found with a plain pickle read of the real batches (not this project's loader).
CIFAR10_ST_KEPT = {0: (48869, 49994), 1: (49173, 49999), 2: (48779, 49995), 3: (49140, 49983), 4: (48824, 49990),
                   5: (27, 49988), 6: (0, 49996), 7: (7, 49986), 8: (8, 49985), 9: (1, 49997)}


@pytest.mark.data
def test_cifar10_st_on_the_real_files():
    from torchvision.datasets import CIFAR10

    from dpdro.common.data import resolve_data_root

    root = resolve_data_root("auto")
    if not (root / CIFAR_DIR).is_dir():
        pytest.skip(f"CIFAR-10 not under {root}")
    st = load_dataset("cifar10-st", "train")
    labels = st.y.numpy()
    assert st.x.shape == (25_500, 3, 32, 32)
    assert np.bincount(labels, minlength=10).tolist() == [100] * 5 + [5000] * 5
    raw = CIFAR10(str(root), train=True, download=False)  # an independent read of the same files
    raw_labels = np.asarray(raw.targets)
    pixels = ((st.x + 1) / 2 * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()  # back to HWC uint8
    for k, (first, last) in CIFAR10_ST_KEPT.items():
        of_k = np.flatnonzero(raw_labels == k)
        kept = of_k[-100:] if k < 5 else of_k  # classes 0-4: the last 100 in the original order; 5-9: all
        assert (kept[0], kept[-1]) == (first, last)
        # the loader's class-k records, in order, are exactly those training images
        assert np.array_equal(pixels[labels == k], raw.data[kept])
    test = load_dataset("cifar10-st", "test")
    assert np.bincount(test.y.numpy(), minlength=10).tolist() == [1000] * 10
