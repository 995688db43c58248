"""dpdro's node-level runs beside Flower's own DP-FedAvg on the same nodes, partition, model and epsilon: the table
of docs/research/NODES.md ("Node-level privacy against Flower's DP-FedAvg (1,000 nodes)"). A benchmark script, not
a test.

  python -m dpdro.simulations.dp_fedavg --out runs/dp-fedavg [--nodes 1000] [--sampled 30] [--rounds 100] \
      [--seeds 0 1 2] [--sites 10]

Rows (all at node-level epsilon ``--epsilon`` and delta 1/(10 m) for m nodes; each seed's in OUT/seed-S, and with
several seeds a table of means and 95 % intervals of the decisive differences, ``seeds_table``):

- ``dpdro dp-sgd``: ``privacy-unit = node``, ``node-sampling-rate = sampled / nodes``: each sampled node sends its
  mean gradient clipped to C, Gaussian noise on the sum (ALGORITHMS.md 5.9), in-process transport (equal to the
  Flower simulation, tests/test_node_sampling.py); the noise multiplier z is calibrated by dpdro's ledger.
- ``dpdro recursive-spider, dro-groups = node``: the same with the nodes as the DRO groups (ALGORITHMS.md 3.3).
- ``... local epochs E``: the same two with ``local-epochs = E`` (``--local-epochs``): each sampled node runs E epochs
  of local SGD (Flower's local step size and batch) and sends its model update clipped to Flower's clip
  (``client/local_steps.py``), at ``lr-x = 1`` and no momentum: FedAvg's server step, so dpdro's dp-sgd row is
  DP-FedAvg in dpdro's engine (Poisson node sampling, dpdro's ledger) and differs from Flower's only in the sample.
- ``dpdro recursive-spider, dro-groups = site, local epochs E`` (``--sites S``): the nodes numbered site by site
  into S public sites, the label skew drawn per site (``num-sites``, ALGORITHMS.md 3.3, every row's partition then),
  and the sites as the DRO groups; the table adds the worst site's accuracy. ``--site-lambda L ...`` adds the same
  row at other DRO temperatures (``lambda``; the default is 1).
- ``Flower DP-FedAvg``: Flower's ``FedAvg`` wrapped in ``DifferentialPrivacyServerSideFixedClipping``
  (``simulations/dpfedavg_app``) on Flower's simulation engine with one SuperNode per node: each round ``sampled``
  nodes drawn uniformly without replacement, each runs ``--fedavg-epochs`` local epochs of SGD from the global model,
  the server clips each update to ``--fedavg-clip`` and adds noise z x clip / sampled to their mean, with the same z
  as dpdro's row, so both spend the same releases at the same noise. Flower's wrapper reports no epsilon with
  amplification (its accountant refuses any sampling method but 'no-amplification'); this script charges it in
  dpdro's ledger as Poisson node sampling at rate sampled / nodes, the customary approximation for a fixed-size
  sample (McMahan et al. 2018 analyse Poisson sampling; a fixed-size sample is not Poisson sampling, so the anchor's
  epsilon is approximate), and prints beside it what the same releases cost without amplification.

Every model is evaluated here, alike: accuracy and worst-class accuracy on the test split and, per node, on node j's
part of the test split under the same seeded Dirichlet partition (``server.evaluate.node_of_records``): the worst
node's accuracy and the spread. Runs resume: a finished row is read back, not rerun.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import numpy as np

APP = Path(__file__).resolve().parent / "dpfedavg_app"
_SHARDS: dict = {}


def anchor_config(run_config):
    """The dpdro Config the anchor app's ServerApp and ClientApps share (run config key ``dpdro-config``, JSON)."""
    from ..common.config import Config

    return Config.from_mapping(json.loads(str(run_config["dpdro-config"])))


def flat_model(cfg, num_classes: int, input_shape: tuple[int, ...]):
    """The FlatModel of ``cfg``'s model as a dpdro run builds it (``make_model`` seeded by the config's seed)."""
    import torch

    from ..common.models import make_model, resolve_model
    from ..common.per_sample import FlatModel

    return FlatModel(make_model(resolve_model(cfg.model, cfg.dataset), num_classes, cfg.seed, torch.float32,
                                input_shape, cfg.model_fix))


