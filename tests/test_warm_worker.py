"""The warm worker of a deployed node (client/flower/warm.py, warm_daemon.py): a long-lived process that keeps
torch, the shard and the model across messages. Its replies must be the ClientApp's own, bit for bit (the
releases and their noise are unchanged), errors must come back unchanged, and it must not outlive its node."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from dpdro.common.config import Config
from dpdro.common.faults import RUN_CONFIG_KEY
from dpdro.common.messages import Point, Query


def _write_csv(path: Path, n: int, seed: int) -> None:
    """n records 'f1,f2,label' in [0, 10] (label 'yes' when f1 > f2)."""
    rng = np.random.default_rng(seed)
    rows = ["f1,f2,label"] + [f"{a:.3f},{b:.3f},{'yes' if a > b else 'no'}" for a, b in rng.uniform(0, 10, (n, 2))]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(rows) + "\n")


@pytest.fixture
def short_dir():
    """A folder with a short path (a Unix socket's path is limited to 107 bytes; pytest's tmp_path is long)."""
    d = Path(tempfile.mkdtemp(prefix="dpdro-wt-", dir="/tmp"))
    os.chmod(d, 0o700)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def csv_cfg(tmp_path) -> Config:
    _write_csv(tmp_path / "data" / "train.csv", 300, 1)
    _write_csv(tmp_path / "data" / "test.csv", 100, 2)
    return Config.from_mapping({"dataset": "csv", "csv-bounds": "0:10", "data-root": str(tmp_path / "data"),
                                "cache-dir": str(tmp_path / "c"),
                                "num-clients": 2, "reproducible": True, "reproducible-for-testing": True,
                                "seed": 3, "threads": 1})


def _daemon_pids(log_file: Path) -> list[int]:
    return [int(p) for p in re.findall(r"warm\[(\d+)\] serving", log_file.read_text())]


def _wait_gone(pid: int, seconds: float) -> bool:
    from dpdro.common.process_state import alive

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.1)
    return False


@pytest.fixture
def watched():
    """A stand-in for the SuperExec the warm worker watches."""
    proc = subprocess.Popen(["sleep", "300"])
    yield proc
    proc.kill()
    proc.wait()


def test_warm_worker_replies_are_the_clientapps_own_and_it_exits_with_its_node(csv_cfg, short_dir, watched):
    """Refresh, difference and client-noised queries answered by the warm worker equal, bit for bit, those of
    the ClientApp's in-process worker (reproducible mode); the second request reuses the same process; a
    computation's exception comes back unchanged; a wrong key is refused; and the worker exits once the process
    it watches (its SuperExec) is gone, removing its socket."""
    from multiprocessing import AuthenticationError
    from multiprocessing.connection import Client

    from dpdro.client.flower import warm
    from dpdro.client.flower.app import _worker

    local = _worker(csv_cfg, 1)
    d = local.model.dim
    rng = np.random.default_rng(0)
    versions = {0: rng.normal(size=d), 1: rng.normal(size=d)}
    queries = [Query(4, "x-refresh", "dual-x", (Point(1, 0.3),), 0.5, 1.0, d),
               Query(4, "x-diff", "dual-x", (Point(1, 0.3), Point(0, 0.2)), 0.5, 0.1, d),
               Query(5, "x-refresh", "dual-x", (Point(0, 0.2),), 0.5, 1.0, d, noise_std=0.7)]
    expected = [local.answer(q, versions) for q in queries]
    ep = warm.Endpoint("t", short_dir)
    base = {"config": csv_cfg.to_dict(), "partition": 1}
    try:
        assert warm.call(ep, 60, watched.pid, {**base, "op": "records"}) == local.num_records == 150
        got = warm.call(ep, 60, watched.pid, {**base, "op": "answer", "queries": queries, "versions": versions})
        assert [(r.qid, r.partition, r.count) for r in got] == [(r.qid, r.partition, r.count) for r in expected]
        for a, b in zip(got, expected, strict=True):
            assert a.total.dtype == b.total.dtype and np.array_equal(a.total, b.total)
        assert len(_daemon_pids(ep.log_file)) == 1  # one start for both requests
        pid = _daemon_pids(ep.log_file)[0]

        faulty = {"config": {**csv_cfg.to_dict(), RUN_CONFIG_KEY: "1:4:raise"}, "partition": 1}
        with pytest.raises(RuntimeError, match=r"^injected failure of partition 1 at iteration 4 \(injected fault\)$"):
            warm.call(ep, 60, watched.pid, {**faulty, "op": "answer", "queries": queries[:1], "versions": versions})
        with pytest.raises(ValueError, match="op='nope'"):
            warm.call(ep, 60, watched.pid, {**base, "op": "nope"})
        with pytest.raises(AuthenticationError):
            Client(ep.address, family="AF_UNIX", authkey=b"x" * 32)
        assert warm.call(ep, 60, watched.pid, {**base, "op": "records"}) == 150  # still serving
        assert _daemon_pids(ep.log_file) == [pid]
        assert oct(os.stat(ep.key_file).st_mode & 0o777) == "0o600"

        watched.kill()
        watched.wait()
        assert _wait_gone(pid, 10), "the warm worker outlived the process it watches"
        assert not Path(ep.address).exists()
    finally:
        for p in _daemon_pids(ep.log_file) if ep.log_file.exists() else []:
            with contextlib.suppress(OSError):
                os.kill(p, signal.SIGKILL)


def test_warm_worker_exits_when_idle(csv_cfg, short_dir, watched):
    from dpdro.client.flower import warm

    ep = warm.Endpoint("i", short_dir)
    try:
        assert warm.call(ep, 1.0, watched.pid, {"config": csv_cfg.to_dict(), "partition": 0, "op": "records"}) == 150
        pid = _daemon_pids(ep.log_file)[0]
        assert _wait_gone(pid, 15), "the warm worker did not exit after warm-seconds without a request"
    finally:
        for p in _daemon_pids(ep.log_file) if ep.log_file.exists() else []:
            with contextlib.suppress(OSError):
                os.kill(p, signal.SIGKILL)


def test_warm_seconds_node_key_and_where_the_warm_worker_is_used():
    from dpdro.client.flower import warm

    assert warm.idle_seconds({}) == warm.DEFAULT_IDLE_SECONDS
    assert warm.idle_seconds({"warm-seconds": 0}) == 0.0
    assert warm.idle_seconds({"warm-seconds": "30"}) == 30.0
    for bad in (-1, "soon", float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"node config key 'warm-seconds': got .*; allowed: a number of seconds"):
            warm.idle_seconds({"warm-seconds": bad})
    assert not warm.in_deployment()  # pytest: the ClientApp computes in its own process


def test_warm_socket_folder_must_be_private(tmp_path, monkeypatch):
    from dpdro.client.flower import warm

    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    assert oct(warm.socket_dir().stat().st_mode & 0o777) == "0o700"
    os.chmod(tmp_path / f"dpdro-warm-{os.getuid()}", 0o755)
    with pytest.raises(PermissionError, match="is not a private folder"):
        warm.socket_dir()


def test_clientapp_computes_itself_when_the_warm_worker_is_off_or_unreachable(monkeypatch):
    """node config warm-seconds=0 never contacts a warm worker; an unreachable one (WarmUnavailable) makes the
    ClientApp compute the reply itself (None here); an error of the computation itself is raised unchanged."""
    from flwr.app import Context, RecordDict

    from dpdro.client.flower import app, warm

    calls = []

    def fake_call(ep, idle, watch_pid, request):
        calls.append((idle, request["op"]))
        raise behaviour.pop(0)

    monkeypatch.setattr(warm, "in_deployment", lambda: True)
    monkeypatch.setattr(warm, "call", fake_call)
    monkeypatch.setattr(warm.Endpoint, "for_node", classmethod(lambda cls, node_id, watch_pid: cls("x", Path("/"))))

    def context(node_config):
        return Context(run_id=1, node_id=7, node_config=node_config, state=RecordDict(), run_config={})

    assert app._on_warm_worker(context({"warm-seconds": 0}), {"op": "records"}) is None and calls == []
    behaviour = [warm.WarmUnavailable("did not answer"), KeyError("missing model versions [3]")]
    assert app._on_warm_worker(context({"warm-seconds": 5}), {"op": "records"}) is None
    with pytest.raises(KeyError, match="missing model versions"):
        app._on_warm_worker(context({}), {"op": "answer"})
    assert calls == [(5.0, "records"), (warm.DEFAULT_IDLE_SECONDS, "answer")]
