"""Models for record-level DP training, and the validator that refuses layers that mix records.

BatchNorm normalises with batch statistics, so one record's output depends on the others and a
per-record sensitivity no longer exists (ALGORITHMS.md 5.3, item 8). Only GroupNorm/LayerNorm models.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .registry import Registry

# name -> factory(num_classes) -> nn.Module (config key ``model``); a model is one class with ``register_model``.
MODELS: Registry[Callable[[int], nn.Module]] = Registry("model")


def register_model(name: str):
    """Class (or factory) decorator: register a model under config value ``name``. It is called with
    ``num_classes`` and must return an ``nn.Module`` mapping (B, *input shape) float to (B, num_classes) logits
    without mixing records (``validate_model`` runs on every build). ValueError if the name is taken."""
    return MODELS.register(name)


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


@register_model("cnn")
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


class _BasicBlock(nn.Module):
    """Two 3x3 convolutions with GroupNorm and ReLU, plus the identity or a 1x1 convolution shortcut."""

    def __init__(self, cin: int, cout: int, stride: int, groups: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.norm1 = nn.GroupNorm(groups, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, stride=1, padding=1, bias=False)
        self.norm2 = nn.GroupNorm(groups, cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False),
                                          nn.GroupNorm(groups, cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.norm1(self.conv1(x)))
        return torch.relu(self.norm2(self.conv2(out)) + self.shortcut(x))


@register_model("resnet20")
class GroupNormResNet20(nn.Module):
    """ResNet20 (He et al. 2016, the CIFAR variant: 3 stages of 3 basic blocks, 16/32/64 channels) with
    GroupNorm (8 groups) in place of BatchNorm and 1x1-convolution shortcuts where the shape changes.

    Input: (B, 3, 32, 32) float; output: (B, num_classes) logits. About 0.27M parameters.
    """

    def __init__(self, num_classes: int = 10, groups: int = 8) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.GroupNorm(groups, 16), nn.ReLU())
        blocks, cin = [], 16
        for cout, stride in ((16, 1), (32, 2), (64, 2)):
            for i in range(3):
                blocks.append(_BasicBlock(cin, cout, stride if i == 0 else 1, groups))
                cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)))


@register_model("cnn64")
class GroupNormCNN64(nn.Module):
    """Small CNN for 3x64x64 inputs (CelebA at 64x64) with GroupNorm and tanh.

    Input: (B, 3, 64, 64) float; output: (B, num_classes) logits. About 33k parameters.
    """

    def __init__(self, num_classes: int = 2) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 5, stride=2, padding=2), nn.GroupNorm(4, 16), nn.Tanh(),
            nn.Conv2d(16, 32, 5, stride=2, padding=2), nn.GroupNorm(4, 32), nn.Tanh(),
            nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.GroupNorm(8, 64), nn.Tanh(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(64, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def resolve_model(name: str, dataset: str) -> str:
    """Config key ``model``: 'auto' picks the data set's default model (``DatasetSpec.default_model``: cnn for
    28x28 grey, resnet20 for CIFAR-10, cnn64 for CelebA at 64x64); any other name is returned unchanged."""
    from .data import DATASETS

    return DATASETS.get_entry(dataset).default_model if name == "auto" else name


def make_model(name: str, num_classes: int, seed: int, dtype: torch.dtype = torch.float32) -> nn.Module:
    """Build and validate the model registered as ``name`` (config key ``model``), initialised from ``seed``
    (public). Use ``resolve_model`` first for the config value 'auto'.

    Raises ValueError for an unknown name and ModelError for a model that mixes records.
    """
    factory = MODELS.get_entry(name)
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = factory(num_classes)
    finally:
        torch.random.set_rng_state(gen_state)
    return validate_model(model.to(dtype))


def __getattr__(name: str) -> dict[str, str]:
    """DEFAULT_MODEL (data set -> its default model): derived from the data-set registry when read."""
    if name == "DEFAULT_MODEL":
        from .data import DATASETS

        return {d: spec.default_model for d, spec in DATASETS.items()}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