def node_shard(cfg, partition_id: int):
    """(x, y, model) of node ``partition_id`` for the anchor app: its records of the training split under dpdro's
    own ``make_partition`` (node k holds what node k holds in a dpdro run) and the model; cached per process (a
    ClientApp worker serves many nodes)."""
    import torch

    from ..common.data import load_from_config
    from ..common.partition import make_partition

    key = json.dumps(cfg.to_dict(), sort_keys=True, default=str)
    if key not in _SHARDS:
        train = load_from_config(cfg, True)
        _SHARDS.clear()
        _SHARDS[key] = (train, make_partition(cfg.data, train.y.numpy()),
                        flat_model(cfg, train.num_classes, tuple(train.x.shape[1:])))
    train, parts, model = _SHARDS[key]
    idx = torch.as_tensor(parts[partition_id])
    return train.x[idx].float(), train.y[idx], model


def base_keys(a: argparse.Namespace) -> dict:
    """The keys every row shares: data, partition, privacy unit and sampling, rounds, epsilon."""
    return {"dataset": "mnist-st", "num-clients": a.nodes, "partition": "dirichlet", "dirichlet-alpha": a.alpha,
            "privacy-unit": "node", "node-sampling-rate": a.sampled / a.nodes, "iterations": a.rounds,
            "eval-every": a.rounds, "epsilon": a.epsilon, "seed": a.seed, "threads": 1, "eval-data": "server",
            "reproducible": False, "num-sites": a.sites}


def figures(cfg, flat: np.ndarray) -> dict:
    """Test accuracy, worst-class accuracy, worst-node accuracy, node spread, per-node accuracy and its 10th
    percentile over the nodes with test records (with about 10 test records per node at 1,000 nodes the minimum is
    often 0) of ``flat`` under ``cfg``'s model and partition (no post-hoc shift: every row alike)."""
    from ..common.data import load_from_config
    from ..server.evaluate import evaluate, node_of_records

    test = load_from_config(cfg, "test")
    model = flat_model(cfg, test.num_classes, tuple(test.x.shape[1:]))
    m = evaluate(model, flat, test, cfg.training, node_of=node_of_records(cfg.data, test.y.numpy()),
                 num_nodes=cfg.num_clients, num_sites=cfg.num_sites)
    per_node = np.asarray(m["per_node_accuracy"], dtype=float)
    return {**{k: m[k] for k in ("test_accuracy", "worst_class_accuracy", "worst_node_accuracy",
                                 "node_accuracy_spread", "per_node_accuracy", "worst_site_accuracy",
                                 "per_site_accuracy") if k in m},
            "node_accuracy_p10": float(np.nanpercentile(per_node, 10))}


def dpdro_row(name: str, keys: dict, out: Path) -> dict:
    """Train one dpdro row single-node (``launch.local.train_local``; a finished row is read back) and evaluate
    it."""
    from ..common.config import Config
    from ..launch.local import train_local

    run = out / name
    done = run / "row.json"
    if done.exists():
        return json.loads(done.read_text())
    cfg = Config.from_mapping({**keys, "out-dir": str(run), "overwrite": True})
    start = time.perf_counter()
    s = train_local(cfg).summary
    row = {"row": name, "epsilon": float(s["epsilon_spent"]), "delta": float(s["delta"]),
           # the gradient release's z: dp-sgd's 'grad', the paper methods' 'x-refresh'
           "noise_multiplier": float(s["noise_multipliers"].get("grad", s["noise_multipliers"].get("x-refresh"))),
           "seconds": time.perf_counter() - start,
           **figures(cfg, np.load(run / "final_params.npy"))}
    done.write_text(json.dumps(row, indent=1))
    return row


