"""Random number generators for every draw site (docs/explanation/ARCHITECTURE.md section 4).

Reproducible mode: a draw site's generator derives from (seed, *keys) through numpy's SeedSequence, keys
being the iteration, the mechanism and the partition id (never a Flower node id), so results do not
depend on the order in which replies arrive. Secret mode: each draw site gets a fresh PCG64 seeded with
128 bits from the operating system's CSPRNG; the seed is never logged or saved.

Caveat (Mironov 2012): Gaussian noise drawn in floating point by PCG64 is not an exact sample of the continuous
Gaussian; the low-order bits of a released float can reveal the value under the noise. By default dpdro does not
protect against such floating-point attacks on the Gaussian mechanism, and the run summary lists it as not
accounted. Config key ``secure-noise = true`` (``gaussian_noise(..., secure=True)``) draws every noise vector as
Opacus' ``secure_mode`` does (``opacus/optimizers/optimizer.py``, ``_generate_noise``): the sum of 4 Gaussian draws
of std sigma / 2, each from the operating system's CSPRNG (here ``secrets``, i.e. getrandom; Opacus uses
torchcsprng's /dev/urandom generator), following Holohan and Braghin, "Secure random sampling in differential
privacy" (ESORICS 2021, arXiv:2107.10138): the sum smooths the gaps in the floating-point support that the
attack of Mironov (CCS 2012) exploits, and a CSPRNG leaves nothing to recover from a seed.
"""

from __future__ import annotations

import math
import secrets
import zlib

import numpy as np

#: Gaussian draws summed per coordinate by the secure sampler (Opacus' secure_mode: 4 draws of std sigma / 2)
SECURE_DRAWS = 4


def key_int(key: int | str) -> int:
    """A stable non-negative integer for a key (strings through CRC32, stable across processes)."""
    if isinstance(key, str):
        return zlib.crc32(key.encode("utf-8"))
    if key < 0:
        raise ValueError(f"rng key must be >= 0, got {key}")
    return int(key)


def derived_rng(seed: int, *keys: int | str) -> np.random.Generator:
    """Generator determined by (seed, keys)."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(seed), *map(key_int, keys)])))


def secret_rng() -> np.random.Generator:
    """PCG64 generator seeded with 128 bits from the OS CSPRNG (``secrets``); its draws are PCG64's, not the
    CSPRNG's."""
    return np.random.Generator(np.random.PCG64(secrets.randbits(128)))


def site_rng(reproducible: bool, seed: int, *keys: int | str) -> np.random.Generator:
    """``derived_rng(seed, *keys)`` when reproducible, else ``secret_rng()``."""
    return derived_rng(seed, *keys) if reproducible else secret_rng()


def csprng_uniform(size: int) -> np.ndarray:
    """(size,) float64 uniform on (0, 1], every value a multiple of 2^-53, from 8 bytes of the OS CSPRNG
    (``secrets.token_bytes``) each; nothing in it derives from a seed. ValueError for size < 0."""
    if size < 0:
        raise ValueError(f"size must be >= 0, got {size}")
    raw = np.frombuffer(secrets.token_bytes(8 * size), dtype=np.uint64)
    return ((raw >> np.uint64(11)).astype(np.float64) + 1.0) * 2.0**-53


def csprng_normal(size: int) -> np.ndarray:
    """(size,) float64 standard normal draws by the Box-Muller transform (Box and Muller 1958) of CSPRNG uniforms
    (``csprng_uniform``; (0, 1] so that the logarithm is finite)."""
    pairs = (size + 1) // 2
    radius = np.sqrt(-2.0 * np.log(csprng_uniform(pairs)))
    angle = (2.0 * math.pi) * csprng_uniform(pairs)
    return np.concatenate([radius * np.cos(angle), radius * np.sin(angle)])[:size]


def secure_gaussian(std: float, shape: tuple[int, ...]) -> np.ndarray:
    """``shape`` float64 array of N(0, std^2) noise drawn as Opacus' secure_mode draws it: the sum of
    ``SECURE_DRAWS`` = 4 independent CSPRNG normals scaled by std / 2 (module docstring; Holohan and Braghin 2021).
    Not reproducible from any seed. ValueError unless std is finite and >= 0."""
    if not (math.isfinite(std) and std >= 0):
        raise ValueError(f"noise std must be finite and >= 0, got {std}")
    size = math.prod(shape)
    total = csprng_normal(SECURE_DRAWS * size).reshape(SECURE_DRAWS, size).sum(axis=0)
    return (total * (std / math.sqrt(SECURE_DRAWS))).reshape(shape)


def gaussian_noise(std: float, shape: tuple[int, ...], rng: np.random.Generator, *, secure: bool = False
                   ) -> np.ndarray:
    """``shape`` float64 array of N(0, std^2) noise: ``secure_gaussian`` when ``secure`` (config key secure-noise),
    else ``rng.normal`` (the draw site's generator, ``site_rng``)."""
    return secure_gaussian(std, shape) if secure else rng.normal(0.0, std, size=shape)
