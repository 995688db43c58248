"""Deployment: certificates, a real loopback SuperLink + 2 SuperNodes with TLS and SuperNode authentication
running DP Double-SPIDER on real MNIST-ST shards, and static checks that the Dockerfile and compose.yaml use
the same flags as the tested deployment."""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
from pathlib import Path

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from dpdro.launch.certs import CertificateExistsError, add_node_key, create_certificates

ROOT = Path(__file__).resolve().parent.parent


# ----- certificates ---------------------------------------------------------------------------------------
def test_certificates_chain_sans_and_permissions(tmp_path):
    cs = create_certificates(tmp_path / "c", ["site-a", "site-b"], ["localhost", "127.0.0.1", "superlink"])
    ca = x509.load_pem_x509_certificate(cs.ca_cert.read_bytes())
    srv = x509.load_pem_x509_certificate(cs.server_cert.read_bytes())
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is True
    assert srv.issuer == ca.subject
    srv.verify_directly_issued_by(ca)  # raises if the signature or issuer is wrong
    san = srv.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["localhost", "superlink"]
    assert [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    for path in (cs.ca_key, cs.server_key, *(priv for priv, _ in cs.node_keys.values())):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    for path in (cs.ca_cert, cs.server_cert, *(pub for _, pub in cs.node_keys.values())):
        assert stat.S_IMODE(path.stat().st_mode) == 0o644, path
    priv, pub = cs.node_keys["site-a"]
    assert pub.read_text().startswith("ecdsa-sha2-nistp384 ")
    key = serialization.load_ssh_private_key(priv.read_bytes(), password=None)
    assert key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                         serialization.PublicFormat.OpenSSH).decode() == pub.read_text().strip()


def test_certificates_never_overwrite_silently(tmp_path):
    cs = create_certificates(tmp_path, ["n1"])
    before = cs.ca_key.read_bytes(), cs.node_keys["n1"][0].read_bytes()
    with pytest.raises(CertificateExistsError, match="--force"):
        create_certificates(tmp_path, ["n1"])
    with pytest.raises(CertificateExistsError):
        add_node_key(tmp_path, "n1")
    assert (cs.ca_key.read_bytes(), cs.node_keys["n1"][0].read_bytes()) == before
    assert create_certificates(tmp_path, ["n1"], reuse=True) == cs  # complete set: reused untouched
    assert cs.ca_key.read_bytes() == before[0]
    create_certificates(tmp_path, ["n1"], force=True)
    assert cs.ca_key.read_bytes() != before[0]
    assert stat.S_IMODE(cs.ca_key.stat().st_mode) == 0o600
    with pytest.raises(ValueError, match="bad node name"):
        create_certificates(tmp_path / "x", ["../evil"])


def test_cli_certs_refuses_then_forces(tmp_path, capsys):
    from dpdro.cli import main

    assert main(["certs", "create", "--out", str(tmp_path), "--nodes", "2"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ca.crt", "ca.key", "server.key", "server.pem",
                                                          "supernode-1", "supernode-1.pub", "supernode-2",
                                                          "supernode-2.pub"]
    assert main(["certs", "create", "--out", str(tmp_path), "--nodes", "2"]) == 2
    assert "refusing to overwrite" in capsys.readouterr().err
    assert main(["certs", "add-node", "--out", str(tmp_path), "hospital-3"]) == 0
    assert (tmp_path / "hospital-3.pub").read_text().startswith("ecdsa-sha2-nistp384 ")


# ----- Fleet-only gateway ------------------------------------------------------------------
def _assert_site_port_refuses_control_api(dep, home: Path) -> None:
    """A party holding only ca.crt and the site-facing (Fleet) address cannot register a SuperNode key or list
    runs: every Control API call through that port fails, and the operator still sees only its own nodes."""
    import subprocess

    from dpdro.launch.deploy import CONNECTION, HOST, _bin

    cmd = dep.superlink_command()
    assert cmd[cmd.index("--host") + 1] == HOST  # Control API on the operator's host only
    node = dep.supernode_command(0)
    assert node[node.index("--superlink") + 1] == dep.fleet_address != dep.control_address
    home.mkdir(parents=True)
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "site"\n\n[superlink.site]\naddress = "{dep.fleet_address}"\n'
        f'root-certificates = "{dep.certs.ca_cert}"\n')
    _, rogue_pub = add_node_key(home / "keys", "rogue")
    env = {**dep.env(home), "FLWR_HOME": str(home)}

    def attacker(*args):
        return subprocess.run([_bin("flwr"), *args], env=env, capture_output=True, text=True, timeout=120, cwd=home)

    reg = attacker("supernode", "register", str(rogue_pub), "site", "--name", "rogue", "--format", "json")
    assert reg.returncode != 0 or '"success": false' in reg.stdout, reg.stdout
    for args in (("ls", "site", "--format", "json"), ("supernode", "list", "site", "--format", "json")):
        out = attacker(*args)
        assert out.returncode != 0 or '"success": false' in out.stdout, (args, out.stdout)
        assert '"runs"' not in out.stdout and '"nodes"' not in out.stdout
    nodes = json.loads(dep.flwr("supernode", "list", CONNECTION, "--format", "json").stdout)["nodes"]
    assert len(nodes) == dep.num_nodes  # no rogue key was registered


