"""Using a finished run's model on data (``dpdro predict`` and ``dpdro evaluate``): predictions as CSV, and
accuracy, per-class and worst-class (or worst-group) accuracy with a confusion matrix.

Which data: ``data`` is 'test', 'train' or 'validation', the split of the run's own configuration (its data
set, data-root and max-*-records: 'test' is exactly the split the run evaluated on, so the accuracy it gives is
the run's reported one), or a path, which replaces the run's data-root (a folder or file in the layout of the
run's data set) and reads its test split. ``overrides`` are further data keys (role 'data' of the
configuration schema, e.g. max-test-records=0 for the whole test split).
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..common.config import ConfigError, keys_with_role
from ..common.data import ArrayDataset, load_from_config
from .engine import load_run_config
from .evaluate import per_class_accuracy, per_group_accuracy
from .model_files import ModelSpec, load_model, predict_classes, predict_logits
from .run_report import confusion_matrix, plot_confusion
from .rundir import atomic_write_bytes

SPLITS = {"test": "test", "train": "train", "validation": "val"}


@dataclass(frozen=True)
class Predictions:
    """Predicted classes (N,) int64, labels (N,) int64, the adjusted logits' softmax (N, K) float64, group
    labels (N,) or None, and the ModelSpec and data set they came from."""

    predicted: np.ndarray
    labels: np.ndarray
    scores: np.ndarray
    groups: np.ndarray | None
    num_groups: int
    spec: ModelSpec
    data: ArrayDataset


def data_label(data: str) -> str:
    """A short file-name-safe label of a ``data`` argument: the split name, or the path's stem."""
    return data if data in SPLITS else (Path(data).stem or "data")


def load_data(run_dir: str | Path, data: str = "test", overrides: dict | None = None) -> ArrayDataset:
    """The records ``data`` names for the run in ``run_dir`` (module docstring). Raises ConfigError for an
    override that is not a data key or a bad value, DataError when the files are missing or malformed."""
    overrides = dict(overrides or {})
    data_keys = set(keys_with_role("data"))
    for key in overrides:
        if key not in data_keys:
            raise ConfigError(f"--set {key}: only data keys may change for prediction; allowed: "
                              f"{', '.join(sorted(data_keys))}")
    if data not in SPLITS:
        overrides["data-root"] = str(Path(data).expanduser())
    cfg = load_run_config(str(run_dir)).with_updates(overrides) if overrides else load_run_config(str(run_dir))
    return load_from_config(cfg, SPLITS.get(data, "test"))


def predict(run_dir: str | Path, data: str = "test", overrides: dict | None = None) -> Predictions:
    """Predictions of the run's model (model.pt built from model.json) on ``data``, with the run's post-hoc
    logit adjustment; the same batches as the run's evaluation, hence the same predictions."""
    module, spec = load_model(run_dir)
    ds = load_data(run_dir, data, overrides)
    if list(ds.x.shape[1:]) != spec.input_shape:
        raise ConfigError(f"data {data!r}: records of shape {tuple(ds.x.shape[1:])}, the model takes "
                          f"{tuple(spec.input_shape)}")
    logits = predict_logits(module, ds.x, spec.torch_dtype)
    shift = spec.prediction_shift
    adjusted = logits if shift is None else logits + torch.as_tensor(shift).to(logits.dtype)
    return Predictions(predict_classes(logits, shift), ds.y.numpy(), torch.softmax(adjusted.double(), 1).numpy(),
                       None if ds.groups is None else ds.groups.numpy(), ds.num_groups, spec, ds)


def write_predictions_csv(p: Predictions, path: Path) -> None:
    """Atomically write one row per record: index, label, predicted (class index), predicted_class (name) and
    score_<class> (softmax of the adjusted logits, whose argmax is the prediction)."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["index", "label", "predicted", "predicted_class"] + [f"score_{c}" for c in p.spec.classes])
    for i in range(len(p.predicted)):
        w.writerow([i, int(p.labels[i]), int(p.predicted[i]), p.spec.classes[p.predicted[i]]]
                   + [f"{s:.6g}" for s in p.scores[i]])
    atomic_write_bytes(Path(path), buf.getvalue().encode())


def metrics(p: Predictions) -> dict:
    """accuracy, per_class_accuracy (NaN for an absent class), worst_class_accuracy, worst_class (index),
    confusion (K, K) counts, records; with groups also per_group_accuracy and worst_group_accuracy."""
    k = p.spec.num_classes
    per_class = per_class_accuracy(p.predicted, p.labels, k)
    out = {"records": int(len(p.labels)), "accuracy": float((p.predicted == p.labels).mean()),
           "per_class_accuracy": per_class, "worst_class_accuracy": float(np.nanmin(per_class)),
           "worst_class": int(np.nanargmin(per_class)), "confusion": confusion_matrix(p.labels, p.predicted, k)}
    if p.groups is not None:
        per_group = per_group_accuracy(p.predicted == p.labels, p.groups, p.num_groups)
        out |= {"per_group_accuracy": per_group, "worst_group_accuracy": float(np.nanmin(per_group))}
    return out


def write_confusion_png(p: Predictions, m: dict, path: Path, data: str) -> None:
    """The confusion matrix of ``metrics`` ``m`` as a PNG at ``path``."""
    plot_confusion(m["confusion"], p.spec.classes, Path(path),
                   f"confusion matrix, data {data} ({m['records']} records, accuracy {m['accuracy']:.4f})")
