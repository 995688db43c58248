"""Scale of a node-sampled fleet on Flower's simulation engine: docs/research/FLEETS.md (30 to 1,000 simulated
nodes; PERFORMANCE.md links it). A benchmark that prints figures and ratios, not a timed test.

  python -m dpdro.simulations.node_scale --out runs/node-scale [--nodes 30 100 300 1000] [--iterations 20]

Each row is one ``dpdro simulate`` run (``launch.simulate.run_simulation``: a local SuperLink, one simulated
SuperNode per node) of dp-sgd on MNIST-ST split over the nodes by the Dirichlet-by-label partition (alpha 0.3),
record-level epsilon 4, node sampling p = 0.03 (the 30-node row asks every node, p = 1, with the record rate scaled
so that both sides release about the same expected records per round: the issue's comparison of 1,000 nodes at 30
sampled against 30 nodes all sampled). Measured per row:

- start-up: the command's wall time minus its training loop (Flower's SuperLink, SuperNodes and app start, the
  data each node loads);
- seconds per round: the training loop's wall time between the first and the last evaluation divided by the rounds
  in between (``metrics.csv`` wall_seconds; one release round per iteration for dp-sgd);
- the ServerApp's resident memory at the end (``metrics.csv`` server_rss_mb) and the peak of the summed resident
  memory of every process the run started (SuperLink, SuperNode runtime, ServerApp, ClientApp workers), sampled
  twice a second from /proc (Linux; ``TreeMemory``);
- the ledger's time: computing the run's epsilon from its releases (``server.ledger.epsilon_of`` with the node
  rate, PLD), which depends on p, r, z and T, not on the number of nodes.

Runs resume: a finished row's run directory is read again, not rerun. The machine's load is printed beside the table
(rows run one after another, so load from other jobs disturbs them unequally; the ratio of the 1,000-node to the
30-node round is the figure the issue asks for).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import threading
import time
from pathlib import Path

NODE_RATE = 0.03
EXPECTED_RECORDS = 256  # per round on every row: the record rate is refresh-batch / n, times p on sampled rows
ALPHA = 0.3


def scale_config(nodes: int, iterations: int, out: Path):
    """The Config of one row: dp-sgd, MNIST-ST, ``nodes`` nodes, Dirichlet(0.3) by label, node sampling p = 0.03
    (p = 1 for 30 nodes or fewer, each asked every round), refresh-batch 256 / p (about 256 records per round on
    every row), epsilon 4, evaluation only at the start and the end."""
    from ..common.config import Config

    rate = 1.0 if nodes <= 30 else NODE_RATE
    return Config.from_mapping({
        "dataset": "mnist-st", "algorithm": "dp-sgd", "num-clients": nodes, "partition": "dirichlet",
        "dirichlet-alpha": ALPHA, "node-sampling-rate": rate, "iterations": iterations, "eval-every": iterations,
        "epsilon": 4.0, "refresh-batch": round(EXPECTED_RECORDS / rate), "threads": 1, "seed": 0,
        "max-test-records": 2000, "out-dir": str(out / f"n{nodes}")})


class TreeMemory:
    """Peak summed resident memory (MiB) of this process's descendants, sampled every ``period`` seconds from
    /proc in a background thread while the ``with`` block runs (Linux only; 0 elsewhere)."""

    def __init__(self, period: float = 0.5):
        self.period, self.peak_mb = period, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    @staticmethod
    def descendants_rss_mb(root: int) -> float:
        parent, rss = {}, {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                fields = dict(line.split(":", 1) for line in (entry / "status").read_text().splitlines() if ":" in line)
            except OSError:  # the process ended meanwhile
                continue
            parent[int(entry.name)] = int(fields["PPid"])
            rss[int(entry.name)] = int(fields.get("VmRSS", "0 kB").split()[0]) / 1024
        tree, frontier = set(), {root}
        while frontier:
            frontier = {pid for pid, pp in parent.items() if pp in frontier and pid not in tree}
            tree |= frontier
        return sum(rss[pid] for pid in tree)

    def _watch(self) -> None:
        while not self._stop.wait(self.period):
            self.peak_mb = max(self.peak_mb, self.descendants_rss_mb(os.getpid()))

    def __enter__(self) -> TreeMemory:
        if Path("/proc/self/status").exists():
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


def _metrics(run: Path) -> list[dict]:
    with open(run / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def ledger_seconds(run: Path) -> tuple[float, float]:
    """(seconds, epsilon): the ledger's epsilon of the run's releases recomputed from its summary's sampling
    rates, noise multipliers and release counts (PLD, with its node rate), its cache cleared first."""
    from ..server.ledger import epsilon_of

    s = json.loads((run / "summary.json").read_text())
    cfg = json.loads((run / "config.json").read_text())
    p = float(cfg.get("node-sampling-rate", cfg.get("privacy", {}).get("node-sampling-rate", 1.0)))
    counts = {}
    for mech, rate in s["sampling_rates"].items():
        z = s["noise_multipliers"][mech]
        counts[(float(rate), float(z))] = counts.get((float(rate), float(z)), 0) + int(s["releases"][mech])
    from ..server import ledger

    for cached in (ledger._epsilon_cached, ledger._ddg_epsilon_cached):  # time the computation, not the cache
        cached.cache_clear()
    start = time.perf_counter()
    eps = epsilon_of(counts, float(s["delta"]), "pld", p)
    return time.perf_counter() - start, eps


def measure(nodes: int, iterations: int, out: Path) -> dict:
    """One row (module docstring), running the simulation unless its run directory has finished."""
    from ..launch.simulate import run_simulation

    cfg = scale_config(nodes, iterations, out)
    run = Path(cfg.out_dir)
    record = run / "scale.json"
    if record.exists():
        return json.loads(record.read_text())
    if run.exists():  # an unfinished row starts again (the figures need one uninterrupted process)
        cfg = cfg.with_updates({"overwrite": True})
    start = time.perf_counter()
    with TreeMemory() as memory:
        summary = run_simulation(cfg, stream=False)
    command = time.perf_counter() - start
    rows = _metrics(run)
    first, last = rows[0], rows[-1]
    rounds = int(last["iteration"]) - int(first["iteration"])
    led_s, led_eps = ledger_seconds(run)
    row = {"nodes": nodes, "node_sampling_rate": cfg.privacy.node_sampling_rate, "iterations": iterations,
           "startup_seconds": command - float(summary["wall_seconds"]),
           "seconds_per_round": (float(last["wall_seconds"]) - float(first["wall_seconds"])) / rounds,
           "server_rss_mb": float(last["server_rss_mb"]),
           "peak_tree_rss_mb": memory.peak_mb,
           "ledger_seconds": led_s, "epsilon_spent": float(summary["epsilon_spent"]), "ledger_epsilon": led_eps,
           "load_average": os.getloadavg()[0]}
    record.write_text(json.dumps(row, indent=1))
    return row


def table(rows: list[dict]) -> list[str]:
    """Markdown lines: one row per fleet size, then the ratio of the largest fleet's round to the 30-node one."""
    columns = ["nodes", "p", "nodes asked per round (expected)", "start-up (s)", "seconds per round",
               "ServerApp RSS (MiB)", "peak RSS, all processes (MiB)", "ledger (s)", "epsilon", "load average"]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append(f"| {r['nodes']:,} | {r['node_sampling_rate']:g} | {r['nodes'] * r['node_sampling_rate']:g} | "
                     f"{r['startup_seconds']:.1f} | "
                     f"{r['seconds_per_round']:.3f} | {r['server_rss_mb']:.0f} | {r['peak_tree_rss_mb']:.0f} | "
                     f"{r['ledger_seconds']:.3f} | {r['epsilon_spent']:.3f} | {r['load_average']:.1f} |")
    by = {r["nodes"]: r for r in rows}
    if 30 in by and len(by) > 1:
        big = max(by)
        lines += ["", f"Round time, {big:,} nodes at p = {by[big]['node_sampling_rate']:g} against 30 nodes all "
                      f"asked: {by[big]['seconds_per_round'] / by[30]['seconds_per_round']:.2f}x."]
    return lines


