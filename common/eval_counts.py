"""Evaluation on the nodes, the node's side: per-class correct and total counts of a model on the node's own
held-out records (config key eval-data=nodes; the server's side, which noises and releases their sum, is
server/node_evaluation.py).

A node's reply to an evaluation query (``Query.quantity == EVAL_QUANTITY``) is the (2K,) float64 vector
``[correct_0 .. correct_{K-1}, total_0 .. total_{K-1}]`` summed over its held-out records: each record contributes
e_y (its class's total) and, when the model's argmax (with the public prediction shift added to the logits) is its
label, e_y once more in the correct half. One record's vector therefore has L2 norm 1 (wrong) or sqrt(2) (right):
the query's clip is ``EVAL_SENSITIVITY`` = sqrt(2) and no record is ever scaled down by it (the vector is exact
small integers, so the float64 sum is exact too).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .partition import is_node_local

EVAL_QUANTITY = "eval-counts"  # Query.quantity and Query.mechanism of a node evaluation
EVAL_SENSITIVITY = math.sqrt(2.0)  # L2 norm bound of one record's (2K,) count vector (module docstring)


def evaluates_on_nodes(cfg) -> bool:
    """Whether a run of ``cfg`` evaluates on the nodes: config key eval-data 'nodes', or 'auto' with
    partition=node-local (deployment: the sites' records are not the server's, so the server has no test records
    of their population) or with checkpoint-select=private-best (the selection reads charged noisy counts of the
    clients' validation records, server/checkpoint_selection.py). 'auto' is 'server' otherwise (simulations,
    single-node runs: today's evaluation on the server's public test split)."""
    return cfg.eval_data == "nodes" or (cfg.eval_data == "auto" and (
        is_node_local(cfg.partition) or cfg.checkpoint_select == "private-best"))


def count_vector(pred: np.ndarray, labels: np.ndarray, num_classes: int) -> np.ndarray:
    """(2K,) float64 [per-class correct, per-class total] of predictions ``pred`` (N,) int against ``labels`` (N,)
    int in [0, K). ValueError for a label outside [0, K)."""
    labels = np.asarray(labels, dtype=np.int64)
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        raise ValueError(f"labels must lie in [0, {num_classes}), got range [{labels.min()}, {labels.max()}]")
    correct = np.bincount(labels[np.asarray(pred) == labels], minlength=num_classes)
    total = np.bincount(labels, minlength=num_classes)
    return np.concatenate([correct, total]).astype(np.float64)


def node_counts(model, flat: torch.Tensor, x: torch.Tensor, y: torch.Tensor, num_classes: int,
                shift: tuple[float, ...] = (), batch: int = 2048) -> np.ndarray:
    """The (2K,) count vector (``count_vector``) of parameters ``flat`` (d,) of ``model`` (a FlatModel) on records
    x (N, ...), y (N,); ``shift`` (K,) or empty, the public post-hoc logit shift added before the argmax
    (server/model_export.prediction_shift). N = 0 gives zeros."""
    preds = []
    with torch.no_grad():
        s = torch.as_tensor(shift, dtype=x.dtype, device=x.device) if shift else None
        for start in range(0, int(y.shape[0]), batch):
            logits = model.logits(flat, x[start:start + batch])
            preds.append((logits if s is None else logits + s).argmax(1).cpu())
    pred = torch.cat(preds).numpy() if preds else np.zeros(0, np.int64)
    return count_vector(pred, y.cpu().numpy(), num_classes)
