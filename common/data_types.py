"""What every data-set loader shares: the error it raises, the split it returns, the seeded stratified split, and
the class list of user data (``common.data`` registers the loaders; ``common.tabular_data`` and
``common.image_folder`` read user files). Kept apart from ``common.data`` so that those readers need not import
it (it imports them to register them)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from .errors import DpdroError

if TYPE_CHECKING:  # imported where tensors are built: config validation must not load torch
    import torch

# Test split of user data without a declared test file or folder: this fraction of every class (seeded by
# split-seed), as the CelebA subset's split (docs/explanation/ALGORITHMS.md 6.2).
USER_TEST_FRACTION = 0.2


class DataError(FileNotFoundError, DpdroError):
    """Data could not be found or read; the message says where it looked and how to fix it."""


class LoadedSplit(NamedTuple):
    """What a ``DatasetSpec.load`` returns (a plain 3-tuple (x, y, groups) is read as one).

    x: uint8 images (N, H, W) or (N, C, H, W), mapped by the fixed x / 255 * 2 - 1; or float32 records (N, ...)
    already scaled by public constants (used as they are). y: int64 (N,) in [0, num_classes). groups: int64 (N,)
    in [0, num_groups) or None. num_classes / num_groups: 0 means the ``DatasetSpec``'s; user data sets, whose
    classes come from their files or the config key ``classes``, set them. class_names: the names of classes
    0 .. K-1 when the files give them (folder names, label values; public, as the number of classes), else ().
    skipped_files: files of the data set's folders that were not read as records (user image folders: files that
    are not images, or hidden), counted over all its splits; 0 for the others.
    """

    x: torch.Tensor
    y: torch.Tensor
    groups: torch.Tensor | None = None
    num_classes: int = 0
    num_groups: int = 0
    class_names: tuple[str, ...] = ()
    skipped_files: int = 0


class RecordsRead(NamedTuple):
    """Records of the user's own file or folder read to be scored by a trained model (``OwnRecords.read``).

    x: float32 (N, ...) model inputs scaled exactly as in training (before the feature front-end, config key
    features, which the caller applies). labels: int64 (N,) indices into the model's classes, or None
    (unlabelled). groups: int64 (N,) in [0, num_groups) or None. sources: where each record came from (a file's
    line, an image's path relative to the folder given), one string per record.
    """

    x: torch.Tensor
    labels: np.ndarray | None
    groups: np.ndarray | None
    num_groups: int
    sources: list[str]


@dataclass(frozen=True)
class OwnRecords:
    """How ``dpdro predict`` / ``dpdro evaluate`` read records of the user's own for a run of one data set
    (``DatasetSpec.own_records``; server/prediction.py), beside the run's splits and a data root.

    description: what such a path may be, in words (help text and the error for a path not found).
    is_data_root(path) -> bool: whether an existing ``path`` is a data root of the data set (its test split is
    read, as in training) rather than records to score.
    read(path, options, classes, model) -> RecordsRead: ``options``: the run's configuration keys (kebab-case);
    ``classes``: the model's class names in label order; ``model``: model.json's contents (e.g.
    ``feature_names``). Raises DataError naming the file, line or folder it cannot use.
    """

    description: str
    is_data_root: Callable[[Path], bool]
    read: Callable[[Path, Mapping[str, Any], list[str], Mapping[str, Any]], RecordsRead]


def stratified_split(groups: np.ndarray, fractions: tuple[float, ...], seed: int) -> list[np.ndarray]:
    """Split indices so that every group is cut by ``fractions`` (rounded, the last part takes the rest),
    after a seeded shuffle within each group. Returns one sorted int64 index array per fraction."""
    from .rng import derived_rng

    rng = derived_rng(seed, "stratified-split")
    parts: list[list[np.ndarray]] = [[] for _ in fractions]
    for g in np.unique(groups):
        idx = rng.permutation(np.flatnonzero(groups == g))
        cuts = np.round(np.cumsum(fractions)[:-1] * len(idx)).astype(np.int64)
        for i, piece in enumerate(np.split(idx, cuts)):
            parts[i].append(piece)
    return [np.sort(np.concatenate(p)).astype(np.int64) for p in parts]


def user_test_split(labels: np.ndarray, split: str, seed: int) -> np.ndarray:
    """Positions of ``split`` ('train' or 'test') when user data has no declared test file or folder: a
    stratified split by class of ``USER_TEST_FRACTION`` to test, seeded by ``seed`` (config key split-seed)."""
    train, test = stratified_split(np.asarray(labels), (1.0 - USER_TEST_FRACTION, USER_TEST_FRACTION), seed)
    return train if split == "train" else test


def declared_classes(text: str) -> list[str]:
    """Config key ``classes``: comma-separated class names in label order ([] when empty: derived from the
    training split). Raises ValueError for an empty or repeated name."""
    if not text.strip():
        return []
    names = [c.strip() for c in text.split(",")]
    if any(not c for c in names) or len(set(names)) != len(names):
        raise ValueError(f"config key 'classes': got {text!r}; allowed: comma-separated distinct non-empty class "
                         "names, in label order (or '' to take them from the training split)")
    return names


def natural_order(values) -> list[str]:
    """Distinct strings sorted as numbers when every one is an integer ('2' < '10'), else as text."""
    distinct = set(values)
    try:
        return sorted(distinct, key=int)
    except ValueError:
        return sorted(distinct)
