"""Containers for real: build the image from ./Dockerfile with podman, bring up compose.yaml (TLS SuperLink
with SuperNode authentication, the Fleet-only gateway, 2 SuperNodes each with its own data folder, their executors)
and run the main job's configuration (simulations/configs/main.toml) for 2 iterations on 4,000 MNIST-ST records
through `flwr run`.

The end-to-end test is marked ``container``: not part of the default run (pyproject's addopts), run by .ci/run with
``pytest -m container``. Skips, naming what is missing, where podman cannot run; with DPDRO_REQUIRE_CONTAINERS=1
(CI) it fails instead. Environment: DPDRO_BASE_IMAGE (default: a local Debian base made by
containers/make-base.sh, which needs root and debootstrap), DPDRO_EXTRA_CA_CERTS (a PEM file; default: the host's
/usr/local/share/ca-certificates), DPDRO_CONTAINER_WORK (keep the work folder there for inspection)."""

from __future__ import annotations

import csv
import json
import os
import shutil
import ssl
import subprocess
import tomllib
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
IMAGE = "localhost/dpdro:0.1.0"
LOCAL_BASE = "localhost/dpdro-debian-base:bookworm"


def _skip_or_fail(reason: str) -> None:
    if os.environ.get("DPDRO_REQUIRE_CONTAINERS") == "1":
        pytest.fail(f"containers required (DPDRO_REQUIRE_CONTAINERS=1) but: {reason}")
    pytest.skip(reason)


def _env_conf() -> None:
    os.environ.setdefault("CONTAINERS_CONF", str(ROOT / "containers" / "containers.conf"))


def _base_image() -> str:
    """The base image to build on: DPDRO_BASE_IMAGE, else the local Debian base (made once)."""
    base = os.environ.get("DPDRO_BASE_IMAGE")
    if base:
        return base
    if subprocess.run(["podman", "image", "exists", LOCAL_BASE], capture_output=True).returncode == 0:
        return LOCAL_BASE
    if os.geteuid() != 0 or shutil.which("debootstrap") is None:
        _skip_or_fail("no base image: set DPDRO_BASE_IMAGE, or run as root with debootstrap installed "
                      "(containers/make-base.sh)")
    out = subprocess.run([str(ROOT / "containers" / "make-base.sh"), LOCAL_BASE], capture_output=True, text=True,
                         timeout=1200)
    assert out.returncode == 0, f"containers/make-base.sh failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}"
    return LOCAL_BASE


def _fleet_port_answers_only_fleet(port: int, ca: Path) -> None:
    """The one published port is the gateway's: /health answers, the Control API is refused (404)."""
    ctx = ssl.create_default_context(cafile=str(ca))
    with urllib.request.urlopen(f"https://127.0.0.1:{port}/health", timeout=10, context=ctx) as r:
        assert r.status == 200
    req = urllib.request.Request(f"https://127.0.0.1:{port}/v1/control/list-runs", data=b"{}", method="POST")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=10, context=ctx)
    assert err.value.code == 404


def test_compose_publishes_only_the_fleet_gateway():
    """Static: of all services, only the Fleet gateway publishes a port; the SuperLink is on the operator network
    only; each site's ClientApp executor mounts its own data folder read-only."""
    services = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    published = {name: s["ports"] for name, s in services.items() if s.get("ports")}
    assert published == {"fleet-gateway": ["${FLEET_PORT:-9092}:9092"]}
    assert services["superlink"]["networks"] == ["operator"]
    data = [v for name in ("clientapp-1", "clientapp-2") for v in services[name]["volumes"] if ":/data:" in v]
    assert data == ["${DATA_SITE1:-./data/site-1}:/data:ro", "${DATA_SITE2:-./data/site-2}:/data:ro"]


def test_image_installs_the_features_extra():
    """Static: the image installs dpdro with the 'features' extra, and that extra holds kymatio at the version the
    scattering front-end expects, so features=scatternet runs on every node of a containerised deployment."""
    from dpdro.common.scattering import EXTRA, KYMATIO_VERSION

    lines = (ROOT / "Dockerfile").read_text().splitlines()
    installs = [line for line in lines if "pip install" in line and " -e " in line]
    assert len(installs) == 1 and installs[0].rstrip(" ;\\").endswith(f'-e ".[{EXTRA}]"'), installs
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert f"kymatio=={KYMATIO_VERSION}" in extras[EXTRA]


