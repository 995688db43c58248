"""Using a finished run's model on data (``dpdro predict`` and ``dpdro evaluate``, ``dpdro.predict`` and
``dpdro.evaluate``): predictions as CSV, and accuracy, per-class and worst-class (or worst-group) accuracy with a
confusion matrix.

Which data (``data``):
- 'test', 'train' or 'validation': the split of the run's own configuration (its data set, data-root and
  max-*-records): 'test' is exactly the split the run evaluated on, so the accuracy it gives is the run's reported
  one;
- records of your own to score, labelled or not, for a data set that declares how to read them
  (``DatasetSpec.own_records``): for a dataset=csv run one CSV file, every row of it, read with the run's columns
  and public bounds, the label column optional; for a dataset=image-folder run one image, a folder of images
  (unlabelled) or a folder of class sub-folders (labelled, every image), converted as in training;
- any other path: a data root in the layout of the run's data set (a folder holding train/ test/ or train.csv
  test.csv, or a built-in data set's folder), which replaces the run's data-root; its test split is read;
- an ``ArrayDataset`` (Python: ``dpdro.records(x, y, K)``), e.g. for a run of ``dpdro.fit(data=...)``.
``overrides`` are further data keys (role 'data' of the configuration schema, e.g. max-test-records=0).
Unlabelled records can be predicted, not evaluated.

What it costs in privacy (``privacy_statement``, recorded in ``Predictions.privacy`` and ``metrics``): on the
public test split, a data root's test split or records of your own, post-processing of the released model (no
privacy cost to the training records); on 'train' or 'validation', the run's private training records themselves,
"not private (reads private records)": the figures and predictions are exact functions of private records, outside
the run's epsilon. The CLI writes nothing derived from them into the run directory unless given ``--out``.
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..common.atomic import atomic_write_bytes
from ..common.config import AUTO, Config, ConfigError, keys_with_role
from ..common.data import DATASETS, ArrayDataset, DataError, load_from_config
from ..common.scattering import compute_features
from .engine import load_run_config
from .evaluate import group_metrics, per_class_accuracy
from .model_files import ModelSpec, load_model, predict_classes, predict_logits
from .run_report import confusion_matrix, plot_confusion
from .rundir import RunDir, read_json

SPLITS = {"test": "test", "train": "train", "validation": "val"}
# The splits made of the run's private training records ('validation' is held out of them, or, for a data set with
# its own validation split, held beside them): reading them is not private.
PRIVATE_SPLITS = ("train", "validation")
NOT_PRIVATE = "not private (reads private records)"
POST_PROCESSING = "post-processing of the released model: no privacy cost"


@dataclass(frozen=True)
class Records:
    """Model inputs x (N, *input shape) float32; labels (N,) int64 or None (unlabelled); groups (N,) int64 or
    None and their number; sources: where each record came from (a file's line, an image's path) or None."""

    x: torch.Tensor
    labels: np.ndarray | None
    groups: np.ndarray | None = None
    num_groups: int = 0
    sources: list[str] | None = None


@dataclass(frozen=True)
class Predictions:
    """Predicted classes (N,) int64, labels (N,) int64 or None (unlabelled records), the adjusted logits'
    softmax (N, K) float64, group labels (N,) or None, the source of each record (or None), and the ModelSpec."""

    predicted: np.ndarray
    labels: np.ndarray | None
    scores: np.ndarray
    groups: np.ndarray | None
    num_groups: int
    spec: ModelSpec
    sources: list[str] | None = None
    privacy: str = POST_PROCESSING  # privacy_statement of the records: NOT_PRIVATE for the private splits


def reads_private_records(data) -> bool:
    """Whether ``data`` (a ``predict`` argument) names a split of the run's private training records
    (PRIVATE_SPLITS: 'train' or 'validation')."""
    return not isinstance(data, ArrayDataset) and str(data) in PRIVATE_SPLITS


def privacy_statement(data) -> str:
    """What predicting on ``data`` costs in privacy: NOT_PRIVATE for a private split, else POST_PROCESSING."""
    return NOT_PRIVATE if reads_private_records(data) else POST_PROCESSING


def data_label(data) -> str:
    """A short file-name-safe label of a ``data`` argument: the split name, or the path's stem."""
    if isinstance(data, ArrayDataset):
        return "records"
    return data if data in SPLITS else (Path(data).stem or "data")


