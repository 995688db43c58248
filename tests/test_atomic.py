"""The one atomic-write helper (common/atomic.py): a crash while writing leaves the old file and no temporary
file, a finished write is durable (file and folder fsynced) with the mode asked for."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from dpdro.common import atomic
from dpdro.common.atomic import DEFAULT_MODE, atomic_write_bytes, atomic_writer


def test_error_while_writing_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    dest = tmp_path / "f.bin"
    dest.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="crash"), atomic_writer(dest) as f:
        f.write(b"half of the new")
        raise RuntimeError("crash")
    assert dest.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.bin"]


def test_write_replaces_fsyncs_file_and_folder_and_sets_the_mode(tmp_path, monkeypatch):
    synced = []
    real = os.fsync

    def fsync(fd):
        synced.append(stat.S_ISDIR(os.fstat(fd).st_mode))
        real(fd)

    monkeypatch.setattr(atomic.os, "fsync", fsync)
    dest = tmp_path / "sub" / "key"  # the folder is created
    atomic_write_bytes(dest, b"secret", mode=0o600)
    assert dest.read_bytes() == b"secret" and stat.S_IMODE(dest.stat().st_mode) == 0o600
    assert synced == [False, True]  # the file, then its folder (the rename)
    atomic_write_bytes(dest, b"public")
    assert dest.read_bytes() == b"public" and stat.S_IMODE(dest.stat().st_mode) == DEFAULT_MODE
    assert sorted(p.name for p in dest.parent.iterdir()) == ["key"]


def test_two_writers_of_one_file_use_different_temporary_files(tmp_path):
    """The run directory's old helper used one fixed '<name>.tmp' for every writer."""
    dest = tmp_path / "f"
    with atomic_writer(dest) as a, atomic_writer(dest) as b:
        assert a.name != b.name and {Path(a.name).parent, Path(b.name).parent} == {tmp_path}
        a.write(b"a")
        b.write(b"b")
    assert dest.read_bytes() == b"a"  # the outer block ends last: its rename wins
