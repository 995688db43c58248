"""``dataset=image-folder``: images in class sub-folders, torchvision's ``ImageFolder`` layout (registered in
``common.data``).

Layout (``data-root``): ``train/<class>/<image>`` and, optionally, ``test/<class>/<image>``; or ``<class>/<image>``
directly, in which case ``USER_TEST_FRACTION`` of every class (seeded by split-seed) is the test split. As
``ImageFolder`` (whose ``make_dataset`` walks the folders here), a class folder is read recursively: images in
its sub-folders at any depth belong to the class; classes are the top-level sub-folder names, sorted, or config
key ``classes``. Images are the files with one of ``IMAGE_EXTENSIONS``; other files, hidden ones (and the files of
hidden folders) and files beside the class folders are skipped, counted (``LoadedSplit.skipped_files``, reported
in summary.json) and logged once as a warning.

Each image is converted to ``image-channels`` (1: grey, 3: RGB) and resized to ``image-size`` x ``image-size``
(bilinear; 0: kept, then every image must have one size). Values: x / 255 * 2 - 1 (as the built-ins), or
(x / 255 - image-mean) / image-std per channel when those public constants are declared (e.g. ImageNet's):
never statistics of the private images.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .data_types import DataError, LoadedSplit, OwnRecords, RecordsRead, declared_classes, user_test_split

if TYPE_CHECKING:  # torch is imported where tensors are built (config validation stays free of it)
    import torch

log = logging.getLogger(__name__)

KEYS = ("classes", "image-size", "image-channels", "image-mean", "image-std")
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")  # torchvision's


def _floats(text: str, key: str, channels: int) -> list[float]:
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        values = []
    if len(values) != channels:
        raise ValueError(f"config key '{key}': got {text!r}; allowed: {channels} comma-separated numbers (one per "
                         "channel, image-channels) or '' for x / 255 * 2 - 1")
    return values


def normalisation(options: Mapping[str, Any]) -> tuple[list[float], list[float]] | None:
    """(mean, std) per channel from image-mean / image-std, or None when both are '' (x / 255 * 2 - 1). Raises
    ValueError naming the key when only one is set, a count differs from image-channels, or a std is <= 0."""
    mean, std = options["image-mean"].strip(), options["image-std"].strip()
    if not mean and not std:
        return None
    if not mean or not std:
        raise ValueError(f"config keys 'image-mean', 'image-std': got {mean!r}, {std!r}; allowed: both set (public "
                         "per-channel constants) or both ''")
    channels = options["image-channels"]
    m, s = _floats(mean, "image-mean", channels), _floats(std, "image-std", channels)
    if min(s) <= 0:
        raise ValueError(f"config key 'image-std': got {std!r}; allowed: numbers > 0")
    return m, s


def check_options(options: Mapping[str, Any]) -> None:
    """The syntax of the image-folder keys (before any file is read); ValueError naming the key."""
    if options["image-channels"] not in (1, 3):
        raise ValueError(f"config key 'image-channels': got {options['image-channels']}; allowed: 1 (grey) or 3 (RGB)")
    normalisation(options)
    declared_classes(options["classes"])


def folders(data_root: Path) -> tuple[Path, Path | None]:
    """(training folder, test folder or None) of a data root (see the module docstring)."""
    if (data_root / "train").is_dir():
        test = data_root / "test"
        return data_root / "train", test if test.is_dir() else None
    return data_root, None


def class_folders(folder: Path) -> list[str]:
    """The sorted names of the visible sub-folders of ``folder``; DataError when it is missing or has none."""
    if not folder.is_dir():
        raise DataError(f"{folder} not found: dataset=image-folder expects data-root to be a folder of class "
                        "sub-folders (<class>/<image>), or one holding train/ and optionally test/ in that layout")
    names = sorted(p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not names:
        raise DataError(f"{folder} has no class sub-folder: expected one folder per class holding its images "
                        "(torchvision's ImageFolder layout)")
    return names


def class_images(folder: Path) -> tuple[list[Path], list[Path]]:
    """(images, skipped files) of one class folder, walked as torchvision's ``ImageFolder`` walks it (its
    ``make_dataset``): the folder and every sub-folder at any depth (symbolic links followed), folders in sorted
    path order, files by name within each. Images: the files ending in one of ``IMAGE_EXTENSIONS`` (any case,
    ``has_file_allowed_extension``), except that hidden files and the files of hidden folders (a name starting
    with '.', e.g. macOS '._x.png' companions, which are no images) are skipped, as ImageFolder does not.
    Skipped: every other file."""
    from torchvision.datasets.folder import has_file_allowed_extension, make_dataset

    skipped = []

    def is_image(path: str) -> bool:
        visible = not any(part.startswith(".") for part in Path(path).relative_to(folder).parts)
        if visible and has_file_allowed_extension(path, IMAGE_EXTENSIONS):
            return True
        skipped.append(Path(path))
        return False

    found = make_dataset(str(folder.parent), {folder.name: 0}, is_valid_file=is_image, allow_empty=True)
    return [Path(p) for p, _ in found], skipped


def image_files(folder: Path) -> list[Path]:
    """The images of one class folder (``class_images``); DataError naming the folder when it has none."""
    files = class_images(folder)[0]
    if not files:
        raise DataError(f"class folder {folder} has no images: expected files ending in "
                        f"{', '.join(IMAGE_EXTENSIONS)} (remove the folder, or declare the classes with config key "
                        "'classes' and leave the class out of the folders)")
    return files


def _decode(path: Path, channels: int, size: int) -> np.ndarray:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as im:
            im = im.convert("L" if channels == 1 else "RGB")
            if size:
                im = im.resize((size, size), Image.BILINEAR)
            a = np.asarray(im, dtype=np.uint8)
    except (OSError, UnidentifiedImageError, ValueError) as e:
        raise DataError(f"cannot read image {path} ({type(e).__name__}: {e}): replace or remove it") from None
    return a[None] if a.ndim == 2 else a.transpose(2, 0, 1)


@functools.lru_cache(maxsize=4)
def _read_folder(folder: str, classes: tuple[str, ...], channels: int, size: int,
                 stamp: tuple) -> tuple[np.ndarray, np.ndarray]:
    """(uint8 images (N, C, H, W), int64 labels (N,)) of one folder of class folders, in class order, each class
    in the order of ``class_images`` (cached per folder, classes, channels, size and the files' names, sizes and
    modification times)."""
    images, labels = [], []
    for k, name in enumerate(classes):
        sub = Path(folder) / name
        if not sub.is_dir():
            continue  # a split may lack a class (the training folder was checked to have them all)
        for f in image_files(sub):
            a = _decode(f, channels, size)
            if images and a.shape != images[0].shape:
                raise DataError(f"image {f} is {a.shape[2]}x{a.shape[1]}, the first image "
                                f"{images[0].shape[2]}x{images[0].shape[1]}: with image-size=0 every image must "
                                "have one size; set image-size to resize them")
            images.append(a)
            labels.append(k)
    return np.stack(images), np.asarray(labels, dtype=np.int64)


def _stamp(folder: Path) -> tuple:
    return tuple((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(folder.rglob("*")) if p.is_file())


@functools.lru_cache(maxsize=8)
def _skipped(folder: str, stamp: tuple) -> int:
    """How many files of the split folder ``folder`` (a folder of class folders) are not read as images: the visible
    files beside the class folders and the files ``class_images`` skips. Logs them as a warning (once per folder
    and ``stamp``, its files' names, sizes and modification times)."""
    root = Path(folder)
    skipped = [p for p in sorted(root.iterdir()) if p.is_file() and not p.name.startswith(".")]
    for name in class_folders(root):
        skipped += class_images(root / name)[1]
    if skipped:
        shown = ", ".join(str(p.relative_to(root)) for p in skipped[:5]) + (", ..." if len(skipped) > 5 else "")
        log.warning("image-folder %s: skipped %d file(s) that are not images (not ending in %s, hidden, or beside "
                    "the class folders): %s", root, len(skipped), ", ".join(IMAGE_EXTENSIONS), shown)
    return len(skipped)


def fingerprint(data_root: Path) -> str:
    """Digest of every file's path, size and modification time under the data root."""
    import hashlib

    return hashlib.sha256(repr(_stamp(data_root) if data_root.is_dir() else ()).encode()).hexdigest()[:20]


def load(split: str, data_root: Path, cache_dir: Path, download: bool, split_seed: int,
         options: Mapping[str, Any]) -> LoadedSplit:
    """The 'train' or 'test' split: images uint8 (N, C, S, S) (or float32 with a declared normalisation), labels
    int64 (N,), no groups, and the number of files skipped in the training and test folders (``_skipped``, the
    same for both splits). Raises DataError naming the folder or file for a missing folder, a class folder with no
    images, an unreadable image, a test class folder the training folder lacks (or outside ``classes``)."""
    import torch

    train_dir, test_dir = folders(data_root)
    found = class_folders(train_dir)
    declared = declared_classes(options["classes"])
    classes = declared or found
    where = "declared classes (config key 'classes')" if declared else f"class folders of {train_dir}"
    for name in found:
        if name not in classes:
            raise DataError(f"class folder {train_dir / name} is not one of the {where} ({', '.join(classes)})")
        image_files(train_dir / name)  # a class folder with no images is an error, not a missing class
    folder = test_dir if split == "test" and test_dir is not None else train_dir
    if folder is test_dir:
        for name in class_folders(test_dir):
            if name not in classes:
                raise DataError(f"test class folder {test_dir / name} is not one of the {where} "
                                f"({', '.join(classes)}): more classes in test than in training")
    channels, size = options["image-channels"], options["image-size"]
    stamps = {f: _stamp(f) for f in (train_dir, test_dir) if f is not None}
    x, y = _read_folder(str(folder), tuple(classes), channels, size, stamps[folder])
    skipped = sum(_skipped(str(f), stamp) for f, stamp in stamps.items())
    if test_dir is None:
        keep = user_test_split(y, split, split_seed)
        x, y = x[keep], y[keep]
    images = torch.from_numpy(np.ascontiguousarray(x))
    norm = normalisation(options)
    if norm is not None:
        mean, std = (torch.tensor(v, dtype=torch.float32).view(-1, 1, 1) for v in norm)
        images = (images.to(torch.float32) / 255.0 - mean) / std
    return LoadedSplit(images, torch.from_numpy(np.ascontiguousarray(y)), None, len(classes), 0, tuple(classes),
                       skipped)


def _visible(folder: Path) -> tuple[list[Path], list[Path]]:
    """(image files, sub-folders) directly in ``folder``, hidden ones skipped, sorted by name."""
    entries = sorted(p for p in folder.iterdir() if not p.name.startswith("."))
    return ([p for p in entries if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS],
            [p for p in entries if p.is_dir()])


def read_for_prediction(path: Path, options: Mapping[str, Any], classes: list[str],
                        ) -> tuple[torch.Tensor, np.ndarray | None, list[str]]:
    """Images to score with a trained model, converted and scaled exactly as in training (image-channels,
    image-size, image-mean / image-std of the run): (inputs (N, C, S, S), labels int64 (N,) indices into
    ``classes`` or None, source of each image (its path relative to ``path``)).

    ``path``: one image file; a folder of images (no sub-folders: unlabelled); or a folder of class sub-folders
    (``<class>/<image>``: labelled, every image). Raises DataError naming the path for a missing path, a file that
    is not an image, a folder with both images and sub-folders or with neither, a class folder that is not one of
    ``classes``, and an unreadable image."""
    import torch

    channels, size = options["image-channels"], options["image-size"]
    if path.is_file():
        if path.suffix.lower() not in IMAGE_EXTENSIONS:
            raise DataError(f"{path} is not an image: expected a file ending in {', '.join(IMAGE_EXTENSIONS)}, or "
                            "a folder of them")
        files, labels, root = [path], None, path.parent
    elif path.is_dir():
        images, subs = _visible(path)
        if images and subs:
            raise DataError(f"{path} holds both images ({images[0].name}, ...) and sub-folders ({subs[0].name}, "
                            "...): expected either images only (unlabelled) or class sub-folders only "
                            "(<class>/<image>, labelled)")
        if not images and not subs:
            raise DataError(f"{path} holds no images: expected files ending in {', '.join(IMAGE_EXTENSIONS)} or "
                            "class sub-folders of them")
        files, labels, root = images, None, path
        if subs:
            files, labels = [], []
            for sub in subs:
                if sub.name not in classes:
                    raise DataError(f"class folder {sub} is not one of the model's classes ({', '.join(classes)}): "
                                    "expected <class>/<image> with the class names of model.json, or a folder of "
                                    "images without sub-folders (unlabelled)")
                found = image_files(sub)
                files += found
                labels += [classes.index(sub.name)] * len(found)
    else:
        raise DataError(f"{path} not found: expected an image, a folder of images, or a folder of class "
                        "sub-folders")
    arrays = [_decode(f, channels, size) for f in files]
    for f, a in zip(files, arrays, strict=True):
        if a.shape != arrays[0].shape:
            raise DataError(f"image {f} is {a.shape[2]}x{a.shape[1]}, the first image {arrays[0].shape[2]}x"
                            f"{arrays[0].shape[1]}: the run used image-size=0 (no resizing), so every image must "
                            "have one size")
    x = torch.from_numpy(np.stack(arrays))
    norm = normalisation(options)
    if norm is None:
        x = x.to(torch.float32) / 255.0 * 2.0 - 1.0  # the built-ins' fixed map (common.data._to_float)
    else:
        mean, std = (torch.tensor(v, dtype=torch.float32).view(-1, 1, 1) for v in norm)
        x = (x.to(torch.float32) / 255.0 - mean) / std
    return x, None if labels is None else np.asarray(labels, dtype=np.int64), \
        [str(f.relative_to(root)) for f in files]


def _records_of_path(path: Path, options: Mapping[str, Any], classes: list[str], model: Mapping[str, Any],
                     ) -> RecordsRead:
    """``read_for_prediction`` as ``OwnRecords.read`` (no groups)."""
    x, y, sources = read_for_prediction(path, options, classes)
    return RecordsRead(x, y, None, 0, sources)


def _is_data_root(path: Path) -> bool:
    """A folder holding train/ or test/ is a data root; any other image or folder is images to score."""
    return path.is_dir() and any((path / s).is_dir() for s in ("train", "test"))


# What dpdro predict / evaluate read for an image-folder run besides its splits and a data root
OWN_RECORDS = OwnRecords("an image, a folder of images (unlabelled) or of class sub-folders (labelled)",
                         _is_data_root, _records_of_path)


def input_scaling(options: Mapping[str, Any]) -> str | None:
    """How an image becomes model inputs, in words (model.json's input_scaling); None without image-channels in
    ``options``."""
    o = options
    if "image-channels" not in o:
        return None
    size = f"resized to {o['image-size']}x{o['image-size']} (bilinear)" if o["image-size"] else "not resized"
    values = (f"(p / 255 - image-mean) / image-std with image-mean {o['image-mean']}, image-std {o['image-std']}"
              if o["image-mean"].strip() else "p / 255 * 2 - 1")
    return (f"images converted to {'grey' if o['image-channels'] == 1 else 'RGB'}, {size}, pixels p -> {values} "
            "(channels first, float)")
