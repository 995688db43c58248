"""Config key ``features``: a feature front-end computed once per record, on the node that holds the record.

``scatternet`` is the wavelet scattering transform of Tramer and Boneh (ICLR 2021, "Differentially private
learning needs better features", github.com/ftramer/Handcrafted-DP, ``data.py: get_scatter_transform``): kymatio's
``Scattering2D(J=2, shape=(H, W))`` (L = 8 angles, order 2), 81 channels per colour at a quarter of the
resolution: (3, 32, 32) images become (243, 8, 8) features, (1, 28, 28) ones (81, 7, 7). The transform has no
trainable part and reads no other record: a fixed function of each record, so it costs no privacy. It is applied
to (x + 1) / 2, i.e. the pixels p / 255 of the fixed map x = p / 255 * 2 - 1 of ``common.data`` (torchvision's
``ToTensor`` scale, Tramer and Boneh's input for (Fashion-)MNIST). The features are not normalised here: the
scatter models normalise each record by itself (``nn.GroupNorm(27, C, affine=False)``, Tramer and Boneh's
data-independent option ``input_norm=GroupNorm``), so no statistic of the records is ever computed.

Features are cached beside the shards: ``<cache-dir>/features/<data set>-<digest>.npz``, the digest a SHA-256
over the transform's parameters and the bytes of the input records (so the data set, the subset and the
transform all key it), written atomically (``common.atomic.atomic_writer``), readable by the node's user only; a
damaged entry (the zip's CRCs, or shapes that do not fit) is rebuilt. On a Flower node the features are
computed there, from the node's own records: nothing new leaves the node.

kymatio 0.3.0 imports ``scipy.special.sph_harm`` in its 3-D module on every import (``kymatio.torch`` too), a
name scipy 1.15 deprecated and later releases removed. ``import_kymatio`` defines it from ``sph_harm_y`` first
(``sph_harm``), the one workaround, tested in tests/test_scattering.py.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from .atomic import atomic_writer
from .errors import DpdroError

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

# config key ``features``: the allowed values (common/config.py repeats them without importing this module)
FEATURES = ("none", "scatternet")
SCATTER_J = 2  # Tramer and Boneh's J: 2^J = 4 times fewer pixels per side
SCATTER_L = 8  # kymatio's default number of angles
CHANNELS_PER_COLOUR = 81  # 1 + J L + L^2 J (J - 1) / 2 for J = 2, L = 8
EXTRA = "features"  # the optional dependency group of pyproject.toml that installs kymatio
KYMATIO_VERSION = "0.3.0"
BATCH = 64  # images per call of the transform (bounds its memory; faster than 256 or 16 on this CPU)


class FeatureError(ValueError, DpdroError):
    """The feature front-end cannot be used (kymatio missing, records that are not images); the message says
    what to do."""


def sph_harm(m, n, theta, phi):
    """scipy's removed ``sph_harm(m, n, theta, phi)`` (order m, degree n, theta the azimuthal angle, phi the polar
    angle) from its successor ``sph_harm_y(n, m, theta, phi)`` (degree first, theta the polar angle, phi the
    azimuthal one; both with the Condon-Shortley phase): Y_n^m(polar=phi, azimuth=theta), complex, broadcast over
    the arguments. Source: scipy.special's documentation of both functions."""
    from scipy.special import sph_harm_y

    return sph_harm_y(n, m, phi, theta)


def import_kymatio():
    """kymatio's ``Scattering2D`` (torch frontend), with ``scipy.special.sph_harm`` defined first where scipy lacks
    it (``sph_harm``). Raises FeatureError naming the extra to install when kymatio is not installed."""
    import scipy.special

    if not hasattr(scipy.special, "sph_harm"):
        scipy.special.sph_harm = sph_harm
    try:
        from kymatio.torch import Scattering2D
    except ImportError as e:
        raise FeatureError(f"config key 'features': 'scatternet' needs kymatio ({type(e).__name__}: {e}); install "
                           f"the '{EXTRA}' extra: pip install 'dpdro[{EXTRA}]' (kymatio=={KYMATIO_VERSION})") from None
    return Scattering2D