def fedavg_row(a: argparse.Namespace, z: float, lr: float, out: Path) -> dict:
    """Run Flower's DP-FedAvg app at noise multiplier ``z`` on ``a.nodes`` simulated SuperNodes, evaluate it and
    charge its releases in dpdro's ledger (module docstring)."""
    from ..common.config import Config, toml_value
    from ..launch.simulate import run_app
    from ..server.ledger import auto_delta, epsilon_of

    name = f"Flower DP-FedAvg (local lr {lr:g})"
    run = out / name
    done = run / "row.json"
    if done.exists():
        return json.loads(done.read_text())
    run.mkdir(parents=True, exist_ok=True)
    cfg = Config.from_mapping({**base_keys(a), "out-dir": str(run)})
    weights = (run / "final_params.npy").resolve()  # the ServerApp runs in another directory

    settings = {"dpdro-config": json.dumps(cfg.to_dict(), default=str), "num-rounds": a.rounds,
                "sampled": a.sampled, "noise-multiplier": z, "clip": a.fedavg_clip, "lr": lr,
                "local-epochs": a.fedavg_epochs, "batch": a.fedavg_batch, "out-file": str(weights)}
    start = time.perf_counter()
    run_app(APP, " ".join(f"{k}={toml_value(v)}" for k, v in settings.items()), a.nodes,
            check=lambda: weights.exists() or f"wrote no {weights}")
    delta = auto_delta(a.nodes)
    rate = a.sampled / a.nodes
    row = {"row": name, "epsilon": epsilon_of({(rate, z): a.rounds}, delta, "pld"),
           "epsilon_without_amplification": epsilon_of({(1.0, z): a.rounds}, delta, "pld"), "delta": delta,
           "noise_multiplier": z, "seconds": time.perf_counter() - start,
           "round_seconds_median": float(np.median(json.loads(Path(str(weights) + ".json").read_text())
                                                   ["round_seconds"] or [0.0])),
           **figures(cfg, np.load(weights))}
    done.write_text(json.dumps(row, indent=1))
    return row


def table(rows: list[dict]) -> list[str]:
    """One seed's rows (with sites, a worst-site column)."""
    sites = all("worst_site_accuracy" in r for r in rows)
    lines = ["| row | epsilon (dpdro's ledger) | noise multiplier | accuracy | worst class | worst node | "
             f"10th-percentile node | node spread |{' worst site |' if sites else ''} seconds |",
             "|---|---|---|---|---|---|---|---|" + "---|" * (1 + sites)]
    for r in rows:
        site = f" {r['worst_site_accuracy']:.4f} |" if sites else ""
        lines.append(f"| {r['row']} | {r['epsilon']:.3f} | {r['noise_multiplier']:.3f} | {r['test_accuracy']:.4f} | "
                     f"{r['worst_class_accuracy']:.4f} | {r['worst_node_accuracy']:.4f} | "
                     f"{r['node_accuracy_p10']:.4f} | "
                     f"{r['node_accuracy_spread']:.4f} |{site} {r['seconds']:.0f} |")
    return lines


def _median_node(r: dict) -> float:
    return float(np.nanmedian(np.asarray(r["per_node_accuracy"], dtype=float)))


SEED_COLUMNS = (("accuracy", lambda r: r["test_accuracy"]), ("worst class", lambda r: r["worst_class_accuracy"]),
                ("worst node", lambda r: r["worst_node_accuracy"]), ("10th-percentile node",
                                                                     lambda r: r["node_accuracy_p10"]),
                ("median node", _median_node), ("worst site", lambda r: r.get("worst_site_accuracy", float("nan"))))


