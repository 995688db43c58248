"""``dataset=csv``: tabular records from CSV files (registered in ``common.data``).

Layout (``data-root``): a folder holding ``train.csv`` and, optionally, ``test.csv``; or one ``.csv`` file. Without
a test file, ``USER_TEST_FRACTION`` of every class of the training file (seeded by split-seed) is the test split.
The first line names the columns; every record needs a label and, with csv-group, a group (an empty cell is a
DataError naming the file, the line and the column), and a file with a header only is an error. Config keys:
``csv-label`` (label column), ``csv-features`` (feature columns; '' = every other column), ``csv-group`` (optional
group column, for worst-group accuracy), ``classes`` (class names in label order; '' = the distinct labels of the
training file, sorted), ``csv-bounds`` (the public range of every feature).

Privacy: features are scaled by the declared public bounds only, x' = 2 (clip(x, lo, hi) - lo) / (hi - lo) - 1
in [-1, 1]; no statistic of the records (mean, min, max) is computed, as it would be an unaccounted release.
The class list, the group names and the number of records are treated as public, as for the built-in data sets.
"""

from __future__ import annotations

import csv
import functools
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from .data_types import (
    DataError,
    LoadedSplit,
    OwnRecords,
    RecordsRead,
    declared_classes,
    natural_order,
    user_test_split,
)

KEYS = ("classes", "csv-label", "csv-features", "csv-group", "csv-bounds")


def parse_bounds(text: str) -> tuple[tuple[float, float] | None, dict[str, tuple[float, float]]]:
    """Config key ``csv-bounds``: 'lo:hi' for every feature, 'name=lo:hi,...' per feature, or both ('0:1,age=0:120':
    the first for the features not named). Returns (default or None, {name: (lo, hi)}). Raises ValueError naming
    the key for an empty value, bad syntax or lo >= hi."""
    allowed = ("allowed: the public range of every feature, 'lo:hi' for all, 'name=lo:hi,...' per column, or "
               "both ('0:1,age=0:120'); declared, never computed from the records")
    if not text.strip():
        raise ValueError(f"config key 'csv-bounds': required for dataset=csv; {allowed}")
    default, named = None, {}
    for item in text.split(","):
        name, _, rng = item.rpartition("=")
        try:
            lo, hi = (float(v) for v in rng.split(":"))
        except ValueError:
            raise ValueError(f"config key 'csv-bounds': got {text!r} (item {item.strip()!r}); {allowed}") from None
        if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
            raise ValueError(f"config key 'csv-bounds': got {item.strip()!r}; allowed: finite lo < hi")
        if name.strip():
            named[name.strip()] = (lo, hi)
        elif default is None:
            default = (lo, hi)
        else:
            raise ValueError(f"config key 'csv-bounds': got {text!r}: two ranges without a column name; {allowed}")
    return default, named


def check_options(options: Mapping[str, Any]) -> None:
    """The syntax of the csv keys (before any file is read); ValueError naming the key."""
    parse_bounds(options["csv-bounds"])
    declared_classes(options["classes"])
    if not options["csv-label"].strip():
        raise ValueError("config key 'csv-label': got ''; allowed: the name of the label column")


@functools.lru_cache(maxsize=4)
def _read_table(path: str, mtime_ns: int, size: int) -> tuple[list[str], list[list[str]]]:
    """(header, rows) of a CSV file (cached per path, modification time and size)."""
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:
            rows = list(csv.reader(f))
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise DataError(f"cannot read {path} ({type(e).__name__}: {e}): expected a UTF-8 CSV file") from None
    if not rows:
        raise DataError(f"{path} is empty: expected a header line naming the columns, then one record a line")
    return [c.strip() for c in rows[0]], rows[1:]


def read_table(path: Path) -> tuple[list[str], list[list[str]]]:
    """(header, rows as lists of strings) of the CSV file ``path``; DataError if it is missing or unreadable."""
    if not path.is_file():
        raise DataError(f"{path} not found: dataset=csv expects data-root to be a .csv file or a folder holding "
                        "train.csv (and optionally test.csv)")
    st = path.stat()
    return _read_table(str(path), st.st_mtime_ns, st.st_size)


