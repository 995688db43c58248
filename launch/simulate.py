"""Run a configuration on Flower's simulation engine through the real ``flwr run`` and wait for it.

Handles Flower 1.42's pitfalls (FLOWER.md 3.1-3.3, 7): ``flwr run`` exits 0 even when the ServerApp
fails, so the run's status is read with ``flwr ls``; the per-run ``uv sync`` is disabled
(FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1) so the app runs in this environment; FLWR_HOME defaults to
``<app>/.flwr`` so the user's ~/.flwr is untouched; the auto-started local SuperLink, a detached daemon,
is stopped afterwards if this call started it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from ..common.config import Config, toml_value
from ..common.data import DataError, data_missing, resolve_cache_dir, resolve_data_root
from ..server.rundir import RunDir, read_json

LOCAL_SUPERLINK_HEALTH = "http://127.0.0.1:39091/health"


class SimulationError(RuntimeError):
    """The Flower run failed or did not finish; the message carries Flower's status and log tail."""


def run_config_string(cfg: Config) -> str:
    """Every key as Flower's --run-config string ('key=value key2="text" ...')."""
    return " ".join(f"{k}={toml_value(v)}" for k, v in cfg.to_dict().items())


def _flwr(*args: str) -> list[str]:
    exe = Path(sys.executable).with_name("flwr")
    return [str(exe) if exe.exists() else "flwr", *args]


def _superlink_up() -> bool:
    try:
        with urllib.request.urlopen(LOCAL_SUPERLINK_HEALTH, timeout=1):
            return True
    except OSError:
        return False


def _local_superlink_pids(flwr_home: Path) -> list[int]:
    pids = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "flower-superlink" in cmd and str(flwr_home) in cmd:
            pids.append(int(proc.name))
    return pids


def stop_local_superlink(flwr_home: Path) -> None:
    """Stop the local SuperLink that ``flwr run`` auto-started with this FLWR_HOME (by PID)."""
    for pid in _local_superlink_pids(flwr_home):
        try:
            os.kill(pid, signal.SIGTERM)
        except OSError:
            pass
    deadline = time.monotonic() + 10
    while _local_superlink_pids(flwr_home) and time.monotonic() < deadline:
        time.sleep(0.2)


def _status(run_id: str, env: dict) -> tuple[str, str]:
    out = subprocess.run(_flwr("ls", "--run-id", run_id, "--format", "json"), env=env, capture_output=True,
                         text=True, timeout=60)
    try:
        run = json.loads(out.stdout)["runs"][0]
        return run["status"], run.get("status-details", "")
    except (ValueError, KeyError, IndexError):
        return "unknown", out.stdout[-500:] + out.stderr[-500:]


def run_simulation(cfg: Config, app_dir: Path = Path("."), stream: bool = True, timeout: float = 24 * 3600,
                   keep_superlink: bool = False) -> dict:
    """Run ``cfg`` with ``flwr run`` on ``cfg.num_clients`` simulated SuperNodes; return summary.json.

    Relative paths (out-dir, data-root, cache-dir) are made absolute here, since the ServerApp and
    ClientApps run in other processes and directories. Raises DataError before Flower starts if the data set
    cannot be found, SimulationError if the run fails.
    """
    app_dir = app_dir.resolve()
    cfg = cfg.with_updates({"out-dir": str(Path(cfg.out_dir).resolve()),
                            "data-root": str(resolve_data_root(cfg.data_root).resolve()),
                            "cache-dir": str(resolve_cache_dir(cfg.cache_dir).resolve())})
    missing = data_missing(cfg)  # the clear DataError now, not from inside the ServerApp after Flower started
    if missing:
        raise DataError(missing)
    env = dict(os.environ)
    flwr_home = Path(env.setdefault("FLWR_HOME", str(app_dir / ".flwr"))).resolve()
    env["FLWR_HOME"] = str(flwr_home)
    env["FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION"] = "1"
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    started_superlink = not _superlink_up()
    summary_path = RunDir(cfg.out_dir).summary
    summary_path.unlink(missing_ok=True)
    fed = f"num-supernodes={cfg.num_clients} client-resources-num-cpus=1"
    try:
        out = subprocess.run(_flwr("run", str(app_dir), "--format", "json", "--federation-config", fed,
                                   "--run-config", run_config_string(cfg)),
                             env=env, capture_output=True, text=True, timeout=300)
        try:
            run_id = str(json.loads(out.stdout)["run-id"])
        except (ValueError, KeyError):
            raise SimulationError(
                f"flwr run did not start a run:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}") from None
        log_proc = None
        if stream:
            log_proc = subprocess.Popen(_flwr("log", run_id, "--stream"), env=env)
        deadline = time.monotonic() + timeout
        status, details = "pending", ""
        while time.monotonic() < deadline:
            status, details = _status(run_id, env)
            if status.startswith("finished"):
                break
            time.sleep(2)
        if log_proc is not None:
            time.sleep(1.5)  # let the log stream flush its last lines
            log_proc.terminate()
            log_proc.wait(timeout=30)
        if status != "finished:completed":
            tail = subprocess.run(_flwr("log", run_id, "--show"), env=env, capture_output=True, text=True,
                                  timeout=60).stdout[-3000:]
            raise SimulationError(f"Flower run {run_id} ended with status {status!r} {details}\n{tail}")
        if not summary_path.exists():
            raise SimulationError(f"Flower run {run_id} completed but wrote no {summary_path}")
        return read_json(summary_path)
    finally:
        if started_superlink and not keep_superlink:
            stop_local_superlink(flwr_home)
