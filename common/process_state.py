"""Whether a process is alive, from Linux's /proc (shared by launch/ and the client's warm worker)."""

from __future__ import annotations

from pathlib import Path


def alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie (state Z) or dead (X), read from /proc/<pid>/stat."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")
