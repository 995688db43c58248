"""Benchmark of the node evaluation's accuracy (eval-data=nodes, server/node_evaluation.py): how far the per-class
accuracies from noisy counts fall from the exact ones, and the table of expected errors the docs print.

    python -m dpdro.simulations.node_eval_bench [--dataset mnist-st] [--eval-epsilon 1] [--draws 100] [--nodes 4]

1. A model to evaluate: a linear classifier (Flatten, Linear) trained without privacy for ``--epochs`` epochs of
   Adam on the data set's training split (the benchmark measures the evaluation, not the model; any released model
   would do).
2. The test split (MNIST-ST: 10,000 records) is partitioned over ``--nodes`` in-process nodes (partition iid, as
   ``LocalTransport`` partitions a run's held-out records), and each of ``--draws`` node evaluations runs through the
   product's path: ``node_evaluation.evaluate_on_nodes`` with a ``Releaser`` and a ``Ledger`` whose plan is one
   evaluation at the noise multiplier calibrated to ``--eval-epsilon`` at the run's delta (1/(10 n), n the training
   split), central noise mode. The exact per-class accuracies are those of the same nodes without noise.
3. Printed: the noise multiplier and count std, for every class its exact accuracy, the fraction of draws within
   ``--tolerance`` (0.02) of it and the 95th percentile of the absolute error, the fraction of draws with every class
   within the tolerance, and the table of ``node_evaluation.expected_error`` (standard error of one class's accuracy
   at true accuracy 0.9) for epsilons x records per class at delta 1e-6.

A benchmark, not a test: the figures depend on the noise drawn (secret-seeded).
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
from pathlib import Path

import numpy as np
import torch
from torch import nn

TABLE_EPSILONS = (0.1, 0.5, 1.0, 2.0, 4.0)
TABLE_RECORDS = (100, 1000, 10_000)
TABLE_DELTA = 1e-6


def train_linear(x: torch.Tensor, y: torch.Tensor, num_classes: int, epochs: int, seed: int = 0) -> nn.Module:
    """A linear classifier on flattened x (N, ...) trained non-privately (Adam, lr 1e-3, batches of 256)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Flatten(), nn.Linear(int(np.prod(x.shape[1:])), num_classes))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(epochs):
        order = torch.randperm(len(y))
        for s in range(0, len(y), 256):
            idx = order[s:s + 256]
            opt.zero_grad()
            nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
    return model


def run(dataset: str = "mnist-st", eval_epsilon: float = 1.0, draws: int = 100, nodes: int = 4, epochs: int = 2,
        tolerance: float = 0.02) -> dict:
    """The benchmark (module docstring); returns its figures as a dict and prints them."""
    from ..client.local_transport import LocalTransport
    from ..common.config import Config
    from ..common.data import load_from_config
    from ..server.ledger import Ledger, auto_delta
    from ..server.node_evaluation import (
        EVAL_MECHANISM,
        eval_noise_multiplier,
        evaluate_on_nodes,
        expected_error,
        mechanisms,
    )
    from ..server.releaser import Releaser
    from ..server.rundir import RunDir

    with tempfile.TemporaryDirectory() as tmp:
        base = {"dataset": dataset, "num-clients": nodes, "eval-data": "nodes", "eval-epsilon": eval_epsilon,
                "iterations": 1, "eval-every": 1, "threads": 2, "out-dir": str(Path(tmp) / "run")}
        cfg = Config.from_mapping(base)
        train, test = load_from_config(cfg, True), load_from_config(cfg, False)
        module = train_linear(train.x, train.y, train.num_classes, epochs)
        flat = torch.cat([p.detach().flatten() for p in module.parameters()]).double().numpy()
        n = len(train)
        delta = auto_delta(n)
        transport = LocalTransport(cfg, train, module, held_out=test)
        z = eval_noise_multiplier(eval_epsilon, delta, cfg.accountant)
        (mech, _), = mechanisms(cfg, delta).items()
        plan, noise = {dataclasses.replace(mech, fixed_noise=z): 1}, {EVAL_MECHANISM: z}
        rd = RunDir(cfg.out_dir)
        rd.create()
        exact_cfg = Config.from_mapping({**base, "epsilon": float("inf")})
        exact = evaluate_on_nodes(Releaser(exact_cfg, transport, Ledger(plan, {EVAL_MECHANISM: 0.0}, float("inf"),
                                                                          delta), n, rd), 0, flat, test.num_classes)
        errors, std = [], None
        for i in range(draws):
            releaser = Releaser(cfg, transport, Ledger(plan, noise, cfg.epsilon, delta, cfg.accountant), n, rd)
            row = evaluate_on_nodes(releaser, i, flat, test.num_classes)
            std = row["eval_noise_std"]
            errors.append(np.abs(np.array(row["per_class_accuracy"]) - np.array(exact["per_class_accuracy"])))
    errors = np.array(errors)  # (draws, K)
    within = (errors <= tolerance).mean(axis=0)
    out = {"dataset": dataset, "records": len(test), "nodes": nodes, "n": n, "delta": delta,
           "eval_epsilon": eval_epsilon, "noise_multiplier": z, "count_std": std, "draws": draws,
           "exact_per_class": exact["per_class_accuracy"], "class_totals": exact["eval_class_totals"],
           "within_tolerance": within.tolist(), "p95_error": np.quantile(errors, 0.95, axis=0).tolist(),
           "all_within": float((errors <= tolerance).all(axis=1).mean()),
           "table": {eps: {r: expected_error(eps, TABLE_DELTA, r) for r in TABLE_RECORDS} for eps in TABLE_EPSILONS}}
    print(f"{dataset}: {len(test)} test records over {nodes} nodes, n = {n}, delta = {delta:.3g}, eval epsilon "
          f"{eval_epsilon:g}: noise multiplier {z:.4f}, std of each count {std:.3f}; {draws} draws")
    print(f"class  records  exact accuracy  within {tolerance:g}  95th pct |error|")
    for k in range(len(within)):
        print(f"{k:>5}  {round(out['class_totals'][k]):>7}  {out['exact_per_class'][k]:>14.4f}  {within[k]:>9.2f}  "
              f"{out['p95_error'][k]:>16.4f}")
    print(f"every class within {tolerance:g} at once: {out['all_within']:.2f} of draws")
    print(f"expected standard error of one class's accuracy (true accuracy 0.9, delta {TABLE_DELTA:g}):")
    print("epsilon  " + "  ".join(f"{r:>8} rec." for r in TABLE_RECORDS))
    for eps, row in out["table"].items():
        print(f"{eps:>7g}  " + "  ".join(f"{row[r]:>13.4f}" for r in TABLE_RECORDS))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", default="mnist-st")
    p.add_argument("--eval-epsilon", type=float, default=1.0)
    p.add_argument("--draws", type=int, default=100)
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--tolerance", type=float, default=0.02)
    a = p.parse_args(argv)
    run(a.dataset, a.eval_epsilon, a.draws, a.nodes, a.epochs, a.tolerance)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
