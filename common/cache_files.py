"""Integrity of data files: the decompressed copies in the cache carry a record of their size and SHA-256
(``<file>.meta.json``, written atomically when the copy is made), and IDX files (MNIST's format) are checked
against the size their header promises. A damaged copy is then found before torchvision reads it (which
otherwise fails with ``RuntimeError: shape ... is invalid``), so the loader can rebuild it from an intact
source or name the file to delete.

The record also holds the copy's mtime: a copy whose size and mtime still match is trusted without
re-hashing it (a truncation or an edit changes both); any other copy is hashed and compared.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import math
import struct
from pathlib import Path

from .atomic import atomic_write_bytes, atomic_writer

RECORD_SUFFIX = ".meta.json"
# IDX type code -> bytes per value (torchvision's read_sn3_pascalvincent_tensor)
_IDX_TYPE_SIZES = {0x08: 1, 0x09: 1, 0x0B: 2, 0x0C: 4, 0x0D: 4, 0x0E: 8}


def record_path(path: Path) -> Path:
    """Where the record of the cached file ``path`` lives: ``<path>.meta.json`` beside it."""
    return path.with_name(path.name + RECORD_SUFFIX)


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def decompress_into_cache(source: Path, dest: Path) -> None:
    """Decompress the .gz file ``source`` to ``dest`` atomically, then write its record (size, SHA-256,
    mtime, source name) atomically beside it. Raises OSError (e.g. EOFError for a truncated .gz)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    h, size = hashlib.sha256(), 0
    with gzip.open(source, "rb") as fin, atomic_writer(dest, mode=0o600) as fout:
        for block in iter(lambda: fin.read(1 << 20), b""):
            h.update(block)
            size += len(block)
            fout.write(block)
    record = {"bytes": size, "sha256": h.hexdigest(), "mtime_ns": dest.stat().st_mtime_ns, "source": source.name}
    atomic_write_bytes(record_path(dest), (json.dumps(record, sort_keys=True) + "\n").encode(), mode=0o600)


def cache_entry_problem(path: Path) -> str | None:
    """Why the cached copy ``path`` cannot be trusted, or None: its record is missing or unreadable, or its
    size or SHA-256 differs from the record."""
    try:
        record = json.loads(record_path(path).read_text())
        expected_size, expected_sha = int(record["bytes"]), str(record["sha256"])
    except FileNotFoundError:
        return f"has no record of its size and checksum ({record_path(path).name})"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"has an unreadable record {record_path(path).name} ({e})"
    stat = path.stat()
    if stat.st_size != expected_size:
        return f"holds {stat.st_size} bytes where its record says {expected_size} (truncated or damaged)"
    if stat.st_mtime_ns == record.get("mtime_ns"):
        return None
    if _sha256(path) != expected_sha:
        return "differs from the SHA-256 in its record (damaged or edited)"
    return None


def idx_problem(path: Path) -> str | None:
    """Why ``path`` is not a complete IDX file (MNIST's format), or None: the header's type and dimensions
    fix the file size exactly, so a truncated or padded file is found without reading it."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(4)
            if len(head) < 4 or head[:2] != b"\0\0" or head[2] not in _IDX_TYPE_SIZES or not 1 <= head[3] <= 4:
                return "does not start with an IDX header"
            raw_dims = f.read(4 * head[3])
            if len(raw_dims) < 4 * head[3]:
                return f"is cut short inside its header ({size} bytes)"
    except OSError as e:
        return f"cannot be read ({e})"
    dims = struct.unpack(f">{head[3]}I", raw_dims)
    expected = 4 + 4 * len(dims) + math.prod(dims) * _IDX_TYPE_SIZES[head[2]]
    if size != expected:
        shape = " x ".join(map(str, dims))
        return f"holds {size} bytes where its header ({shape}) promises {expected} (truncated or damaged)"
    return None
