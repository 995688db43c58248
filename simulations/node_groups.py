"""The worst-off node (config key dro-groups=node; docs/research/NODES.md): the group level of a paper method with the
nodes as its groups (agnostic federated learning, Mohri et al. 2019) against the same method with the classes as its
groups and against dp-sgd, on MNIST-ST split over the nodes by a Dirichlet-by-label partition. A benchmark: it
prints a table of accuracy, worst-class accuracy, worst-node accuracy and the spread of per-node accuracy (maximum
minus minimum), not a timed test.

  python -m dpdro.simulations.node_groups --out /tmp/nodes [--nodes 10] [--alpha 0.3] [--iterations 100]
                                           [--epsilon 4] [--seed 0] [--method recursive-spider] [--jobs 1]

Each run starts from the method's tuned epsilon-4 file (simulations/configs/tuned/mnist-st-eps4-<method>.toml) with
the partition, node count, iterations (warm-up a quarter of them), epsilon and seed replaced. Per-node accuracy is
the final model's (with the run's post-hoc logit adjustment, ``server.prediction.predict``) on node j's part of the
server's test split, partitioned by the same seeded Dirichlet split as the training records
(``server.evaluate.node_of_records``): the test split of MNIST-ST is balanced, so node j's part has node j's label
mix but not its size. For the dro-groups=node run this equals the summary's worst_node_accuracy (checked here).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np

TUNED = Path(__file__).resolve().parent / "configs" / "tuned"
ROWS = (("dp-sgd", "class", "dp-sgd"), ("{method}", "class", "{method}, dro-groups=class"),
        ("{method}", "node", "{method}, dro-groups=node"))


def configs(out: Path, method: str, nodes: int, alpha: float, iterations: int, epsilon: float,
            seed: int) -> list[tuple[str, dict]]:
    """(label, kebab-case keys) of the three runs."""
    from ..common.config import load_toml_keys

    out_rows = []
    for algorithm, groups, label in ROWS:
        algorithm, label = algorithm.format(method=method), label.format(method=method)
        keys = load_toml_keys(TUNED / f"mnist-st-eps4-{algorithm}.toml")
        keys.update({"num-clients": nodes, "partition": "dirichlet", "dirichlet-alpha": alpha,
                     "iterations": iterations, "epsilon": epsilon, "seed": seed, "threads": 1,
                     "out-dir": str(out / f"{algorithm}-{groups}"), "overwrite": True, "eval-every": iterations})
        if "warmup-iterations" in keys:
            keys["warmup-iterations"] = iterations // 4
        if algorithm != "dp-sgd":
            keys["dro-groups"] = groups
        out_rows.append((label, keys))
    return out_rows


def node_figures(run_dir: str | Path) -> dict:
    """Accuracy, worst-class accuracy and the per-node figures of a finished run's final model on its test split."""
    from ..server.engine import load_run_config
    from ..server.evaluate import node_metrics, node_of_records
    from ..server.prediction import predict

    cfg = load_run_config(str(run_dir))
    p = predict(run_dir, "test")
    node_of = node_of_records(cfg.data, p.labels)
    summary = json.loads((Path(run_dir) / "summary.json").read_text())
    return {"test_accuracy": summary["test_accuracy"], "worst_class_accuracy": summary["worst_class_accuracy"],
            "epsilon_spent": summary["epsilon_spent"], "wall_seconds": summary.get("wall_seconds", math.nan),
            "summary_worst_node": summary.get("worst_node_accuracy"),
            "test_per_node": np.bincount(node_of, minlength=cfg.num_clients).tolist(),
            **node_metrics(p.predicted == p.labels, node_of, cfg.num_clients)}


def table(rows: list[tuple[str, dict]]) -> str:
    """Markdown table of (label, node_figures) rows."""
    lines = ["| run | accuracy | worst class | worst node | node spread (max - min) | epsilon spent |",
             "|---|---|---|---|---|---|"]
    for label, f in rows:
        lines.append(f"| {label} | {f['test_accuracy']:.4f} | {f['worst_class_accuracy']:.4f} | "
                     f"{f['worst_node_accuracy']:.4f} | {f['node_accuracy_spread']:.4f} | {f['epsilon_spent']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m dpdro.simulations.node_groups", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for the three run directories and table.md")
    ap.add_argument("--nodes", type=int, default=10)
    ap.add_argument("--alpha", type=float, default=0.3)
    ap.add_argument("--iterations", type=int, default=100)
    ap.add_argument("--epsilon", type=float, default=4.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--method", default="recursive-spider", choices=("recursive-spider", "dp-double-spider"))
    ap.add_argument("--jobs", type=int, default=1)
    a = ap.parse_args(argv)
    from ..common.config import Config
    from .runner import run_many

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = configs(out, a.method, a.nodes, a.alpha, a.iterations, a.epsilon, a.seed)
    results = run_many([Config.from_mapping(keys) for _, keys in runs], a.jobs, "node-groups")
    missing = [msg for _, msg in results if msg]
    if missing:
        raise SystemExit(f"data missing: {missing[0]}")
    rows = [(label, node_figures(keys["out-dir"])) for label, keys in runs]
    for label, f in rows:
        if f["summary_worst_node"] is not None and abs(f["summary_worst_node"] - f["worst_node_accuracy"]) > 1e-12:
            raise SystemExit(f"{label}: the summary's worst_node_accuracy {f['summary_worst_node']} differs from "
                             f"this evaluation's {f['worst_node_accuracy']}")
    text = table(rows)
    (out / "table.md").write_text(text + "\n")
    (out / "rows.json").write_text(json.dumps(rows, indent=1))
    print(text)
    for label, f in rows:
        print(label, "per-node accuracy", [round(v, 3) for v in f["per_node_accuracy"]],
              "test records per node", f["test_per_node"], f"wall {f['wall_seconds']:.0f} s")


if __name__ == "__main__":
    main()
