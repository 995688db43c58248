"""Private input normalisation of scattering features (config key ``feature-norm = private``;
docs/explanation/ALGORITHMS.md 5.3 item 8).

Tramer and Boneh (ICLR 2021, "Differentially private learning needs better features", section 3 and their
repository's ``dp_utils.scatter_normalization``) normalise ScatterNet features per channel with a mean and variance
estimated under DP, which their CIFAR-10 figures (67.0 % for ScatterNet + linear at (3, 1e-5)) use. dpdro releases
both moments in one setup release ('feature-moments', server/setup.py): every record contributes
v = [mean_c x ; mean_c x^2] over each channel's positions, (2C,), clipped to ``feature-norm-clip`` as one vector
(the null record contributes 0, so the sensitivity is the clip), the sum gets Gaussian noise at the fixed
multiplier ``feature-norm-noise-multiplier``, and the ledger charges it like every setup release. (Their code clips
each moment at the median of the records' norms, which it calls "technically a small privacy leak"; dpdro's clip is
a public constant.) Everything below is post-processing of that release.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

# BatchNorm's default epsilon, as in Tramer and Boneh's fixed-statistics BatchNorm
EPS = 1e-5
MOMENTS = "feature-moments"  # the setup release's mechanism name
QUANTITY = "channel-moments"  # its per-record quantity (common/quantities.py)


def channel_moments(x: torch.Tensor) -> torch.Tensor:
    """Per record [mean over positions of x_c ; mean over positions of x_c^2], (B, 2C) in x's dtype, for inputs x
    (B, C, H, W) (or (B, C): one position). Touches no parameter."""
    flat = x.reshape(x.shape[0], x.shape[1], -1)
    return torch.cat([flat.mean(-1), (flat * flat).mean(-1)], dim=1)


def stats_from_moments(moments: np.ndarray) -> tuple[float, ...]:
    """(mean_1..C, inv_std_1..C) from the released mean (2C,) of the records' moment vectors (the noisy sum
    divided by n): var_c = max(m2_c - m1_c^2, 0) and inv_std_c = 1 / sqrt(var_c + EPS). Post-processing.
    ValueError for an odd length."""
    moments = np.asarray(moments, dtype=np.float64)
    if moments.ndim != 1 or moments.size % 2:
        raise ValueError(f"channel moments: expected (2C,), got shape {moments.shape}")
    c = moments.size // 2
    mean, square = moments[:c], moments[c:]
    inv_std = 1.0 / np.sqrt(np.maximum(square - mean * mean, 0.0) + EPS)
    return tuple(float(v) for v in np.concatenate([mean, inv_std]))


def norm_modules(module: nn.Module) -> list[nn.Module]:
    """The module's ``models.ScatterNorm`` layers (the inputs' normalisation that feature-norm=private fixes)."""
    from .models import ScatterNorm

    return [m for m in module.modules() if isinstance(m, ScatterNorm)]


def channels(module: nn.Module) -> int:
    """C of the module's input normalisation (its first ScatterNorm's channel count); 0 without one."""
    layers = norm_modules(module)
    return int(layers[0].mean.numel()) if layers else 0


def apply_stats(module: nn.Module, stats: tuple[float, ...]) -> None:
    """Fix every ScatterNorm of ``module`` to ``stats`` (2C,: means then inverse stds, ``stats_from_moments``), in
    place, in the module's dtype. ValueError when the module has no ScatterNorm or a layer's channel count is not
    C."""
    layers = norm_modules(module)
    if not layers:
        raise ValueError("feature-norm=private: the model has no ScatterNorm input layer (scatter-linear and "
                         "scatter-cnn have one)")
    values = torch.as_tensor(stats, dtype=torch.float64)
    c = values.numel() // 2
    for layer in layers:
        if layer.mean.numel() != c:
            raise ValueError(f"feature-norm=private: statistics of {c} channels for a layer of {layer.mean.numel()}")
        layer.set_stats(values[:c].to(layer.mean.dtype), values[c:].to(layer.inv_std.dtype))
