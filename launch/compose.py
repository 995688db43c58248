"""Containerised deployment: ``compose.yaml`` brought up with podman-compose (or ``docker compose``), nodes
registered and a run submitted through the operator's ``cli`` service, waited on with ``flwr ls``.

What it does, in order (the same steps docs/how-to/OPERATOR.md gives an operator, "Containers"):

1. certificates with ``dpdro certs create`` into ``<work>/certs`` (SANs: localhost, 127.0.0.1, superlink,
   fleet-gateway); the private keys and the run folder are handed to uid 49999, the user the image runs as
   (``podman unshare chown`` when not root);
2. ``compose up -d superlink fleet-gateway serverapp cli`` (the operator's side; only the gateway's port is
   published; ``cli`` is the operator's flwr CLI, used through ``compose exec``); the SuperLink is up when
   ``flwr supernode list`` succeeds (retry loop: no healthchecks run under podman without systemd);
3. ``flwr supernode register /app/certificates/supernode-N.pub dpdro`` for each node, by the operator;
4. ``compose up -d supernode-1 clientapp-1 supernode-2 clientapp-2``, then wait until both are online;
5. ``flwr run /app dpdro --run-config ...`` (the app as installed in the image), then ``flwr ls`` until
   ``finished:*``;
6. ``compose down -v`` (containers, networks and volumes of this project name), always.

Every container belongs to the compose project ``project_name``, so several deployments (or tests) on one host
do not meet. Needs podman (with ``CONTAINERS_CONF`` pointing at containers/containers.conf where podman's
defaults fail, see docs/how-to/OPERATOR.md) and the image built from ./Dockerfile.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from .deploy import DeploymentError, RunOutcome
from .flwr_output import require_run_id, run_status

__all__ = ["APP_IN_IMAGE", "CONNECTION", "IMAGE_UID", "NODE_SERVICES", "OPERATOR_SERVICES", "ComposeDeployment",
           "build_image", "container_problem", "default_compose", "download_torch_wheels", "host_extra_ca_certs",
           "site_data_folder"]

CONNECTION = "dpdro"                       # the connection in containers/flwr-cli.toml
APP_IN_IMAGE = "/app"                      # the project as copied into the image (what `flwr run` submits)
IMAGE_UID = 49999                          # user "app" of the image (Flower's images use the same uid)
OPERATOR_SERVICES = ("superlink", "fleet-gateway", "serverapp", "cli")
NODE_SERVICES = ("supernode-1", "clientapp-1", "supernode-2", "clientapp-2")
CERT_HOSTS = ("localhost", "127.0.0.1", "superlink", "fleet-gateway")


def default_compose() -> list[str]:
    """podman-compose next to this Python (a venv's bin, not always on PATH), else from PATH."""
    here = Path(sys.executable).with_name("podman-compose")
    return [str(here) if here.exists() else "podman-compose"]


def container_problem(image: str, compose: Sequence[str] | None = None) -> str | None:
    """Why containers cannot run here (None when they can): podman or the compose tool missing, podman unable to
    start a container, or ``image`` not present. Cheap (one ``podman run --rm ... true``)."""
    compose = list(compose or default_compose())
    if shutil.which("podman") is None:
        return "podman is not installed (apt-get install podman runc; see docs/how-to/OPERATOR.md)"
    if shutil.which(compose[0]) is None:
        return f"{compose[0]} is not installed (pip install podman-compose)"
    try:
        if subprocess.run(["podman", "image", "exists", image], capture_output=True, timeout=60).returncode != 0:
            return f"image {image} is not built"
        out = subprocess.run(["podman", "run", "--rm", "--entrypoint", "true", image], capture_output=True,
                             text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"podman does not answer: {e}"
    if out.returncode != 0:
        return f"podman cannot start a container here: {out.stderr.strip()[-500:]}"
    return None


def torch_pins(project_dir: str | os.PathLike) -> list[str]:
    """``torch==V`` and ``torchvision==V`` for the versions CI tests, pyproject.toml's [tool.dpdro.tested] (the
    image installs the same). Raises DeploymentError when that table lacks either."""
    import tomllib

    tested = tomllib.loads((Path(project_dir) / "pyproject.toml").read_text()).get("tool", {}).get("dpdro", {})
    tested = tested.get("tested", {})
    if not {"torch", "torchvision"} <= set(tested):
        raise DeploymentError(f"pyproject.toml's [tool.dpdro.tested] should give torch and torchvision; found "
                              f"{sorted(tested)}")
    return [f"torch=={tested['torch']}", f"torchvision=={tested['torchvision']}"]


def download_torch_wheels(project_dir: str | os.PathLike, dest: str | os.PathLike | None = None) -> Path:
    """``pip download`` torch, torchvision and their dependencies (pinned as in pyproject.toml) into
    ``dest`` (default containers/wheels, inside the build context) with this machine's pip configuration, so
    the image gets the very wheels the project's environment was installed from. Nothing is done when both
    pinned wheels are already there (pip would re-read gigabytes to check them). Raises DeploymentError with
    pip's output on failure."""
    dest = Path(dest or Path(project_dir) / "containers" / "wheels")
    dest.mkdir(parents=True, exist_ok=True)
    pins = torch_pins(project_dir)
    if all(any(dest.glob(f"{pin.replace('==', '-')}-*.whl")) for pin in pins):
        return dest
    out = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "-d", str(dest),
                          *pins], capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        raise DeploymentError(f"pip download of torch failed:\n{out.stderr[-3000:]}")
    return dest


def host_extra_ca_certs() -> str:
    """PEM text of the CA certificates this host trusts in addition to the distribution's: the file named by
    $DPDRO_EXTRA_CA_CERTS, else every ``*.crt`` under /usr/local/share/ca-certificates (where Debian keeps
    locally added CAs, e.g. of a proxy that re-signs HTTPS). '' when there are none."""
    named = os.environ.get("DPDRO_EXTRA_CA_CERTS")
    if named:
        return Path(named).read_text()
    folder = Path("/usr/local/share/ca-certificates")
    return "".join(p.read_text() for p in sorted(folder.rglob("*.crt"))) if folder.is_dir() else ""


def _image_id(image: str, env: dict) -> str:
    out = subprocess.run(["podman", "image", "inspect", image, "--format", "{{.Id}}"], capture_output=True,
                         text=True, timeout=60, env=env)
    return out.stdout.strip() if out.returncode == 0 else ""


def build_image(project_dir: str | os.PathLike, image: str, base_image: str | None = None,
                wheels: str = "containers/wheels", extra_ca_certs: str = "", log: Path | None = None,
                timeout: float = 3600) -> float:
    """``podman build -t IMAGE`` of ./Dockerfile with the build arguments BASE_IMAGE (None: the Dockerfile's
    default, Flower's image), WHEELS and EXTRA_CA_CERTS. Returns the seconds it took; the output goes to
    ``log``. The image a rebuild replaces (now untagged) is removed. Raises DeploymentError with the output's
    tail on failure."""
    cmd = ["podman", "build", "-t", image, "--build-arg", f"WHEELS={wheels}"]
    if base_image:
        cmd += ["--build-arg", f"BASE_IMAGE={base_image}"]
    if extra_ca_certs:
        cmd += ["--build-arg", f"EXTRA_CA_CERTS={extra_ca_certs}"]
    env = {**os.environ, "CONTAINERS_CONF": os.environ.get(
        "CONTAINERS_CONF", str(Path(project_dir).resolve() / "containers" / "containers.conf"))}
    previous = _image_id(image, env)
    t0 = time.monotonic()
    out = subprocess.run([*cmd, "."], cwd=project_dir, capture_output=True, text=True, timeout=timeout, env=env)
    seconds = time.monotonic() - t0
    if out.returncode == 0 and previous and previous != _image_id(image, env):
        # the image this build replaced is now untagged: remove it (and its layers no other image uses), or every
        # rebuild would keep gigabytes; a container still using it keeps it (then rmi fails, harmlessly)
        subprocess.run(["podman", "rmi", previous], capture_output=True, timeout=300, env=env)
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(out.stdout + out.stderr)
    if out.returncode != 0:
        raise DeploymentError(f"podman build failed ({' '.join(cmd[:3])} ...):\n{(out.stdout + out.stderr)[-4000:]}")
    return seconds


def site_data_folder(source_root: str | os.PathLike, dest: str | os.PathLike, dataset_folder: str = "MNIST") -> Path:
    """A site's own data folder ``dest/<dataset_folder>/raw`` made of hard links to (or, across file systems,
    copies of) ``source_root/<dataset_folder>/raw``: each site mounts its own folder, as separate sites would.
    Raises DeploymentError when the source has no such folder."""
    src = Path(source_root) / dataset_folder / "raw"
    if not src.is_dir():
        raise DeploymentError(f"no data set folder {src}")
    raw = Path(dest) / dataset_folder / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not (raw / f.name).exists():
            try:
                os.link(f, raw / f.name)
            except OSError:
                shutil.copy2(f, raw / f.name)
    return Path(dest)


def give_to_image_user(paths: Sequence[Path]) -> None:
    """chown ``paths`` to the image's user (uid/gid 49999) so the containers can read the private keys (mode
    0600 stays) and write the run folder; ``podman unshare`` maps the uid for rootless podman."""
    if os.geteuid() == 0:
        for p in paths:
            os.chown(p, IMAGE_UID, IMAGE_UID)
        return
    out = subprocess.run(["podman", "unshare", "chown", f"{IMAGE_UID}:{IMAGE_UID}", *map(str, paths)],
                         capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise DeploymentError(f"cannot hand {[str(p) for p in paths]} to uid {IMAGE_UID}: {out.stderr.strip()}")


class ComposeDeployment:
    """compose.yaml's deployment (SuperLink, Fleet gateway, ServerApp executor, 2 SuperNodes with their ClientApp
    executors) under one compose project name.

    Args:
        project_dir: folder holding compose.yaml and containers/ (this repository).
        work_dir: folder for ``certs/``, ``runs/`` (mounted at /app/runs in the ServerApp executor) and logs.
        data_server: host folder mounted read-only at /data in the ServerApp executor (evaluation data).
        data_sites: one host folder per site, mounted read-only at /data in that site's ClientApp executor only.
        fleet_port: host port the Fleet gateway is published on.
        image: image name (built from ./Dockerfile).
        project_name: compose project name (prefix of containers, networks and volumes).
        compose: the compose command (``podman-compose`` or ``docker compose``; None: ``default_compose()``).
        startup_timeout: seconds for the SuperLink to answer and for the nodes to come online.
    """

    def __init__(self, project_dir: str | os.PathLike, work_dir: str | os.PathLike, data_server: str | os.PathLike,
                 data_sites: Sequence[str | os.PathLike], fleet_port: int, image: str = "localhost/dpdro:0.1.0",
                 project_name: str = "dpdro", compose: Sequence[str] | None = None,
                 startup_timeout: float = 300.0) -> None:
        if len(data_sites) != 2:
            raise ValueError(f"compose.yaml has 2 sites; data_sites has {len(data_sites)} folders")
        self.project = Path(project_dir).resolve()
        self.work = Path(work_dir).resolve()
        self.certs = self.work / "certs"
        self.runs = self.work / "runs"
        self.logs = self.work / "logs"
        self.data_server = Path(data_server).resolve()
        self.data_sites = [Path(d).resolve() for d in data_sites]
        self.fleet_port = int(fleet_port)
        self.image = image
        self.name = project_name
        self.compose_cmd = list(compose or default_compose())
        self.startup_timeout = startup_timeout

    def env(self) -> dict[str, str]:
        """Environment of every compose call: the paths and port compose.yaml reads, and CONTAINERS_CONF."""
        e = dict(os.environ)
        e.update({"CERTS": str(self.certs), "RUNS": str(self.runs), "DATA_SERVER": str(self.data_server),
                  "DATA_SITE1": str(self.data_sites[0]), "DATA_SITE2": str(self.data_sites[1]),
                  "FLEET_PORT": str(self.fleet_port), "DPDRO_IMAGE": self.image})
        e.setdefault("CONTAINERS_CONF", str(self.project / "containers" / "containers.conf"))
        return e

    def compose(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        """``<compose> --profile cli -p NAME -f compose.yaml ARGS`` (the profile makes the ``cli`` service
        known); never raises on exit status."""
        cmd = [*self.compose_cmd, "--profile", "cli", "-p", self.name, "-f", str(self.project / "compose.yaml"),
               *args]
        return subprocess.run(cmd, env=self.env(), capture_output=True, text=True, timeout=timeout, cwd=self.project)

    def flwr(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        """``flwr ARGS`` in the running ``cli`` container (operator network); never raises on exit status."""
        return self.compose("exec", "-T", "cli", "flwr", *args, timeout=timeout)

    def _up(self, services: Sequence[str]) -> None:
        out = self.compose("up", "-d", *services)
        if out.returncode != 0:
            raise DeploymentError(f"compose up {' '.join(services)} failed:\n{out.stdout[-2000:]}\n"
                                  f"{out.stderr[-2000:]}")

    def prepare(self) -> None:
        """Certificates (``dpdro certs create``), the run folder, and their owner (the image's user)."""
        from .certs import create_certificates

        self.work.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(exist_ok=True)
        self.runs.mkdir(exist_ok=True)
        for d in (self.data_server, *self.data_sites):
            if not d.is_dir():
                raise DeploymentError(f"data folder {d} does not exist")
        cs = create_certificates(self.certs, ["supernode-1", "supernode-2"], CERT_HOSTS, reuse=True)
        give_to_image_user([cs.server_key, *(priv for priv, _ in cs.node_keys.values()), self.runs])

    def online_nodes(self) -> int:
        """Number of SuperNodes the SuperLink lists as online; -1 when the SuperLink does not answer."""
        out = self.flwr("supernode", "list", CONNECTION, "--format", "json")
        try:
            nodes = json.loads(out.stdout).get("nodes", [])
        except ValueError:
            return -1
        return sum(1 for n in nodes if str(n.get("status", "")).lower() == "online")

    def _wait(self, what: str, done) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while not done():
            if time.monotonic() > deadline:
                raise DeploymentError(f"{what} not reached within {self.startup_timeout:g} s; logs in {self.logs}")
            time.sleep(2.0)

    def start(self) -> ComposeDeployment:
        """prepare, operator services up, SuperLink answering, nodes registered, node services up, both nodes
        online. On failure the logs are saved and everything is taken down before the error propagates."""
        try:
            self.prepare()
            self._up(OPERATOR_SERVICES)
            self._wait("the SuperLink answering the operator's flwr", lambda: self.online_nodes() >= 0)
            for name in ("supernode-1", "supernode-2"):
                out = self.flwr("supernode", "register", f"/app/certificates/{name}.pub", CONNECTION,
                                "--name", name, "--format", "json")
                if out.returncode != 0 or '"success": false' in out.stdout:
                    raise DeploymentError(f"flwr supernode register {name} failed:\n{out.stdout}\n{out.stderr}")
            self._up(NODE_SERVICES)
            self._wait("2 SuperNodes online", lambda: self.online_nodes() == 2)
        except BaseException:
            self.stop()
            raise
        return self

    def submit(self, run_config: str, app: str = APP_IN_IMAGE) -> str:
        """``flwr run APP dpdro --format json --run-config RUN_CONFIG`` (APP: a path inside the image); returns
        the run id. Raises DeploymentError if no run was started."""
        out = self.flwr("run", app, CONNECTION, "--format", "json", "--run-config", run_config)
        return require_run_id(out, DeploymentError)

    def status(self, run_id: str) -> tuple[str, str]:
        """(status, status-details) of a run from ``flwr ls --run-id``; ('unknown', output) if unreadable."""
        return run_status(self.flwr("ls", CONNECTION, "--run-id", run_id, "--format", "json", timeout=120))

    def run(self, run_config: str, timeout: float = 1800, app: str = APP_IN_IMAGE, poll: float = 3.0) -> RunOutcome:
        """Submit and poll ``flwr ls`` until ``finished:*`` or ``timeout`` seconds (then ``flwr stop``, status
        'timeout'). The log tail of a run that did not complete is in the outcome."""
        start = time.monotonic()
        run_id = self.submit(run_config, app)
        status, details = "pending", ""
        while time.monotonic() - start < timeout:
            status, details = self.status(run_id)
            if status.startswith("finished"):
                break
            time.sleep(poll)
        else:
            self.flwr("stop", run_id, CONNECTION)
            status, details = "timeout", f"the run did not finish within {timeout:g} s (stopped)"
        seconds = time.monotonic() - start
        log_tail = ""
        if status != "finished:completed":
            log_tail = self.flwr("log", run_id, CONNECTION, "--show", timeout=120).stdout[-4000:]
        return RunOutcome(run_id, status, details, seconds, log_tail)

    def save_logs(self) -> None:
        """Each service's container log into ``<work>/logs/<service>.log``."""
        self.logs.mkdir(parents=True, exist_ok=True)
        for service in (*OPERATOR_SERVICES, *NODE_SERVICES):
            out = self.compose("logs", service, timeout=60)
            (self.logs / f"{service}.log").write_text(out.stdout + out.stderr)

    def stop(self) -> subprocess.CompletedProcess:
        """Save the logs, then ``compose down -v``: this project's containers, networks and volumes."""
        try:
            self.save_logs()
        except (OSError, subprocess.TimeoutExpired):
            pass
        return self.compose("down", "-v", "-t", "10", timeout=300)

    def __enter__(self) -> ComposeDeployment:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

