"""The server's memory as the metrics report it (metrics.csv: server_rss_mb, server_heap_mb).

The resident set size alone is a poor leak detector: glibc keeps freed memory cached in one arena per thread
that allocated (gRPC and torch threads), and how much it keeps varies from run to run (the Flower server's RSS
moved in ~19 MiB steps without any leak). So the RSS is measured after a garbage collection
and ``malloc_trim``, and the C heap in use (``mallinfo2``), which does not move with that caching, is
reported next to it; tests/test_reliability.py bounds the growth of both.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import resource


def _libc():
    """The C library (None where it cannot be loaded)."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


_LIBC = _libc()


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


def trim_c_heap() -> None:
    """Return the C heap's free pages to the OS (glibc ``malloc_trim``, all arenas; nothing elsewhere)."""
    trim = getattr(_LIBC, "malloc_trim", None)
    if trim is not None:
        trim(0)


def rss_mb() -> float:
    """Resident set size of this process in MiB after a garbage collection and ``trim_c_heap`` (/proc on Linux;
    elsewhere the peak): memory the process holds, not unreachable cycles or free pages its allocator caches.
    Costs a few milliseconds; called once per evaluation."""
    gc.collect()
    trim_c_heap()
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize() / 2**20
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def heap_mb() -> float | None:
    """MiB this process holds from the C allocator, summed over all arenas (glibc >= 2.33 ``mallinfo2``: bytes
    in use in the heaps plus mmapped blocks), or None elsewhere. Counts numpy and torch buffers and Python
    objects above 512 bytes (pymalloc's small-object arenas are mmapped and only show in the RSS), not free
    memory the allocator keeps."""
    info_fn = getattr(_LIBC, "mallinfo2", None)
    if info_fn is None:
        return None
    info_fn.restype = _MallInfo2
    info = info_fn()
    return (info.uordblks + info.hblkhd) / 2**20
