"""Run a configuration on Flower's simulation engine through the real ``flwr run`` and wait for it.

Handles Flower 1.42's pitfalls (docs/explanation/FLOWER.md 3.1-3.3, 7): ``flwr run`` exits 0 even when the ServerApp
fails, so the run's status is read with ``flwr ls``; the per-run ``uv sync`` is disabled
(FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1) so the app runs in this environment; FLWR_HOME defaults to
``<app>/.flwr`` so the user's ~/.flwr is untouched.

The SuperLink is our own: Flower's ``:local:`` connection reuses whatever answers ``/health`` on the fixed
port 39091 (``FLWR_LOCAL_SUPERLINK_HTTP_API_PORT``), so another checkout's SuperLink there would run the job
with *its* code. Instead this module starts ``flower-superlink --simulation`` (the command Flower's CLI
uses for ``:local:``, in-memory state) on a free port chosen at start, checks that the process listening on
that port is the one it started (/proc), and points ``flwr`` at it with an explicit connection in a private
CLI FLWR_HOME. Nothing it starts listens beyond 127.0.0.1: the SuperLink is given ``--host 127.0.0.1``, and Ray
runs as a single-machine node on 127.0.0.1 (``RAY_LOOPBACK_ONLY``; an environment that sets that variable to 1
asks for Ray's cluster mode, which listens on every interface). It is stopped, with every descendant
(SuperExec, the simulation, Ray), when the run ends, fails, or the process gets SIGTERM/SIGINT;
``keep_superlink=True`` keeps it for the next call in this process only (stopped at exit).
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from ..common import faults
from ..common.config import Config, toml_value
from ..common.data import pin_data_paths
from ..common.errors import DpdroError
from ..common.partition import refuse_node_local
from ..server.rundir import RunDir, check_out_dir, read_json
from .flwr_output import require_run_id, run_status
from .processes import HOST, descendants, free_port, listener_pids, stop_on_signals, stop_tree

log = logging.getLogger(__name__)

CONNECTION = "dpdro-local"
# Flower's reason for failing a run whose app stopped sending heartbeats to the SuperLink (flwr 1.42).
HEARTBEAT_LOST = "No heartbeat received"
STARTUP_TIMEOUT = 60.0
# Ray's switch between a single-machine and a cluster node (ray._private.ray_constants.ENABLE_RAY_CLUSTER; on by
# default on Linux). Off, Ray takes 127.0.0.1 as the node's address, and its GCS, raylet (node and object manager),
# runtime-env agent, driver and workers then listen on 127.0.0.1 only; on, they listen on every interface (measured
# with Ray 2.55 under Flower 1.42: eight listeners on '::' and one on the machine's address during a 3-node run).
# Flower 1.42's federation config cannot pass Ray's ``_node_ip_address`` (it carries only num-cpus, num-gpus,
# logging-level and log-to-driver into ``ray.init``), and Ray replaces 127.0.0.1 given there by the machine's
# address in cluster mode anyway (``services.resolve_ip_for_localhost``).
RAY_LOOPBACK_ONLY = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


class SimulationError(RuntimeError, DpdroError):
    """The Flower run failed or did not finish; the message carries Flower's status and log tail."""


def run_config_string(cfg: Config) -> str:
    """Every key as Flower's --run-config string ('key=value key2="text" ...')."""
    return " ".join(f"{k}={toml_value(v)}" for k, v in cfg.to_dict().items())


def _flwr(*args: str) -> list[str]:
    exe = Path(sys.executable).with_name("flwr")
    return [str(exe) if exe.exists() else "flwr", *args]


def _bin(name: str) -> str:
    exe = Path(sys.executable).with_name(name)
    return str(exe) if exe.exists() else name


@dataclass
class LocalSuperLink:
    """A simulation SuperLink started by this process: its Popen, HTTP port, the FLWR_HOME it runs with, the
    private CLI FLWR_HOME holding the ``dpdro-local`` connection, and its log file."""

    popen: subprocess.Popen
    port: int
    flwr_home: Path
    cli_home: Path
    log: Path
    fault: str = ""  # the test hook $DPDRO_INJECT_FAULT it was started with (its apps inherit its environment)

    def alive_and_ours(self) -> bool:
        """Still running and still the listener on its port."""
        return self.popen.poll() is None and bool(listener_pids(self.port, [self.popen.pid]))

    def stop(self, remove_log: bool = True) -> list[int]:
        """Stop it and every descendant (SuperExec, simulation, Ray) by PID; remove the CLI home (and the log
        unless ``remove_log`` is False: kept after a failure). Returns PIDs still alive (empty when all
        stopped)."""
        left = stop_tree([self.popen.pid], descendants(self.popen.pid))
        shutil.rmtree(self.cli_home, ignore_errors=True)
        if remove_log:
            self.log.unlink(missing_ok=True)
        return left