def test_fleet_gateway_forwards_only_fleet_calls():
    """The gateway forwards POST /v1/fleet/<endpoint> and GET /health, byte for byte with the node's
    authentication headers, and answers 404 itself to everything else (Control and Runtime API, path tricks)."""
    import asyncio

    import httpx

    from dpdro.launch.fleet_gateway import allowed, create_app

    seen = []

    def upstream(request: httpx.Request) -> httpx.Response:
        seen.append((request.method, request.url.raw_path.decode(), request.headers.get("x-flwr-sig"),
                     request.content))
        return httpx.Response(200, content=b"\x08\x01", headers={"content-type": "application/protobuf"})

    app = create_app("superlink.test:8000", None, transport=httpx.MockTransport(upstream))

    async def calls():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="https://gw") as client:
            r = await client.post("/v1/fleet/pull-messages", content=b"\x01\x02", headers={"x-flwr-sig": "abc"})
            assert (r.status_code, r.content) == (200, b"\x08\x01")
            assert (await client.get("/health")).status_code == 200
            for method, path in [("POST", "/v1/control/register-node"), ("POST", "/v1/control/list-runs"),
                                 ("POST", "/v1/runtime/pull-messages"), ("GET", "/v1/fleet/pull-messages"),
                                 ("POST", "/docs"), ("POST", "/v1/fleet/pull-messages?x=1")]:
                assert (await client.request(method, path)).status_code == 404, (method, path)

    asyncio.run(calls())
    assert seen == [("POST", "/v1/fleet/pull-messages", "abc", b"\x01\x02"), ("GET", "/health", None, b"")]
    for raw in ("/v1/fleet/../control/register-node", "/v1/fleet/%2e%2e/control/list-runs", "/v1/fleet/a/b",
                "/v1/fleet/", "/v1/Fleet/pull-messages", "//v1/fleet/pull-messages"):
        assert not allowed("POST", raw), raw
    assert allowed("POST", "/v1/fleet/confirm-message-received")


