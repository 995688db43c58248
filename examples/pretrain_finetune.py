"""Pretrain on records declared public, fine-tune with DP on the private rest, against DP training from scratch.

    DPDRO_DATA_ROOT=/path/to/datasets .venv/bin/python examples/pretrain_finetune.py [OUT_DIR] [--seeds 3]

MNIST-ST's training split is cut in two, by a seeded draw: PUBLIC_FRACTION of the records are *declared public*
(as a hospital would use a public data set or records whose owners agreed to their release) and the rest are the
private records. The public slice trains the model without any privacy (plain torch: Adam, cross-entropy, a few
epochs) and its state_dict is saved; then the private records train the same architecture with dpdro at the same
epsilon twice: from those weights (config key init-weights: no privacy cost, the file is public input; its sha256
goes into summary.json and the model card) and from the seeded initialisation. The file must not come from the
private records: here the two slices are disjoint, and the private run never sees the public one.

Both private runs have the same keys (the dp-sgd-la keys below), seeds 0..seeds-1, evaluated on the test split.
Prints each run's test accuracy and worst-class accuracy, the means, and the public model's own test figures.

Measured 2026-12-05 on this project's 2-core machine shared with other jobs (load average 12-15; 424 s wall, nice
19, 3 seeds): 3,035 records declared public, 26,983 private, 2,000 test records. The public model alone: accuracy
0.462, worst class 0.000 (about 6 public records of each rare class). At epsilon 2, mean over 3 seeds: fine-tuned
0.4635, from scratch 0.4547 accuracy; worst class 0.000 for both. At this size the pretrained start moves accuracy
by under one point and neither run learns a rare class: the public slice is too small and too long-tailed to teach
them, and 40 private iterations do not either. It shows the calls, not a result.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import dpdro
from dpdro.common.data import load_dataset
from dpdro.common.models import make_model

logging.getLogger("absl").setLevel(logging.ERROR)  # dp-accounting's per-order convergence chatter (as the CLI)
PUBLIC_FRACTION = 0.1
MODEL = "cnn"
KEYS = {  # the same keys as `dpdro train --set ...`; small enough for a 2-core machine
    "algorithm": "dp-sgd-la", "epsilon": 2.0, "logit-adjust-tau": 1.0, "iterations": 40, "refresh-batch": 512,
    "lr-x": 2.0, "clip-x": 1.0, "num-clients": 2, "eval-every": 40, "threads": 1, "overwrite": True,
}


def accuracy(model: torch.nn.Module, data) -> tuple[float, float]:
    """(accuracy, worst-class accuracy) of ``model`` on an ArrayDataset."""
    with torch.no_grad():
        pred = model(data.x).argmax(1)
    per_class = [float((pred[data.y == k] == k).float().mean()) for k in range(data.num_classes) if (data.y == k).any()]
    return float((pred == data.y).float().mean()), min(per_class)


def pretrain(public, seed: int, epochs: int = 3) -> torch.nn.Module:
    """The model trained without privacy on the public records only (Adam, lr 1e-3, batches of 128)."""
    torch.manual_seed(seed)
    model = make_model(MODEL, public.num_classes, seed)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(epochs):
        for batch in torch.randperm(len(public.y)).split(128):
            opt.zero_grad()
            F.cross_entropy(model(public.x[batch]), public.y[batch]).backward()
            opt.step()
    return model.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", nargs="?", default="runs/example-pretrain")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--max-test-records", type=int, default=2000)
    args = parser.parse_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)

    train = load_dataset("mnist-st", "train")
    test = load_dataset("mnist-st", "test", max_records=args.max_test_records)
    public_mask = torch.rand(len(train.y), generator=torch.Generator().manual_seed(12345)) < PUBLIC_FRACTION
    public = dpdro.records(train.x[public_mask], train.y[public_mask], train.num_classes, name="public")
    private = dpdro.records(train.x[~public_mask], train.y[~public_mask], train.num_classes, name="private")
    evaluation = dpdro.records(test.x, test.y, test.num_classes, name="test")
    print(f"records: {len(public.y)} declared public, {len(private.y)} private, {len(evaluation.y)} test")

    start = time.perf_counter()
    net = pretrain(public, seed=0)
    weights = out / "public-pretrained.pt"
    torch.save(net.state_dict(), weights)
    acc, worst = accuracy(net, evaluation)
    print(f"public model (no privacy, public records only): test accuracy {acc:.4f}, worst class {worst:.4f} "
          f"({time.perf_counter() - start:.0f} s)")

    figures: dict[str, list[tuple[float, float]]] = {"fine-tuned": [], "scratch": []}
    for seed in range(args.seeds):
        for name, extra in (("fine-tuned", {"init-weights": str(weights)}), ("scratch", {})):
            keys = {**KEYS, **extra, "seed": seed, "out-dir": str(out / f"{name}-seed{seed}")}
            result = dpdro.fit(keys, data=(private, evaluation), model=MODEL)
            s = result.summary
            figures[name].append((s["test_accuracy"], s["worst_class_accuracy"]))
            print(f"seed {seed} {name:>10}: test accuracy {s['test_accuracy']:.4f}, worst class "
                  f"{s['worst_class_accuracy']:.4f}, epsilon spent {result.privacy['epsilon_spent']:.3f}")
    for name, rows in figures.items():
        print(f"mean over {len(rows)} seeds, {name:>10}: accuracy {statistics.mean(r[0] for r in rows):.4f}, "
              f"worst class {statistics.mean(r[1] for r in rows):.4f}")
    print(f"wall {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