_OURS: LocalSuperLink | None = None  # the SuperLink this process started and keeps (keep_superlink=True)


def _health(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://{HOST}:{port}/health", timeout=1):
            return True
    except OSError:
        return False


def start_local_superlink(flwr_home: Path, env: dict) -> LocalSuperLink:
    """Start ``flower-superlink --insecure --simulation`` on a free port of 127.0.0.1 (new session, FLWR_HOME
    ``flwr_home``, log ``<flwr_home>/dpdro-superlink-<port>.log``) and wait until it answers. Raises
    SimulationError if it exits, does not answer within STARTUP_TIMEOUT seconds, or if the process that
    answers on the port is not the one started here (it is then stopped)."""
    flwr_home.mkdir(parents=True, exist_ok=True)
    port = free_port()
    log = flwr_home / f"dpdro-superlink-{port}.log"
    cmd = [_bin("flower-superlink"), "--insecure", "--simulation", "--isolation", "subprocess", "--host", HOST,
           "--port", str(port)]
    with open(log, "ab") as f:
        popen = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 cwd=flwr_home, start_new_session=True)
    cli_home = flwr_home / f"dpdro-cli-{port}"
    cli_home.mkdir(parents=True, exist_ok=True)
    (cli_home / "config.toml").write_text(f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\n'
                                          f'address = "{HOST}:{port}"\ninsecure = true\n')
    link = LocalSuperLink(popen, port, flwr_home, cli_home, log, env.get(faults.ENV, ""))
    deadline = time.monotonic() + STARTUP_TIMEOUT
    try:
        while not _health(port):
            if popen.poll() is not None:
                raise SimulationError(f"flower-superlink exited with code {popen.returncode} before answering on "
                                      f"{HOST}:{port}; log {log}:\n{_tail(log)}")
            if time.monotonic() > deadline:
                raise SimulationError(f"flower-superlink did not answer on {HOST}:{port} within "
                                      f"{STARTUP_TIMEOUT:g} s; log {log}:\n{_tail(log)}")
            time.sleep(0.2)
        if not link.alive_and_ours():
            raise SimulationError(f"{HOST}:{port} answers, but not from the SuperLink started here (PID "
                                  f"{popen.pid}): another process took the port; refusing to submit the job to it")
    except BaseException:
        link.stop(remove_log=False)
        raise
    return link


def _tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def stop_local_superlink(flwr_home: Path | None = None, remove_log: bool = True) -> None:  # noqa: ARG001
    """Stop the SuperLink this process started and kept (``keep_superlink=True``), if any, by PID. Never
    touches a SuperLink started by anyone else (``flwr_home`` is ignored; kept for old callers)."""
    global _OURS
    if _OURS is not None:
        _OURS.stop(remove_log=remove_log)
        _OURS = None


atexit.register(stop_local_superlink)


def _status(run_id: str, env: dict) -> tuple[str, str]:
    return run_status(subprocess.run(_flwr("ls", CONNECTION, "--run-id", run_id, "--format", "json"), env=env,
                                     capture_output=True, text=True, timeout=60))


def _our_superlink(flwr_home: Path, env: dict) -> LocalSuperLink:
    """The SuperLink this process kept, if it still runs with this FLWR_HOME and holds its port; else a new
    one (the stale one stopped)."""
    global _OURS
    if (_OURS is not None and _OURS.flwr_home == flwr_home and _OURS.fault == env.get(faults.ENV, "")
            and _OURS.alive_and_ours()):
        return _OURS
    stop_local_superlink()
    _OURS = start_local_superlink(flwr_home, env)
    return _OURS


def run_simulation(cfg: Config, app_dir: Path = Path("."), stream: bool = True, timeout: float = 24 * 3600,
                   keep_superlink: bool = False) -> dict:
    """Run ``cfg`` with ``flwr run`` on ``cfg.num_clients`` simulated SuperNodes; return summary.json.

    The job goes to a SuperLink this call (or, with ``keep_superlink``, an earlier call in this process)
    started on a free port, never to one listening elsewhere (module docstring). Relative paths (out-dir,
    data-root, cache-dir) are made absolute here, since the ServerApp and ClientApps run in other processes
    and directories. Raises ConfigError before Flower starts if out-dir is not empty (without config key
    resume or overwrite), DataError if the data set cannot be found, SimulationError if the run fails. The
    SuperLink and all its descendants are stopped when the call ends (unless ``keep_superlink`` and it
    succeeded), also on SIGTERM/SIGHUP (``TerminatedBySignal`` then propagates) and Ctrl-C.
    """
    refuse_node_local(cfg.partition)  # simulated nodes have no data of their own
    app_dir = app_dir.resolve()
    cfg = cfg.with_updates({"out-dir": str(Path(cfg.out_dir).resolve())})
    check_out_dir(cfg.out_dir, resume=cfg.resume, overwrite=cfg.overwrite)  # before any work
    cfg = pin_data_paths(cfg)  # the clear DataError now, not from inside the ServerApp after Flower started
    summary_path = RunDir(cfg.out_dir).summary
    summary_path.unlink(missing_ok=True)
    run_app(app_dir, run_config_string(cfg), cfg.num_clients, stream=stream, timeout=timeout,
            keep_superlink=keep_superlink, check=lambda: summary_path.exists() or f"wrote no {summary_path}")
    return read_json(summary_path)