# ----- loopback deployment (real processes, real data) --------------------------------------------------
@pytest.mark.flower
@pytest.mark.data
def test_loopback_tls_auth_deployment_runs_dp_double_spider(tmp_path, monkeypatch):
    """2 iterations with q=2: one refresh and one difference release of both eta and x (4 message rounds),
    so every mechanism of DP Double-SPIDER crosses the TLS + authenticated deployment; every process it starts
    (SuperLink, Fleet gateway, SuperNodes, their executors and apps) listens on 127.0.0.1 only."""
    from dpdro.common.config import Config, toml_value
    from dpdro.common.data import resolve_cache_dir, resolve_data_root
    from dpdro.launch.deploy import CONNECTION, LoopbackDeployment, alive, override_string

    out = tmp_path / "run"
    cfg = Config.from_mapping({"num-clients": 2, "iterations": 2, "q": 2, "max-train-records": 2000,
                               "max-test-records": 500, "threads": 1, "eval-every": 2, "epsilon": 4.0,
                               "out-dir": str(out), "round-timeout": 300.0})
    data_root = str(resolve_data_root("auto").resolve())
    cache_dir = str(resolve_cache_dir("auto").resolve())
    cfg = cfg.with_updates({"data-root": data_root, "cache-dir": cache_dir})
    node_cfg = {"data-root": data_root, "cache-dir": cache_dir}
    dep = LoopbackDeployment(tmp_path / "deploy", 2, [node_cfg, node_cfg])
    with _listeners(monkeypatch) as seen:
        try:
            dep.start()
            cmd = " ".join(dep.superlink_command())
            for flag in ("--ssl-ca-certfile", "--ssl-certfile", "--ssl-keyfile", "--enable-supernode-auth",
                         "--disable-runtime-dependency-installation"):
                assert flag in cmd
            assert "--insecure" not in cmd
            assert 'partition-id=1 num-partitions=2' in " ".join(dep.supernode_command(1))
            assert dep.online_nodes() == 2
            nodes = json.loads(dep.flwr("supernode", "list", CONNECTION, "--format", "json").stdout)["nodes"]
            assert len(nodes) == 2
            started = dep.pids()
            assert len(started) >= 4  # SuperLink, Fleet gateway, 2 SuperNodes (and their SuperExecs)
            _assert_site_port_refuses_control_api(dep, tmp_path / "attacker")
            outcome = dep.run(ROOT, override_string(cfg, toml_value), timeout=600)
            assert outcome.ok, f"{outcome.status} {outcome.details}\n{outcome.log_tail}"
        finally:
            left = dep.stop()
    assert left == []
    assert not any(alive(pid) for pid in started)
    _assert_loopback_only(seen, ("flower-superlink", "fleet_gateway", "flower-supernode"))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["transport"] == "flower"
    assert summary["num_clients"] == 2 and summary["iterations"] == 2
    assert summary["releases"] == {"eta-refresh": 1, "x-refresh": 1, "eta-diff": 1, "x-diff": 1}
    assert summary["epsilon_target"] == 4.0
    assert 3.9 <= summary["epsilon_spent"] <= 4.0 + 1e-9
    assert summary["private"] is True
    assert 0.0 <= summary["test_accuracy"] <= 1.0
    assert len((out / "events.jsonl").read_text().splitlines()) == 4
    # each node cached its own shard in a local file (cheap ClientApp start-up on later messages)
    shards = list((Path(cache_dir) / "shards").glob("mnist-st-*-p[01]-of-2.npz"))
    assert len(shards) >= 2


