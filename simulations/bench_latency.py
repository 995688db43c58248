"""Seconds per message round on a real loopback deployment (TLS + SuperNode authentication, 2 SuperNodes):
dpdro's DP Double-SPIDER next to Flower's own FedAvg strategy on the same SuperLink and SuperNodes.

    .venv/bin/python simulations/bench_latency.py [--rounds 5] [--iterations 4] [--write docs/DEPLOYMENT_LATENCY.md]

- FedAvg: ``simulations/fedavg_app`` (Flower's ``FedAvg``, ``send_and_receive``, a float32 array of our CNN's
  size, 26,106 values, to each node and back, no training); time of each round from the strategy's
  ``evaluate_fn`` callback.
- dpdro: ``dp-double-spider`` on MNIST-ST (2,000 training records, 500 test records, one partition per node,
  threads=1); one release per message round (eta block, then x block: 2 rounds per iteration). Seconds per
  round = (training loop wall time, without the two evaluations) / number of releases, from metrics.csv
  and summary.json.

Prints both and, with --write, writes the figures, the command and the machine's load into a Markdown file.
Every process is stopped by PID at the end (LoopbackDeployment).

``--containers``: the same dpdro run on compose.yaml's deployment (podman, the image localhost/dpdro:0.1.0 built
beforehand, launch/compose.py) instead, FedAvg not run; with --write the figures are appended to the file as a
section of their own, next to the loopback ones.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONTAINERS_HEADING = "## In containers (compose.yaml, podman)"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5, help="FedAvg rounds")
    p.add_argument("--iterations", type=int, default=4, help="dp-double-spider iterations (2 rounds each)")
    p.add_argument("--repeats", type=int, default=2, help="FedAvg, dpdro pairs, run alternately (A B A B)")
    p.add_argument("--work-dir", default=None, help="deployment folder (default: a temporary folder)")
    p.add_argument("--write", default=None, help="Markdown file to write the figures into")
    p.add_argument("--containers", action="store_true",
                   help="dpdro on compose.yaml's containers (podman) instead of the loopback deployment")
    args = p.parse_args(argv)
    if args.containers:
        return containers_main(args, argv)

    from dpdro.common.config import Config, toml_value
    from dpdro.common.data import resolve_cache_dir, resolve_data_root
    from dpdro.launch.deploy import LoopbackDeployment, override_string

    os.environ.setdefault("DPDRO_CACHE_DIR", str(ROOT / ".cache" / "data"))
    tmp = tempfile.mkdtemp(prefix="dpdro-latency-")
    work = Path(args.work_dir or Path(tmp) / "deploy")
    cfg = Config.from_mapping({"num-clients": 2, "iterations": args.iterations, "max-train-records": 2000,
                               "max-test-records": 500, "threads": 1, "eval-every": args.iterations,
                               "out-dir": str(Path(tmp) / "run")})
    data_root = str(resolve_data_root(cfg.data_root).resolve())
    cache_dir = str(resolve_cache_dir(cfg.cache_dir).resolve())
    cfg = cfg.with_updates({"data-root": data_root, "cache-dir": cache_dir})
    load_before = os.getloadavg()
    t0 = time.monotonic()
    fed_runs: list[tuple[list[float], float]] = []  # (seconds of each FedAvg round, submit-to-finish)
    our_runs: list[tuple[int, float, float, float]] = []  # (releases, loop s, s per round, submit-to-finish)
    with LoopbackDeployment(work, 2, [{"data-root": data_root, "cache-dir": cache_dir}] * 2) as dep:
        startup = time.monotonic() - t0
        for rep in range(args.repeats):  # A B A B: the machine's load drifts; pairs are compared
            fed_out = Path(tmp) / f"fedavg-{rep}.json"
            fed = dep.run(ROOT / "simulations" / "fedavg_app",
                          f"num-rounds={args.rounds} dim=26106 min-nodes=2 out-file='{fed_out}'", timeout=1200)
            if not fed.ok:
                print(f"FedAvg run failed: {fed.status} {fed.details}\n{fed.log_tail}", file=sys.stderr)
                return 1
            fed_runs.append((json.loads(fed_out.read_text())["round_seconds"], fed.seconds))
            out_dir = Path(tmp) / f"run-{rep}"
            ours = dep.run(ROOT, override_string(cfg.with_updates({"out-dir": str(out_dir)}), toml_value),
                           timeout=3600)
            if not ours.ok:
                print(f"dpdro run failed: {ours.status} {ours.details}\n{ours.log_tail}", file=sys.stderr)
                return 1
            our_runs.append((*_round_seconds(out_dir), ours.seconds))
    load_after = os.getloadavg()
    ratios = [o[2] / statistics.mean(f[0]) for f, o in zip(fed_runs, our_runs, strict=True)]
    lines = [f"startup (certificates, SuperLink, registration, 2 SuperNodes online): {startup:.1f} s"]
    for rep, ((fed_rounds, fed_s), (releases, loop_s, ours_round, ours_s)) in enumerate(
            zip(fed_runs, our_runs, strict=True)):
        lines += [
            f"pair {rep + 1}: FedAvg (Flower's strategy, send_and_receive, 26,106 float32 each way): "
            f"{len(fed_rounds)} rounds, mean {statistics.mean(fed_rounds):.2f} s/round (median "
            f"{statistics.median(fed_rounds):.2f}, min {min(fed_rounds):.2f}, max {max(fed_rounds):.2f}); run "
            f"{fed_s:.1f} s submit-to-finish",
            f"pair {rep + 1}: dpdro dp-double-spider: {releases} rounds ({args.iterations} iterations), "
            f"{ours_round:.2f} s/round ({2 * ours_round:.2f} s/iteration), loop {loop_s:.1f} s; run {ours_s:.1f} s "
            f"submit-to-finish; ratio to this pair's FedAvg round {ratios[rep]:.2f}",
        ]
    lines += [
        f"**dpdro round / FedAvg round: median {statistics.median(ratios):.2f}** over {len(ratios)} pairs "
        f"({', '.join(f'{r:.2f}' for r in ratios)}); target <= 1",
        f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f} ({os.cpu_count()} CPUs)",
    ]
    print("\n".join(lines))
    if args.write:
        cmd = "simulations/bench_latency.py " + " ".join(argv if argv is not None else sys.argv[1:])
        text = (f"# Round latency on the loopback deployment\n\nMeasured {dt.date.today().isoformat()} with "
                f"`.venv/bin/python {cmd.strip()}` on this project's {os.cpu_count()}-core CPU machine "
                f"(SuperLink and 2 SuperNodes on 127.0.0.1, TLS and SuperNode authentication; the machine was "
                f"shared with other jobs, see the load average).\n\n" + "\n".join(f"- {x}" for x in lines) + "\n")
        path = Path(args.write)
        old = path.read_text() if path.is_file() else ""
        kept = "\n" + old[old.index(CONTAINERS_HEADING):] if CONTAINERS_HEADING in old else ""  # separate runs
        path.write_text(text + kept)
        print(f"wrote {args.write}")
    return 0


def _round_seconds(out_dir: Path) -> tuple[int, float, float]:
    """(releases, training-loop seconds without the two evaluations, seconds per release round) of a run."""
    rows = list(csv.DictReader(open(out_dir / "metrics.csv")))
    summary = json.loads((out_dir / "summary.json").read_text())
    releases = sum(summary["releases"].values())
    eval_s = float(rows[0]["wall_seconds"])  # the first row is the evaluation of the initial model
    loop_s = float(rows[-1]["wall_seconds"]) - 2 * eval_s
    return releases, loop_s, loop_s / releases


def containers_main(args, argv) -> int:
    """The dpdro part of the benchmark on compose.yaml's deployment (see the module docstring)."""
    from dpdro.common.config import Config, toml_value
    from dpdro.common.data import resolve_data_root
    from dpdro.launch.compose import ComposeDeployment, container_problem, site_data_folder
    from dpdro.launch.deploy import free_ports, override_string

    image = "localhost/dpdro:0.1.0"
    os.environ.setdefault("CONTAINERS_CONF", str(ROOT / "containers" / "containers.conf"))
    problem = container_problem(image)
    if problem:
        print(f"cannot run containers: {problem}", file=sys.stderr)
        return 1
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="dpdro-latency-containers-"))
    data_root = resolve_data_root("auto").resolve()
    server = site_data_folder(data_root, work / "data" / "server")
    sites = [site_data_folder(data_root, work / "data" / f"site-{i}") for i in (1, 2)]
    cfg = Config.from_mapping({"num-clients": 2, "iterations": args.iterations, "max-train-records": 2000,
                               "max-test-records": 500, "threads": 1, "eval-every": args.iterations,
                               "out-dir": "/app/runs/latency"})
    load_before = os.getloadavg()
    t0 = time.monotonic()
    with ComposeDeployment(ROOT, work, server, sites, free_ports(29192, 1)[0],
                           project_name=f"dpdrolatency{os.getpid()}") as dep:
        startup = time.monotonic() - t0
        ours = dep.run(override_string(cfg, toml_value), timeout=3600)
    load_after = os.getloadavg()
    if not ours.ok:
        print(f"dpdro run failed: {ours.status} {ours.details}\n{ours.log_tail}", file=sys.stderr)
        return 1
    releases, loop_s, per_round = _round_seconds(dep.runs / "latency")
    lines = [
        f"startup (compose up, SuperLink answering, registration, 2 SuperNodes online; flwr CLI in a container): "
        f"{startup:.1f} s",
        f"dpdro dp-double-spider: {releases} rounds ({args.iterations} iterations), {per_round:.2f} s/round "
        f"({2 * per_round:.2f} s/iteration), loop {loop_s:.1f} s; run {ours.seconds:.1f} s submit-to-finish",
        f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f} ({os.cpu_count()} CPUs)",
    ]
    print("\n".join(lines))
    if args.write:
        cmd = "simulations/bench_latency.py " + " ".join(argv if argv is not None else sys.argv[1:])
        text = (f"\n{CONTAINERS_HEADING}\n\nMeasured {dt.date.today().isoformat()} with "
                f"`.venv/bin/python {cmd.strip()}`: the same dpdro run on compose.yaml's deployment (one container "
                f"per process, podman 4.3.1 with runc, TLS and SuperNode authentication, SuperNodes through the "
                f"Fleet gateway), same machine.\n\n" + "\n".join(f"- {x}" for x in lines) + "\n")
        with open(args.write, "a") as f:
            f.write(text)
        print(f"appended to {args.write}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
