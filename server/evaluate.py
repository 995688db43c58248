"""The run's evaluation: accuracy, per-class and worst-class accuracy, mean loss and the exact DRO objective F(x)
of the run's psi (docs/explanation/ALGORITHMS.md 1.2). On the public test split (eval-split=test) post-processing of the
released iterate, no privacy cost; on the validation split (eval-split=validation, held-out private training records)
not private, and the summary's not_accounted says so."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from ..common.data import ArrayDataset
from ..common.dro import dro_objective
from ..common.per_sample import FlatModel
from ..common.psi import make_psi


def per_class_accuracy(pred: np.ndarray, labels: np.ndarray, num_classes: int) -> list[float]:
    """Accuracy of each class (NaN for a class absent from ``labels``)."""
    out = []
    for k in range(num_classes):
        mask = labels == k
        out.append(float((pred[mask] == k).mean()) if mask.any() else float("nan"))
    return out


def per_group_accuracy(correct: np.ndarray, groups: np.ndarray, num_groups: int) -> list[float]:
    """Accuracy within each group (NaN for an empty group). correct: (N,) bool; groups: (N,) ints."""
    return [float(correct[groups == g].mean()) if np.any(groups == g) else float("nan") for g in range(num_groups)]


def group_metrics(correct: np.ndarray, groups: np.ndarray, num_groups: int) -> dict:
    """Group figures from ``correct`` (N,) bool and ``groups`` (N,) ints in [0, num_groups): per_group_accuracy
    (list, NaN for an empty group), worst_group_accuracy (the minimum), per_group_records (G ints: records per group)
    and worst_group_records (the records behind the worst group's accuracy, the fewest if groups tie), so that a
    worst-group figure resting on a handful of records says so (CelebA's blond men: about 8 per split)."""
    per_group = per_group_accuracy(correct, groups, num_groups)
    records = [int(np.sum(groups == g)) for g in range(num_groups)]
    worst = float(np.nanmin(per_group))
    tied = [records[g] for g in range(num_groups) if per_group[g] == worst]
    return {"per_group_accuracy": per_group, "worst_group_accuracy": worst, "per_group_records": records,
            "worst_group_records": min(tied)}


def worst_group_words(figures: dict, sep: str = ", ") -> str:
    """``sep`` + 'worst-group accuracy A (N records)' for a summary, metrics row or ``group_metrics`` dict with a
    worst group, '' without one (the record count is left out for summaries written before it was recorded)."""
    if "worst_group_accuracy" not in figures:
        return ""
    n = figures.get("worst_group_records")
    records = f" ({n} records)" if n is not None else ""
    return f"{sep}worst-group accuracy {figures['worst_group_accuracy']:.4f}{records}"


def node_of_records(data, labels: np.ndarray) -> np.ndarray:
    """Each record's node (N,) int64 in [0, num-clients) under the partition of a Config's ``data`` section
    (common/partition.py: the same seeded split as the training records', applied to these labels). The server
    partitions its own evaluation split this way to report per-node accuracy (dro-groups=node): node j's part is
    what a node with node j's label mix would hold out, which is how the Flower nodes split their held-out records
    (eval-data=nodes). ConfigError for partition='node-local' (nothing is partitioned centrally)."""
    from ..common.partition import make_partition  # late: not every evaluation needs it

    out = np.full(len(labels), -1, dtype=np.int64)
    for node, idx in enumerate(make_partition(data, np.asarray(labels))):
        out[idx] = node
    return out


def node_metrics(correct: np.ndarray, node_of: np.ndarray, num_nodes: int, num_sites: int = 0) -> dict:
    """Per-node accuracy figures from ``correct`` (N,) bool and ``node_of`` (N,) ints in [0, num_nodes):
    per_node_accuracy (list, NaN for a node with no record), worst_node_accuracy (the minimum) and
    node_accuracy_spread (maximum minus minimum over the nodes with records); with ``num_sites`` > 0 also
    per_site_accuracy and worst_site_accuracy over the nodes' sites (``common.partition.site_of``)."""
    per_node = per_group_accuracy(correct, node_of, num_nodes)
    worst, best = float(np.nanmin(per_node)), float(np.nanmax(per_node))
    out = {"per_node_accuracy": per_node, "worst_node_accuracy": worst, "node_accuracy_spread": best - worst}
    if num_sites > 0:
        from ..common.partition import site_of  # late, as in node_of_records

        per_site = per_group_accuracy(correct, site_of(node_of, num_nodes, num_sites), num_sites)
        out |= {"per_site_accuracy": per_site, "worst_site_accuracy": float(np.nanmin(per_site))}
    return out


def evaluate(model: FlatModel, flat: np.ndarray, test: ArrayDataset, objective,
             prediction_shift: np.ndarray | None = None, batch: int = 2048,
             node_of: np.ndarray | None = None, num_nodes: int = 0, num_sites: int = 0) -> dict:
    """Metrics of parameters ``flat`` (d,) on ``test``: test_accuracy, worst_class_accuracy,
    per_class_accuracy (list), eval_loss (mean cross-entropy), eval_dro_objective (F on test losses), and
    'losses': the per-record test losses (n_test,) float64 for algorithm-specific objectives, and
    eval_class_correct / eval_class_total (K ints each: correct predictions and records per class; the noisy
    score of a private search releases them, server/private_tuning.py). With group
    labels (CelebA) also ``group_metrics``: per_group_accuracy, worst_group_accuracy (the minimum over groups),
    per_group_records and worst_group_records. ``objective``: what
    holds the DRO objective's keys psi, cvar_alpha and lambda_ (a Config's ``training`` section).

    ``prediction_shift`` (K,), when given, is added to the logits before the argmax (post-hoc logit
    adjustment, -tau log pi: Menon et al. 2021, eq. (8)); losses stay those of the unshifted logits.

    ``node_of`` (N,) int64, each test record's node in [0, num_nodes) (``node_of_records``), adds ``node_metrics``:
    per_node_accuracy, worst_node_accuracy, node_accuracy_spread (and with ``num_sites`` the sites' figures)."""
    shift = None if prediction_shift is None else torch.as_tensor(prediction_shift).to(model.dtype)
    p = torch.as_tensor(flat).to(model.dtype)
    losses, preds = [], []
    with torch.no_grad():
        for s in range(0, len(test), batch):
            logits = model.logits(p, test.x[s:s + batch].to(model.dtype))
            losses.append(F.cross_entropy(logits, test.y[s:s + batch], reduction="none").double())
            preds.append((logits if shift is None else logits + shift).argmax(1))
    loss = torch.cat(losses).numpy()
    pred = torch.cat(preds).numpy()
    labels = test.y.numpy()
    per_class = per_class_accuracy(pred, labels, test.num_classes)
    dro, _ = dro_objective(loss, make_psi(objective.psi, objective.cvar_alpha), objective.lambda_)
    extra = {}
    if test.groups is not None:
        extra = group_metrics(pred == labels, test.groups.numpy(), test.num_groups)
    if node_of is not None:
        extra |= node_metrics(pred == labels, node_of, num_nodes, num_sites)
    return {**extra, "test_accuracy": float((pred == labels).mean()),
            "worst_class_accuracy": float(np.nanmin(per_class)),
            "per_class_accuracy": per_class, "eval_loss": float(loss.mean()), "eval_dro_objective": dro,
            "eval_class_correct": [int(((pred == k) & (labels == k)).sum()) for k in range(test.num_classes)],
            "eval_class_total": [int((labels == k).sum()) for k in range(test.num_classes)], "losses": loss}