@pytest.mark.container
def test_containerised_round_runs_main_config(tmp_path):
    """Build, bring up, run main.toml (2 clients, 2 iterations, 4,000 records) and check the run directory: the
    run finished, its ledger's epsilon recomputed from events.jsonl equals summary.json's and is at most the
    target, and the run directory holds what a run writes."""
    from dpdro.common.config import Config, toml_value
    from dpdro.launch import compose
    from dpdro.launch.deploy import free_ports, override_string
    from dpdro.server.ledger import epsilon_of

    _env_conf()
    if shutil.which("podman") is None:
        _skip_or_fail("podman is not installed (apt-get install podman runc; docs/how-to/OPERATOR.md)")
    if shutil.which("iptables") is None:  # netavark runs it for every container network (.ci/install-podman)
        _skip_or_fail("iptables is not installed: podman's netavark needs it (apt-get install iptables)")
    base = _base_image()
    work = Path(os.environ.get("DPDRO_CONTAINER_WORK") or tmp_path)
    compose.download_torch_wheels(ROOT)
    seconds = compose.build_image(ROOT, IMAGE, base, extra_ca_certs=compose.host_extra_ca_certs(),
                                  log=work / "logs" / "build.log")
    problem = compose.container_problem(IMAGE)
    if problem:
        _skip_or_fail(problem)
    size = subprocess.run(["podman", "image", "inspect", IMAGE, "--format", "{{.Size}}"], capture_output=True,
                          text=True).stdout.strip()
    print(f"\nimage {IMAGE} built in {seconds:.0f} s (cached layers count as built), {int(size) / 1e9:.2f} GB")

    from dpdro.common.data import resolve_data_root

    data_root = resolve_data_root("auto").resolve()
    data = work / "data"
    server_data = compose.site_data_folder(data_root, data / "server")
    sites = [compose.site_data_folder(data_root, data / f"site-{i}") for i in (1, 2)]
    with open(ROOT / "simulations" / "configs" / "main.toml", "rb") as f:
        main = tomllib.load(f)
    cfg = Config.from_mapping({**main, "num-clients": 2, "iterations": 2, "max-train-records": 4000,
                               "max-test-records": 500, "eval-every": 2, "checkpoint-every": 2, "threads": 1,
                               "out-dir": "/app/runs/main", "round-timeout": 600.0})
    dep = compose.ComposeDeployment(ROOT, work, server_data, sites, free_ports(29092, 1)[0],
                            image=IMAGE, project_name=f"dpdrotest{os.getpid()}")
    try:
        dep.start()
        _fleet_port_answers_only_fleet(dep.fleet_port, dep.certs / "ca.crt")
        outcome = dep.run(override_string(cfg, toml_value), timeout=1800)
    finally:
        down = dep.stop()
    assert outcome.ok, f"{outcome.status} {outcome.details}\n{outcome.log_tail}"
    assert down.returncode == 0, down.stderr[-2000:]
    left = subprocess.run(["podman", "ps", "-a", "--filter", f"label=io.podman.compose.project={dep.name}",
                           "--format", "{{.Names}}"], capture_output=True, text=True).stdout.split()
    assert left == []

    run = dep.runs / "main"
    assert {"config.json", "summary.json", "events.jsonl", "metrics.csv"} <= {p.name for p in run.iterdir()}
    summary = json.loads((run / "summary.json").read_text())
    assert summary["transport"] == "flower" and summary["algorithm"] == "dp-sgd-la"
    assert summary["num_clients"] == 2 and summary["iterations"] == 2
    assert summary["epsilon_target"] == 4.0 and summary["private"] is True
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    assert [e["clients"] for e in events if e.get("phase") != "setup"] == [2, 2]
    counts = Counter((e["rate"], e["noise_multiplier"]) for e in events)
    config = json.loads((run / "config.json").read_text())
    recomputed = epsilon_of(counts, float(summary["delta"]), config.get("accountant", "pld"))
    assert recomputed == pytest.approx(summary["epsilon_spent"], rel=1e-6)
    assert 3.9 <= summary["epsilon_spent"] <= 4.0 + 1e-9
    assert 0.0 <= summary["test_accuracy"] <= 1.0
    rows = list(csv.DictReader(open(run / "metrics.csv")))
    loop = float(rows[-1]["wall_seconds"]) - 2 * float(rows[0]["wall_seconds"])
    releases = sum(summary["releases"].values())
    print(f"containerised run: {outcome.seconds:.1f} s submit-to-finish, {releases} release rounds, "
          f"{loop / releases:.2f} s per round")
