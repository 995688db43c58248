"""Child processes of ``dpdro deploy`` / ``dpdro simulate``: free ports, process trees, ownership of a listening
port, and stopping every descendant on SIGTERM/SIGINT (Linux /proc; no psutil dependency).

Why this exists: Flower's SuperLink and SuperNodes start helpers in their own sessions (``flower-superexec``,
``flwr-serverapp``, ``flwr-clientapp``, Ray), so killing one process group is not enough, and a Python
process killed by SIGTERM runs no ``finally`` block. ``stop_on_signals`` turns SIGTERM/SIGHUP into an
exception (SIGINT already is one) so the callers' cleanup runs; ``become_subreaper`` keeps orphaned
grandchildren findable as our descendants; ``stop_tree`` stops a whole tree by PID.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from ..common.process_state import alive

HOST = "127.0.0.1"
PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>
# Seconds a child gets between SIGTERM and SIGKILL. Short on purpose: measured on a loopback deployment and a
# simulation, flwr-serverapp, flwr-simulation and Ray's raylet do not exit on SIGTERM once their parent is
# gone (they wait for it), so a longer grace only delays the SIGKILL that ends them anyway.
STOP_GRACE = 3.0


class TerminatedBySignal(SystemExit):
    """Raised in the main thread when SIGTERM/SIGHUP arrives inside ``stop_on_signals``; exit code 128 + signal
    number, as a shell reports it. A SystemExit, so ``except Exception`` does not swallow it."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signum = signum


def free_port(host: str = HOST) -> int:
    """A TCP port on ``host`` that the kernel reports free now (bound to port 0 and released).

    Another process can still take it before the caller binds it: check ownership afterwards
    (``listener_pids``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _process_table() -> dict[int, list[int]]:
    """Parent PID -> child PIDs of every process now (one pass over /proc)."""
    table: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        table.setdefault(ppid, []).append(int(stat.parent.name))
    return table


def _children(pid: int) -> list[int]:
    """PIDs whose parent is ``pid``."""
    return _process_table().get(pid, [])


def descendants(pid: int, table: dict[int, list[int]] | None = None) -> list[int]:
    """Every living descendant PID of ``pid`` (children first, then theirs); ``table`` from
    ``_process_table`` (None: read /proc now)."""
    table = _process_table() if table is None else table
    out, todo = [], [pid]
    while todo:
        kids = table.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def _listening_inodes(port: int) -> set[str]:
    """Socket inodes listening on TCP ``port`` (any address, IPv4 and IPv6)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) > 9 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:  # 0A = LISTEN
                inodes.add(f[9])
    return inodes


def _address(hex_addr: str) -> str:
    """The address of a /proc/net/tcp{,6} entry ('0100007F' -> '127.0.0.1'; 32 hex digits -> IPv6 text)."""
    import ipaddress

    raw = bytes.fromhex(hex_addr)
    # the kernel prints each 32-bit word in host byte order (little-endian on every platform Linux runs us on)
    ip = ipaddress.ip_address(b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)))
    return str(getattr(ip, "ipv4_mapped", None) or ip)


def _fd_links(pid: int) -> list[str]:
    """Targets of /proc/<pid>/fd/* ('socket:[inode]', paths, ...); empty when the process cannot be read. A
    descriptor closed while listing (the listing's own, in this process) is skipped."""
    links = []
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return links
    for fd in fds:
        with contextlib.suppress(OSError):
            links.append(os.readlink(fd))
    return links


def listening_sockets(pids: Iterable[int]) -> list[tuple[int, str, int]]:
    """(pid, address, port) of every TCP socket in LISTEN state held by one of ``pids`` (IPv4 and IPv6, read
    from /proc/<pid>/net/tcp{,6} and /proc/<pid>/fd; processes that exited or cannot be read are skipped).
    Addresses as text: '127.0.0.1', '::1', '0.0.0.0' or '::' (every interface); an IPv4-mapped IPv6 address as
    its IPv4 address."""
    out = []
    for pid in pids:
        inodes = {link[8:-1] for link in _fd_links(pid) if link.startswith("socket:[")}
        for table in ("tcp", "tcp6"):
            try:
                lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
            except OSError:
                continue
            for line in lines:
                f = line.split()
                if len(f) > 9 and f[3] == "0A" and f[9] in inodes:  # 0A = LISTEN
                    addr, port = f[1].rsplit(":", 1)
                    out.append((pid, _address(addr), int(port, 16)))
    return out