def files(data_root: Path) -> tuple[Path, Path | None]:
    """(training file, test file or None) of a data root (see the module docstring)."""
    if data_root.suffix.lower() == ".csv":
        return data_root, None
    test = data_root / "test.csv"
    return data_root / "train.csv", test if test.is_file() else None


def fingerprint(data_root: Path) -> str:
    """Digest of the CSV files' paths, sizes and modification times ('' parts for missing files)."""
    import hashlib

    parts = [f"{p}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files(data_root) if p and p.is_file()]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:20]


def _column(header: list[str], name: str, path: Path, key: str) -> int:
    if name not in header:
        raise DataError(f"{path}: no column {name!r} (config key '{key}'); the header has: {', '.join(header)}")
    return header.index(name)


def _index(values: list[str], names: list[str], path: Path, rows: range, what: str, where: str) -> np.ndarray:
    """Each value's position in ``names``; DataError naming the first line whose value is not there."""
    pos = {n: i for i, n in enumerate(names)}
    out = np.empty(len(values), dtype=np.int64)
    for i, (v, line) in enumerate(zip(values, rows, strict=True)):
        if v not in pos:
            raise DataError(f"{path}, line {line}: {what} {v!r} is not one of the {where} ({', '.join(names)})")
        out[i] = pos[v]
    return out


def _short_row(path: Path, line: int, row: list[str], header: list[str]) -> DataError:
    return DataError(f"{path}, line {line}: {len(row)} cells; expected {len(header)} (one per column of the header)")


def _cells(path: Path, header: list[str], rows: list[list[str]], keep, col: int, what: str, key: str) -> list[str]:
    """The stripped cells of column ``col`` (the ``what`` column, config key ``key``) of the rows at positions
    ``keep`` (file line = position + 2, the header being line 1). Raises DataError naming the file, the line and the
    column for a row of the wrong length or an empty cell (a record without a label or group)."""
    out = []
    for i in keep:
        row, line = rows[i], int(i) + 2
        if len(row) != len(header):
            raise _short_row(path, line, row, header)
        value = row[col].strip()
        if not value:
            raise DataError(f"{path}, line {line}, column {header[col]!r}: empty {what} cell; every record needs a "
                            f"{what} (config key '{key}'): fill it in or remove the line")
        out.append(value)
    return out


def _records(path: Path, rows: list[list[str]], split: str = "") -> list[list[str]]:
    """``rows`` of the file ``path``; DataError naming the file (and ``split``, the split it holds) when it has a
    header only."""
    if not rows:
        empty = f" (the {split} split would be empty)" if split else ""
        raise DataError(f"{path} has a header but no records{empty}: expected one record a line after the header")
    return rows


def feature_names(header: list[str], options: Mapping[str, Any], path: Path) -> list[str]:
    """The feature columns: config key csv-features, or every column of ``header`` but the label and group
    columns. DataError naming the file when there is none or a named one is missing."""
    label, group = options["csv-label"].strip(), options["csv-group"].strip()
    names = [c.strip() for c in options["csv-features"].split(",")] if options["csv-features"].strip() else \
        [c for c in header if c not in (label, group)]
    if not names:
        raise DataError(f"{path}: no feature column (the header has only {', '.join(header)})")
    for n in names:
        _column(header, n, path, "csv-features")
    return names


def scaled_features(path: Path, header: list[str], rows: list[list[str]], keep, names: list[str],
                    bounds: str) -> np.ndarray:
    """Float64 (len(keep), F) features of the rows at positions ``keep`` (file line = position + 2), columns
    ``names``, clipped to the declared public ``bounds`` (config key csv-bounds) and scaled to [-1, 1]. Raises
    DataError naming the file, the line and the column for a row of the wrong length or a non-numeric or
    non-finite cell, and the key for bounds that do not cover the features."""
    fi = [_column(header, n, path, "csv-features") for n in names]
    default, named = parse_bounds(bounds)
    unknown = sorted(set(named) - set(names))
    if unknown:
        raise DataError(f"config key 'csv-bounds' names {', '.join(unknown)}, which are not feature columns of "
                        f"{path} ({', '.join(names)})")
    x = np.empty((len(keep), len(names)), dtype=np.float64)
    for j, i in enumerate(keep):
        row, line = rows[i], int(i) + 2
        if len(row) != len(header):
            raise _short_row(path, line, row, header)
        for k, (c, n) in enumerate(zip(fi, names, strict=True)):
            try:
                v = float(row[c])
            except ValueError:
                raise DataError(f"{path}, line {line}, column {n!r}: {row[c]!r} is not a number; feature columns "
                                "must be numeric (encode categories as numbers first, or leave the column out: "
                                "csv-features, csv-group)") from None
            if not math.isfinite(v):
                raise DataError(f"{path}, line {line}, column {n!r}: {row[c]!r} is not a finite number")
            x[j, k] = v
    # after the cells: a text column's error (encode it, or leave it out) comes before asking for its range
    missing = [n for n in names if n not in named and default is None]
    if missing:
        raise DataError(f"config key 'csv-bounds': no range for feature column(s) {', '.join(missing)} of {path}; "
                        "add 'name=lo:hi' for each, or a range 'lo:hi' for all")
    lo = np.array([named.get(n, default)[0] for n in names])
    hi = np.array([named.get(n, default)[1] for n in names])
    return 2.0 * (np.clip(x, lo, hi) - lo) / (hi - lo) - 1.0


def load(split: str, data_root: Path, cache_dir: Path, download: bool, split_seed: int,
         options: Mapping[str, Any]) -> LoadedSplit:
    """The 'train' or 'test' split: features float32 (N, F) in [-1, 1], labels int64 (N,), groups int64 (N,) or
    None. Raises DataError naming the file (and the split) for a file with a header only, and naming the file, the
    line and the column for a missing column, a row of the wrong length, an empty label or group cell (of any
    training record, whichever split is asked for), a non-numeric or non-finite feature, a label (or group) of the
    test file the training file lacks (or outside ``classes``)."""
    import torch

    train_path, test_path = files(data_root)
    label, group = options["csv-label"].strip(), options["csv-group"].strip()
    train_header, train_rows = read_table(train_path)
    _records(train_path, train_rows, "train")
    li = _column(train_header, label, train_path, "csv-label")
    gi = _column(train_header, group, train_path, "csv-group") if group else None
    every = range(len(train_rows))
    train_labels = _cells(train_path, train_header, train_rows, every, li, "label", "csv-label")
    classes = declared_classes(options["classes"]) or natural_order(train_labels)
    class_source = "declared classes (config key 'classes')" if options["classes"].strip() else \
        f"classes of the training file {train_path.name}"
    groups_names = natural_order(_cells(train_path, train_header, train_rows, every, gi, "group", "csv-group")) \
        if gi is not None else []
    path, header, rows = (test_path, *read_table(test_path)) if split == "test" and test_path else \
        (train_path, train_header, train_rows)
    if test_path is None:
        keep = user_test_split(_index(train_labels, classes, train_path, range(2, len(train_rows) + 2), "label",
                                      class_source), split, split_seed)
    else:
        keep = np.arange(len(_records(path, rows, split)))
    li = _column(header, label, path, "csv-label")
    gi = _column(header, group, path, "csv-group") if group else None
    names = feature_names(header, options, path)
    scaled = scaled_features(path, header, rows, keep, names, options["csv-bounds"])
    lines = [int(i) + 2 for i in keep]
    y = _index(_cells(path, header, rows, keep, li, "label", "csv-label"), classes, path, lines, "label",
               class_source)
    g = None
    if gi is not None:
        g = torch.from_numpy(_index(_cells(path, header, rows, keep, gi, "group", "csv-group"), groups_names, path,
                                    lines, "group", f"groups of the training file {train_path.name}"))
    return LoadedSplit(torch.from_numpy(scaled.astype(np.float32)), torch.from_numpy(y), g, len(classes),
                       len(groups_names), tuple(classes))


def training_feature_names(data_root: Path, options: Mapping[str, Any]) -> list[str] | None:
    """The feature columns of the training file of ``data_root``, in model-input order (for model.json, so that
    other files are read in that order), or None when that file cannot be read here (e.g. a server without it)."""
    try:
        path = files(data_root)[0]
        return feature_names(read_table(path)[0], options, path)
    except DataError:
        return None


def read_file_records(path: Path, options: Mapping[str, Any], classes: list[str], names: list[str] | None,
                      ) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None, int, list[int]]:
    """Every row of the CSV file ``path`` as model inputs, for prediction with a trained model: (features float32
    (N, F) scaled as in training, labels int64 (N,) indices into ``classes`` or None when the file has no label
    column (config key csv-label), groups int64 (N,) or None (indices into the file's own sorted group names),
    number of groups, file line of every row). ``names``: the training feature columns (model.json), else
    csv-features or every column but the label and group. Raises DataError naming the file, the line and the
    column (a missing feature column, a non-numeric cell, an empty label or group cell, a label outside
    ``classes``), and naming the file for a file with a header only."""
    header, rows = read_table(path)
    label, group = options["csv-label"].strip(), options["csv-group"].strip()
    _records(path, rows)
    names = names or feature_names(header, options, path)
    for n in names:
        if n not in header:
            raise DataError(f"{path}: no feature column {n!r}; the model was trained on the columns "
                            f"{', '.join(names)} and the header has: {', '.join(header)}")
    keep = np.arange(len(rows))
    x = scaled_features(path, header, rows, keep, names, options["csv-bounds"]).astype(np.float32)
    lines = [int(i) + 2 for i in keep]
    y = None
    if label in header:
        y = _index(_cells(path, header, rows, keep, header.index(label), "label", "csv-label"), classes, path, lines,
                   "label", "classes of the model")
    g, num_groups = None, 0
    if group and group in header:
        values = _cells(path, header, rows, keep, header.index(group), "group", "csv-group")
        group_names = natural_order(values)
        g, num_groups = _index(values, group_names, path, lines, "group", "groups"), len(group_names)
    return x, y, g, num_groups, lines


