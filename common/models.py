"""Models for record-level DP training, and the validator that refuses layers that mix records.

BatchNorm normalises with batch statistics, so one record's output depends on the others and a
per-record sensitivity no longer exists (ALGORITHMS.md 5.3, item 8). Only GroupNorm/LayerNorm models.
"""

from __future__ import annotations

import torch
from torch import nn


class ModelError(ValueError):
    """A model cannot be used for record-level DP training; the message names the layer and the fix."""


def validate_model(model: nn.Module) -> nn.Module:
    """Return ``model`` unchanged, or raise ModelError if a layer mixes records of a batch.

    Refused: every BatchNorm variant (including SyncBatchNorm) and InstanceNorm with running statistics.
    """
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            raise ModelError(
                f"layer '{name or type(module).__name__}' is {type(module).__name__}: batch normalisation mixes "
                "records, so per-record clipping bounds nothing. Replace it with nn.GroupNorm (for example "
                "GroupNorm(min(32, channels), channels)) or nn.LayerNorm.")
        if isinstance(module, nn.modules.instancenorm._InstanceNorm) and module.track_running_stats:
            raise ModelError(
                f"layer '{name}' is {type(module).__name__} with track_running_stats=True: running statistics "
                "are computed from private records outside any release. Use track_running_stats=False or GroupNorm.")
    return model


class GroupNormCNN(nn.Module):
    """CNN for 1x28x28 inputs with GroupNorm and tanh (tanh suits DP-SGD: Papernot et al. 2021).

    Input: (B, 1, 28, 28) float; output: (B, num_classes) logits. About 26k parameters.
    """

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 8, stride=2, padding=3),
            nn.GroupNorm(4, 16),
            nn.Tanh(),
            nn.MaxPool2d(2, 1),
            nn.Conv2d(16, 32, 4, stride=2),
            nn.GroupNorm(4, 32),
            nn.Tanh(),
            nn.MaxPool2d(2, 1),
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(32 * 4 * 4, 32), nn.Tanh(), nn.Linear(32, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def make_model(name: str, num_classes: int, seed: int, dtype: torch.dtype = torch.float32) -> nn.Module:
    """Build and validate the model for config key ``model``, initialised from ``seed`` (public).

    Raises ValueError for an unknown name.
    """
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        if name == "cnn":
            model = GroupNormCNN(num_classes)
        else:
            raise ValueError(f"unknown model {name!r}; allowed: cnn")
    finally:
        torch.random.set_rng_state(gen_state)
    return validate_model(model.to(dtype))