def listener_pids(port: int, candidates: Iterable[int]) -> list[int]:
    """Those of ``candidates`` that hold a socket listening on TCP ``port`` (checked through
    /proc/<pid>/fd; only our own processes are readable, which is all we ask about)."""
    inodes = _listening_inodes(port)
    out = []
    for pid in candidates:
        try:
            links = {os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()}
        except OSError:
            continue
        if any(f"socket:[{i}]" in links for i in inodes):
            out.append(pid)
    return out


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _reap(pids: Iterable[int]) -> None:
    for pid in pids:  # our own children: collect them so they leave no zombies
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass


def stop_tree(roots: Iterable[int], known: Iterable[int] = (), grace: float = STOP_GRACE) -> list[int]:
    """Stop ``roots``, every PID in ``known`` and all their descendants: SIGTERM to each (and to each root's
    process group when it leads one), SIGKILL to whatever is alive after ``grace`` seconds. The tree is
    listed before any signal is sent (a dying parent's children are re-parented and would be lost) and again
    while waiting (children started during shutdown). Returns the PIDs still alive afterwards."""
    roots = list(roots)
    targets: set[int] = set(known) | set(roots)
    table = _process_table()
    for r in roots:
        targets.update(descendants(r, table))
    for r in roots:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if os.getpgid(r) == r:
                os.killpg(r, signal.SIGTERM)
    for pid in targets:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        table = _process_table()
        for pid in list(targets):
            if alive(pid):
                targets.update(descendants(pid, table))
        _reap(roots)
        if not any(alive(pid) for pid in targets):
            break
        time.sleep(0.1)
    for pid in targets:
        if alive(pid):
            _signal(pid, signal.SIGKILL)
    for r in roots:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(r, signal.SIGKILL)
    time.sleep(0.05)
    _reap(roots)
    _reap_orphans()
    return sorted(pid for pid in targets if alive(pid))


def _reap_orphans() -> None:
    """As a subreaper we inherit orphaned grandchildren; collect those that have exited."""
    for pid in _children(os.getpid()):
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                os.waitpid(pid, os.WNOHANG)
        except (OSError, IndexError, ChildProcessError):
            pass


def become_subreaper() -> bool:
    """Make this process the child subreaper of its descendants (Linux prctl): a grandchild whose parent
    exits is re-parented here instead of to init, so ``descendants(os.getpid())`` still finds it when the
    tree is stopped. Returns False where unsupported. Meant for the ``dpdro`` command's process only."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """Within the block, SIGTERM and SIGHUP raise ``TerminatedBySignal`` and SIGINT raises KeyboardInterrupt
    in the main thread, so ``finally``/``__exit__`` cleanup runs (it stops the children). A second signal
    during that cleanup is ignored, so the cleanup itself is not cut short. Previous handlers are restored
    afterwards. Outside the main thread it does nothing (Python only runs handlers there)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    sigs = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
    previous = {s: signal.getsignal(s) for s in sigs}

    def handler(signum, frame):  # noqa: ARG001 - signal handler signature
        for s in sigs:  # cleanup must not be interrupted by a repeated Ctrl-C / kill
            signal.signal(s, signal.SIG_IGN)
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise TerminatedBySignal(signum)

    for s in sigs:
        signal.signal(s, handler)
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def stop_descendants(grace: float = STOP_GRACE) -> list[int]:
    """Stop every process below this one (``stop_tree`` on its children): the last sweep of a command that
    started Flower processes, catching orphans re-parented here by ``become_subreaper``. Returns the PIDs
    still alive afterwards."""
    return stop_tree(_children(os.getpid()), grace=grace)
