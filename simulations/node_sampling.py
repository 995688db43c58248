"""Node sampling (config key node-sampling-rate; server/node_sampling.py, ALGORITHMS.md 5.8): the figures of the design
note, printed by this script (a benchmark: ratios and epsilons, not a timed test).

  python -m dpdro.simulations.node_sampling epsilon   # the epsilon table of ALGORITHMS.md 5.8
  python -m dpdro.simulations.node_sampling round     # a round of 1,000 nodes at p = 0.03 / 30 nodes all asked

``epsilon``: the ledger's epsilon of T node-sampled releases (the revealed mixture) against Poisson sampling at rate
p r (what a product-of-rates argument would charge; unsound, ALGORITHMS.md 5.8) and at rate r alone (node sampling
ignored), all with dp-accounting's PLD.

``round``: the in-process transport (client/local_transport.py) with synthetic records of MNIST's shape, 20 records
per node and the 'mlp' model: the wall time of one release round (``releaser.collect_round`` + aggregation of a dp-sgd
gradient query at record rate r) with 1,000 nodes at node-sampling-rate 0.03 (30 nodes expected) against 30 nodes all
asked at the same record rate (the same expected records per round). Rounds are interleaved and the ratio is the
median of per-pair ratios, so that load from other processes disturbs both sides alike.
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np
import torch

RECORDS_PER_NODE = 20


def epsilon_table(delta: float = 1e-5) -> list[tuple]:
    """Rows (p, r, z, T, ledger epsilon, Poisson at p r, Poisson at r)."""
    from ..server.ledger import epsilon_of

    rows = []
    for p, r, z, t in [(0.3, 0.1, 1.0, 5), (0.03, 0.5, 1.0, 100), (0.03, 0.5, 0.8, 1000)]:
        rows.append((p, r, z, t, epsilon_of({(r, z): t}, delta, "pld", p), epsilon_of({(p * r, z): t}, delta, "pld"),
                     epsilon_of({(r, z): t}, delta, "pld")))
    return rows


def _transport(num_nodes: int, node_rate: float):
    from ..client.local_transport import LocalTransport
    from ..common.config import Config
    from ..common.data import ArrayDataset

    n = num_nodes * RECORDS_PER_NODE
    gen = torch.Generator().manual_seed(0)
    data = ArrayDataset(torch.rand(n, 1, 28, 28, generator=gen) * 2 - 1, torch.randint(0, 10, (n,), generator=gen),
                        10, "synthetic")
    cfg = Config.from_mapping({"algorithm": "dp-sgd", "model": "mlp", "num-clients": num_nodes, "partition": "iid",
                               "node-sampling-rate": node_rate, "epsilon": "inf", "reproducible": True,
                               "threads": 1, "dataset": "mnist-st"})
    return cfg, LocalTransport(cfg, data)


def round_ratio(rounds: int = 20) -> dict:
    """Median per-pair ratio of a 1,000-node round at p = 0.03 to a 30-node round with every node asked."""
    from ..common.messages import Point, Query
    from ..server.release import aggregate
    from ..server.releaser import collect_round

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    big = _transport(1000, 0.03)
    build_big = time.perf_counter() - t0
    small = _transport(30, 1.0)
    dim = big[1].workers[0].model.dim
    versions = {0: np.zeros(dim)}
    rate = 0.5  # record rate; expected records per round: 0.03 x 0.5 x 20,000 = 0.5 x 600 = 300 on both sides
    times: dict[str, list[float]] = {"1000 nodes, p=0.03": [], "30 nodes, all": []}
    asked = []
    for it in range(rounds):
        pair = [("1000 nodes, p=0.03", big), ("30 nodes, all", small)]
        for name, (cfg, transport) in pair if it % 2 == 0 else pair[::-1]:
            q = Query(it, "grad", "ce-grad", (Point(0, 0.0),), rate, 1.0, dim)
            start = time.perf_counter()
            replies = collect_round(cfg, transport, [q], versions)
            aggregate(q, replies[q.qid])
            times[name].append(time.perf_counter() - start)
            if name.startswith("1000"):
                asked.append(len(replies[q.qid]))
    ratios = [a / b for a, b in zip(times["1000 nodes, p=0.03"], times["30 nodes, all"], strict=True)]
    return {"median_ratio": statistics.median(ratios), "median_seconds": {k: statistics.median(v)
                                                                       for k, v in times.items()},
            "nodes_asked_mean": float(np.mean(asked)), "build_1000_nodes_seconds": build_big, "rounds": rounds}


def main(argv: list[str]) -> int:
    what = argv[0] if argv else "epsilon"
    if what == "epsilon":
        print("p      r     z     T     ledger (mixture)  Poisson at p r (unsound)  Poisson at r")
        for p, r, z, t, mix, pr, r_only in epsilon_table():
            print(f"{p:<6g} {r:<5g} {z:<5g} {t:<5d} {mix:<17.4f} {pr:<25.4f} {r_only:.4f}")
        return 0
    if what == "round":
        out = round_ratio()
        print(f"round time ratio (1,000 nodes at p = 0.03 / 30 nodes all asked): {out['median_ratio']:.3f}")
        print(f"median seconds per round: {out['median_seconds']}; nodes asked on average "
              f"{out['nodes_asked_mean']:.1f}; building the 1,000 workers took {out['build_1000_nodes_seconds']:.1f} s")
        return 0
    print(f"unknown {what!r}; allowed: epsilon, round", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
