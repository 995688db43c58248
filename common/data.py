"""Data sets: MNIST, Fashion-MNIST and CIFAR-10 (standard and long-tailed '-ST'), and CelebA
(Blond_Hair with group Male), as tensors.

Where the files come from (``data-root``): a folder with ``<Name>/raw/`` in torchvision's layout, the
files either extracted or still ``.gz`` (as in ``../shared/datasets``). Compressed files are checked
against torchvision's published md5 and decompressed once into the writable ``cache-dir``; the data root
itself is never written. An explicit data root must hold the files (extracted or ``.gz``); only
``data-root=auto`` falls back to the cache's copies when the resolved folder lacks them. With
``download=true`` torchvision downloads missing files into the cache. Damaged files are found before they are
read (``common.cache_files``): a damaged cached copy of an intact source is rebuilt; any other damaged file is
a DataError naming it.

'-ST' construction (docs/explanation/ALGORITHMS.md 6.2, after the code of Qi et al. 2021): the training split in file
order; for each class k in the first half of the classes keep only its last ceil(r * count_k) records
(indices floor(count_k (1 - r)) to the end of that class's list); keep every record of the other classes.
The test split is unchanged.

Inputs are scaled with the fixed, data-independent map x / 255 * 2 - 1 (no statistic of private data).

CIFAR-10 is read by torchvision's ``CIFAR10`` class from its on-disk format (``<root>/cifar-10-batches-py/``,
python pickles, read in place: ``../shared/datasets`` holds the byte-exact files); its md5 check of every file it
lists (five training batches, the test batch, batches.meta) is the integrity check, and a failing check is a
DataError naming each bad file. ``download=true`` fetches the files with torchvision into the cache.

CelebA (Sagawa et al. 2020): target Blond_Hair, group attribute Male, 4 groups (target x group), inputs
resized to ``CELEBA_SIZE`` x ``CELEBA_SIZE``. With the full data set under ``<root>/celeba/`` torchvision's
``CelebA`` and the official partition are used. With the 10,000-image subset of ``../shared/datasets/celeba``
(89x109 copies, all in the official training partition) a documented, seeded split stratified by the 4
cells is made instead: ``CELEBA_SPLIT`` fractions train/validation/test, seed ``split-seed``.
"""

from __future__ import annotations

import contextvars
import hashlib
import logging
import os
import pickle
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from . import image_folder, tabular_data
from .atomic import atomic_writer
from .cache_files import cache_entry_problem, decompress_into_cache, idx_problem, record_path
from .data_types import DataError, LoadedSplit, OwnRecords, stratified_split
from .registry import AUTO, Registry
from .scattering import compute_features

if TYPE_CHECKING:  # torch is imported inside the functions that build tensors: the registry (config validation,
    import torch  # `dpdro keys`, `--help`) must not pay for it (tests/test_cli_startup.py)

__all__ = ["DataError", "LoadedSplit", "stratified_split"]  # re-exported: the names loaders and callers use

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ArrayDataset:
    """Records as tensors: x (N, C, H, W) float32 in [-1, 1], y (N,) int64 in [0, num_classes); optional
    groups (N,) int64 in [0, num_groups) for worst-group accuracy (CelebA: 2 * Blond_Hair + Male); class_names:
    the names of classes 0 .. num_classes-1 when the data set gives them (user data), else () (model.json then
    names the classes by index); skipped_files: files of the data set's folders not read as records
    (``LoadedSplit.skipped_files``; summary.json reports it); source: the folder the records were read from (the
    data root, or the cache when data-root=auto fell back to its copies; '' for records not read from files),
    which config.json records as data_read."""

    x: torch.Tensor
    y: torch.Tensor
    num_classes: int
    name: str
    groups: torch.Tensor | None = None
    num_groups: int = 0
    class_names: tuple[str, ...] = ()
    skipped_files: int = 0
    source: str = ""

    def __len__(self) -> int:
        return int(self.y.shape[0])

    def subset(self, idx: np.ndarray) -> ArrayDataset:
        """The records at ``idx`` (int array, any order, repeats allowed) as a new ArrayDataset."""
        import torch

        t = torch.as_tensor(np.asarray(idx, dtype=np.int64))
        groups = None if self.groups is None else self.groups[t]
        return ArrayDataset(self.x[t], self.y[t], self.num_classes, self.name, groups, self.num_groups,
                            self.class_names, self.skipped_files, self.source)


Loader = Callable[..., "tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | LoadedSplit"]


