"""A node's local SGD under privacy-unit=node (config key ``local-epochs``; docs/explanation/ALGORITHMS.md 5.9).

DP-FedAvg (McMahan, Ramage, Talwar and Zhang 2018, "Learning differentially private recurrent language models",
ICLR, Algorithm 1): a sampled node starts from the broadcast model x_0, runs local SGD over its own shard and sends
its update. dpdro sends the update as a pseudo-gradient, x_0 - x_K, so that the server's step x - lr-x * mean is
FedAvg's at lr-x = 1. The caller clips the whole update to C as one vector (``worker.node_contribution``): the node
is the unit, so nothing inside the local steps needs a per-record bound, and the release's sensitivity is C as for a
node's mean gradient. Everything here is a function of the node's own records, the public x_0 and the node's own
shuffling randomness: no other node's data and no extra release.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch


def local_update(flat0: torch.Tensor, num_records: int, grad_sum: Callable[[torch.Tensor, np.ndarray], torch.Tensor],
                 epochs: int, lr: float, batch: int, rng: np.random.Generator) -> torch.Tensor:
    """x_0 - x_K after ``epochs`` epochs of local SGD, K = epochs * ceil(num_records / batch) steps.

    Each epoch visits the node's records once in an order drawn from ``rng`` (``rng.permutation``), ``batch`` at a
    time (the last batch may hold fewer); a step is x <- x - lr * grad_sum(x, rows) / len(rows).

    Args:
        flat0: (d,) the broadcast model's trainable parameters (any float dtype; the steps run in float64).
        num_records: the node's records (0: no step, the zero update).
        grad_sum: (x (d,) float64, rows (b,) int64 indices) -> (d,) float64, the sum of the per-record gradients of
            the release's quantity at x over those records, unclipped.
        epochs, lr, batch: config keys local-epochs (>= 1), local-lr (> 0), local-batch (>= 1).
        rng: the node's shuffling generator.

    Returns: (d,) float64 on flat0's device, unclipped. Raises ValueError for epochs < 1, lr <= 0 or batch < 1.
    """
    if epochs < 1 or not lr > 0 or batch < 1:
        raise ValueError(f"local steps: epochs {epochs} (allowed >= 1), lr {lr} (allowed > 0), batch {batch} "
                         "(allowed >= 1)")
    x0 = flat0.to(torch.float64)
    x = x0.clone()
    for _ in range(epochs):
        order = rng.permutation(num_records)
        for start in range(0, num_records, batch):
            rows = order[start:start + batch]
            x = x - (lr / len(rows)) * grad_sum(x, rows)
    return x0 - x
