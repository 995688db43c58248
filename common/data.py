"""Data sets: MNIST and Fashion-MNIST (standard and long-tailed '-ST'), loaded through torchvision.

Where the files come from (``data-root``): a folder with ``<Name>/raw/`` in torchvision's layout, the
files either extracted or still ``.gz`` (as in ``../shared/datasets``). Compressed files are checked
against torchvision's published md5 and decompressed once into the writable ``cache-dir``; the data root
itself is never written. With ``download=true`` torchvision downloads missing files into the cache.

'-ST' construction (ALGORITHMS.md 6.2, after the code of Qi et al. 2021): the training split in file
order; for each class k in the first half of the classes keep only its last ceil(r * count_k) records
(indices floor(count_k (1 - r)) to the end of that class's list); keep every record of the other classes.
The test split is unchanged.

Inputs are scaled with the fixed, data-independent map x / 255 * 2 - 1 (no statistic of private data).
"""

from __future__ import annotations

import gzip
import hashlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .config import AUTO


class DataError(FileNotFoundError):
    """Data could not be found or read; the message says where it looked and how to fix it."""


@dataclass(frozen=True)
class ArrayDataset:
    """Records as tensors: x (N, C, H, W) float32 in [-1, 1], y (N,) int64 in [0, num_classes)."""

    x: torch.Tensor
    y: torch.Tensor
    num_classes: int
    name: str

    def __len__(self) -> int:
        return int(self.y.shape[0])

    def subset(self, idx: np.ndarray) -> ArrayDataset:
        t = torch.as_tensor(np.asarray(idx, dtype=np.int64))
        return ArrayDataset(self.x[t], self.y[t], self.num_classes, self.name)


# dataset key -> (torchvision class name, long-tailed?)
_SOURCES = {
    "mnist": ("MNIST", False),
    "mnist-st": ("MNIST", True),
    "fashion-mnist": ("FashionMNIST", False),
    "fashion-mnist-st": ("FashionMNIST", True),
}


def project_root() -> Path:
    """The repository root (parent of common/)."""
    return Path(__file__).resolve().parent.parent


def resolve_data_root(value: str) -> Path:
    """``data-root``: the value itself, or for 'auto' $DPDRO_DATA_ROOT, else ../shared/datasets beside the
    project when it exists, else the cache directory."""
    if value != AUTO:
        return Path(value).expanduser()
    env = os.environ.get("DPDRO_DATA_ROOT")
    if env:
        return Path(env).expanduser()
    shared = project_root().parent / "shared" / "datasets"
    if shared.is_dir():
        return shared
    return resolve_cache_dir(AUTO)


