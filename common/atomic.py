"""The one way dpdro writes a whole file: atomically and durably, so that a crash (or power loss) at any moment
leaves either the old file or the new one under its name, never a torn or empty one.

How: the bytes go to a temporary file in the destination's folder (a name unique to this writer, so processes
writing the same file at once never share one), which is flushed and fsynced, renamed onto the destination
(``os.replace``, atomic within one file system), and then the folder is fsynced so that the rename itself
survives a power loss. On an error the temporary file is removed and the destination left as it was.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

# The mode a plain open() would give a new file (0666 less the umask). os.umask can only be read by setting it,
# so once, at import (before any thread of ours writes files).
_UMASK = os.umask(0o022)
os.umask(_UMASK)
DEFAULT_MODE = 0o666 & ~_UMASK


def _fsync_dir(folder: Path) -> None:
    """fsync ``folder`` so that a rename into it is durable; a no-op where folders cannot be opened (Windows)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems refuse fsync on a folder: the rename is still atomic
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_writer(dest: str | os.PathLike, mode: int | None = None) -> Iterator[BinaryIO]:
    """A binary file to write ``dest`` through; ``dest`` gets its content when the block ends without error.

    dest: the file to write (its folder is created). mode: its permission bits, e.g. 0o600 for a node's own
    records or a key (set before the content is visible under ``dest``); None: what ``open`` would give
    (0666 less the umask). Raises what writing raises (OSError), after removing the temporary file."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".part")  # mode 0600
    os.close(fd)  # reopened by name: the file object's .name is its path (onnx.save reads it), not a descriptor
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            if (DEFAULT_MODE if mode is None else mode) != 0o600:
                os.fchmod(f.fileno(), DEFAULT_MODE if mode is None else mode)
            os.fsync(f.fileno())
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(dest.parent)


def atomic_write_bytes(path: str | os.PathLike, data: bytes, mode: int | None = None) -> None:
    """Write ``data`` to ``path`` through :func:`atomic_writer` (``mode`` as there)."""
    with atomic_writer(path, mode) as f:
        f.write(data)


def atomic_write_text(path: str | os.PathLike, text: str, mode: int | None = None) -> None:
    """Write ``text`` (UTF-8) to ``path`` through :func:`atomic_writer` (``mode`` as there)."""
    atomic_write_bytes(path, text.encode("utf-8"), mode)