def _run_config(run_dir: str | Path, overrides: dict | None) -> Config:
    overrides = dict(overrides or {})
    data_keys = set(keys_with_role("data"))
    for key in overrides:
        if key not in data_keys:
            raise ConfigError(f"--set {key}: only data keys may change for prediction; allowed: "
                              f"{', '.join(sorted(data_keys))}")
    cfg = load_run_config(str(run_dir))
    root = str(cfg.data_root)
    if "data-root" not in overrides and root and root != AUTO and not Path(root).is_absolute() \
            and not Path(root).exists():
        # a relative data-root was resolved from the folder the run was started in; from anywhere else (the
        # model card's commands run from the run folder) use the folder the run recorded as read (absolute)
        read = read_json(RunDir(str(run_dir)).config).get("data_read", "")
        if read and Path(read).is_dir():
            overrides["data-root"] = read
    return cfg.with_updates(overrides) if overrides else cfg


def load_data(run_dir: str | Path, data="test", overrides: dict | None = None, spec: ModelSpec | None = None,
              ) -> Records:
    """The records ``data`` names for the run in ``run_dir`` (module docstring). Raises ConfigError for an
    override that is not a data key or a bad value, or 'validation' for a run that held none out; DataError naming
    the file, line or folder when the files are missing or malformed."""
    if isinstance(data, ArrayDataset):  # records from Python get the run's front-end, as in dpdro.fit(data=...)
        x = compute_features(data.x, _run_config(run_dir, overrides).features, None)
        return _records(data, x)
    if not isinstance(data, (str, Path)):
        raise ValueError(f"data must be 'test', 'train', 'validation', a path or dpdro.records(...); got "
                         f"{type(data).__name__}")
    cfg = _run_config(run_dir, overrides)
    if str(data) == "validation" and not cfg.validation_fraction > 0 and not _own_validation(cfg.dataset):
        raise ConfigError(f"--data validation: the run held out no validation split (its validation-fraction is "
                          f"{cfg.validation_fraction:g} and {cfg.dataset} has none of its own); allowed: 'test', "
                          "'train', or a run trained with validation-fraction > 0")
    if str(data) in SPLITS:
        return _records(load_from_config(cfg, SPLITS[str(data)]))
    path = Path(data).expanduser()
    own = DATASETS.get_entry(cfg.dataset).own_records  # how the data set reads records of your own, if it does
    if not path.exists():
        raise DataError(f"--data {data}: {path} not found; expected 'test', 'train', 'validation'"
                        + (f", {own.description}" if own is not None else "")
                        + f" or a data root of data set {cfg.dataset!r}")
    if own is None or own.is_data_root(path):
        return _records(load_from_config(cfg.with_updates({"data-root": str(path)}), "test"))
    spec = spec or _spec(run_dir)
    read = own.read(path, cfg.to_dict(), spec.classes, spec.raw)
    return Records(compute_features(read.x, cfg.features, None), read.labels, read.groups, read.num_groups,
                   read.sources)


def _records(ds: ArrayDataset, x: torch.Tensor | None = None) -> Records:
    """The records of ``ds`` (with inputs ``x`` instead of its own when given)."""
    return Records(ds.x if x is None else x, ds.y.numpy(), None if ds.groups is None else ds.groups.numpy(),
                   ds.num_groups)


def _own_validation(dataset: str) -> bool:
    """Whether data set ``dataset`` has a validation split of its own (CelebA)."""
    return dataset in DATASETS and DATASETS[dataset].own_validation


