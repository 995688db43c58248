"""A toy data set in one file (CONTRIBUTING.md): two well-separated classes of 4x4 grey images, drawn from a
fixed seed (no files). Registering it is the ``register_dataset`` call; tests/test_plugins.py trains on it."""

from __future__ import annotations

import numpy as np
import torch

from dpdro.common.data import DatasetSpec, register_dataset


def load_toy_blobs(split: str, data_root, cache_dir, download: bool, split_seed: int):
    """(uint8 images (N, 4, 4), int64 labels (N,), no groups): class k has bright pixels in row k, plus noise.
    'train': 400 records, 'test': 200 (different draws)."""
    n = 400 if split == "train" else 200
    rng = np.random.default_rng({"train": 1, "test": 2}[split])
    labels = np.arange(n) % 2
    images = rng.integers(0, 60, size=(n, 4, 4))
    images[np.arange(n), labels, :] += 180
    return torch.from_numpy(images.astype(np.uint8)), torch.from_numpy(labels.astype(np.int64)), None


register_dataset("toy-blobs", DatasetSpec(load_toy_blobs, num_classes=2, default_model="toy-linear"))
