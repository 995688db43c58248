"""Loopback deployment: a real Flower SuperLink and N SuperNodes on 127.0.0.1 with TLS and SuperNode
authentication, the SuperNodes reaching it through the Fleet-only gateway, a run submitted with
``flwr run <app> <connection>`` and waited on with ``flwr ls``.

This is the deployment of a real federation (docs/explanation/FLOWER.md 3.5, 3.6) with every process on one host,
so it can run in CI. What it does, in order:

1. certificates in ``<work>/certs`` (``launch/certs.py``: CA, SuperLink certificate with SANs localhost and
   127.0.0.1, one P-384 authentication key pair per node), reused when they already exist;
2. ``flower-superlink --ssl-ca-certfile --ssl-certfile --ssl-keyfile --enable-supernode-auth
   --disable-runtime-dependency-installation --host 127.0.0.1 --port P`` (Flower 1.42 serves the Runtime,
   Control and Fleet API on this one HTTPS port, so it listens on the operator's host only), FLWR_HOME
   ``<work>/superlink``; the process listening on P is checked to be the one started here;
3. the Fleet-only gateway (``launch.fleet_gateway``) on port F: the only port the SuperNodes use; it
   forwards ``POST /v1/fleet/*`` to P and refuses the Control and Runtime APIs (no registering, no listing
   runs from the site side);
4. ``flwr supernode register <node>.pub <connection>`` for each node, by the operator over P (the CLI's
   FLWR_HOME ``<work>/cli`` holds the connection: address and root certificate);
5. ``flower-supernode --root-certificates ca.crt --superlink 127.0.0.1:F --auth-supernode-private-key <node>
   --node-config "partition-id=i num-partitions=N ..." --port Q_i``, FLWR_HOME ``<work>/node-i``;
6. ``flwr run <app> <connection> --format json --run-config ...``, then ``flwr ls <connection> --run-id ID``
   until the status is ``finished:*`` (``flwr run`` exits 0 even when the ServerApp fails:
   docs/explanation/FLOWER.md 3.3);
7. every process this module started is stopped by its PID (its process group, then its remaining
   descendants by PID), always, also after a failure, Ctrl-C or SIGTERM (``deploy_config`` turns SIGTERM
   into an exception so the cleanup runs: ``launch.processes``).

``FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1`` is set for every process, so no ``uv sync`` runs and
the apps run in this Python environment (docs/explanation/FLOWER.md pitfall 14). Logs of every process are in
``<work>/logs``.
"""

from __future__ import annotations

import json
import os
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..common.errors import RunFailed
from .certs import CertSet, create_certificates
from .flwr_output import require_run_id, run_status
from .processes import STOP_GRACE, alive, descendants, listener_pids, stop_on_signals, stop_tree

__all__ = ["CONNECTION", "DeploymentError", "LoopbackDeployment", "RunOutcome", "alive", "deploy_config",
           "descendants", "free_ports", "override_string", "port_free"]

CONNECTION = "dpdro-loopback"
HOST = "127.0.0.1"
DEFAULT_SUPERLINK_PORT = 18000
DEFAULT_SUPERNODE_PORT = 19094
DEFAULT_FLEET_PORT = 19092


class DeploymentError(RuntimeError, RunFailed):
    """A deployment step failed; the message names the step, and carries the relevant log tail."""


@dataclass
class RunOutcome:
    """Result of one ``flwr run`` on the deployment: run id, final status (e.g. 'finished:completed'),
    Flower's status details, and seconds from submission to the final status."""

    run_id: str
    status: str
    details: str
    seconds: float
    log_tail: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "finished:completed"


def _bin(name: str) -> str:
    exe = Path(sys.executable).with_name(name)
    return str(exe) if exe.exists() else name


