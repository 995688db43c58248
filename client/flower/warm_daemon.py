"""The warm worker process of one SuperNode (``client/flower/warm.py`` explains why and how it is reached).

    python -m dpdro.client.flower.warm_daemon --address SOCK --key-file KEY --idle SECONDS --watch-pid PID

Serves requests on the Unix socket SOCK (each connection must prove KEY's bytes: ``multiprocessing.connection``'s
HMAC challenge), one thread per connection, with the ClientApp's own cached ``ShardWorker`` (``app._worker``:
shard and model built once per run configuration and partition). Requests are dicts:

- ``{"op": "records", "config": {...}, "partition": p}`` -> the shard's number of records;
- ``{"op": "answer", "config": {...}, "partition": p, "queries": [Query], "versions": {id: (d,) array}}``
  -> ``[Reply]``, ``ShardWorker.answer`` of each query in order.

The answer is ``(True, value)``, or ``(False, exception)`` for an exception raised by the work (re-raised by
the ClientApp). Exits when process PID is gone (the SuperExec that launches the node's ClientApps), after SECONDS
without a request, or on SIGTERM/SIGHUP (its SuperNode's process group being stopped), removing its socket and key.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import threading
import time

from ...common.process_state import alive

log = logging.getLogger(__name__)
WATCH_SECONDS = 0.5  # how often the watched process and the idle time are checked


def handle(request: dict):
    """The value for one request (see the module docstring). ValueError for an unknown ``op``."""
    from ...common import faults
    from ...common.config import Config
    from .app import _worker

    os.environ.pop(faults.ENV, None)  # this request's fault, if any, and no earlier one
    cfg = Config.from_mapping(faults.adopt(request["config"]), warn=False)
    worker = _worker(cfg, int(request["partition"]))
    if request["op"] == "records":
        return worker.num_records
    if request["op"] == "answer":
        return [worker.answer(q, request["versions"]) for q in request["queries"]]
    raise ValueError(f"warm worker request op={request['op']!r}; allowed: 'records', 'answer'")


class Server:
    """Args: address (Unix socket path), key (bytes), idle (seconds), watch_pid (exit when it is gone)."""

    def __init__(self, address: str, key: bytes, idle: float, watch_pid: int, key_file: str = "") -> None:
        from multiprocessing.connection import Listener

        self.address = address
        self.key_file = key_file
        self.idle = idle
        self.watch_pid = watch_pid
        self.last = time.monotonic()
        self.busy = 0
        self.lock = threading.Lock()
        old = os.umask(0o177)  # the socket file: this user only (its folder is 0700 as well)
        try:
            self.listener = Listener(address, family="AF_UNIX", authkey=key)
        finally:
            os.umask(old)

    def _serve_one(self, conn) -> None:
        with self.lock:
            self.busy += 1
        try:
            with conn:
                request = conn.recv()
                t0 = time.perf_counter()
                try:
                    answer = (True, handle(request))
                    log.info("%s: %d queries in %.3f s", request.get("op"), len(request.get("queries", ())),
                             time.perf_counter() - t0)
                except Exception as e:  # noqa: BLE001 - handed back to the ClientApp, raised there
                    log.warning("request failed: %r", e)
                    answer = (False, e)
                conn.send(answer)
        except (OSError, EOFError) as e:
            log.warning("connection dropped: %s", e)
        finally:
            with self.lock:
                self.busy -= 1
                self.last = time.monotonic()

    def _watch(self) -> None:
        while True:
            time.sleep(WATCH_SECONDS)
            with self.lock:
                idle_for = time.monotonic() - self.last if self.busy == 0 else 0.0
            watched_gone = not alive(self.watch_pid)
            if watched_gone or (self.idle > 0 and idle_for > self.idle):
                log.info("exiting: %s", "watched process gone" if watched_gone else "idle")
                self.close()
                os._exit(0)  # accept() blocks in the main thread; nothing else needs flushing

    def close(self) -> None:
        """Stop listening and remove the socket and its key file (a later message starts a new worker)."""
        with contextlib.suppress(OSError):
            self.listener.close()
        for path in (self.address, self.key_file):
            if path:
                with contextlib.suppress(OSError):
                    os.unlink(path)

    def serve_forever(self) -> None:
        from multiprocessing import AuthenticationError

        threading.Thread(target=self._watch, daemon=True).start()
        while True:
            try:
                conn = self.listener.accept()
            except (AuthenticationError, EOFError, ConnectionError) as e:
                log.warning("refused a connection: %s", e)
                continue
            with self.lock:
                self.last = time.monotonic()
            threading.Thread(target=self._serve_one, args=(conn,), daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--address", required=True)
    p.add_argument("--key-file", required=True)
    p.add_argument("--idle", type=float, required=True)
    p.add_argument("--watch-pid", type=int, required=True)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s warm[{os.getpid()}] %(message)s")
    with open(args.key_file, "rb") as f:
        key = f.read()
    server = Server(args.address, key, args.idle, args.watch_pid, args.key_file)

    def _stop(signum, frame):  # stopping the SuperNode's process group: leave no socket behind
        server.close()
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGHUP, _stop)
    # import torch and the worker's modules now, while the ClientApp waits for the socket anyway
    from ..worker import ShardWorker  # noqa: F401
    log.info("serving %s for process %d", args.address, args.watch_pid)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