def run_completed(run_id: str, status: str, details: str, outputs_complete: bool = False) -> bool:
    """Whether a Flower run that ended with ``status`` ('finished:...') and ``details`` completed:
    'finished:completed', or 'finished:failed' for a lost heartbeat (``HEARTBEAT_LOST``) when
    ``outputs_complete`` (the caller's check of the run's outputs passed). Flower fails a run when the SuperLink
    misses its app's heartbeats, which a starved CPU causes even after the ServerApp has finished (seen on a
    2-core machine running two other jobs); complete outputs (dpdro: summary.json, written last) show the result
    stands, and a warning says so."""
    if status == "finished:completed":
        return True
    if status == "finished:failed" and HEARTBEAT_LOST in details and outputs_complete:
        log.warning("Flower run %s ended with status %r (%s) after its ServerApp finished: its outputs are "
                    "complete, so the run stands", run_id, status, details)
        return True
    return False


def run_app(app_dir: Path, run_config: str, num_supernodes: int, *, stream: bool = False,
            timeout: float = 24 * 3600, keep_superlink: bool = False, check=None,
            flwr_home: Path | None = None) -> None:
    """Run any Flower app (``app_dir``, e.g. dpdro itself or ``simulations/fedavg_app``) with ``flwr run`` on
    ``num_supernodes`` simulated SuperNodes (one CPU each) of this process's own SuperLink, with the run config
    string ``run_config``, and wait until it finishes. ``check()`` (optional), called after the run completed,
    returns True or the reason the run is not complete. Raises SimulationError if the run does not complete or
    the check fails; the SuperLink is stopped as in ``run_simulation``. FLWR_HOME: ``flwr_home``, else the
    environment's, else ``<app_dir>/.flwr``."""
    env = dict(os.environ)
    if flwr_home is not None:
        env["FLWR_HOME"] = str(flwr_home)
    flwr_home = Path(env.setdefault("FLWR_HOME", str(app_dir / ".flwr"))).resolve()
    env["FLWR_HOME"] = str(flwr_home)
    env["FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION"] = "1"
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    env.setdefault(RAY_LOOPBACK_ONLY, "0")  # Ray on 127.0.0.1 only (module docstring)
    fed = f"num-supernodes={num_supernodes} client-resources-num-cpus=1"
    log_proc = None
    ok = False
    with stop_on_signals():
        try:
            link = _our_superlink(flwr_home, env)
            cli_env = {**env, "FLWR_HOME": str(link.cli_home)}  # the flwr CLI sees only the dpdro-local connection
            out = subprocess.run(_flwr("run", str(app_dir), CONNECTION, "--format", "json", "--federation-config",
                                       fed, "--run-config", run_config),
                                 env=cli_env, capture_output=True, text=True, timeout=300)
            run_id = require_run_id(out, SimulationError)
            if stream:
                log_proc = subprocess.Popen(_flwr("log", run_id, CONNECTION, "--stream"), env=cli_env)
            deadline = time.monotonic() + timeout
            status, details = "pending", ""
            while time.monotonic() < deadline:
                status, details = _status(run_id, cli_env)
                if status.startswith("finished"):
                    break
                time.sleep(2)
            if log_proc is not None:
                time.sleep(1.5)  # let the log stream flush its last lines
            reason = check() if check is not None else True  # once: it may read files the run wrote
            if not run_completed(run_id, status, details, outputs_complete=check is not None and reason is True):
                tail = subprocess.run(_flwr("log", run_id, CONNECTION, "--show"), env=cli_env, capture_output=True,
                                      text=True, timeout=60).stdout[-3000:]
                raise SimulationError(f"Flower run {run_id} ended with status {status!r} {details}\n{tail}")
            if reason is not True:
                raise SimulationError(f"Flower run {run_id} completed but {reason}")
            ok = True
        finally:
            if log_proc is not None:
                stop_tree([log_proc.pid], grace=5.0)
            if not (ok and keep_superlink):
                stop_local_superlink(remove_log=ok)
