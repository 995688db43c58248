"""User code named by import path (docs/how-to/own-data.md): models built by
``model=user_code:<factory>`` and data by ``dataset=user_code:<function>``, with no registration. Test-only:
tests/test_user_data.py puts this folder on sys.path (a user puts theirs on PYTHONPATH)."""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn


def tiny_mlp(num_classes: int, input_shape: tuple[int, ...]) -> nn.Module:
    """A one-hidden-layer MLP (16 units, LayerNorm) for records of any ``input_shape``."""
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), 16), nn.LayerNorm(16), nn.Tanh(),
                         nn.Linear(16, num_classes))


class BatchNormNet(nn.Module):
    """Refused: BatchNorm normalises with the statistics of the batch."""

    def __init__(self, num_classes: int, input_shape: tuple[int, ...]) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), 8), nn.BatchNorm1d(8),
                                 nn.Linear(8, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def batchnorm_channels(num_classes: int, input_shape: tuple[int, ...]) -> nn.Module:
    """Refused as it is (BatchNorm1d); trains with model-fix=groupnorm: a linear map to 4 channels of 8 values,
    BatchNorm1d(4) over them (GroupNorm(4, 4) once fixed: 8 values a group), a linear head."""
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), 32), nn.Unflatten(1, (4, 8)),
                         nn.BatchNorm1d(4), nn.Tanh(), nn.Flatten(), nn.Linear(32, num_classes))


class CentringNet(nn.Module):
    """Refused: subtracts the batch mean (mixes records without any BatchNorm layer)."""

    def __init__(self, num_classes: int, input_shape: tuple[int, ...]) -> None:
        super().__init__()
        self.head = nn.Linear(math.prod(input_shape), num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.flatten(1)
        return self.head(x - x.mean(dim=0, keepdim=True))


class NumpyNet(nn.Module):
    """Refused: leaves torch for numpy in forward (per record, no mixing), which torch.func cannot differentiate."""

    def __init__(self, num_classes: int, input_shape: tuple[int, ...]) -> None:
        super().__init__()
        self.head = nn.Linear(math.prod(input_shape), num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.from_numpy(np.tanh(x.flatten(1).numpy())))


NOT_A_FACTORY = 3


def needs_weights(num_classes: int, input_shape: tuple[int, ...]) -> nn.Module:
    """Refused: the factory itself fails (here: a missing weights file)."""
    raise FileNotFoundError("weights.pt not found")


def no_parameters(num_classes: int) -> nn.Module:
    """Refused: nothing to train."""
    return nn.Flatten()


def blobs(split: str, data_root) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Three well-separated Gaussian blobs in 2-D (features float32 in about [-1, 1]; public constants), 300
    training and 150 test records, group = record index mod 2."""
    rng = np.random.default_rng({"train": 1, "test": 2}[split])
    n = 300 if split == "train" else 150
    y = np.arange(n) % 3
    centres = np.array([[-0.6, -0.6], [0.6, -0.6], [0.0, 0.6]])
    x = centres[y] + rng.normal(0, 0.1, size=(n, 2))
    return x.astype(np.float32), y, np.arange(n) % 2


def blobs_dataset(split: str, data_root) -> torch.utils.data.Dataset:
    """The same records as ``blobs`` as a torch Dataset of (x, y) items."""
    x, y, _ = blobs(split, data_root)
    return torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y))


def blobs_with_extra_test_class(split: str, data_root) -> tuple[np.ndarray, np.ndarray]:
    """Refused: the test split has a label (3) the training split lacks."""
    x, y, _ = blobs(split, data_root)
    return x, (y if split == "train" else np.where(np.arange(len(y)) == 0, 3, y))