def seeds_table(by_seed: dict[int, list[dict]]) -> list[str]:
    """Mean +/- std over the seeds of every row (same name in each seed's rows), then the comparisons the issue asks
    for under the report's interval rule (``tables.verdict``: Welch's 95 % interval of the difference): dpdro's
    DP-FedAvg (dp-sgd with local steps) against Flower's wrapper, and node groups and site groups (``--sites``)
    against none, all with local steps."""
    from .tables import mean_std, verdict

    names = list(dict.fromkeys(r["row"] for rows in by_seed.values() for r in rows))
    runs = {n: [r for rows in by_seed.values() for r in rows if r["row"] == n] for n in names}
    with_sites = all("worst_site_accuracy" in r for rs in runs.values() for r in rs)
    columns = [(c, get) for c, get in SEED_COLUMNS if c != "worst site" or with_sites]
    heads = [c for c, _ in columns]
    lines = [f"| row | seeds | epsilon | {' | '.join(heads)} |", "|---|---|---|" + "---|" * len(columns)]
    for n in names:
        cells = []
        for _, get in columns:
            m, sd = mean_std([get(r) for r in runs[n]])
            cells.append(f"{m:.3f} +/- {sd:.3f}")
        lines.append(f"| {n} | {len(runs[n])} | {max(r['epsilon'] for r in runs[n]):.3f} | {' | '.join(cells)} |")
    fedavg = next((n for n in names if n.startswith("Flower DP-FedAvg")), None)
    local = next((n for n in names if n.startswith("dpdro dp-sgd, local epochs")), None)
    groups = next((n for n in names if n.startswith("dpdro recursive-spider, dro-groups = node, local")), None)
    sites = next((n for n in names if n.startswith("dpdro recursive-spider, dro-groups = site, local")), None)
    lines.append("")
    for a_name, b_name in ((local, fedavg), (groups, local), (sites, local)):
        if a_name is None or b_name is None:
            continue
        for column, get in columns:
            if column == "worst class":
                continue
            lines.append(f"- {a_name} against {b_name}, {column}: "
                         f"{verdict([get(r) for r in runs[a_name]], [get(r) for r in runs[b_name]])}")
    return lines


