"""A warm worker per SuperNode: the ClientApp side.

Flower 1.42's deployment runs every message in a fresh ``flwr-clientapp`` process (its SuperExec's subprocess executor
launches one per task; the warm executors are Kubernetes-only and not for ClientApps: docs/explanation/FLOWER.md 3.4).
Importing torch and rebuilding the shard and model then costs seconds per message. So the ClientApp hands the
computation to a long-lived process of the same node, its *warm worker* (``client/flower/warm_daemon.py``), which
keeps torch imported and the node's ``ShardWorker`` (shard and model) built across messages and runs.

What stays in the ClientApp, unchanged: configuration and partition checks, the model versions in
``context.state`` (sent along with every request), the 'missing model versions' check, the reply. The warm
worker is a pure function of (config, partition, queries, versions): ``ShardWorker.answer`` as before, so the
releases, their noise (PCG64 seeded from the OS CSPRNG, or from the reproducible seed) and the ledger are the
same as in the ClientApp.

- One warm worker per node: keyed by the SuperExec that launches the node's ClientApps (the ClientApp's parent),
  the Flower node id and a fingerprint of dpdro's source files (an edited installation starts a new one).
- It listens on a Unix socket in ``<tmp>/dpdro-warm-<uid>`` (mode 0700, checked to be ours), and a request is
  accepted only with the 32-byte key of a 0600 file next to it (``multiprocessing.connection``'s HMAC challenge);
  it holds the node's records, as the ClientApp process does, and nothing leaves the node through it.
- It is started by the first message that finds none (under a file lock), stays in the SuperNode's process group
  (stopping the SuperNode's group stops it), and exits by itself when its SuperExec is gone or after
  ``warm-seconds`` without a request (node config key; 0 turns the warm worker off on that node).
- Any failure to reach it (not started within ``START_TIMEOUT`` s, died mid-request) makes the ClientApp compute
  the reply itself, as before; an exception raised by the computation is re-raised unchanged.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ...common.atomic import atomic_write_bytes
from ...common.errors import RunFailed

log = logging.getLogger(__name__)

DEFAULT_IDLE_SECONDS = 600.0  # node config warm-seconds: exit after this long without a request
START_TIMEOUT = 180.0  # a cold start imports torch and builds the shard: seconds on a loaded machine
NODE_KEY = "warm-seconds"
_SOURCE = Path(__file__).resolve().parents[1].parent  # the folder holding client/, common/, server/


class WarmUnavailable(RuntimeError, RunFailed):
    """The warm worker could not be reached or did not answer; the ClientApp computes the reply itself."""


def idle_seconds(node_config) -> float:
    """The node's ``warm-seconds`` (default ``DEFAULT_IDLE_SECONDS``); 0 means no warm worker. ValueError naming
    the key for a value that is not a number >= 0."""
    raw = node_config.get(NODE_KEY, DEFAULT_IDLE_SECONDS)
    try:
        value = float(raw)
    except (TypeError, ValueError):
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"node config key {NODE_KEY!r}: got {raw!r}; allowed: a number of seconds >= 0 (0 turns "
                         "the warm worker off)")
    return value


def in_deployment() -> bool:
    """True in a ``flwr-clientapp`` process (Flower's deployment runtime), where each message is a new process;
    False in the simulation engine's long-lived actors and in tests, which need no warm worker."""
    return Path(sys.argv[0]).name == "flwr-clientapp" if sys.argv else False


def source_fingerprint(root: Path = _SOURCE) -> str:
    """Hash of the names, sizes and modification times of dpdro's Python files under ``root`` (cheap: stat
    only): a warm worker started from other code is never used."""
    h = hashlib.sha256()
    for sub in ("client", "common", "server", "dpdro"):
        for p in sorted((root / sub).rglob("*.py")):
            st = p.stat()
            h.update(f"{p.relative_to(root)}:{st.st_size}:{st.st_mtime_ns};".encode())
    return h.hexdigest()[:16]


def socket_dir() -> Path:
    """``<tmp>/dpdro-warm-<uid>``, created with mode 0700. PermissionError if it exists but is not this user's
    own private folder (another user could otherwise listen in our place)."""
    d = Path(tempfile.gettempdir()) / f"dpdro-warm-{os.getuid()}"
    d.mkdir(mode=0o700, exist_ok=True)
    st = d.lstat()
    if not d.is_dir() or d.is_symlink() or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionError(f"{d} is not a private folder of uid {os.getuid()} (mode {oct(st.st_mode)}, owner "
                              f"{st.st_uid}): remove it")
    return d


class Endpoint:
    """Where one node's warm worker listens: ``address`` (Unix socket), ``key_file`` (its 32-byte key),
    ``lock_file`` (serialises starts) and ``log_file``; all in ``socket_dir()``, named by ``node_key``."""

    def __init__(self, node_key: str, folder: Path | None = None) -> None:
        folder = folder if folder is not None else socket_dir()
        self.address = str(folder / f"{node_key}.sock")
        self.key_file = folder / f"{node_key}.key"
        self.lock_file = folder / f"{node_key}.lock"
        self.log_file = folder / f"{node_key}.log"

    @classmethod
    def for_node(cls, node_id: int, watch_pid: int) -> Endpoint:
        """The endpoint of node ``node_id`` whose ClientApps are launched by process ``watch_pid``."""
        h = hashlib.sha256(f"{watch_pid}:{node_id}:{source_fingerprint()}".encode()).hexdigest()[:20]
        return cls(h)

    def key(self) -> bytes:
        return self.key_file.read_bytes()


def _connect(ep: Endpoint):
    from multiprocessing.connection import Client

    return Client(ep.address, family="AF_UNIX", authkey=ep.key())


def _start(ep: Endpoint, idle: float, watch_pid: int) -> subprocess.Popen:
    """A new warm worker for ``ep``: a fresh key file (0600, atomic), then the process, in this process group."""
    atomic_write_bytes(ep.key_file, secrets.token_bytes(32), mode=0o600)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(ep.address)  # a stale socket of a dead worker
    env = dict(os.environ)
    # the same module search path as this process (Flower puts the unpacked FAB first on sys.path)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    cmd = [sys.executable, "-m", "dpdro.client.flower.warm_daemon", "--address", ep.address,
           "--key-file", str(ep.key_file), "--idle", str(idle), "--watch-pid", str(watch_pid)]
    with open(ep.log_file, "ab") as logf:
        return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT, env=env,
                                close_fds=True)