def _site_csv(path: Path, n: int, seed: int, lo: float, hi: float) -> None:
    """n records 'f1,f2,label' with f2 drawn from [lo, hi): a site's own file (label 'hi' iff f1 + 0.3 f2 > 0.65)."""
    import random

    r = random.Random(seed)
    rows = ["f1,f2,label"]
    for _ in range(n):
        a, b = r.random(), r.uniform(lo, hi)
        rows.append(f"{a:.4f},{b:.4f},{'hi' if a + 0.3 * b > 0.65 else 'lo'}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(rows) + "\n")


@pytest.mark.flower
def test_loopback_deployment_trains_on_node_local_csv_files(tmp_path):
    """Two SuperNodes, each with its own CSV file (120 and 80 records from different parts of
    the feature space) named only in its node config (data-root, dataset), partition='node-local': nothing is
    partitioned centrally, the server holds only its evaluation file and learns the shard sizes, so the ledger's
    n is 120 + 80; the global model trains (test accuracy from 0.47 at iteration 0 to >= 0.7 after 4 iterations).
    Each node reads every record of its file: nobody evaluates on a site's records. A third SuperNode's data
    folder is empty (its data cannot be loaded): with on-client-failure=drop and min-clients=2 the run goes on
    without it from the start, its records not in n, every release from the other two. (Before: the whole run
    failed at the nodes' start-up, naming only the Flower node id.)"""
    import numpy as np

    from dpdro.common.config import Config
    from dpdro.launch.deploy import deploy_config

    sites = [tmp_path / "site1" / "records.csv", tmp_path / "site2" / "records.csv"]
    _site_csv(sites[0], 120, 1, 0.0, 0.5)
    _site_csv(sites[1], 80, 2, 0.5, 1.0)
    (tmp_path / "site3").mkdir()  # a site whose records are gone
    server_eval = tmp_path / "server" / "eval.csv"  # public evaluation data (its 20% test split is evaluated)
    _site_csv(server_eval, 500, 3, 0.0, 1.0)
    out = tmp_path / "run"
    cfg = Config.from_mapping({
        "dataset": "csv", "partition": "node-local", "classes": "lo,hi", "csv-bounds": "0:1",
        "data-root": str(server_eval), "cache-dir": str(tmp_path / "cache"), "num-clients": 3, "iterations": 4,
        "q": 2, "refresh-batch": 60, "diff-batch": 30, "epsilon": 8.0, "eval-every": 2, "threads": 1,
        "reproducible": True, "reproducible-for-testing": True, "out-dir": str(out), "round-timeout": 300.0,
        "on-client-failure": "drop", "min-clients": 2, "eval-data": "server"})  # the server's file, not auto's nodes
    summary, outcome = deploy_config(cfg, 3, tmp_path / "deploy", app_dir=ROOT, stream=False, timeout=900,
                                     node_data_roots=[*(str(p) for p in sites), str(tmp_path / "site3")])
    assert outcome.ok, f"{outcome.status} {outcome.details}\n{outcome.log_tail}"
    assert json.loads((out / "config.json").read_text())["n"] == 200  # the sum of the two shards
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    assert [e["clients"] for e in events] == [2] * 8  # every release from the two sites that hold records
    assert summary["transport"] == "flower" and summary["num_clients"] == 3
    assert summary["delta"] == pytest.approx(1 / 2000)  # auto: 1/(10 n) with n = 200
    assert 7.9 <= summary["epsilon_spent"] <= 8.0 + 1e-9
    assert summary["releases"] == {"eta-refresh": 2, "x-refresh": 2, "eta-diff": 2, "x-diff": 2}
    rows = (out / "metrics.csv").read_text().splitlines()
    first, last = (dict(zip(rows[0].split(","), r.split(","), strict=False)) for r in (rows[1], rows[-1]))
    assert int(last["iteration"]) == 4
    assert float(last["test_accuracy"]) >= 0.7 and float(first["test_accuracy"]) < 0.6
    # each node cached its own shard, of its own size, in the cache its node config names
    sizes = sorted(int(np.load(f)["y"].shape[0]) for f in (tmp_path / "cache" / "shards").glob("*.npz"))
    assert sizes == [80, 120]


def test_node_local_partition_is_refused_where_no_node_holds_its_own_data(tmp_path):
    """Single-node training and the simulation hold one data set: partition='node-local' is refused there, and by
    `dpdro deploy` without one --node-data-root per node, before any process starts; a user data set without
    declared classes is refused (each site's files may hold other classes)."""
    from dpdro.cli import main
    from dpdro.common.config import Config, ConfigError
    from dpdro.launch.deploy import deploy_config

    keys = {"dataset": "csv", "partition": "node-local", "classes": "lo,hi", "csv-bounds": "0:1",
            "num-clients": 2, "out-dir": str(tmp_path / "run")}
    with pytest.raises(ConfigError, match="classes"):
        Config.from_mapping({**keys, "classes": ""})
    cfg = Config.from_mapping(keys)
    with pytest.raises(ConfigError, match="one per node"):
        deploy_config(cfg, 2, tmp_path / "deploy", node_data_roots=["a"])
    with pytest.raises(ConfigError, match="--node-data-root SITE1"):
        deploy_config(cfg, 2, tmp_path / "deploy")
    with pytest.raises(ConfigError, match="does not exist"):
        deploy_config(cfg, 2, tmp_path / "deploy", node_data_roots=[str(tmp_path / "x"), str(tmp_path / "y")])
    set_args = ["--set", *(f"{k}={v}" for k, v in keys.items())]
    assert main(["train", *set_args]) == 2
    assert main(["simulate", *set_args]) == 2
    assert not (tmp_path / "run").exists() and not (tmp_path / "deploy").exists()


@pytest.mark.flower
@pytest.mark.data
def test_loopback_deployment_runs_distributed_noise_through_secagg(tmp_path):
    """noise-mode=distributed on the TLS + authenticated deployment: each SuperNode adds its noise share and
    the SuperLink's ServerApp only receives SecAgg+ sums (quantisation bound reported per release)."""
    from dpdro.common.config import Config, toml_value
    from dpdro.common.data import resolve_cache_dir, resolve_data_root
    from dpdro.launch.deploy import LoopbackDeployment, override_string

    out = tmp_path / "run"
    data_root = str(resolve_data_root("auto").resolve())
    cache_dir = str(resolve_cache_dir("auto").resolve())
    cfg = Config.from_mapping({"algorithm": "dp-sgd", "noise-mode": "distributed", "num-clients": 2,
                               "iterations": 2, "max-train-records": 2000, "max-test-records": 500, "threads": 1,
                               "eval-every": 2, "epsilon": 4.0, "out-dir": str(out), "round-timeout": 300.0,
                               "data-root": data_root, "cache-dir": cache_dir})
    node_cfg = {"data-root": data_root, "cache-dir": cache_dir}
    dep = LoopbackDeployment(tmp_path / "deploy", 2, [node_cfg, node_cfg])
    try:
        dep.start()
        outcome = dep.run(ROOT, override_string(cfg, toml_value), timeout=600)
        assert outcome.ok, f"{outcome.status} {outcome.details}\n{outcome.log_tail}"
    finally:
        assert dep.stop() == []
    summary = json.loads((out / "summary.json").read_text())
    assert summary["noise_mode"] == "distributed" and summary["transport"] == "flower"
    assert summary["releases"] == {"grad": 2} and 3.9 <= summary["epsilon_spent"] <= 4.0 + 1e-9
    assert summary["epsilon_against_server"] == pytest.approx(summary["epsilon_spent"], rel=1e-9)
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    assert [e["clients"] for e in events] == [2, 2]
    assert all(0 < e["quantisation_bound"] < 1e-3 * e["noise_multiplier"] * e["clip"] for e in events)


# ----- static checks of the Docker image and compose file --------------------------------------------------
def _compose() -> dict:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def test_compose_matches_tested_deployment_flags():
    services = _compose()["services"]
    image = "${DPDRO_IMAGE:-localhost/dpdro:0.1.0}"  # one image, the entry point chosen per service
    assert {s["image"] for s in services.values()} == {image}
    link = services["superlink"]
    assert link["entrypoint"] == ["flower-superlink"]
    cmd = link["command"]
    for flag in ("--ssl-ca-certfile", "--ssl-certfile", "--ssl-keyfile", "--enable-supernode-auth",
                 "--disable-runtime-dependency-installation", "--port"):
        assert flag in cmd, flag
    assert "--insecure" not in cmd
    assert cmd[cmd.index("--isolation") + 1] == "process"  # the executors run in their own containers
    port = cmd[cmd.index("--port") + 1]
    # the SuperLink's port (Control API) is not published; it is on the operator network only
    assert "ports" not in link and link["networks"] == ["operator"]
    gw = services["fleet-gateway"]
    assert gw["entrypoint"] == ["python", "-m", "dpdro.launch.fleet_gateway"]
    gcmd = gw["command"]
    assert gcmd[gcmd.index("--superlink") + 1] == f"superlink:{port}"
    gw_port = gcmd[gcmd.index("--listen") + 1].rsplit(":", 1)[1]
    assert gw["ports"] == [f"${{FLEET_PORT:-{gw_port}}}:{gw_port}"]
    assert set(gw["networks"]) == {"operator", "federation"}
    nodes = [s for name, s in services.items() if name.startswith("supernode-")]
    assert len(nodes) == 2
    for i, node in enumerate(sorted(nodes, key=lambda s: s["command"][s["command"].index("--node-config") + 1])):
        c = node["command"]
        assert node["entrypoint"] == ["flower-supernode"]
        assert c[c.index("--superlink") + 1] == f"fleet-gateway:{gw_port}"  # never the SuperLink itself
        assert "operator" not in node["networks"]
        assert "--root-certificates" in c and "--auth-supernode-private-key" in c and "--insecure" not in c
        assert c[c.index("--isolation") + 1] == "process"
        assert c[c.index("--node-config") + 1].startswith(f"partition-id={i} num-partitions=2")
    executors = [s for name, s in services.items() if name.startswith(("serverapp", "clientapp"))]
    assert len(executors) == 3  # one ServerApp executor, one ClientApp executor per SuperNode
    for ex in executors:
        assert "entrypoint" not in ex  # the image's: flower-superexec
        assert "--runtime-api-address" in ex["command"]
    server_ex = services["serverapp"]["command"]
    assert server_ex[server_ex.index("--runtime-api-address") + 1] == f"superlink:{port}"
    assert "--root-certificates" in server_ex and "--insecure" not in server_ex
    # data mounted read-only on the ClientApp executors, which are the only readers
    for name in ("clientapp-1", "clientapp-2"):
        vols = services[name]["volumes"]
        assert any(v.endswith(":/data:ro") for v in vols), vols
    # private keys only where needed: the TLS key on the SuperLink and the gateway (both the operator's), each
    # node its own auth key
    assert not any("server.key" in str(v) for n, s in services.items() if n not in ("superlink", "fleet-gateway")
                   for v in s.get("volumes", []))
    cli = services["cli"]
    assert cli["profiles"] == ["cli"] and cli["networks"] == ["operator"]
    assert not any(v.rsplit(":", 2)[0].endswith(("supernode-1", "supernode-2", ".key")) for v in cli["volumes"])


def test_dockerfile_base_wheels_and_ca_are_build_arguments():
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^ARG BASE_IMAGE=flwr/superexec:1\.42\.0$", text, re.M)
    assert re.search(r"^FROM \$\{BASE_IMAGE\}$", text, re.M)
    for arg in ("WHEELS=containers/wheels", "TORCH_INDEX_URL=", "EXTRA_CA_CERTS=", "PIP_NO_INDEX"):
        assert re.search(rf"^ARG {arg}$", text, re.M), arg
    assert "--mount=type=bind,source=${WHEELS},target=/wheels" in text
    assert "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1" in text
    # the image must carry every package the app imports
    for folder in ("dpdro", "common", "server", "client", "launch"):  # launch: the fleet-gateway service
        assert re.search(rf"^COPY .*\b{folder}\b", text, re.M), folder
    # the image installs the torch and torchvision CI tests (pyproject.toml's [tool.dpdro.tested])
    import tomllib

    tested = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["dpdro"]["tested"]
    assert f"torch=={tested['torch']} torchvision=={tested['torchvision']}" in text
    assert f"flwr/superexec:{tested['flwr']}" in text


def test_operator_guide_mentions_tested_commands():
    text = (ROOT / "docs" / "how-to" / "OPERATOR.md").read_text()
    for needle in ("flwr supernode register", "flwr supernode unregister", "--enable-supernode-auth",
                   "--auth-supernode-private-key", "--root-certificates", "dpdro certs create", "dpdro deploy",
                   "CONTAINERS_CONF", "podman-compose", "make-base.sh", "--node-data-root", "partition=node-local"):
        assert needle in text, needle
    assert os.path.exists(ROOT / "docs" / "research" / "DEPLOYMENT_LATENCY.md")


# ----- simulate never uses a foreign SuperLink ---------------------------------------------
def _tiny_run(out: Path) -> dict:
    return {"num-clients": 2, "iterations": 1, "q": 1, "max-train-records": 2000, "max-test-records": 200,
            "threads": 1, "eval-every": 1, "out-dir": str(out)}


@pytest.mark.flower
@pytest.mark.data
def test_simulate_never_submits_to_a_foreign_superlink(tmp_path, monkeypatch):
    """A foreign listener answers 200 to everything on Flower's local-SuperLink port (the one
    FLWR_LOCAL_SUPERLINK_HTTP_API_PORT names; not 39091 itself, which other processes on a shared machine
    use): dpdro simulate still runs its own job to the end on a SuperLink it started, sends the foreign one
    nothing, and stops its SuperLink afterwards. (Before: `flwr run` sent the job to the listener.)"""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from dpdro.common.config import Config
    from dpdro.launch import simulate

    hits = []

    class Foreign(BaseHTTPRequestHandler):
        def _answer(self):
            hits.append((self.command, self.path))
            self.send_response(200)
            self.send_header("content-length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        do_GET = do_POST = _answer

        def log_message(self, *args):
            pass

    servers = [ThreadingHTTPServer(("127.0.0.1", 0), Foreign)]
    for srv in servers:
        threading.Thread(target=srv.serve_forever, daemon=True).start()
    monkeypatch.setenv("FLWR_LOCAL_SUPERLINK_HTTP_API_PORT", str(servers[0].server_address[1]))
    monkeypatch.setenv("FLWR_HOME", str(tmp_path / "flwr"))
    try:
        summary = simulate.run_simulation(Config.from_mapping(_tiny_run(tmp_path / "run")), app_dir=ROOT,
                                          stream=False)
    finally:
        for srv in servers:
            srv.shutdown()
            srv.server_close()
    assert hits == []
    assert summary["transport"] == "flower" and summary["iterations"] == 1
    assert simulate._OURS is None  # its SuperLink was stopped
    assert not list((tmp_path / "flwr").glob("dpdro-cli-*"))


# ----- SIGTERM stops every child ------------------------------------------------------------
def _marked(marker: str) -> dict[int, str]:
    """PID -> command line of every process whose environment holds ``marker`` (inherited by all
    descendants of the process started with it)."""
    out = {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if marker.encode() in (proc / "environ").read_bytes():
                out[int(proc.name)] = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
    return out


def _sigterm_leaves_nothing(tmp_path: Path, argv: list[str], busy: tuple[str, ...]) -> None:
    """Start ``dpdro ARGV`` with a marker in its environment, wait until one of its descendants' command
    lines contains one of ``busy`` (the run is in progress), send SIGTERM, and check that the command exits
    (status 143) and that no process carrying the marker remains."""
    import signal
    import subprocess
    import sys
    import time
    import uuid

    marker = f"DPDRO_SIGTERM_TEST={uuid.uuid4().hex}"
    env = {**os.environ, marker.split("=")[0]: marker.split("=")[1], "FLWR_HOME": str(tmp_path / "flwr")}
    log = open(tmp_path / "dpdro.log", "wb")  # noqa: SIM115 - closed in finally
    proc = subprocess.Popen([str(Path(sys.executable).with_name("dpdro")), *argv], env=env, cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not any(b in cmd for cmd in _marked(marker).values() for b in busy):
            assert proc.poll() is None, (tmp_path / "dpdro.log").read_text()[-3000:]
            assert time.monotonic() < deadline, f"no {busy} process after 300 s: {_marked(marker)}"
            time.sleep(0.5)
        running = _marked(marker)
        assert len(running) >= 4, running
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)  # measured: 5.7-7 s (3 s grace, then SIGKILL for what ignores SIGTERM)
        time.sleep(1.0)
        left = _marked(marker)
        assert left == {}, f"{len(left)} of {len(running)} processes still run after SIGTERM: {left}"
        assert proc.returncode == 128 + signal.SIGTERM
    finally:
        for pid in _marked(marker):  # never leave the machine dirty, even when the test fails
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        log.close()


@pytest.mark.flower
@pytest.mark.data
def test_sigterm_to_dpdro_deploy_stops_every_child(tmp_path):
    sets = [f"{k}={v}" for k, v in {**_tiny_run(tmp_path / "run"), "iterations": 50}.items()]
    _sigterm_leaves_nothing(tmp_path, ["deploy", "--nodes", "2", "--work-dir", str(tmp_path / "w"), "--quiet",
                                       "--set", *sets], busy=("flwr-clientapp",))


@pytest.mark.flower
@pytest.mark.data
def test_sigterm_to_dpdro_simulate_stops_every_child(tmp_path):
    sets = [f"{k}={v}" for k, v in {**_tiny_run(tmp_path / "run"), "iterations": 50}.items()]
    _sigterm_leaves_nothing(tmp_path, ["simulate", "--quiet", "--set", *sets], busy=("raylet",))


# ----- nothing the product starts listens beyond loopback ------------------------------------------------------
LOOPBACK = {"127.0.0.1", "::1"}


@contextlib.contextmanager
def _listeners(monkeypatch):
    """Within the block, the TCP listeners of every process started with a marker that ``monkeypatch`` puts in
    this process's environment (every launcher passes its environment on, so each descendant inherits it, Ray's
    included), sampled every 0.2 s: a dict address -> {(port, program)}. Skips the test where this platform does
    not let a process read its own listening sockets (/proc/<pid>/net/tcp and /proc/<pid>/fd)."""
    import socket
    import sys
    import threading
    import uuid

    from dpdro.launch.processes import listening_sockets

    with socket.socket() as probe:  # the reader must see a listener of our own, else the check would be empty
        probe.bind(("127.0.0.1", 0))
        probe.listen()
        if ("127.0.0.1", probe.getsockname()[1]) not in {(a, p) for _, a, p in listening_sockets([os.getpid()])}:
            pytest.skip(f"cannot read listening sockets through /proc on {sys.platform}")
    marker = f"DPDRO_LISTEN_TEST={uuid.uuid4().hex}"
    monkeypatch.setenv(*marker.split("="))
    seen: dict[str, set[tuple[int, str]]] = {}
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.2):
            marked = _marked(marker)
            for pid, addr, port in listening_sockets(marked):
                program = " ".join(Path(arg).name for arg in marked[pid].split()[:3])
                seen.setdefault(addr, set()).add((port, program))

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield seen
    finally:
        done.set()
        thread.join()


def _assert_loopback_only(seen: dict, programs: tuple[str, ...]) -> None:
    """Every listener in ``seen`` (``_listeners``) is on 127.0.0.1 or ::1, and each of ``programs`` was seen
    listening (the check looked at the processes that matter)."""
    wide = {addr: sorted(found) for addr, found in seen.items() if addr not in LOOPBACK}
    assert wide == {}, f"listening beyond loopback: {wide}"
    names = " | ".join(program for found in seen.values() for _, program in found)
    assert all(p in names for p in programs), f"expected listeners of {programs}, saw {names}"


@pytest.mark.flower
@pytest.mark.data
def test_simulate_listens_on_loopback_only(tmp_path, monkeypatch):
    """During `dpdro simulate` the SuperLink, the simulation (Ray's driver), Ray's GCS, raylet, runtime-env agent
    and workers listen on 127.0.0.1 only. (Before: Ray's GCS, raylets, driver and workers listened on '::', every
    interface, and its runtime-env agent on the machine's address.)"""
    from dpdro.common.config import Config
    from dpdro.launch import simulate

    monkeypatch.delenv(simulate.RAY_LOOPBACK_ONLY, raising=False)
    monkeypatch.setenv("FLWR_HOME", str(tmp_path / "flwr"))
    with _listeners(monkeypatch) as seen:
        summary = simulate.run_simulation(Config.from_mapping(_tiny_run(tmp_path / "run")), app_dir=ROOT,
                                          stream=False)
    assert summary["transport"] == "flower" and summary["iterations"] == 1
    _assert_loopback_only(seen, ("flower-superlink", "flwr-simulation", "gcs_server", "raylet", "ray::"))


def test_flwr_json_output_is_read_alike_by_every_launcher():
    """launch/flwr_output.py: a run id and a status from flwr's JSON, also after lines the containerised CLI
    prints first; None / 'unknown' with the output's tails when there is nothing to read."""
    import subprocess

    from dpdro.launch.flwr_output import require_run_id, run_status, started_run_id

    def out(stdout, stderr=""):
        return subprocess.CompletedProcess([], 0, stdout, stderr)

    assert started_run_id(out('{"success": true, "run-id": 42}')) == "42"
    assert started_run_id(out('Loading project configuration...\n{"run-id": 7}')) == "7"
    assert started_run_id(out("Error: no connection", "boom")) is None
    assert require_run_id(out('{"run-id": 9}'), RuntimeError) == "9"
    with pytest.raises(RuntimeError, match="flwr run did not start a run:\nError: no connection\nboom"):
        require_run_id(out("Error: no connection", "boom"), RuntimeError)
    runs = '{"runs": [{"status": "finished:completed", "status-details": ""}]}'
    assert run_status(out(runs)) == ("finished:completed", "")
    assert run_status(out('{"runs": []}', "err")) == ("unknown", '{"runs": []}err')


def test_a_run_failed_for_a_lost_heartbeat_stands_only_with_complete_outputs(caplog):
    """Flower failed a finished run ('No heartbeat received from the task') on a 2-core machine under load after
    the ServerApp had written its summary; the run stands when the outputs are complete, and only then."""
    from dpdro.launch.simulate import run_completed

    lost = "No heartbeat received from the task"
    assert run_completed("1", "finished:completed", "")
    assert run_completed("1", "finished:failed", lost, outputs_complete=True)
    assert "outputs are complete, so the run stands" in caplog.text
    assert not run_completed("1", "finished:failed", lost, outputs_complete=False)
    assert not run_completed("1", "finished:failed", lost)  # outputs not checked: not accepted
    assert not run_completed("1", "finished:failed", "ServerApp raised ValueError", outputs_complete=True)
    assert not run_completed("1", "finished:stopped", lost, outputs_complete=True)