def feature_shape(input_shape: tuple[int, ...]) -> tuple[int, int, int]:
    """The shape of one record's scattering features for records of ``input_shape`` (C, H, W):
    (81 C, ceil(H / 4), ceil(W / 4)). Raises FeatureError for records that are not images."""
    if len(input_shape) != 3:
        raise FeatureError(f"config key 'features': 'scatternet' needs image records (C, H, W); these are "
                           f"{tuple(input_shape)}: use features='none'")
    c, h, w = input_shape
    step = 2 ** SCATTER_J
    return CHANNELS_PER_COLOUR * c, -(-h // step), -(-w // step)


def scatter(x: torch.Tensor, batch: int = BATCH) -> torch.Tensor:
    """Scattering features of images ``x`` (N, C, H, W) float in the scale x = p / 255 * 2 - 1: kymatio's
    ``Scattering2D(J=2, shape=(H, W))`` of (x + 1) / 2 in float32, reshaped from (N, C, 81, H', W') to
    (N, 81 C, H', W') (channel 81 c + k is colour c's k-th coefficient). ``batch`` images per call; uses
    torch's intra-op threads. Raises FeatureError (no kymatio, not images)."""
    import torch

    shape = feature_shape(tuple(x.shape[1:]))
    transform = import_kymatio()(J=SCATTER_J, shape=tuple(x.shape[2:]), L=SCATTER_L)
    out = torch.empty((x.shape[0], *shape), dtype=torch.float32)
    with torch.no_grad():
        for start in range(0, x.shape[0], batch):
            part = (x[start:start + batch].to(torch.float32) + 1.0) / 2.0
            out[start:start + batch] = transform(part).reshape(-1, *shape)
    return out


def _key(x: np.ndarray, features: str) -> str:
    """SHA-256 (hex) over the transform's parameters and the records' shape, dtype and bytes."""
    h = hashlib.sha256(json.dumps({"features": features, "J": SCATTER_J, "L": SCATTER_L, "kymatio": KYMATIO_VERSION,
                                   "input": "(x + 1) / 2", "shape": list(x.shape), "dtype": str(x.dtype)}).encode())
    h.update(np.ascontiguousarray(x).data)
    return h.hexdigest()


def cache_path(x: torch.Tensor, features: str, cache_dir: Path, name: str) -> Path:
    """Where the features of records ``x`` live: ``<cache_dir>/features/<name>-<digest>.npz`` (``name`` the data
    set, for people; a data set given by import path has ':' replaced)."""
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in name)
    return cache_dir / "features" / f"{safe}-{_key(x.numpy(), features)[:24]}.npz"


def _read(path: Path, shape: tuple[int, ...]) -> np.ndarray | None:
    """The cached features at ``path`` when the file is whole and of ``shape``, else None (logged)."""
    try:  # a zip checks the CRC of every member it reads: truncation and damage are caught here
        with np.load(path, allow_pickle=False) as z:
            features = z["features"]
        if features.shape != shape or features.dtype != np.float32:
            raise ValueError(f"holds {features.dtype} {features.shape}, expected float32 {shape}")
        return features
    except (OSError, EOFError, ValueError, KeyError, zipfile.BadZipFile) as e:
        log.warning("cached features %s are damaged (%s: %s): rebuilding them", path, type(e).__name__, e)
        return None


def compute_features(x: torch.Tensor, features: str, cache_dir: Path | None, name: str = "records") -> torch.Tensor:
    """The front-end ``features`` (config key) of records ``x`` (N, ...): ``x`` itself for 'none'; for
    'scatternet' ``scatter(x)`` (N, 81 C, H', W') float32 on the CPU, read from the cache in ``cache_dir`` when
    there (None: no cache) and else computed and written there. Raises ValueError for an unknown ``features``,
    FeatureError (kymatio missing, not images)."""
    import torch

    if features not in FEATURES:
        raise ValueError(f"config key 'features': got {features!r}; allowed: {', '.join(FEATURES)}")
    if features == "none":
        return x
    x = x.detach().cpu()
    shape = (int(x.shape[0]), *feature_shape(tuple(x.shape[1:])))
    if cache_dir is None:
        return scatter(x)
    path = cache_path(x, features, cache_dir, name)
    with _entry_lock(path):  # runs started side by side (a sweep's jobs) compute an entry once; the others read it
        if path.is_file() and (cached := _read(path, shape)) is not None:
            return torch.from_numpy(cached)
        out = scatter(x)
        try:
            with atomic_writer(path, mode=0o600) as f:  # the node's own records
                np.savez(f, features=out.numpy())
        except OSError as e:
            log.warning("could not write the features cache %s: %s", path, e)
    return out


@contextmanager
def _entry_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive lock (fcntl.flock) on ``<path>.lock`` among the processes of this machine, released at the
    block's end or when the process dies; without one (a cache folder that cannot be written) go on unlocked."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        f = open(path.with_name(path.name + ".lock"), "a")  # noqa: SIM115 (held across the yield)
    except OSError as e:
        log.warning("no lock for the features cache %s (%s): parallel runs may compute it twice", path, e)
        yield
        return
    with f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def feature_description(features: str) -> str:
    """In words, what the front-end ``features`` does to a record after its input scaling (model.json's
    input_scaling); '' for 'none'."""
    if features == "none":
        return ""
    return (f"then kymatio {KYMATIO_VERSION} Scattering2D(J={SCATTER_J}, L={SCATTER_L}) of (x + 1) / 2, channels "
            "colour-major (81 per colour at a quarter of the resolution)")