def connect_or_start(ep: Endpoint, idle: float, watch_pid: int, timeout: float = START_TIMEOUT):
    """A connection to ``ep``'s warm worker, starting one if none answers (at most one start at a time, under
    ``ep.lock_file``). Raises WarmUnavailable if it does not answer within ``timeout`` seconds."""
    import fcntl
    from multiprocessing import AuthenticationError

    with open(ep.lock_file, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            return _connect(ep)
        except (OSError, EOFError, AuthenticationError):
            pass
        proc = _start(ep, idle, watch_pid)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise WarmUnavailable(f"warm worker exited with status {proc.returncode} (log {ep.log_file})")
            try:
                return _connect(ep)
            except (OSError, EOFError, AuthenticationError):
                time.sleep(0.05)
        raise WarmUnavailable(f"warm worker did not answer within {timeout:g} s (log {ep.log_file})")


def call(ep: Endpoint, idle: float, watch_pid: int, request: dict):
    """Send ``request`` (a dict, see ``warm_daemon.handle``) to the node's warm worker and return its result.
    An exception raised there is raised here unchanged; WarmUnavailable if the worker cannot be reached or
    drops the connection."""
    conn = connect_or_start(ep, idle, watch_pid)
    try:
        with conn:
            conn.send(request)
            ok, value = conn.recv()
    except (OSError, EOFError) as e:
        raise WarmUnavailable(f"warm worker dropped the request: {e}") from e
    if not ok:
        raise value
    return value