def seed_rows(a: argparse.Namespace, out: Path) -> list[dict]:
    """Every row of one seed (``a.seed``) in ``out``: dpdro's rows without and with local steps, then Flower's at
    dp-sgd's noise multiplier (finished rows are read back)."""
    out.mkdir(parents=True, exist_ok=True)
    keys = base_keys(a)
    rows = []
    for lr in a.dpdro_lr:  # every step size tried is a row: nothing is selected on the test split
        common = {**keys, "lr-x": lr, "clip-x": a.dpdro_clip, "momentum": a.dpdro_momentum}
        rows.append(dpdro_row(f"dpdro dp-sgd (lr-x {lr:g})", {**common, "algorithm": "dp-sgd"}, out))
        rows.append(dpdro_row(f"dpdro recursive-spider, dro-groups = node (lr-x {lr:g})",
                              {**common, "algorithm": "recursive-spider", "dro-level": "group",
                               "dro-groups": "node"}, out))
        for r in rows[-2:]:
            print(json.dumps({k: v for k, v in r.items() if k != "per_node_accuracy"}), flush=True)
    if a.local_epochs > 0:  # DP-FedAvg's contribution in dpdro: a node's update after local SGD (local-epochs)
        start = len(rows)
        local = {**keys, "lr-x": 1.0, "clip-x": a.fedavg_clip, "momentum": 0.0, "local-epochs": a.local_epochs,
                 "local-lr": a.fedavg_lr[0], "local-batch": a.fedavg_batch}
        rows.append(dpdro_row(f"dpdro dp-sgd, local epochs {a.local_epochs}", {**local, "algorithm": "dp-sgd"}, out))
        rows.append(dpdro_row(f"dpdro recursive-spider, dro-groups = node, local epochs {a.local_epochs}",
                              {**local, "algorithm": "recursive-spider", "dro-level": "group", "dro-groups": "node",
                               "q": 1}, out))
        if a.sites:
            rows.append(dpdro_row(f"dpdro recursive-spider, dro-groups = site, local epochs {a.local_epochs}",
                                  {**local, "algorithm": "recursive-spider", "dro-level": "group",
                                   "dro-groups": "site", "q": 1}, out))
        for lam in a.site_lambda if a.sites else ():  # the DRO's temperature as a lever of the site groups
            rows.append(dpdro_row(f"dpdro recursive-spider, dro-groups = site, local epochs {a.local_epochs}, "
                                  f"lambda {lam:g}", {**local, "algorithm": "recursive-spider", "dro-level": "group",
                                                      "dro-groups": "site", "q": 1, "lambda": lam}, out))
        for r in rows[start:]:
            print(json.dumps({k: v for k, v in r.items() if k != "per_node_accuracy"}), flush=True)
    z = next(r["noise_multiplier"] for r in rows if r["row"].startswith("dpdro dp-sgd"))
    for lr in a.fedavg_lr:
        rows.append(fedavg_row(a, z, lr, out))
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "per_node_accuracy"}), flush=True)
    return rows


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m dpdro.simulations.dp_fedavg", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/dp-fedavg")
    p.add_argument("--nodes", type=int, default=1000)
    p.add_argument("--sampled", type=int, default=30, help="nodes per round (dpdro: expected, Poisson)")
    p.add_argument("--rounds", type=int, default=100)
    p.add_argument("--epsilon", type=float, default=4.0)
    p.add_argument("--alpha", type=float, default=0.3, help="Dirichlet concentration of the label skew")
    p.add_argument("--seeds", type=int, nargs="+", default=[0],
                   help="a run of every row per seed (OUT/seed-S); with several, the table gives mean +/- std over "
                        "them and 95 %% intervals of the differences that decide the comparison")
    p.add_argument("--dpdro-lr", type=float, nargs="*", default=[1.0, 0.2],
                   help="dpdro's lr-x of the rows without local steps (a row each; none: no such rows)")
    p.add_argument("--dpdro-clip", type=float, default=1.0, help="dpdro's clip-x (of a node's mean gradient)")
    p.add_argument("--dpdro-momentum", type=float, default=0.9, help="dpdro's momentum (post-processing)")
    p.add_argument("--fedavg-lr", type=float, nargs="*", default=[0.05],
                   help="local SGD step of the FedAvg nodes (a row each)")
    p.add_argument("--fedavg-epochs", type=int, default=1)
    p.add_argument("--fedavg-batch", type=int, default=16)
    p.add_argument("--fedavg-clip", type=float, default=0.5, help="L2 clip of a node's model update")
    p.add_argument("--sites", type=int, default=0,
                   help="public sites the nodes are numbered into (num-sites; every row's partition then skews labels "
                        "by site) and a row with the sites as DRO groups; 0: none")
    p.add_argument("--site-lambda", type=float, nargs="*", default=[],
                   help="with --sites: more site-group rows at these DRO temperatures (config key lambda)")
    p.add_argument("--local-epochs", type=int, default=1,
                   help="dpdro rows with local-epochs = this (local lr, batch and clip: the first --fedavg-lr, "
                        "--fedavg-batch, --fedavg-clip); 0: none")
    a = p.parse_args(argv)
    logging.getLogger("absl").setLevel(logging.ERROR)  # dp-accounting's per-order convergence chatter
    if not 2 <= a.sampled <= a.nodes:
        print(f"--sampled must be in [2, --nodes = {a.nodes}]; got {a.sampled}", file=sys.stderr)
        return 2
    if not a.dpdro_lr and a.local_epochs < 1:
        print("--dpdro-lr: got no value with --local-epochs 0; allowed: a step size, or --local-epochs >= 1 (Flower's "
              "row takes the noise multiplier of a dpdro dp-sgd row)", file=sys.stderr)
        return 2
    by_seed = {}
    for seed in a.seeds:  # each seed's rows in OUT/seed-S (they resume), then the table over the seeds
        a.seed = seed
        out = Path(a.out) / f"seed-{seed}"
        rows = seed_rows(a, out)
        (out / "table.md").write_text("\n".join(table(rows)) + "\n")
        by_seed[seed] = rows
    lines = table([r for rows in by_seed.values() for r in rows]) if len(a.seeds) == 1 else seeds_table(by_seed)
    print("\n".join(lines))
    Path(a.out, "table.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