@dataclass(frozen=True)
class DatasetSpec:
    """Declaration of one data set (an entry of ``DATASETS``).

    load(split, data_root, cache_dir, download, split_seed) -> (images, labels, groups): uint8 images (N, H, W) or
    (N, C, H, W), int64 labels (N,) in [0, num_classes), and int64 groups (N,) in [0, num_groups) or None; or a
    ``LoadedSplit`` (float32 records already scaled by public constants, its own number of classes); ``split``
    is 'train' or 'test', or also 'val' when ``own_validation``. Raises DataError when files are missing.
    With ``with_options`` it gets a sixth argument: {key: config value} of its ``keys``.
    num_classes: 0 when the loader says (user data: the classes of its files or config key ``classes``).
    long_tailed: the training split is made long-tailed by the '-ST' rule (config key imbalance-ratio).
    own_validation: the data set has its own validation split (config validation-fraction must stay 0).
    default_model: the model config key model='auto' picks (a name in ``common.models.MODELS``).
    keys: config keys the data set reads beyond those every data set reads (data-root, cache-dir, download,
    max-*-records, validation-fraction, split-seed); all of role 'data' (tests/test_registries.py).
    check: checks those keys' values before any file is read (ValueError naming the key); config validation
    calls it.
    fingerprint(data_root): a digest of the files read (names, sizes, modification times) for user files that
    may change under the same config keys; cacheable: False when not even that can be known (user code), so
    that no shard cache is kept (``data_fingerprint``).

    What a finished run's model files and ``dpdro predict`` need (server/model_export.py, server/prediction.py):
    input_scaling: how records become model inputs, in words (model.json): a string, or a function of the run's
    config keys returning one (None: not known from them); None: "as dpdro loads data set NAME".
    input_keys: the config keys that turn a file into model inputs (model.json's ``preprocessing`` lists the
    input_keys of every registered data set). model_facts(data_root, options, input_shape) -> dict: further
    model.json fields (csv: the training file's feature_names). own_records: how records of the user's own are
    read for prediction (``OwnRecords``); None: any path given is a data root of the data set.
    """

    load: Loader
    num_classes: int
    default_model: str
    long_tailed: bool = False
    own_validation: bool = False
    num_groups: int = 0
    keys: tuple[str, ...] = ()
    with_options: bool = False
    check: Callable[[Mapping[str, Any]], None] | None = None
    fingerprint: Callable[[Path], str] | None = None
    cacheable: bool = True
    input_scaling: str | Callable[[Mapping[str, Any]], str | None] | None = None
    input_keys: tuple[str, ...] = ()
    model_facts: Callable[[Path, Mapping[str, Any], tuple[int, ...]], dict[str, Any]] | None = None
    own_records: OwnRecords | None = None


def describe_input_scaling(name: str, options: Mapping[str, Any]) -> str:
    """How records of data set ``name`` become model inputs under config keys ``options``, in words: its
    ``DatasetSpec.input_scaling``, else "as dpdro loads data set NAME" (also for a name not registered)."""
    spec = DATASETS.get(name)
    scaling = None if spec is None else spec.input_scaling
    text = scaling(options) if callable(scaling) else scaling
    return text or f"as dpdro loads data set {name!r}"


def input_keys() -> tuple[str, ...]:
    """The ``input_keys`` of every registered data set (model.json's ``preprocessing``), each once."""
    return tuple(dict.fromkeys(k for spec in DATASETS.values() for k in spec.input_keys))


def _entry_point_spec(obj: Any, path: str) -> DatasetSpec:
    """The data set of config value dataset='package.module:attribute': a ``DatasetSpec`` as it is, or a function
    ``fn(split, data_root)`` (split 'train' or 'test', data_root a Path: config key data-root) returning (x, y),
    (x, y, groups) as tensors or arrays, or a torch ``Dataset`` of (x, y) items. uint8 x are images (mapped by
    x / 255 * 2 - 1), float x are used as they are (scale them by public constants, never by statistics of the
    records). Classes: config key ``classes``, else 0 .. max training label. Default model: mlp."""
    if isinstance(obj, DatasetSpec):
        return obj
    if not callable(obj):
        raise ValueError(f"dataset {path!r} is a {type(obj).__name__}; expected a function (split, data_root) -> "
                         "(x, y[, groups]) or a Dataset, or a DatasetSpec")

    def load(split, data_root, cache_dir, download, split_seed, options):
        return _call_entry_point(obj, path, split, data_root, options)

    return DatasetSpec(load, 0, "mlp", keys=("classes",), with_options=True, cacheable=False)


def _as_tensor(value: Any, what: str, path: str) -> torch.Tensor:
    import torch

    try:
        return torch.as_tensor(np.asarray(value) if not isinstance(value, torch.Tensor) else value)
    except (TypeError, ValueError, RuntimeError) as e:
        raise DataError(f"dataset {path!r}: its {what} cannot be made a tensor ({e})") from None