def port_free(port: int, host: str = HOST) -> bool:
    """True if nothing listens on host:port and it can be bound now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_ports(start: int, count: int, avoid: Sequence[int] = ()) -> list[int]:
    """``count`` free TCP ports on 127.0.0.1, scanning upward from ``start`` (ports in ``avoid`` skipped).
    Raises DeploymentError if none are found within 1000 ports."""
    out: list[int] = []
    for p in range(start, start + 1000):
        if p not in avoid and port_free(p):
            out.append(p)
            if len(out) == count:
                return out
    raise DeploymentError(f"no {count} free ports in {start}..{start + 999} on {HOST}; pass other base ports")


@dataclass
class _Proc:
    name: str
    popen: subprocess.Popen
    log: Path
    known: set[int] = field(default_factory=set)  # descendants seen so far (stopped by PID as well)


class LoopbackDeployment:
    """A SuperLink, its Fleet-only gateway and ``num_nodes`` SuperNodes on 127.0.0.1 with TLS and SuperNode
    authentication. The SuperLink's own port (Control, Runtime and Fleet API) is for the operator: the ``flwr``
    CLI and the ServerApp executor; the SuperNodes use the gateway's port (``fleet_address``).

    Args:
        work_dir: folder for certificates (``certs/``), per-process FLWR_HOME folders, the SuperLink
            database and logs (``logs/``). Created if missing.
        num_nodes: number of SuperNodes.
        node_configs: per node, a mapping added to ``partition-id=i num-partitions=N`` in --node-config
            (e.g. ``{"data-root": "/data"}``); None for none.
        superlink_port: HTTPS port of the SuperLink (None: the first free port from 18000).
        supernode_port: first port of the SuperNodes' local Runtime APIs (None: free ports from 19094).
        fleet_port: port of the Fleet-only gateway, the one the SuperNodes connect to (None: the first free
            port from 19092).
        env: extra environment for every process.
        startup_timeout: seconds to wait for the SuperLink to answer and the nodes to come online.

    Use as a context manager (``with LoopbackDeployment(...) as dep: dep.run(app, run_config)``): processes
    start on enter and are stopped on exit, whatever happened.
    """

    def __init__(self, work_dir: str | os.PathLike, num_nodes: int = 2,
                 node_configs: Sequence[Mapping[str, object]] | None = None, superlink_port: int | None = None,
                 supernode_port: int | None = None, env: Mapping[str, str] | None = None,
                 startup_timeout: float = 120.0, fleet_port: int | None = None) -> None:
        if num_nodes < 1:
            raise ValueError(f"num_nodes must be >= 1, got {num_nodes}")
        if node_configs is not None and len(node_configs) != num_nodes:
            raise ValueError(f"node_configs has {len(node_configs)} entries for {num_nodes} nodes")
        self.work = Path(work_dir).resolve()
        self.num_nodes = num_nodes
        self.node_configs = list(node_configs) if node_configs is not None else [{} for _ in range(num_nodes)]
        self.link_port = superlink_port or free_ports(DEFAULT_SUPERLINK_PORT, 1)[0]
        if supernode_port:
            self.node_ports = list(range(supernode_port, supernode_port + num_nodes))
        else:
            self.node_ports = free_ports(DEFAULT_SUPERNODE_PORT, num_nodes, avoid=[self.link_port])
        self.fleet_port = fleet_port or free_ports(DEFAULT_FLEET_PORT, 1, avoid=[self.link_port, *self.node_ports])[0]
        self.extra_env = dict(env or {})
        self.startup_timeout = startup_timeout
        self.names = [f"supernode-{i + 1}" for i in range(num_nodes)]
        self.procs: list[_Proc] = []
        self.certs: CertSet | None = None
        self.cli_home = self.work / "cli"
        self.logs = self.work / "logs"

    # ----- environment and commands -----------------------------------------------------------------
    def env(self, flwr_home: Path) -> dict[str, str]:
        """Environment of a process with its own FLWR_HOME; the venv's bin first on PATH (the SuperLink and
        SuperNodes start flower-superexec, flwr-serverapp and flwr-clientapp by name)."""
        e = dict(os.environ)
        e.update(self.extra_env)
        e["FLWR_HOME"] = str(flwr_home)
        e["FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION"] = "1"
        e["PATH"] = str(Path(sys.executable).parent) + os.pathsep + e.get("PATH", "")
        e.setdefault("PYTHONUNBUFFERED", "1")
        return e

    def superlink_command(self) -> list[str]:
        """The SuperLink command line (TLS, node authentication, no runtime dependency installation)."""
        assert self.certs is not None
        return [_bin("flower-superlink"),
                "--ssl-ca-certfile", str(self.certs.ca_cert), "--ssl-certfile", str(self.certs.server_cert),
                "--ssl-keyfile", str(self.certs.server_key), "--enable-supernode-auth",
                "--disable-runtime-dependency-installation",
                "--host", HOST, "--port", str(self.link_port),
                "--database", str(self.work / "superlink" / "state.db")]

    @property
    def control_address(self) -> str:
        """host:port of the SuperLink (Control API for the operator's ``flwr``; never given to a site)."""
        return f"{HOST}:{self.link_port}"

    @property
    def fleet_address(self) -> str:
        """host:port of the Fleet-only gateway: what a site's ``flower-supernode --superlink`` gets."""
        return f"{HOST}:{self.fleet_port}"

    def gateway_command(self) -> list[str]:
        """The Fleet-only gateway's command line (TLS with the SuperLink's certificate, upstream verified
        with the CA)."""
        assert self.certs is not None
        return [sys.executable, "-m", "dpdro.launch.fleet_gateway", "--listen", self.fleet_address,
                "--superlink", self.control_address, "--ssl-certfile", str(self.certs.server_cert),
                "--ssl-keyfile", str(self.certs.server_key), "--root-certificates", str(self.certs.ca_cert)]

    def node_config_string(self, i: int) -> str:
        """--node-config of node ``i``: partition-id, num-partitions and the node's extra keys (strings quoted
        as TOML, as Flower parses them)."""
        items: dict[str, object] = {"partition-id": i, "num-partitions": self.num_nodes, **self.node_configs[i]}
        parts = []
        for k, v in items.items():
            if isinstance(v, bool):
                parts.append(f"{k}={'true' if v else 'false'}")
            elif isinstance(v, str):
                if '"' in v or " " in v:
                    raise ValueError(f"node-config value {v!r} of {k} must not contain spaces or quotes")
                parts.append(f'{k}="{v}"')
            else:
                parts.append(f"{k}={v}")
        return " ".join(parts)

    def supernode_command(self, i: int) -> list[str]:
        """The command line of SuperNode ``i`` (0-based)."""
        assert self.certs is not None
        priv, _ = self.certs.node_keys[self.names[i]]
        return [_bin("flower-supernode"), "--root-certificates", str(self.certs.ca_cert),
                "--superlink", self.fleet_address, "--auth-supernode-private-key", str(priv),
                "--node-config", self.node_config_string(i), "--host", HOST, "--port", str(self.node_ports[i])]

    def flwr(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        """Run ``flwr ARGS`` with the CLI's FLWR_HOME (the deployment's connection); never raises on exit code."""
        return subprocess.run([_bin("flwr"), *args], env=self.env(self.cli_home), capture_output=True, text=True,
                              timeout=timeout, cwd=self.work)

    # ----- lifecycle ----------------------------------------------------------------------------------
    def _spawn(self, name: str, cmd: list[str], flwr_home: Path) -> _Proc:
        flwr_home.mkdir(parents=True, exist_ok=True)
        log = self.logs / f"{name}.log"
        with open(log, "ab") as f:
            popen = subprocess.Popen(cmd, env=self.env(flwr_home), stdout=f, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, cwd=flwr_home, start_new_session=True)
        p = _Proc(name, popen, log)
        self.procs.append(p)
        return p

    def _check_running(self) -> None:
        for p in self.procs:
            if p.popen.poll() is not None:
                raise DeploymentError(f"{p.name} exited with code {p.popen.returncode}; log {p.log}:\n"
                                      f"{tail(p.log)}")

    def _wait_listening(self, proc: _Proc, port: int) -> None:
        """Wait until ``proc`` answers over TLS (our CA) on ``port`` and check that the listener on that port
        is ``proc`` itself, not a process this deployment did not start."""
        assert self.certs is not None
        ctx = ssl.create_default_context(cafile=str(self.certs.ca_cert))
        deadline = time.monotonic() + self.startup_timeout
        url = f"https://{HOST}:{port}/health"
        while True:
            self._check_running()
            try:
                with urllib.request.urlopen(url, timeout=2, context=ctx):
                    break
            except urllib.error.HTTPError:  # it answers over TLS with our CA: up
                break
            except (OSError, ssl.SSLError):
                pass
            if time.monotonic() > deadline:
                raise DeploymentError(f"{proc.name} did not answer on {url} within {self.startup_timeout:g} s; "
                                      f"log {proc.log}:\n{tail(proc.log)}")
            time.sleep(0.2)
        # the listening socket may belong to a child that the first look at /proc misses (started, or its fd
        # table read, a moment later): look again for a few seconds before calling it a foreign process
        settle = time.monotonic() + 5.0
        while not listener_pids(port, [proc.popen.pid, *descendants(proc.popen.pid)]):
            if time.monotonic() < settle:
                time.sleep(0.2)
                continue
            raise DeploymentError(f"port {port} on {HOST} answers, but not from the {proc.name} started here "
                                  f"(PID {proc.popen.pid}); another process holds it. Choose other ports.")

    def _write_cli_config(self) -> None:
        assert self.certs is not None
        self.cli_home.mkdir(parents=True, exist_ok=True)
        (self.cli_home / "config.toml").write_text(
            f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\n'
            f'address = "{HOST}:{self.link_port}"\nroot-certificates = "{self.certs.ca_cert}"\n')

    def online_nodes(self) -> int:
        """Number of SuperNodes the SuperLink lists as online (``flwr supernode list --format json``)."""
        out = self.flwr("supernode", "list", CONNECTION, "--format", "json")
        try:
            nodes = json.loads(out.stdout).get("nodes", [])
        except ValueError:
            return 0
        return sum(1 for n in nodes if str(n.get("status", "")).lower() == "online")

    def start(self) -> LoopbackDeployment:
        """Create/reuse certificates, start the SuperLink, register and start the SuperNodes, and wait until
        every node is online. Raises DeploymentError (after stopping what it started) on failure."""
        try:
            self.work.mkdir(parents=True, exist_ok=True)
            self.logs.mkdir(parents=True, exist_ok=True)
            self.certs = create_certificates(self.work / "certs", self.names, ("localhost", HOST), reuse=True)
            for port in [self.link_port, self.fleet_port, *self.node_ports]:
                if not port_free(port):
                    raise DeploymentError(f"port {port} on {HOST} is in use; choose other ports "
                                          f"(--superlink-port / --fleet-port / --supernode-port)")
            (self.work / "superlink").mkdir(parents=True, exist_ok=True)
            (self.work / "superlink" / "state.db").unlink(missing_ok=True)  # a fresh federation each time
            link = self._spawn("superlink", self.superlink_command(), self.work / "superlink")
            self._write_cli_config()
            self._wait_listening(link, self.link_port)
            gateway = self._spawn("fleet-gateway", self.gateway_command(), self.work / "fleet-gateway")
            self._wait_listening(gateway, self.fleet_port)
            for name in self.names:
                out = self.flwr("supernode", "register", str(self.certs.node_keys[name][1]), CONNECTION,
                                "--name", name, "--format", "json")
                if out.returncode != 0 or '"success": false' in out.stdout:
                    raise DeploymentError(f"flwr supernode register {name} failed:\n{out.stdout}\n{out.stderr}")
            for i in range(self.num_nodes):
                self._spawn(self.names[i], self.supernode_command(i), self.work / f"node-{i + 1}")
            deadline = time.monotonic() + self.startup_timeout
            while self.online_nodes() < self.num_nodes:
                self._check_running()
                if time.monotonic() > deadline:
                    raise DeploymentError(f"only {self.online_nodes()} of {self.num_nodes} SuperNodes online after "
                                          f"{self.startup_timeout:g} s; logs in {self.logs}")
                time.sleep(0.5)
        except BaseException:
            self.stop()
            raise
        return self

    def submit(self, app_dir: str | os.PathLike, run_config: str = "") -> str:
        """``flwr run APP CONNECTION --format json --run-config RUN_CONFIG``; returns the run id.
        Raises DeploymentError if no run was started."""
        args = ["run", str(Path(app_dir).resolve()), CONNECTION, "--format", "json"]
        if run_config:
            args += ["--run-config", run_config]
        out = self.flwr(*args, timeout=300)
        return require_run_id(out, DeploymentError)

    def status(self, run_id: str) -> tuple[str, str]:
        """(status, status-details) of a run from ``flwr ls --run-id``; ('unknown', output) if unreadable."""
        return run_status(self.flwr("ls", CONNECTION, "--run-id", run_id, "--format", "json", timeout=60))

    def wait(self, run_id: str, timeout: float, stream: bool = False, poll: float = 1.0) -> RunOutcome:
        """Poll the run's status until ``finished:*`` or ``timeout`` seconds (then ``flwr stop`` and status
        'timeout'). With ``stream`` the run's log is printed as it comes (``flwr log --stream``)."""
        start = time.monotonic()
        log_proc = None
        if stream:
            log_proc = subprocess.Popen([_bin("flwr"), "log", run_id, CONNECTION, "--stream"],
                                        env=self.env(self.cli_home), cwd=self.work, start_new_session=True)
        status, details = "pending", ""
        try:
            while time.monotonic() - start < timeout:
                self._check_running()
                status, details = self.status(run_id)
                if status.startswith("finished"):
                    break
                time.sleep(poll)
            else:
                self.flwr("stop", run_id, CONNECTION)
                status, details = "timeout", f"the run did not finish within {timeout:g} s (stopped)"
        finally:
            if log_proc is not None:
                time.sleep(1.0)  # let the stream flush its last lines
                stop_tree([log_proc.pid], grace=5.0)
        seconds = time.monotonic() - start
        log_tail = ""
        if status != "finished:completed":
            log_tail = self.flwr("log", run_id, CONNECTION, "--show", timeout=60).stdout[-4000:]
        return RunOutcome(run_id, status, details, seconds, log_tail)

    def run(self, app_dir: str | os.PathLike, run_config: str = "", timeout: float = 3600,
            stream: bool = False) -> RunOutcome:
        """Submit the app and wait for its final status (see ``submit`` and ``wait``)."""
        return self.wait(self.submit(app_dir, run_config), timeout, stream=stream)

    def pids(self) -> list[int]:
        """Every PID started by this deployment that is still alive (processes and their descendants)."""
        out = []
        for p in self.procs:
            p.known.update(descendants(p.popen.pid))
            out += [pid for pid in [p.popen.pid, *sorted(p.known)] if alive(pid)]
        return out

    def stop(self, grace: float = STOP_GRACE) -> list[int]:
        """Stop every process this deployment started, by PID: the whole tree (each process, its process
        group and every descendant, listed before the first signal) gets SIGTERM, then SIGKILL what is left
        after ``grace`` seconds. Returns the PIDs still alive afterwards (empty when all stopped)."""
        for p in self.procs:
            p.known.update(descendants(p.popen.pid))
        stop_tree([p.popen.pid for p in self.procs], [pid for p in self.procs for pid in p.known], grace=grace)
        for p in self.procs:
            try:
                p.popen.wait(timeout=1)
            except subprocess.TimeoutExpired:
                pass
        return [pid for p in self.procs for pid in [p.popen.pid, *p.known] if alive(pid)]

    def __enter__(self) -> LoopbackDeployment:
        return self.start()

    def __exit__(self, *exc) -> None:
        left = self.stop()
        if left and exc[0] is None:
            raise DeploymentError(f"processes {left} did not stop")


def tail(path: Path, chars: int = 3000) -> str:
    """The last ``chars`` characters of a text file ('' if missing)."""
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def override_string(cfg, fmt) -> str:
    """--run-config string of the keys whose value differs from the schema default (the app's pyproject
    holds the defaults), formatted with ``fmt`` (TOML values)."""
    from ..common.config import Config

    default = Config.from_mapping({}).to_dict()
    return " ".join(f"{k}={fmt(v)}" for k, v in cfg.to_dict().items() if v != default.get(k, object()))


def deploy_config(cfg, num_nodes: int, work_dir: str | os.PathLike, app_dir: str | os.PathLike = ".",
                  node_data_root: str | None = None, node_cache_dir: str | None = None, stream: bool = True,
                  timeout: float = 24 * 3600, superlink_port: int | None = None,
                  supernode_port: int | None = None, fleet_port: int | None = None,
                  node_data_roots: Sequence[str] | None = None) -> tuple[dict, RunOutcome]:
    """Run a dpdro Config on a loopback deployment of ``num_nodes`` SuperNodes (one partition each, or with
    partition='node-local' each node's own data).

    Each node gets ``data-root``/``cache-dir`` in its node config (default: this machine's resolved
    values), as a real site would: ``node_data_roots`` gives one data-root per node (required, and each must
    exist, for partition='node-local', where node i trains on every record of its data-root and the run
    config's data-root is the server's evaluation data only). The run config carries absolute paths for the
    server side.
    Returns (summary.json, RunOutcome). Raises ConfigError (before anything starts) for a non-empty out-dir
    without config key resume or overwrite, DataError (before anything starts) when the data set is not
    available here, DeploymentError if the run does not complete or writes no summary; every process is
    stopped in all cases, also on SIGTERM/SIGHUP (then ``TerminatedBySignal``, a SystemExit, propagates after
    the cleanup) and Ctrl-C.
    """
    from ..common.config import ConfigError, toml_value
    from ..common.data import pin_data_paths
    from ..common.partition import is_node_local
    from ..server.rundir import RunDir, check_out_dir, read_json

    if cfg.num_clients != num_nodes:
        raise DeploymentError(f"num-clients={cfg.num_clients} but {num_nodes} SuperNodes: they must be equal")
    if node_data_roots is not None and len(node_data_roots) != num_nodes:
        raise ConfigError(f"--node-data-root: got {len(node_data_roots)} folders or files for {num_nodes} SuperNodes; "
                          "allowed: one per node")
    if is_node_local(cfg.partition):
        if node_data_roots is None:
            raise ConfigError("config key 'partition': got 'node-local'; it needs each node's own data: "
                              "dpdro deploy --node-data-root SITE1 --node-data-root SITE2 ... (one per node)")
        missing = [r for r in node_data_roots if not Path(r).exists()]
        if missing:
            raise ConfigError(f"--node-data-root: {', '.join(missing)} does not exist; allowed: a node's data "
                              f"(a folder or file in the layout of dataset={cfg.dataset})")
    cfg = cfg.with_updates({"out-dir": str(Path(cfg.out_dir).resolve())})
    check_out_dir(cfg.out_dir, resume=cfg.resume, overwrite=cfg.overwrite)  # before any work
    cfg = pin_data_paths(cfg)  # DataError (where it looked) before any process starts
    data_root, cache_dir = cfg.data_root, cfg.cache_dir
    node_cfg = {"data-root": node_data_root or data_root, "cache-dir": node_cache_dir or cache_dir}
    node_cfgs = [dict(node_cfg) for _ in range(num_nodes)]
    for i, root in enumerate(node_data_roots or ()):  # a site's own data, as its --node-config would name it
        node_cfgs[i].update({"data-root": str(Path(root).resolve()), "dataset": cfg.dataset})
    summary_path = RunDir(cfg.out_dir).summary
    summary_path.unlink(missing_ok=True)
    with stop_on_signals(), LoopbackDeployment(work_dir, num_nodes, node_cfgs,
                                               superlink_port=superlink_port, supernode_port=supernode_port,
                                               fleet_port=fleet_port) as dep:
        outcome = dep.run(app_dir, override_string(cfg, toml_value), timeout=timeout, stream=stream)
    if not outcome.ok:
        raise DeploymentError(f"Flower run {outcome.run_id} ended with status {outcome.status!r} "
                              f"{outcome.details}\n{outcome.log_tail}")
    if not summary_path.exists():
        raise DeploymentError(f"Flower run {outcome.run_id} completed but wrote no {summary_path}")
    return read_json(summary_path), outcome