def growth(rows: list[dict]) -> list[str]:
    """How start-up, round time and memory grow from one fleet size to the next (ratios against the node ratio)."""
    out = []
    sampled = sorted((r for r in rows if r["node_sampling_rate"] < 1), key=lambda r: r["nodes"])
    for a, b in zip(sampled, sampled[1:], strict=False):
        k = b["nodes"] / a["nodes"]
        asked = (b["nodes"] * b["node_sampling_rate"]) / (a["nodes"] * a["node_sampling_rate"])
        out.append(f"- {a['nodes']:,} to {b['nodes']:,} nodes ({k:.1f}x; nodes asked per round {asked:.1f}x): start-up "
                   f"{b['startup_seconds'] / a['startup_seconds']:.2f}x, seconds per round "
                   f"{b['seconds_per_round'] / a['seconds_per_round']:.2f}x, peak memory of all processes "
                   f"{b['peak_tree_rss_mb'] / a['peak_tree_rss_mb']:.2f}x, ServerApp memory "
                   f"{b['server_rss_mb'] / a['server_rss_mb']:.2f}x.")
    return out


def document(rows: list[dict], command: str, before: list[dict] | None = None) -> str:
    """docs/research/FLEETS.md: the command, the table, the growth lines and what they show."""
    import datetime
    import platform

    by = {r["nodes"]: r for r in rows}
    lines = ["# Fleets: 30 to 1,000 simulated nodes (generated; do not edit)", "",
             f"Generated by `{command}` on {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC "
             f"({platform.platform()}, {os.cpu_count()} cores). Each row is one Flower simulation "
             "(`dpdro simulate`, one simulated SuperNode per node) of dp-sgd on MNIST-ST split by the "
             f"Dirichlet-by-label partition (alpha {ALPHA}), node sampling p = {NODE_RATE} (the 30-node row asks "
             f"every node), about {EXPECTED_RECORDS} records per round on every row, record-level epsilon 4; the "
             "rows ran one after another on a machine shared with other jobs (the load average of each row is in "
             "the table), so absolute times carry that load. `simulations/node_scale.py` says how each column is "
             "measured.", "", *table(rows)[:len(rows) + 2], "",
             "How each cost grows with the fleet (node-sampled rows):", "",
             *growth(rows), ""]
    if before:
        lines += ["Before the hello window (`server/flower/transport.py: HELLO_WINDOW`; the same command at an earlier "
                  "commit, which asked every node at once), start-up (s): "
                  + ", ".join(f"{r['nodes']:,} nodes {r['startup_seconds']:.1f} (now "
                              f"{by[r['nodes']]['startup_seconds']:.1f})" for r in before if r["nodes"] in by)
                  + ". Flower's simulation engine asks its in-memory state for each node's next message every 0.1 s, "
                  "and each query scans every stored message (flwr 1.42 `vce_api.add_messages_to_queue`, "
                  "`InMemoryLinkState.get_message_ins`), so a round with a message to each of N nodes costs O(N^2) "
                  "per sweep on the engine's side, CPU taken from the simulated nodes. The window bounds the stored "
                  "messages; what stays is the engine's query of every node every 0.1 s (O(N) per sweep whatever "
                  "the messages), which makes a start-up that lasts O(N) seconds cost O(N^2) in total: Flower's "
                  "engine, not dpdro's rounds, whose time follows the nodes asked.", ""]
    if 30 in by and len(by) > 1:
        big = max(by)
        ratio = by[big]["seconds_per_round"] / by[30]["seconds_per_round"]
        lines += [f"Goal: a round with {big:,} nodes at 30 sampled takes at most 1.5 times a round with 30 nodes all "
                  f"sampled: {ratio:.2f}x, **{'met' if ratio <= 1.5 else 'not met'}**.", ""]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m dpdro.simulations.node_scale", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/node-scale", help="folder of the rows' run directories")
    p.add_argument("--nodes", nargs="+", type=int, default=[30, 100, 300, 1000])
    p.add_argument("--iterations", type=int, default=20)
    p.add_argument("--write-docs", action="store_true", help="write docs/research/FLEETS.md from the rows")
    p.add_argument("--before", default=None, help="folder of earlier rows (scale.json copies, *.json) to compare "
                                                  "start-up with in FLEETS.md")
    a = p.parse_args(argv)
    bad = [n for n in a.nodes if n < 2]
    if bad or a.iterations < 2:
        print(f"--nodes must be >= 2 (got {bad}) and --iterations >= 2 (got {a.iterations})", file=sys.stderr)
        return 2
    rows = []
    for n in a.nodes:
        rows.append(measure(n, a.iterations, Path(a.out)))
        print(json.dumps(rows[-1]), flush=True)
    for row in rows:  # again, one after another in this process (rows read back were timed by another one)
        row["ledger_seconds"] = ledger_seconds(Path(scale_config(row["nodes"], a.iterations, Path(a.out)).out_dir))[0]
    print("\n".join(table(rows)))
    if a.write_docs:
        from ..common.atomic import atomic_write_bytes

        command = "python -m dpdro.simulations.node_scale " + " ".join(argv)
        path = Path(__file__).resolve().parent.parent / "docs" / "research" / "FLEETS.md"
        before = [json.loads(f.read_text()) for f in sorted(Path(a.before).glob("*.json"))] if a.before else None
        atomic_write_bytes(path, document(rows, command, before).encode())
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