def _call_entry_point(fn: Callable, path: str, split: str, data_root: Path, options: Mapping[str, Any]) -> LoadedSplit:
    """Call a user data function for ``split`` and check what it returns (DataError naming the function)."""
    import torch

    from .data_types import declared_classes

    def call(s: str):
        out = fn(s, data_root)
        if isinstance(out, torch.utils.data.Dataset):
            items = [out[i] for i in range(len(out))]
            if not items:
                raise DataError(f"dataset {path!r}: its {s} Dataset is empty")
            out = tuple(torch.stack([torch.as_tensor(it[j]) for it in items]) for j in range(len(items[0])))
        if not isinstance(out, (tuple, list)) or len(out) not in (2, 3):
            raise DataError(f"dataset {path!r}: {s} returned a {type(out).__name__}; expected (x, y), (x, y, groups) "
                            "or a Dataset of (x, y) items")
        x, y = _as_tensor(out[0], "x", path), _as_tensor(out[1], "y", path)
        g = _as_tensor(out[2], "groups", path).long() if len(out) == 3 and out[2] is not None else None
        if y.dim() != 1 or len(x) != len(y) or (g is not None and g.shape != y.shape):
            raise DataError(f"dataset {path!r}: {s} returned x {tuple(x.shape)}, y {tuple(y.shape)}; expected x "
                            "(N, ...), y (N,) and groups (N,) for the same N records")
        if not len(y):
            raise DataError(f"dataset {path!r}: its {s} split holds no record (x {tuple(x.shape)}): every split "
                            "needs at least one")
        if x.dtype != torch.uint8:
            x = x.to(torch.float32)
        if y.is_floating_point() or y.dtype == torch.bool or (len(y) and int(y.min()) < 0):
            raise DataError(f"dataset {path!r}: {s} labels must be integers >= 0 (class indices), got {y.dtype}")
        return x, y.long(), g

    x, y, g = call(split)
    classes = declared_classes(options["classes"])
    train_y = y if split == "train" else call("train")[1]
    k = len(classes) or int(train_y.max()) + 1
    if len(y) and int(y.max()) >= k:
        where = "the declared classes (config key 'classes')" if classes else "the training split's labels"
        raise DataError(f"dataset {path!r}: the {split} split has label {int(y.max())}, beyond {where} (0 .. {k - 1}): "
                        "more classes than in training")
    return LoadedSplit(x, y, g, k, int(g.max()) + 1 if g is not None and len(g) else 0, tuple(classes))


DATASETS: Registry[DatasetSpec] = Registry("dataset", entry_point=_entry_point_spec)

# Whether the built-in loaders may read the cache's copies of files the data root lacks: only for
# data-root=auto. Set by ``load_dataset`` around each call (a ContextVar keeps the Loader signature of
# plug-in data sets unchanged).
_CACHE_FALLBACK: contextvars.ContextVar[bool] = contextvars.ContextVar("dpdro_cache_fallback", default=True)
# The folder a loader read the records from when it is not the data root (the cache, after a fallback).
_READ_FROM: contextvars.ContextVar[Path | None] = contextvars.ContextVar("dpdro_read_from", default=None)


def register_dataset(name: str, spec: DatasetSpec) -> DatasetSpec:
    """Add a data set under config value ``name`` (ValueError if taken); returns ``spec``."""
    return DATASETS.register(name, spec)


CELEBA_SIZE = 64
CELEBA_SPLIT = (0.8, 0.1, 0.1)
CELEBA_SUBSET_DIR = "img_align_celeba_89x109"


def project_root() -> Path:
    """The repository root (parent of common/)."""
    return Path(__file__).resolve().parent.parent


def resolve_data_root(value: str) -> Path:
    """``data-root``: the value itself, or for 'auto' $DPDRO_DATA_ROOT, else ../shared/datasets beside the
    project when it exists, else the cache directory. Only with 'auto' may the loaders read the cache's
    copies when the resolved folder lacks the files; an explicit folder must hold them. Raises DataError when
    $DPDRO_DATA_ROOT names a folder that does not exist (a typo must not train on other copies)."""
    if value != AUTO:
        return Path(value).expanduser()
    env = os.environ.get("DPDRO_DATA_ROOT")
    if env:
        if not Path(env).expanduser().is_dir():  # a declared folder that is not there: never the cache instead
            raise DataError(f"$DPDRO_DATA_ROOT={env}: no such folder; point it at the folder holding the data "
                            "(<Name>/raw/ in torchvision's layout), or unset it to use ../shared/datasets beside "
                            "the project, else the cache")
        return Path(env).expanduser()
    shared = project_root().parent / "shared" / "datasets"
    if shared.is_dir():
        return shared
    return resolve_cache_dir(AUTO)


def auto_root_origin() -> str:
    """Where data-root=auto pointed and why, for error messages: $DPDRO_DATA_ROOT, ../shared/datasets beside the
    project, or (neither there) the cache."""
    if os.environ.get("DPDRO_DATA_ROOT"):
        return f"data-root=auto: $DPDRO_DATA_ROOT={os.environ['DPDRO_DATA_ROOT']}"
    shared = project_root().parent / "shared" / "datasets"
    if shared.is_dir():
        return f"data-root=auto: {shared}"
    return f"data-root=auto: $DPDRO_DATA_ROOT is unset and {shared} does not exist, so only the cache"