def _spec(run_dir):
    from .model_files import read_model_spec

    return read_model_spec(run_dir)


def predict(run_dir: str | Path, data="test", overrides: dict | None = None, *,
            module: nn.Module | None = None, posthoc_tau: float | None = None) -> Predictions:
    """Predictions of the run's model (model.pt built from model.json, or loaded into ``module``: needed for a
    run of ``dpdro.fit`` with a module object) on ``data`` (module docstring), with the run's post-hoc logit
    adjustment, or with ``posthoc_tau`` instead: argmax(logits - posthoc_tau log pi) with the priors pi the run
    released (and charged; applying a tau is post-processing, Menon et al. 2021, eq. 8). For the run's own
    splits the same batches as its evaluation, hence the same predictions. ``privacy`` of the result: NOT_PRIVATE
    on 'train' or 'validation' (module docstring). Raises ConfigError (also for a
    ``posthoc_tau`` that is negative, or non-zero for a run that released no priors), DataError (naming the file,
    line or folder), RunFileError (missing model files)."""
    model, spec = load_model(run_dir, module=module)
    if posthoc_tau is not None:
        spec = with_posthoc_tau(spec, posthoc_tau)
    records, logits = _logits(model, spec, run_dir, data, overrides)
    return _predictions(logits, records, spec, privacy_statement(data))


def predict_posthoc_taus(run_dir: str | Path, data, taus: list[float], overrides: dict | None = None, *,
                         module: nn.Module | None = None) -> list[Predictions]:
    """``predict`` at each post-hoc tau of ``taus`` (same order), the model run once over ``data``: the cheap way
    to choose tau on the validation split. Applying a tau is post-processing of the released model and priors;
    choosing it on the validation split reads private training records and is not accounted (each result's
    ``privacy`` says so; config key chosen-on-private-data lets a run of the choice list it). Raises as
    ``predict``, before the model runs, for any tau it would refuse."""
    model, spec = load_model(run_dir, module=module)
    specs = [with_posthoc_tau(spec, float(tau)) for tau in taus]
    records, logits = _logits(model, spec, run_dir, data, overrides)
    return [_predictions(logits, records, s, privacy_statement(data)) for s in specs]


def _logits(model: nn.Module, spec: ModelSpec, run_dir, data, overrides) -> tuple[Records, torch.Tensor]:
    """The records ``data`` names and the model's raw logits (N, K) on them; DataError for a wrong input shape."""
    records = load_data(run_dir, data, overrides, spec)
    if list(records.x.shape[1:]) != spec.input_shape:
        raise DataError(f"data {data_label(data)!r}: records of shape {tuple(records.x.shape[1:])}, the model "
                        f"takes {tuple(spec.input_shape)}")
    return records, predict_logits(model, records.x, spec.torch_dtype)


def _predictions(logits: torch.Tensor, records: Records, spec: ModelSpec, privacy: str) -> Predictions:
    """Predictions from raw logits with ``spec``'s post-hoc adjustment; ``privacy``: the records'
    ``privacy_statement``."""
    shift = spec.prediction_shift
    adjusted = logits if shift is None else logits + torch.as_tensor(shift).to(logits.dtype)
    return Predictions(predict_classes(logits, shift), records.labels,
                       torch.softmax(adjusted.double(), 1).numpy(), records.groups, records.num_groups, spec,
                       records.sources, privacy)


def with_posthoc_tau(spec: ModelSpec, tau: float) -> ModelSpec:
    """``spec`` predicting with post-hoc tau ``tau`` >= 0 (a public choice) on the run's released priors. Raises
    ConfigError for a negative tau, or a positive one when the run released no priors (its logit-adjust-tau and
    posthoc-tau were 0: a histogram release would have to be charged first)."""
    import dataclasses

    if not tau >= 0:
        raise ConfigError(f"--posthoc-tau: got {tau}; allowed: >= 0")
    if tau > 0 and spec.priors is None:
        raise ConfigError(f"--posthoc-tau: got {tau}, but this run released no class priors (its logit-adjust-tau "
                          "and posthoc-tau were 0); allowed: 0, or train with posthoc-tau > 0 so the priors are "
                          "released and charged")
    return dataclasses.replace(spec, posthoc_tau=float(tau))


