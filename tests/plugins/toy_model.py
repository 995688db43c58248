"""A toy model in one file (CONTRIBUTING.md): a linear classifier on flattened 1x4x4 inputs. Registering it
is the ``register_model`` decorator; tests/test_plugins.py trains it."""

from __future__ import annotations

import torch
from torch import nn

from dpdro.common.models import register_model


@register_model("toy-linear")
class ToyLinear(nn.Module):
    """Input (B, 1, 4, 4) float, output (B, num_classes) logits; 16 * num_classes + num_classes parameters."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(16, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x)