def resolve_cache_dir(value: str) -> Path:
    """``cache-dir``: the value, or for 'auto' $DPDRO_CACHE_DIR, else ~/.cache/dpdro."""
    if value != AUTO:
        return Path(value).expanduser()
    env = os.environ.get("DPDRO_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "dpdro"


def _md5(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "md5").hexdigest()


def _prepare_root(class_name: str, data_root: Path, cache_dir: Path, download: bool,
                  cache_fallback: bool) -> tuple[Path, bool]:
    """Return (root for torchvision, download flag) after decompressing .gz files into the cache if needed.

    Every file torchvision will read is checked first (``cache_files``): extracted files in the data root
    against their IDX header; cached copies against the record written beside them. A damaged cached copy
    of an intact source is rebuilt from it (with a warning); one without a source is a DataError naming
    the file to delete. The cache alone (no source in the data root) is used only when ``cache_fallback``
    (data-root=auto)."""
    from torchvision import datasets

    tv_class = getattr(datasets, class_name)
    files = [Path(url).name for url, _ in tv_class.resources]  # '...-ubyte.gz'
    md5s = {Path(url).name: md5 for url, md5 in tv_class.resources}
    raw = data_root / class_name / "raw"
    if all((raw / f[:-3]).is_file() for f in files):
        for f in files:
            if problem := idx_problem(raw / f[:-3]):
                raise DataError(f"{raw / f[:-3]} {problem}: replace it with the original {class_name} file (or "
                                "its .gz beside it and delete the damaged one); the data root is never written")
        return data_root, False
    cached = cache_dir / class_name / "raw"
    if all((raw / f).is_file() for f in files):
        for f in files:
            src, dest = raw / f, cached / f[:-3]
            problem = cache_entry_problem(dest) if dest.is_file() else None
            if dest.is_file() and not problem:
                continue
            if problem:  # a copy from before records were written is expected after an upgrade: not a warning
                level = logging.INFO if not record_path(dest).is_file() else logging.WARNING
                log.log(level, "cached %s %s: rebuilding it from %s", dest, problem, src)
            if _md5(src) != md5s[f]:
                raise DataError(f"{src} does not match torchvision's md5 {md5s[f]}: the file is corrupt or not "
                                f"the original {class_name} file; replace it (the data root is never written)")
            try:
                decompress_into_cache(src, dest)
            except (OSError, EOFError) as e:
                raise DataError(f"cannot decompress {src} into {dest}: {e}") from None
        return cache_dir, False
    if cache_fallback and all((cached / f[:-3]).is_file() for f in files):
        _READ_FROM.set(cache_dir)
        for f in files:
            dest = cached / f[:-3]
            # copies made before records were written have none: their IDX header still shows a truncation
            problem = (cache_entry_problem(dest) if record_path(dest).is_file() else None) or idx_problem(dest)
            if problem:
                raise DataError(f"cached {dest} {problem}, and no source {raw / f} to rebuild it from: delete it "
                                f"(and {record_path(dest).name}), then point 'data-root' at the {class_name} files "
                                "or set download=true")
        return cache_dir, False
    if download:
        cache_dir.mkdir(parents=True, exist_ok=True)
        return cache_dir, True
    names = ", ".join(f[:-3] for f in files)
    if not cache_fallback:
        raise DataError(
            f"{class_name} not found in data-root {data_root}: looked for {raw}/<file> or <file>.gz with files "
            f"{names}. Point 'data-root' at a folder holding {class_name}/raw/ (the cache {cache_dir} is used "
            "without a source only with data-root=auto), or set download=true to fetch it (needs internet).")
    places = f"{raw}/<file>[.gz]" + ("" if cached == raw else f" and {cached}/<file>")
    raise DataError(
        f"{class_name} not found: looked for {places} with files {names} ({auto_root_origin()}). Point "
        f"'data-root' (or $DPDRO_DATA_ROOT) at a folder holding {class_name}/raw/, or set download=true to fetch "
        "it with torchvision (needs internet).")


def _load_torchvision(class_name: str, train: bool, data_root: Path, cache_dir: Path, download: bool,
                      cache_fallback: bool):
    from torchvision import datasets

    root, dl = _prepare_root(class_name, data_root, cache_dir, download, cache_fallback)
    try:
        ds = getattr(datasets, class_name)(str(root), train=train, download=dl)
    except (RuntimeError, ValueError, OSError, EOFError) as e:  # files checked above; this is the last line
        raise DataError(f"cannot read {class_name} from {root / class_name / 'raw'} ({type(e).__name__}: {e}): "
                        "a file there is damaged; replace it (or delete it if it is in the cache)") from None
    return ds.data, ds.targets  # uint8 (N, 28, 28), int64 (N,)


CIFAR_DIR = "cifar-10-batches-py"
CIFAR_TRAIN = [f"data_batch_{i}" for i in range(1, 6)]
CIFAR_TEST = ["test_batch"]


def cifar_file_problems(folder: Path) -> list[str]:
    """What is wrong with the CIFAR-10 files in ``folder`` (``<root>/cifar-10-batches-py``), judged by
    torchvision's own list of files and md5s (``CIFAR10.train_list``, ``test_list``, ``meta``): one
    '<path> is missing' or '<path> does not match torchvision's md5 <md5>' per bad file; [] when all are intact."""
    from torchvision import datasets
    from torchvision.datasets.utils import check_integrity

    tv = datasets.CIFAR10
    problems = []
    for name, md5 in [*tv.train_list, *tv.test_list, (tv.meta["filename"], tv.meta["md5"])]:
        path = folder / name
        if not path.is_file():
            problems.append(f"{path} is missing")
        elif not check_integrity(str(path), md5):
            problems.append(f"{path} does not match torchvision's md5 {md5} (truncated or not the original file)")
    return problems


def _read_cifar10(root: Path, train: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One split read by torchvision's ``CIFAR10(root, download=False)``, whose md5 check of every file is the
    integrity check. Returns uint8 (N, 3, 32, 32) in file order and int64 (N,). DataError names each bad file."""
    import torch
    from torchvision import datasets

    try:
        ds = datasets.CIFAR10(str(root), train=train, download=False)
    except (RuntimeError, OSError, EOFError, pickle.UnpicklingError, ValueError, KeyError, TypeError) as e:
        problems = cifar_file_problems(root / CIFAR_DIR) or [f"{type(e).__name__}: {e}"]
        raise DataError(f"cannot read CIFAR-10 from {root / CIFAR_DIR}: " + "; ".join(problems)
                        + ". Replace the damaged files with the originals (or delete them if they are in the cache); "
                        "the data root is never written") from None
    images = np.ascontiguousarray(np.asarray(ds.data, dtype=np.uint8).transpose(0, 3, 1, 2))  # HWC -> CHW
    return torch.from_numpy(images), torch.as_tensor(ds.targets, dtype=torch.int64)


def _load_cifar10(train: bool, data_root: Path, cache_dir: Path, download: bool, cache_fallback: bool):
    # lookup order as for the other data sets: the data root, its CIFAR10/ folder, then (data-root=auto only) the cache
    names = CIFAR_TRAIN if train else CIFAR_TEST
    for root in (data_root, data_root / "CIFAR10") + ((cache_dir,) if cache_fallback else ()):
        if all((root / CIFAR_DIR / n).is_file() for n in names):
            _READ_FROM.set(root)
            return _read_cifar10(root, train)
    if download:
        from torchvision import datasets

        cache_dir.mkdir(parents=True, exist_ok=True)
        datasets.CIFAR10(str(cache_dir), train=train, download=True)  # checks the archive's and files' md5s
        return _read_cifar10(cache_dir, train)
    cached = f" and {cache_dir}/{CIFAR_DIR}/" if cache_fallback else ""
    raise DataError(f"CIFAR-10 not found: looked for {data_root}/{CIFAR_DIR}/, {data_root}/CIFAR10/{CIFAR_DIR}/"
                    f"{cached} with {', '.join(names)}. Point 'data-root' at a folder holding "
                    f"{CIFAR_DIR}/ (torchvision's layout), or set download=true (needs internet).")


def read_celeba_attributes(path: Path) -> tuple[list[str], np.ndarray, list[str]]:
    """CelebA's list_attr_celeba.txt: (image names, (N, 40) int8 values in {0, 1}, attribute names).
    The first line (a count) is ignored; -1/1 map to 0/1 as in torchvision."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
        header = lines[1].split()
        names, values = [], []
        for line in lines[2:]:
            parts = line.split()
            if len(parts) == len(header) + 1:
                names.append(parts[0])
                values.append([int(v) for v in parts[1:]])
    except (IndexError, ValueError, UnicodeDecodeError) as e:
        raise DataError(f"cannot read CelebA attributes {path} ({type(e).__name__}: {e}): it is truncated or not "
                        "the original list_attr_celeba.txt; replace it") from None
    return names, (np.asarray(values, dtype=np.int8) + 1) // 2, header


def _celeba_subset_arrays(root: Path, cache_dir: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Images (N, 3, S, S) uint8, Blond_Hair (N,) and Male (N,) of the resized subset, decoded once and
    cached in cache_dir (the images are centre-cropped to 89x89, then resized to S x S, bilinear)."""
    cache = cache_dir / f"celeba_subset_{CELEBA_SIZE}.npz"
    if cache.is_file():
        try:  # a zip checks the CRC of every member it reads: truncation and damage are caught here
            with np.load(cache, allow_pickle=False) as z:
                x, blond, male = z["x"], z["blond"], z["male"]
            if x.shape[1:] != (3, CELEBA_SIZE, CELEBA_SIZE) or not len(x) == len(blond) == len(male):
                raise ValueError(f"shapes {x.shape}, {blond.shape}, {male.shape} do not fit")
            return x, blond, male
        except (OSError, EOFError, ValueError, KeyError, zipfile.BadZipFile) as e:
            log.warning("cached %s is damaged (%s: %s): rebuilding it from %s", cache, type(e).__name__, e, root)
    from PIL import Image

    names, attrs, header = read_celeba_attributes(root / "list_attr_celeba.txt")
    folder = root / CELEBA_SUBSET_DIR
    keep = [i for i, n in enumerate(names) if (folder / n).is_file()]
    images = np.zeros((len(keep), 3, CELEBA_SIZE, CELEBA_SIZE), dtype=np.uint8)
    for j, i in enumerate(keep):
        try:
            with Image.open(folder / names[i]) as im:
                im = im.convert("RGB")
                w, h = im.size
                top = (h - w) // 2
                im = im.crop((0, top, w, top + w)).resize((CELEBA_SIZE, CELEBA_SIZE), Image.BILINEAR)
                images[j] = np.asarray(im).transpose(2, 0, 1)
        except (OSError, ValueError) as e:
            raise DataError(f"cannot read CelebA image {folder / names[i]} ({e}): replace it with the original "
                            "file") from None
    blond = attrs[keep, header.index("Blond_Hair")].astype(np.int64)
    male = attrs[keep, header.index("Male")].astype(np.int64)
    with atomic_writer(cache) as f:  # a temporary file per writer: parallel builds never mix
        np.savez(f, x=images, blond=blond, male=male)
    return images, blond, male


def _load_celeba(split: str, data_root: Path, cache_dir: Path, download: bool, split_seed: int):
    """(images uint8 (N,3,S,S), Blond_Hair labels, groups = 2 * blond + male) of one split."""
    import torch

    root = data_root / "celeba"
    if (root / "img_align_celeba").is_dir() or download:
        from torchvision import datasets, transforms

        tv = datasets.CelebA(str(data_root if (root / "img_align_celeba").is_dir() else cache_dir),
                             split={"val": "valid"}.get(split, split), target_type="attr", download=download,
                             transform=transforms.Compose([transforms.CenterCrop(178),
                                                           transforms.Resize(CELEBA_SIZE)]))
        bi, mi = tv.attr_names.index("Blond_Hair"), tv.attr_names.index("Male")
        imgs = np.stack([np.asarray(tv[i][0]).transpose(2, 0, 1) for i in range(len(tv))])
        blond, male = tv.attr[:, bi].numpy().astype(np.int64), tv.attr[:, mi].numpy().astype(np.int64)
    elif (root / CELEBA_SUBSET_DIR).is_dir():
        imgs, blond, male = _celeba_subset_arrays(root, cache_dir)
        parts = stratified_split(2 * blond + male, CELEBA_SPLIT, split_seed)
        idx = parts[{"train": 0, "val": 1, "test": 2}[split]]
        imgs, blond, male = imgs[idx], blond[idx], male[idx]
    else:
        raise DataError(f"CelebA not found: looked for {root}/img_align_celeba/ (full data set) and "
                        f"{root}/{CELEBA_SUBSET_DIR}/ (the resized subset). Point 'data-root' at the folder holding "
                        "celeba/, or set download=true (needs internet).")
    return torch.from_numpy(imgs), torch.from_numpy(blond), torch.from_numpy(2 * blond + male)


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


def validation_split(labels: np.ndarray, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, validation) positions into ``labels`` (N,): ``fraction`` of every class (rounded) goes to
    validation after a shuffle seeded by ``seed`` (config split-seed); both sorted, disjoint, covering all."""
    train, val = stratified_split(np.asarray(labels), (1.0 - fraction, fraction), seed)
    return train, val


def even_subset(n: int, k: int) -> np.ndarray:
    """k indices of range(n) evenly spaced (all of them when k == 0 or k >= n); deterministic."""
    if k == 0 or k >= n:
        return np.arange(n, dtype=np.int64)
    return np.unique(np.linspace(0, n - 1, k).round().astype(np.int64))


def _to_float(images: torch.Tensor) -> torch.Tensor:
    import torch

    if images.is_floating_point():  # records a loader already scaled by public constants
        return images.to(torch.float32)
    x = images.to(torch.float32) / 255.0 * 2.0 - 1.0
    return x.unsqueeze(1) if x.dim() == 3 else x


def load_dataset(dataset: str, train: bool | str, *, data_root: str = AUTO, cache_dir: str = AUTO,
                 download: bool = False, imbalance_ratio: float = 0.02, max_records: int = 0,
                 split_seed: int = 0, validation_fraction: float = 0.0,
                 options: Mapping[str, Any] | None = None, features: str = "none") -> ArrayDataset:
    """Load a split of ``dataset`` (a name in ``DATASETS``) as an ArrayDataset.

    ``train``: True / 'train' for the training split, False / 'test' for the test split, 'val' for the
    validation split: the data set's own (CelebA), or for the others the ``validation_fraction`` of the training
    split (after the '-ST' construction) held out by ``validation_split``, which the 'train' split then
    excludes. ``options``: {key: value} of the data set's ``keys`` for a loader ``with_options`` (user data).
    ``features``: config key features, the front-end applied to the split's records last, cached in the cache
    directory (``scattering.compute_features``).
    Raises ValueError for an unknown dataset or split and DataError when files are missing or corrupt or the split
    holds no record (naming the split and the data root); FeatureError when the front-end cannot run.
    """
    import torch

    spec = DATASETS.get_entry(dataset)
    split = {True: "train", False: "test"}.get(train, train)
    if split not in ("train", "val", "test") or (split == "val" and not spec.own_validation
                                                 and validation_fraction <= 0):
        raise ValueError(f"unknown split {train!r} for {dataset} (a validation split needs validation-fraction > 0)")
    root, cache = resolve_data_root(data_root), resolve_cache_dir(cache_dir)
    # a validation split is carved from the training files, unless the data set has its own
    files = split if spec.own_validation or split == "test" else "train"
    token = _CACHE_FALLBACK.set(data_root == AUTO)  # an explicit data root must hold the data itself
    read_token = _READ_FROM.set(None)
    try:
        extra = (dict(options or {}),) if spec.with_options else ()
        images, labels, groups, num_classes, num_groups, class_names, skipped = LoadedSplit(
            *spec.load(files, root, cache, download, split_seed, *extra))
        source = _READ_FROM.get() or root
    finally:
        _CACHE_FALLBACK.reset(token)
        _READ_FROM.reset(read_token)
    num_classes, num_groups = num_classes or spec.num_classes, num_groups or spec.num_groups
    labels_np = labels.numpy()
    idx = np.arange(len(labels_np), dtype=np.int64)
    if split in ("train", "val") and not spec.own_validation and spec.long_tailed:
        idx = long_tailed_indices(labels_np, num_classes, imbalance_ratio)
    whole = idx  # the split's records before a validation carve-out: the features' cache entry (below)
    if split in ("train", "val") and not spec.own_validation and validation_fraction > 0:
        idx = idx[validation_split(labels_np[idx], validation_fraction, split_seed)[split == "val"]]
    idx = idx[even_subset(len(idx), max_records)]
    if not len(idx):
        name = {"val": "validation"}.get(split, split)
        raise DataError(f"the {name} split of dataset {dataset!r} (data-root {root}) holds no record: every split "
                        "needs at least one; add records, or give the split its own file or folder where the data "
                        "set allows (a split carved from the training data, by validation-fraction or as the 20% "
                        "test split of user data without a test file, takes a rounded fraction of every class)")
    t = torch.as_tensor(idx)
    if features != "none" and not max_records and len(whole) > len(idx):
        # a validation carve-out and the rest of the split read one cache entry: the features of every record of
        # the split, computed once (a record's features depend on that record alone)
        at = torch.as_tensor(np.searchsorted(whole, idx))  # whole is ascending (arange, long_tailed_indices)
        x = compute_features(_to_float(images[torch.as_tensor(whole)]), features, cache, dataset)[at]
    else:
        x = compute_features(_to_float(images[t]), features, cache, dataset)
    return ArrayDataset(x, labels[t].clone(), num_classes, dataset,
                        None if groups is None else groups[t].clone(), num_groups if groups is not None else 0,
                        tuple(class_names), skipped, str(Path(source).resolve()))


def with_features(ds: ArrayDataset, features: str, cache_dir: str = AUTO) -> ArrayDataset:
    """``ds`` with the front-end ``features`` (config key) applied to its records, as ``load_dataset`` applies it
    to a loaded split: for records given from Python (``dpdro.fit(data=...)``, ``dpdro.evaluate``) and image files
    scored by ``dpdro predict``. ``ds`` itself for 'none'. Raises FeatureError as ``compute_features``."""
    if features == "none":
        return ds
    return replace(ds, x=compute_features(ds.x, features, resolve_cache_dir(cache_dir), ds.name))


def _torchvision_loader(class_name: str) -> Loader:
    def load(split, data_root, cache_dir, download, split_seed):
        return (*_load_torchvision(class_name, split == "train", data_root, cache_dir, download,
                                   _CACHE_FALLBACK.get()), None)

    return load


def _cifar10_loader(split, data_root, cache_dir, download, split_seed):
    return (*_load_cifar10(split == "train", data_root, cache_dir, download, _CACHE_FALLBACK.get()), None)


# ---- the built-in data sets ('-st': long-tailed, docs/explanation/ALGORITHMS.md 6.2) ----
# How they scale their inputs (``_to_float``): a data-independent map, stated for users in model.json.
BUILTIN_INPUT_SCALING = "uint8 pixels p -> p / 255 * 2 - 1 (channels first, float)"
for _name, _class, _model in (("mnist", "MNIST", "cnn"), ("fashion-mnist", "FashionMNIST", "cnn")):
    register_dataset(f"{_name}-st", DatasetSpec(_torchvision_loader(_class), 10, _model, long_tailed=True,
                                                keys=("imbalance-ratio",), input_scaling=BUILTIN_INPUT_SCALING))
    register_dataset(_name, DatasetSpec(_torchvision_loader(_class), 10, _model,
                                        input_scaling=BUILTIN_INPUT_SCALING))
# CIFAR10-ST's default is the small CNN that trains on a CPU in minutes; model=resnet20 is the paper's (a GPU's)
register_dataset("cifar10-st", DatasetSpec(_cifar10_loader, 10, "cnn32", long_tailed=True,
                                           keys=("imbalance-ratio",), input_scaling=BUILTIN_INPUT_SCALING))
register_dataset("cifar10", DatasetSpec(_cifar10_loader, 10, "resnet20", input_scaling=BUILTIN_INPUT_SCALING))
register_dataset("celeba", DatasetSpec(_load_celeba, 2, "cnn64", own_validation=True, num_groups=4,
                                       input_scaling=BUILTIN_INPUT_SCALING))
# ---- user data (docs/how-to/own-data.md): classes from the files or config key 'classes' ----
register_dataset("image-folder", DatasetSpec(image_folder.load, 0, "convnet", keys=image_folder.KEYS,
                                             with_options=True, check=image_folder.check_options,
                                             fingerprint=image_folder.fingerprint,
                                             input_scaling=image_folder.input_scaling, input_keys=image_folder.KEYS,
                                             own_records=image_folder.OWN_RECORDS))
register_dataset("csv", DatasetSpec(tabular_data.load, 0, "mlp", keys=tabular_data.KEYS, with_options=True,
                                    check=tabular_data.check_options, fingerprint=tabular_data.fingerprint,
                                    input_scaling=tabular_data.input_scaling, input_keys=tabular_data.KEYS,
                                    model_facts=tabular_data.model_facts, own_records=tabular_data.OWN_RECORDS))


# ---- records passed from Python (dpdro.fit(data=...)): recorded as this data set, which no file holds ----
PYTHON_DATA = "python-data"


def _load_python_data(split, data_root, cache_dir, download, split_seed):
    raise DataError(f"dataset {PYTHON_DATA!r}: the run trained on records passed to dpdro.fit(data=...) from "
                    "Python, which no file holds; evaluate and predict in Python with dpdro.evaluate(run_dir, "
                    "dpdro.records(x, y, num_classes)) and dpdro.predict(run_dir, ...); to train from the command "
                    "line, use dataset=csv, image-folder or package.module:function")


register_dataset(PYTHON_DATA, DatasetSpec(_load_python_data, 0, "mlp", cacheable=False))


def data_fingerprint(cfg) -> str | None:
    """What, beyond the config keys, decides the records a data set yields, for caches of derived data (the
    Flower client's shard cache): '' for fixed files (the built-ins: checked against their md5 or headers), a
    digest of the names, sizes and modification times of user files (csv, image-folder), None when unknowable
    (user code by import path: keep no cache)."""
    spec = DATASETS.get_entry(cfg.dataset)
    if not spec.cacheable:
        return None
    return spec.fingerprint(resolve_data_root(cfg.data_root)) if spec.fingerprint is not None else ""


def data_missing(cfg) -> str | None:
    """Why the data set of a ``Config`` cannot be used here (the DataError's message: where it looked, what to
    set), or None when it can; checked by loading the evaluation split, so call it before starting any work."""
    try:
        load_from_config(cfg, False)
    except DataError as e:
        return str(e)
    return None


def pin_data_paths(cfg):
    """``cfg`` with data-root and cache-dir as absolute folders, for processes that resolve paths elsewhere
    (Flower's ServerApp and ClientApps, SuperNodes): an explicit data-root made absolute; for 'auto' the folder
    the data set is read from here (the resolved root, or the cache when only the cache holds it). Loads the
    evaluation split once or twice; raises DataError (where it looked) when the data set is not available."""
    cache = str(resolve_cache_dir(cfg.cache_dir).resolve())
    pinned = cfg.with_updates({"data-root": str(resolve_data_root(cfg.data_root).resolve()), "cache-dir": cache})
    missing = data_missing(pinned)
    if missing and cfg.data_root == AUTO:
        missing = data_missing(cfg.with_updates({"cache-dir": cache}))  # with the cache as fallback, as locally
        pinned = pinned.with_updates({"data-root": cache})
    if missing:
        raise DataError(missing)
    return pinned


def load_from_config(cfg, train: bool | str) -> ArrayDataset:
    """A split described by a ``Config``: True / 'train' the training split (without any validation part);
    False / 'eval' the split named by config key eval-split ('test', or 'validation' = 'val'); or 'test' / 'val'
    explicitly."""
    split = {False: "eval", True: "train"}.get(train, train)
    if split == "eval":
        split = "val" if cfg.eval_split == "validation" else "test"
    values = cfg.to_dict()
    return load_dataset(cfg.dataset, split, data_root=cfg.data_root, cache_dir=cfg.cache_dir,
                        download=cfg.download, imbalance_ratio=cfg.imbalance_ratio,
                        max_records=cfg.max_train_records if split == "train" else cfg.max_test_records,
                        split_seed=cfg.split_seed, validation_fraction=cfg.validation_fraction,
                        options={k: values[k] for k in DATASETS.get_entry(cfg.dataset).keys},
                        features=cfg.features)
