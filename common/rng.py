"""Random number generators for every draw site (docs/explanation/ARCHITECTURE.md section 4).

Reproducible mode: a draw site's generator derives from (seed, *keys) through numpy's SeedSequence, keys
being the iteration, the mechanism and the partition id (never a Flower node id), so results do not
depend on the order in which replies arrive. Secret mode: each draw site gets a fresh PCG64 seeded with
128 bits from the operating system's CSPRNG; the seed is never logged or saved.

Caveat (Mironov 2012): Gaussian noise drawn in floating point by PCG64 is not an exact sample of the continuous
Gaussian; the low-order bits of a released float can reveal the value under the noise. dpdro does not protect
against such floating-point attacks on the Gaussian mechanism (Opacus' ``secure_mode`` does, with a CSPRNG and
a sum of several Gaussian draws; dpdro has no such mode). The run summary lists it as not accounted.
"""

from __future__ import annotations

import secrets
import zlib

import numpy as np


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