def resolve_cache_dir(value: str) -> Path:
    """``cache-dir``: the value, or for 'auto' $DPDRO_CACHE_DIR, else ~/.cache/dpdro."""
    if value != AUTO:
        return Path(value).expanduser()
    env = os.environ.get("DPDRO_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "dpdro"


def _md5(path: Path) -> str:
    h = hashlib.md5()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _prepare_root(class_name: str, data_root: Path, cache_dir: Path, download: bool) -> tuple[Path, bool]:
    """Return (root for torchvision, download flag) after decompressing .gz files into the cache if needed."""
    from torchvision import datasets

    tv_class = getattr(datasets, class_name)
    files = [Path(url).name for url, _ in tv_class.resources]  # '...-ubyte.gz'
    md5s = {Path(url).name: md5 for url, md5 in tv_class.resources}
    raw = data_root / class_name / "raw"
    if all((raw / f[:-3]).is_file() for f in files):
        return data_root, False
    cached = cache_dir / class_name / "raw"
    if all((cached / f[:-3]).is_file() for f in files):
        return cache_dir, False
    if all((raw / f).is_file() for f in files):
        cached.mkdir(parents=True, exist_ok=True)
        for f in files:
            src = raw / f
            if _md5(src) != md5s[f]:
                raise DataError(f"{src} does not match torchvision's md5 {md5s[f]}: the file is corrupt or not "
                                f"the original {class_name} file")
            tmp = cached / (f[:-3] + ".part")
            with gzip.open(src, "rb") as fin, open(tmp, "wb") as fout:
                shutil.copyfileobj(fin, fout)
            os.replace(tmp, cached / f[:-3])  # atomic: a crash never leaves a half file under the real name
        return cache_dir, False
    if download:
        cache_dir.mkdir(parents=True, exist_ok=True)
        return cache_dir, True
    raise DataError(
        f"{class_name} not found: looked for {raw}/<file>[.gz] and {cached}/<file> with files "
        f"{', '.join(f[:-3] for f in files)}. Point 'data-root' (or $DPDRO_DATA_ROOT) at a folder holding "
        f"{class_name}/raw/, or set download=true to fetch it with torchvision (needs internet).")


def _load_torchvision(class_name: str, train: bool, data_root: Path, cache_dir: Path, download: bool):
    from torchvision import datasets

    root, dl = _prepare_root(class_name, data_root, cache_dir, download)
    ds = getattr(datasets, class_name)(str(root), train=train, download=dl)
    return ds.data, ds.targets  # uint8 (N, 28, 28), int64 (N,)


def long_tailed_indices(labels: np.ndarray, num_classes: int, ratio: float) -> np.ndarray:
    """Indices (ascending, file order) kept by the '-ST' rule: for classes 0..K/2-1 the last
    ceil(ratio * count_k) records of that class, all records of the other classes.

    labels: (N,) ints. ratio in (0, 1]. Returns int64 indices.
    """
    labels = np.asarray(labels)
    keep = np.ones(labels.shape[0], dtype=bool)
    for k in range(num_classes // 2):
        idx = np.flatnonzero(labels == k)
        start = int(np.floor(len(idx) * (1.0 - ratio)))
        keep[idx[:start]] = False
    return np.flatnonzero(keep).astype(np.int64)


def even_subset(n: int, k: int) -> np.ndarray:
    """k indices of range(n) evenly spaced (all of them when k == 0 or k >= n); deterministic."""
    if k == 0 or k >= n:
        return np.arange(n, dtype=np.int64)
    return np.unique(np.linspace(0, n - 1, k).round().astype(np.int64))


def _to_float(images: torch.Tensor) -> torch.Tensor:
    return (images.to(torch.float32) / 255.0 * 2.0 - 1.0).unsqueeze(1)


def load_dataset(dataset: str, train: bool, *, data_root: str = AUTO, cache_dir: str = AUTO,
                 download: bool = False, imbalance_ratio: float = 0.02, max_records: int = 0) -> ArrayDataset:
    """Load a split of ``dataset`` (config key values) as an ArrayDataset.

    Raises ValueError for an unknown dataset and DataError when files are missing or corrupt.
    """
    if dataset not in _SOURCES:
        raise ValueError(f"unknown dataset {dataset!r}; allowed: {', '.join(_SOURCES)}")
    class_name, long_tailed = _SOURCES[dataset]
    images, labels = _load_torchvision(class_name, train, resolve_data_root(data_root),
                                       resolve_cache_dir(cache_dir), download)
    labels_np = labels.numpy()
    idx = np.arange(len(labels_np), dtype=np.int64)
    if train and long_tailed:
        idx = long_tailed_indices(labels_np, 10, imbalance_ratio)
    idx = idx[even_subset(len(idx), max_records)]
    t = torch.as_tensor(idx)
    return ArrayDataset(_to_float(images[t]), labels[t].clone(), 10, dataset)


def load_from_config(cfg, train: bool) -> ArrayDataset:
    """The training or test split described by a ``Config``."""
    return load_dataset(cfg.dataset, train, data_root=cfg.data_root, cache_dir=cfg.cache_dir,
                        download=cfg.download, imbalance_ratio=cfg.imbalance_ratio,
                        max_records=cfg.max_train_records if train else cfg.max_test_records)
