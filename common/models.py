"""Models for record-level DP training, and the validator that refuses layers that mix records.

BatchNorm normalises with batch statistics, so one record's output depends on the others and a
per-record sensitivity no longer exists (docs/explanation/ALGORITHMS.md 5.3, item 8). Only GroupNorm/LayerNorm models;
config key ``model-fix=groupnorm`` replaces a model's BatchNorm layers with GroupNorm before the check
(``model_fix.py``).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .errors import DpdroError
from .model_fix import fix_model
from .registry import Registry


def _entry_point_factory(obj: Any, path: str) -> Callable[..., nn.Module]:
    """The factory of config value model='package.module:factory' (an nn.Module class or a function)."""
    if not callable(obj):
        raise ValueError(f"model {path!r} is a {type(obj).__name__}; expected an nn.Module class or a function "
                         "factory(num_classes[, input_shape]) returning an nn.Module")
    return obj


# name -> factory(num_classes[, input_shape=...]) -> nn.Module (config key ``model``); a model is one class with
# ``register_model``; config value 'package.module:factory' names user code (``get_entry`` imports it).
MODELS: Registry[Callable[..., nn.Module]] = Registry("model", entry_point=_entry_point_factory)


def register_model(name: str):
    """Class (or factory) decorator: register a model under config value ``name``. It is called with
    ``num_classes`` (and ``input_shape=`` the shape of one record, e.g. (C, H, W) or (F,), when it has a parameter
    of that name) and must return an ``nn.Module`` mapping (B, *input shape) float to (B, num_classes) logits
    without mixing records (``validate_model`` runs on every build). ValueError if the name is taken."""
    return MODELS.register(name)


class ModelError(ValueError, DpdroError):
    """A model cannot be used for record-level DP training; the message names the layer and the fix."""


def validate_model(model: nn.Module) -> nn.Module:
    """Return ``model`` unchanged, or raise ModelError if a layer mixes records of a batch.

    Refused: every BatchNorm variant (including SyncBatchNorm) and InstanceNorm with running statistics.
    """
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            raise ModelError(
                f"layer '{name or type(module).__name__}' is {type(module).__name__}: batch normalisation mixes "
                "records, so per-record clipping bounds nothing. Set config key model-fix=groupnorm to replace "
                "every BatchNorm with GroupNorm(gcd(32, channels), channels), or replace it yourself with "
                "nn.GroupNorm or nn.LayerNorm.")
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


@register_model("cnn32")
class GroupNormCNN32(nn.Module):
    """Small CNN for 3x32x32 inputs (CIFAR-10) with GroupNorm and tanh: CIFAR10-ST's default, sized for a CPU.

    Three 3x3 convolutions with stride 2 (16, 32, 64 channels; 32 -> 16 -> 8 -> 4 pixels), then a linear layer.
    Why so small: a per-record gradient step writes a (batch x parameters) matrix, so its time grows with the
    parameter count; a 357k-parameter variant (32/64/128 channels, 128 hidden units) took 10x longer per step
    on this CPU (docs/reference/datasets.md). The GroupNorm ResNet20 (``resnet20``) is the paper profile for a GPU.

    Input: (B, 3, 32, 32) float; output: (B, num_classes) logits. 34,058 parameters (10 classes).
    """

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.GroupNorm(4, 16), nn.Tanh(),
            nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.GroupNorm(8, 32), nn.Tanh(),
            nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.GroupNorm(8, 64), nn.Tanh())
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(64 * 4 * 4, num_classes))

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


@register_model("mlp")
class TabularMLP(nn.Module):
    """Small MLP for tabular records (dataset=csv): flatten, two tanh hidden layers of ``hidden`` units.

    Input: (B, *input_shape) float, e.g. (B, F) features in [-1, 1]; output: (B, num_classes) logits.
    (F + 1) h + (h + 1) h + (h + 1) K parameters. Raises ValueError without ``input_shape``.
    """

    def __init__(self, num_classes: int, input_shape: tuple[int, ...] | None = None, hidden: int = 64) -> None:
        super().__init__()
        if input_shape is None:
            raise ValueError("model 'mlp' needs input_shape (the shape of one record)")
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), hidden), nn.Tanh(),
                                 nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@register_model("convnet")
class GroupNormConvNet(nn.Module):
    """Small CNN for images of any size (dataset=image-folder): three stride-2 3x3 convolutions (16, 32, 64
    channels) with GroupNorm and tanh, global average pooling, a linear head.

    Input: (B, C, H, W) float with C = input_shape[0] (1 without input_shape); output: (B, num_classes) logits.
    About 23k + 65 K parameters for C = 3.
    """

    def __init__(self, num_classes: int, input_shape: tuple[int, ...] | None = None) -> None:
        super().__init__()
        channels = input_shape[0] if input_shape else 1
        self.features = nn.Sequential(
            nn.Conv2d(channels, 16, 3, stride=2, padding=1), nn.GroupNorm(4, 16), nn.Tanh(),
            nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.GroupNorm(4, 32), nn.Tanh(),
            nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.GroupNorm(8, 64), nn.Tanh(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(64, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


# Groups of the scatter models' input GroupNorm: Tramer and Boneh's published GroupNorm setting (README of
# github.com/ftramer/Handcrafted-DP: --input_norm=GroupNorm --num_groups=27), 3 channels per group on one colour's 81,
# 9 on three colours' 243.
SCATTER_GROUPS = 27


def _scatter_shape(name: str, input_shape: tuple[int, ...] | None) -> tuple[int, int, int]:
    """(C, H, W) of scattering features (config key features=scatternet), or ValueError naming the model."""
    if input_shape is None or len(input_shape) != 3 or input_shape[0] % SCATTER_GROUPS:
        raise ValueError(f"model {name!r} reads scattering features (C, H, W) with C a multiple of {SCATTER_GROUPS} "
                         f"(81 per colour); got input shape {input_shape}: set config key features=scatternet")
    return tuple(input_shape)  # type: ignore[return-value]


class ScatterNorm(nn.Module):
    """The input normalisation of the scattering models: GroupNorm(27, C, affine=False), each record normalised by
    itself (Tramer and Boneh's ``--input_norm=GroupNorm --num_groups=27``, no statistic of other records), until
    ``set_stats`` fixes per-channel statistics released privately by the run (config key feature-norm=private,
    ``common.feature_norm``); then (x - mean_c) * inv_std_c, their ``--input_norm=BN`` with DP statistics.

    Buffers (in the state dict, so that an exported model predicts as it was trained): ``mean`` (C,), ``inv_std``
    (C,) and ``fixed`` (bool scalar). A state dict saved before the buffers existed (GroupNorm) loads with the
    GroupNorm defaults. Input (B, C, H, W), output the same shape.
    """

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(channels))
        self.register_buffer("inv_std", torch.ones(channels))
        self.register_buffer("fixed", torch.zeros((), dtype=torch.bool))
        self._register_load_state_dict_pre_hook(self._fill_missing)

    def _fill_missing(self, state, prefix, *args) -> None:
        """A model file from before the buffers: keep the GroupNorm behaviour it was trained with."""
        for name, buf in (("mean", self.mean), ("inv_std", self.inv_std), ("fixed", self.fixed)):
            state.setdefault(prefix + name, torch.zeros_like(buf) if name != "inv_std" else torch.ones_like(buf))

    def set_stats(self, mean: torch.Tensor, inv_std: torch.Tensor) -> None:
        """Fix the per-channel statistics (C,) each, in place (the tensors a FlatModel holds see them)."""
        with torch.no_grad():
            self.mean.copy_(mean)
            self.inv_std.copy_(inv_std)
            self.fixed.fill_(True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool(self.fixed):
            return (x - self.mean.view(1, -1, 1, 1)) * self.inv_std.view(1, -1, 1, 1)
        return nn.functional.group_norm(x, SCATTER_GROUPS)


@register_model("scatter-linear")
class ScatterLinear(nn.Module):
    """Tramer and Boneh's ScatterNet + linear model (ICLR 2021; github.com/ftramer/Handcrafted-DP, ``models.py:
    ScatterLinear`` with ``input_norm="GroupNorm"``): GroupNorm(27, C, affine=False) on the scattering features, each
    record normalised by itself (no statistic of other records, no parameter), or with feature-norm=private the
    privately released channel statistics (``ScatterNorm``), then one linear layer.

    Input: (B, C, H, W) features of config key features=scatternet, e.g. (243, 8, 8) for 32x32 RGB images;
    output: (B, num_classes) logits. C H W K + K parameters (155,530 for (243, 8, 8) and 10 classes).
    Raises ValueError for another input shape.
    """

    def __init__(self, num_classes: int, input_shape: tuple[int, ...] | None = None) -> None:
        super().__init__()
        c, h, w = _scatter_shape("scatter-linear", input_shape)
        self.norm = ScatterNorm(c)
        self.head = nn.Linear(c * h * w, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(x).flatten(1))


@register_model("scatter-cnn")
class ScatterCNN(nn.Module):
    """Tramer and Boneh's ScatterNet + CNN (github.com/ftramer/Handcrafted-DP, ``models.py``, the default size) on
    GroupNorm(27, C, affine=False)-normalised scattering features, tanh activations. On one colour's 81 channels
    (grey images) their MNIST model: 3x3 convolutions to 16 channels (stride 2) and 32 channels, then linear layers
    of 32 units and K. On more colours their CIFAR-10 model: 3x3 convolutions to 64 channels, 2x2 max-pooling,
    a 3x3 convolution to 64 channels, a linear layer.

    Input: (B, C, H, W) features of config key features=scatternet; output: (B, num_classes) logits. 187,210
    parameters for (243, 8, 8) and 10 classes, 33,066 for (81, 7, 7). Raises ValueError for another input shape.
    """

    def __init__(self, num_classes: int, input_shape: tuple[int, ...] | None = None) -> None:
        super().__init__()
        c, h, w = _scatter_shape("scatter-cnn", input_shape)
        self.norm = ScatterNorm(c)
        if c == 81:
            self.features = nn.Sequential(nn.Conv2d(c, 16, 3, stride=2, padding=1), nn.Tanh(),
                                          nn.Conv2d(16, 32, 3, padding=1), nn.Tanh())
            side = ((h + 1) // 2) * ((w + 1) // 2)
            self.head = nn.Sequential(nn.Flatten(), nn.Linear(32 * side, 32), nn.Tanh(), nn.Linear(32, num_classes))
        else:
            self.features = nn.Sequential(nn.Conv2d(c, 64, 3, padding=1), nn.Tanh(), nn.MaxPool2d(2),
                                          nn.Conv2d(64, 64, 3, padding=1), nn.Tanh())
            self.head = nn.Sequential(nn.Flatten(), nn.Linear(64 * (h // 2) * (w // 2), num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(self.norm(x)))


def resolve_model(name: str, dataset: str) -> str:
    """Config key ``model``: 'auto' picks the data set's default model (``DatasetSpec.default_model``: cnn for
    28x28 grey, cnn32 for CIFAR10-ST, resnet20 for CIFAR-10, cnn64 for CelebA at 64x64); any other name is
    returned unchanged."""
    from .data import DATASETS

    return DATASETS.get_entry(dataset).default_model if name == "auto" else name


def _takes_input_shape(factory: Callable[..., Any]) -> bool:
    try:
        return "input_shape" in inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        return False


def make_model(name: str, num_classes: int, seed: int, dtype: torch.dtype = torch.float32,
               input_shape: tuple[int, ...] | None = None, fix: str = "none") -> nn.Module:
    """Build and validate the model registered as ``name`` (config key ``model``; or an import path
    'package.module:factory'), initialised from ``seed`` (public). Use ``resolve_model`` first for 'auto'.

    fix: config key ``model-fix`` ('none', or 'groupnorm': BatchNorm layers replaced before validation;
    ``model_fix.fix_model``).

    input_shape: the shape of one record ((C, H, W) or (F,)); passed to a factory with an ``input_shape``
    parameter, and with it the model is probed by ``check_per_record`` before it is returned (once per process
    for a name, shape, number of classes and dtype).
    Raises ValueError for an unknown name or an import path that does not import, and ModelError for a model
    that mixes records, does not build, or whose per-record gradients torch.func cannot compute.
    """
    factory = MODELS.get_entry(name)
    kwargs = {"input_shape": tuple(input_shape)} if input_shape is not None and _takes_input_shape(factory) else {}
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = factory(num_classes, **kwargs)
    except Exception as e:  # noqa: BLE001 - user code may raise anything: report it with the call
        raise ModelError(f"model {name!r}: factory(num_classes={num_classes}"
                         f"{', input_shape=' + str(kwargs['input_shape']) if kwargs else ''}) failed "
                         f"({type(e).__name__}: {e})") from None
    finally:
        torch.random.set_rng_state(gen_state)
    if not isinstance(model, nn.Module):
        raise ModelError(f"model {name!r}: the factory returned a {type(model).__name__}; expected an nn.Module")
    model = validate_model(fix_model(model, fix).to(dtype))
    probe = (name, tuple(input_shape or ()), num_classes, dtype, fix)
    if input_shape is not None and probe not in _PROBED:  # once per process: every client builds the same model
        check_per_record(model, tuple(input_shape), num_classes, name)
        _PROBED.add(probe)
    return model


# (model name, input shape, classes, dtype, model fix) that passed ``check_per_record`` in this process
_PROBED: set[tuple] = set()


def check_per_record(model: nn.Module, input_shape: tuple[int, ...], num_classes: int, name: str = "") -> None:
    """Probe ``model`` on 3 public random records of ``input_shape`` (a fixed generator; the global RNG, the
    parameters and the buffers are untouched): the logits must be (3, num_classes), each record's output must not
    depend on the other records of the batch, and torch.func must compute finite per-record gradients (the
    vmap(grad) of ``per_sample.FlatModel``, as in training). Raises ModelError naming the model and the cause."""
    from .per_sample import FlatModel  # late: per_sample is the math layer beside this one

    label = f"model {name!r}" if name else "the model"
    if not any(p.requires_grad for p in model.parameters()):
        raise ModelError(f"{label} has no trainable parameters")
    flat_model = FlatModel(model)
    flat = flat_model.initial()
    gen = torch.Generator().manual_seed(0)
    x = (torch.rand((3, *input_shape), generator=gen) * 2 - 1).to(flat.dtype)
    try:
        with torch.no_grad():
            out = flat_model.logits(flat, x)
            alone = flat_model.logits(flat, x[:1])
    except Exception as e:  # noqa: BLE001 - any failure of user code is reported with its cause
        single = ("; a GroupNorm whose groups hold one value each (as model-fix=groupnorm makes of a BatchNorm1d "
                  "on (B, C) features, C dividing 32) cannot normalise one record: use nn.LayerNorm(C) there"
                  if "more than 1 value per channel" in str(e) else "")
        raise ModelError(f"{label} fails on input of shape {tuple(x.shape)} ({type(e).__name__}: {e}): it must map "
                         f"(B, {', '.join(map(str, input_shape))}) records to (B, {num_classes}) logits{single}"
                         ) from None
    if tuple(out.shape) != (3, num_classes):
        raise ModelError(f"{label} returns shape {tuple(out.shape)} for input {tuple(x.shape)}; expected "
                         f"(3, {num_classes}): one row of {num_classes} logits per record")
    if not torch.allclose(out[:1], alone, rtol=1e-4, atol=1e-5):
        raise ModelError(f"{label}: a record's output changes with the other records of its batch (a layer mixes "
                         "records, like BatchNorm), so per-record clipping bounds nothing. Replace that layer "
                         "(nn.GroupNorm or nn.LayerNorm instead of batch statistics).")
    try:
        _, grads = flat_model.losses_and_grads(flat, x, torch.zeros(3, dtype=torch.long))
    except Exception as e:  # noqa: BLE001
        raise ModelError(f"torch.func cannot compute per-record gradients of {label} ({type(e).__name__}: {e}). "
                         "Per-record gradients are vmap(grad(...)) over records: avoid in-place changes of inputs or "
                         "buffers, .item() / .numpy() / data-dependent Python control flow in forward, and layers that "
                         "mix records.") from None
    if grads.shape != (3, flat_model.dim) or not bool(torch.isfinite(grads).all()):
        raise ModelError(f"{label}: per-record gradients are not finite at the initial parameters")


def __getattr__(name: str) -> dict[str, str]:
    """DEFAULT_MODEL (data set -> its default model): derived from the data-set registry when read."""
    if name == "DEFAULT_MODEL":
        from .data import DATASETS

        return {d: spec.default_model for d, spec in DATASETS.items()}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