def accuracy(p: Predictions) -> float | None:
    """Fraction of correct predictions, or None for unlabelled records."""
    return None if p.labels is None else float((p.predicted == p.labels).mean())


def write_predictions_csv(p: Predictions, path: Path) -> None:
    """Atomically write one row per record: index, source (file line or image path, for records read from your
    own files), label (class index; only for labelled records), predicted (class index), predicted_class (name)
    and score_<class> (softmax of the adjusted logits, whose argmax is the prediction); for private records
    (``p.privacy`` NOT_PRIVATE) a last column privacy holding that statement on every row."""
    private = p.privacy == NOT_PRIVATE
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["index"] + (["source"] if p.sources else []) + (["label"] if p.labels is not None else [])
               + ["predicted", "predicted_class"] + [f"score_{c}" for c in p.spec.classes]
               + (["privacy"] if private else []))
    for i in range(len(p.predicted)):
        w.writerow([i] + ([p.sources[i]] if p.sources else [])
                   + ([int(p.labels[i])] if p.labels is not None else [])
                   + [int(p.predicted[i]), p.spec.classes[p.predicted[i]]] + [f"{s:.6g}" for s in p.scores[i]]
                   + ([p.privacy] if private else []))
    atomic_write_bytes(Path(path), buf.getvalue().encode())


def metrics(p: Predictions) -> dict:
    """accuracy, per_class_accuracy (NaN for an absent class), worst_class_accuracy, worst_class (index),
    confusion (K, K) counts, records, privacy (``p.privacy``: NOT_PRIVATE for the private splits); with groups
    also ``evaluate.group_metrics``: per_group_accuracy, worst_group_accuracy, per_group_records and
    worst_group_records."""
    if p.labels is None:
        raise DataError("evaluation needs labels and these records have none (a CSV file without the label "
                        "column, config key csv-label, or a folder of images without class sub-folders): use "
                        "predict, or give labelled records")
    k = p.spec.num_classes
    per_class = per_class_accuracy(p.predicted, p.labels, k)
    out = {"records": int(len(p.labels)), "accuracy": float((p.predicted == p.labels).mean()),
           "per_class_accuracy": per_class, "worst_class_accuracy": float(np.nanmin(per_class)),
           "worst_class": int(np.nanargmin(per_class)), "confusion": confusion_matrix(p.labels, p.predicted, k),
           "privacy": p.privacy}
    if p.groups is not None:
        out |= group_metrics(p.predicted == p.labels, p.groups, p.num_groups)
    return out


def write_confusion_png(p: Predictions, m: dict, path: Path, data: str) -> None:
    """The confusion matrix of ``metrics`` ``m`` as a PNG at ``path`` (its title says NOT_PRIVATE for private
    records)."""
    note = f"; {NOT_PRIVATE}" if p.privacy == NOT_PRIVATE else ""
    plot_confusion(m["confusion"], p.spec.classes, Path(path),
                   f"confusion matrix, data {data} ({m['records']} records, accuracy {m['accuracy']:.4f}{note})")


def evaluate(run_dir: str | Path, data="test", overrides: dict | None = None, *,
             module: nn.Module | None = None) -> dict:
    """``metrics`` of the run's model on ``data`` (as ``predict``; labelled records only): accuracy, per-class
    and worst-class accuracy, the confusion matrix, with groups the worst-group accuracy, and privacy (NOT_PRIVATE
    on 'train' or 'validation'). Writes nothing."""
    return metrics(predict(run_dir, data, overrides, module=module))
