"""Seconds per message round on a real loopback deployment (TLS + SuperNode authentication, 2 SuperNodes):
dpdro's DP Double-SPIDER next to Flower's own FedAvg strategy on the same SuperLink and SuperNodes.

    .venv/bin/python simulations/bench_latency.py [--rounds 5] [--iterations 4]
        [--write docs/research/DEPLOYMENT_LATENCY.md]

- FedAvg: ``simulations/fedavg_app`` (Flower's ``FedAvg``, ``send_and_receive``, a float32 array of our CNN's
  size, 26,106 values, to each node and back, no training); time of each round from the strategy's
  ``evaluate_fn`` callback.
- dpdro: ``dp-double-spider`` on MNIST-ST (2,000 training records, 500 test records, one partition per node,
  threads=1) in both block orders: 'sequential' (one release per message round: the eta block, then the x block,
  2 rounds per iteration) and 'simultaneous' (both releases in one round; docs/explanation/ALGORITHMS.md 3.4). Seconds
  per round = (training loop wall time, without the two evaluations) / number of rounds, from metrics.csv and
  summary.json. The same configuration single-node in this process (no Flower) gives the compute each round
  contains, so the transport's share can be set against FedAvg's round, which trains nothing.

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

from dpdro.common.atomic import atomic_write_text  # run as a script: absolute

ROOT = Path(__file__).resolve().parent.parent
CONTAINERS_HEADING = "## In containers (compose.yaml, podman)"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5, help="FedAvg rounds")
    p.add_argument("--iterations", type=int, default=4, help="dp-double-spider iterations (2 releases each)")
    p.add_argument("--repeats", type=int, default=2,
                   help="repetitions of FedAvg and dpdro in both block orders, run alternately (A B C A B C)")
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
    ours: dict[str, list[tuple[int, float, float, float]]] = {o: [] for o in ORDERS}  # (rounds, loop, s/round, run)
    with LoopbackDeployment(work, 2, [{"data-root": data_root, "cache-dir": cache_dir}] * 2) as dep:
        startup = time.monotonic() - t0
        for rep in range(args.repeats):  # A B C A B C: the machine's load drifts; each repetition is compared
            fed_out = Path(tmp) / f"fedavg-{rep}.json"
            fed = dep.run(ROOT / "simulations" / "fedavg_app",
                          f"num-rounds={args.rounds} dim=26106 min-nodes=2 out-file='{fed_out}'", timeout=1200)
            if not fed.ok:
                print(f"FedAvg run failed: {fed.status} {fed.details}\n{fed.log_tail}", file=sys.stderr)
                return 1
            fed_runs.append((json.loads(fed_out.read_text())["round_seconds"], fed.seconds))
            for order in ORDERS:
                out_dir = Path(tmp) / f"run-{order}-{rep}"
                run_cfg = cfg.with_updates({"out-dir": str(out_dir), "block-order": order})
                run = dep.run(ROOT, override_string(run_cfg, toml_value), timeout=3600)
                if not run.ok:
                    print(f"dpdro run failed: {run.status} {run.details}\n{run.log_tail}", file=sys.stderr)
                    return 1
                ours[order].append((*_round_seconds(out_dir, order), run.seconds))
    compute = {order: _single_node_seconds(cfg.with_updates({"block-order": order,
                                                             "out-dir": str(Path(tmp) / f"single-{order}")}))
               for order in ORDERS}  # the same iterations without Flower: what a round costs beyond transport
    load_after = os.getloadavg()
    fed_mean = [statistics.mean(f[0]) for f in fed_runs]
    ratios = {o: [r[2] / f for f, r in zip(fed_mean, ours[o], strict=True)] for o in ORDERS}
    per_iter = {o: statistics.median(r[1] for r in ours[o]) / args.iterations for o in ORDERS}
    lines = [f"startup (certificates, SuperLink, registration, 2 SuperNodes online): {startup:.1f} s"]
    for rep, (fed_rounds, fed_s) in enumerate(fed_runs):
        lines.append(f"repetition {rep + 1}: FedAvg (Flower's strategy, send_and_receive, 26,106 float32 each way): "
                     f"{len(fed_rounds)} rounds, mean {statistics.mean(fed_rounds):.2f} s/round (median "
                     f"{statistics.median(fed_rounds):.2f}, min {min(fed_rounds):.2f}, max {max(fed_rounds):.2f}); "
                     f"run {fed_s:.1f} s submit-to-finish")
        for order in ORDERS:
            rounds, loop_s, per_round, run_s = ours[order][rep]
            lines.append(f"repetition {rep + 1}: dpdro dp-double-spider, block-order={order} "
                         f"({RELEASES_PER_ROUND[order]} release(s) per round): {rounds} rounds ({args.iterations} "
                         f"iterations), {per_round:.2f} s/round ({loop_s / args.iterations:.2f} s/iteration), loop "
                         f"{loop_s:.1f} s; run {run_s:.1f} s submit-to-finish; round / this repetition's FedAvg "
                         f"round {ratios[order][rep]:.2f}")
    for order in ORDERS:
        floor = compute[order] * RELEASES_PER_ROUND[order] / 2  # seconds of compute per round
        beyond = [(r[2] - floor) / f for f, r in zip(fed_mean, ours[order], strict=True)]
        lines.append(f"**block-order={order}: dpdro round / FedAvg round median "
                     f"{statistics.median(ratios[order]):.2f}** over {len(fed_runs)} repetitions "
                     f"({', '.join(f'{r:.2f}' for r in ratios[order])}); target <= 1. The same iterations single-node "
                     f"(no Flower, this process) take {compute[order]:.2f} s/iteration = {floor:.2f} s of compute "
                     f"per round; the round minus that compute / FedAvg round: median {statistics.median(beyond):.2f}")
    lines.append(f"seconds per iteration on the deployment: sequential {per_iter['sequential']:.2f}, simultaneous "
                 f"{per_iter['simultaneous']:.2f} (ratio {per_iter['simultaneous'] / per_iter['sequential']:.2f})")
    lines.append(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f} ({os.cpu_count()} CPUs)")
    print("\n".join(lines))
    if args.write:
        cmd = "simulations/bench_latency.py " + " ".join(argv if argv is not None else sys.argv[1:])
        shared = max(load_before[0], load_after[0]) > 1.0
        text = (f"# Round latency on the loopback deployment\n\nMeasured {dt.date.today().isoformat()} with "
                f"`.venv/bin/python {cmd.strip()}` on this project's {os.cpu_count()}-core CPU machine "
                f"(SuperLink and 2 SuperNodes on 127.0.0.1, TLS and SuperNode authentication"
                + ("; the machine was shared with other jobs, see the load average" if shared else "")
                + ").\n\n" + "\n".join(f"- {x}" for x in lines) + "\n")
        path = Path(args.write)
        old = path.read_text() if path.is_file() else ""
        kept = "\n" + old[old.index(CONTAINERS_HEADING):] if CONTAINERS_HEADING in old else ""  # separate runs
        atomic_write_text(path, text + kept)
        print(f"wrote {args.write}")
    return 0


# sequential: the eta block, then the x block at the new eta, one release per round; simultaneous: both in one
# round (docs/explanation/ALGORITHMS.md 3.4)
ORDERS = ("sequential", "simultaneous")
RELEASES_PER_ROUND = {"sequential": 1, "simultaneous": 2}


def _round_seconds(out_dir: Path, order: str = "sequential") -> tuple[int, float, float]:
    """(message rounds, training-loop seconds without the two evaluations, seconds per round) of a run."""
    summary = json.loads((out_dir / "summary.json").read_text())
    rounds = sum(summary["releases"].values()) // RELEASES_PER_ROUND[order]
    loop_s = _loop_seconds(out_dir)
    return rounds, loop_s, loop_s / rounds


def _loop_seconds(out_dir: Path) -> float:
    """Training-loop seconds of a run from its metrics.csv, without its two evaluations (the first row is the
    evaluation of the initial model; the last one's is taken to cost the same)."""
    rows = list(csv.DictReader(open(out_dir / "metrics.csv")))
    eval_s = float(rows[0]["wall_seconds"])
    return float(rows[-1]["wall_seconds"]) - 2 * eval_s


def _single_node_seconds(cfg) -> float:
    """Seconds per training iteration of ``cfg`` single-node (in this process, no Flower), from metrics.csv."""
    from dpdro.client.local_transport import LocalTransport
    from dpdro.common.data import load_from_config
    from dpdro.server.engine import train

    train(cfg, LocalTransport(cfg, load_from_config(cfg, train=True)), load_from_config(cfg, train=False))
    return _loop_seconds(Path(cfg.out_dir)) / cfg.iterations


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
    releases, loop_s, per_round = _round_seconds(dep.runs / "latency")  # sequential: a round per release
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
