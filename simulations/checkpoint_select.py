"""Benchmark of checkpoint-select=private-best against the last iterate at equal total epsilon
(server/checkpoint_selection.py): the test-split figures of the model each run returns.

    python -m dpdro.simulations.checkpoint_select [--config simulations/configs/tuned/mnist-st-eps4-dp-sgd-la.toml]
        [--iterations 100] [--eval-every 25] [--eval-epsilon 0.5] [--validation-fraction 0.2] [--seeds 0 1]

For each seed, three runs of the configuration (every one at the config's epsilon, each over the same training
records: all hold out the same validation split, ``--validation-fraction``):

- ``last, test eval``: checkpoint-select=last, evaluated on the server's public test split (free): training gets the
  whole epsilon;
- ``last, node eval``: checkpoint-select=last with the same charged node evaluations of the validation split as
  private-best: training gets what private-best's training gets, the last iterate is returned;
- ``private-best``: checkpoint-select=private-best: 1 + iterations / eval-every charged evaluations of the
  validation split at ``--eval-epsilon`` each, the iterate with the best noisy score returned.

Printed per run: the training noise multiplier, the epsilon of the evaluations alone, the iteration returned, and
the returned model's accuracy and worst-class accuracy on the test split (``dpdro evaluate``'s figures:
server/prediction.py, with the run's post-hoc tau); then the mean over seeds. A benchmark, not a test: the noise is
secret-seeded, so the figures vary from run to run.
"""

from __future__ import annotations

import argparse
import tempfile
import tomllib
from pathlib import Path

MODES = {"last, test eval": {"checkpoint-select": "last", "eval-split": "test", "eval-data": "server"},
         "last, node eval": {"checkpoint-select": "last", "eval-split": "validation", "eval-data": "nodes"},
         "private-best": {"checkpoint-select": "private-best", "eval-split": "validation", "eval-data": "nodes"}}


def run(config: str, iterations: int, eval_every: int, eval_epsilon: float, validation_fraction: float,
        seeds: list[int], threads: int = 2) -> list[dict]:
    """The benchmark (module docstring); returns one dict per (seed, mode) and prints the table."""
    from ..common.config import Config
    from ..launch.local import train_local
    from ..server.prediction import metrics, predict

    with open(config, "rb") as f:
        base = {k: v for k, v in tomllib.load(f).items() if k not in ("out-dir", "chosen-on-private-data")}
    base.update({"iterations": iterations, "eval-every": eval_every, "eval-epsilon": eval_epsilon,
                 "validation-fraction": validation_fraction, "checkpoint-every": 0, "threads": threads})
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            for name, keys in MODES.items():
                run_dir = Path(tmp) / f"{seed}-{keys['checkpoint-select']}-{keys['eval-data']}"
                cfg = Config.from_mapping({**base, **keys, "seed": seed, "out-dir": str(run_dir)}, warn=False)
                s = train_local(cfg).summary
                m = metrics(predict(run_dir, "test"))
                r = s["checkpoint_returned"]
                out.append({"seed": seed, "mode": name, "train_noise": s["noise_multipliers"][_train_mechanism(s)],
                            "eval_epsilon_total": r.get("evaluations_epsilon", 0.0), "iteration": r["iteration"],
                            "epsilon_spent": s["epsilon_spent"], "accuracy": m["accuracy"],
                            "worst_class": m["worst_class_accuracy"]})
                o = out[-1]
                print(f"seed {seed}  {name:<16} training noise {o['train_noise']:.3f}  evaluations epsilon "
                      f"{o['eval_epsilon_total']:.3f}  epsilon {o['epsilon_spent']:.3f}  returned iteration "
                      f"{o['iteration']:>4}  test accuracy {o['accuracy']:.4f}  worst-class {o['worst_class']:.4f}",
                      flush=True)
    for name in MODES:
        rows = [o for o in out if o["mode"] == name]
        print(f"mean over {len(rows)} seed(s)  {name:<16} test accuracy "
              f"{sum(o['accuracy'] for o in rows) / len(rows):.4f}  worst-class "
              f"{sum(o['worst_class'] for o in rows) / len(rows):.4f}")
    return out


def _train_mechanism(summary: dict) -> str:
    """The name of the run's (first) training mechanism: the noise multiplier that calibration chose."""
    fixed = summary["noise_allocation"]["fixed"]
    return next(k for k in summary["noise_multipliers"] if k not in fixed and k != "prior")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="simulations/configs/tuned/mnist-st-eps4-dp-sgd-la.toml")
    p.add_argument("--iterations", type=int, default=100)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--eval-epsilon", type=float, default=0.5)
    p.add_argument("--validation-fraction", type=float, default=0.2)
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args(argv)
    run(a.config, a.iterations, a.eval_every, a.eval_epsilon, a.validation_fraction, a.seeds, a.threads)


if __name__ == "__main__":
    main()