def _records_of_file(path: Path, options: Mapping[str, Any], classes: list[str], model: Mapping[str, Any],
                     ) -> RecordsRead:
    """``read_file_records`` as ``OwnRecords.read``: the training feature columns from model.json's
    ``feature_names`` (else csv-features), each record's source its 'file:line'."""
    import torch

    x, y, g, num_groups, lines = read_file_records(path, options, classes, model.get("feature_names"))
    return RecordsRead(torch.from_numpy(x), y, g, num_groups, [f"{path.name}:{line}" for line in lines])


# What dpdro predict / evaluate read for a csv run besides its splits: one file, every row (a folder: a data root)
OWN_RECORDS = OwnRecords("a .csv file (every row; the label column optional)", Path.is_dir, _records_of_file)


def input_scaling(options: Mapping[str, Any]) -> str | None:
    """How a row becomes model inputs, in words (model.json's input_scaling); None without csv-bounds in
    ``options``."""
    if "csv-bounds" not in options:
        return None
    return (f"feature columns clipped to the declared public bounds (csv-bounds {options['csv-bounds']}) and scaled "
            "to [-1, 1]: 2 (clip(x, lo, hi) - lo) / (hi - lo) - 1")


def model_facts(data_root: Path, options: Mapping[str, Any], input_shape: tuple[int, ...]) -> dict[str, Any]:
    """model.json's ``feature_names``: the training file's feature columns in input order (other files are read
    by name), when that file can be read here and has one column per model input; else {}."""
    names = training_feature_names(data_root, options)
    return {"feature_names": names} if names is not None and len(names) == int(input_shape[0]) else {}
