"""Benchmark of checkpoint-select=private-best against the last iterate at equal total epsilon
(server/checkpoint_selection.py): the test-split figures of the model each run returns.

    python -m dpdro.simulations.checkpoint_select [--config simulations/configs/tuned/mnist-st-eps4-dp-sgd-la.toml]
        [--iterations 100] [--eval-every 20] [--eval-epsilon 0.5] [--validation-fraction 0.2] [--seeds 0 1]

For each seed, two runs of the configuration, both at its epsilon and over the same training records (both hold
out the same validation split, ``--validation-fraction``):

- ``last``: checkpoint-select=last, evaluated on the server's public test split (free): training gets the whole
  epsilon and the last iterate is returned;
- ``private-best``: checkpoint-select=private-best: 1 + iterations / eval-every charged evaluations of the
  validation split at ``--eval-epsilon`` each (training gets the rest of the epsilon), the iterate with the best
  noisy score returned.

Within the private-best run the benchmark also scores every evaluated iterate on the public test split (a callback;
post-processing, no budget, and never seen by the run): so the returned iterate is compared, paired, with the same
run's last iterate (what checkpoint-select=last would return at the same training noise) and with the iterate
that is best on the test split (an oracle no private run has). Printed per run: the training noise multiplier, the
epsilon of the evaluations alone, the iteration returned and the test accuracy and worst-class accuracy (with the
run's post-hoc tau, as ``dpdro evaluate`` computes them); then the means over seeds. A benchmark, not a test: the
noise is secret-seeded, so the figures vary from run to run.
"""

from __future__ import annotations

import argparse
import tempfile
import tomllib
from pathlib import Path

from ..server.callbacks import Callback


class IterateScores(Callback):
    """Scores every evaluated iterate on the public ``test`` records: iteration -> (accuracy, worst-class)."""

    def __init__(self, test) -> None:
        self.test = test
        self.scores: dict[int, tuple[float, float]] = {}

    def on_eval(self, run, row):
        from ..server.evaluate import evaluate
        from ..server.model_export import prediction_shift

        x, _ = run.plan.algo.returned(run.state)
        m = evaluate(run.plan.model, x, self.test, run.cfg.training, prediction_shift(run.cfg.training, run.setup))
        self.scores[int(row["iteration"])] = (m["test_accuracy"], m["worst_class_accuracy"])


def _train(cfg, test=None):
    """(summary, IterateScores or None) of one run of ``cfg``; ``test``: the public test records to score every
    evaluated iterate on."""
    from ..launch.local import prepare_local
    from ..server.engine import train

    transport, eval_set = prepare_local(cfg)
    scores = IterateScores(test) if test is not None else None
    result = train(cfg, transport, eval_set, callbacks=[scores] if scores else None)
    return result.summary, scores


def run(config: str, iterations: int, eval_every: int, eval_epsilon: float, validation_fraction: float,
        seeds: list[int], threads: int = 2) -> list[dict]:
    """The benchmark (module docstring); returns one dict per seed and prints the table."""
    from ..common.config import Config
    from ..common.data import load_from_config

    with open(config, "rb") as f:
        base = {k: v for k, v in tomllib.load(f).items() if k not in ("out-dir", "chosen-on-private-data")}
    base.update({"iterations": iterations, "eval-every": eval_every, "eval-epsilon": eval_epsilon,
                 "validation-fraction": validation_fraction, "checkpoint-every": 0, "threads": threads})
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            last_cfg = Config.from_mapping({**base, "seed": seed, "out-dir": str(Path(tmp) / f"{seed}-last")},
                                           warn=False)
            test = load_from_config(last_cfg, train=False)  # eval-split test: the public test split
            last, _ = _train(last_cfg)
            best_cfg = Config.from_mapping({**base, "seed": seed, "out-dir": str(Path(tmp) / f"{seed}-best"),
                                            "checkpoint-select": "private-best", "eval-split": "validation"},
                                           warn=False)
            best, scores = _train(best_cfg, test)
            chosen = best["checkpoint_returned"]["iteration"]
            oracle = max(scores.scores, key=lambda t: (scores.scores[t][1], scores.scores[t][0]))
            o = {"seed": seed, "last": (last["test_accuracy"], last["worst_class_accuracy"]),
                 "chosen": scores.scores[chosen], "same_run_last": scores.scores[iterations],
                 "oracle": scores.scores[oracle], "chosen_iteration": chosen, "oracle_iteration": oracle,
                 "noise_last": last["noise_multipliers"]["grad"], "noise_best": best["noise_multipliers"]["grad"],
                 "evaluations_epsilon": best["checkpoint_returned"]["evaluations_epsilon"],
                 "epsilon": (last["epsilon_spent"], best["epsilon_spent"])}
            out.append(o)
            print(f"seed {seed}: last (all epsilon {o['epsilon'][0]:.3f} to training, noise {o['noise_last']:.3f}): "
                  f"test accuracy {o['last'][0]:.4f}, worst-class {o['last'][1]:.4f}", flush=True)
            print(f"seed {seed}: private-best (epsilon {o['epsilon'][1]:.3f}: evaluations "
                  f"{o['evaluations_epsilon']:.3f} on their own, training noise {o['noise_best']:.3f}): returned "
                  f"iteration {chosen}: test accuracy "
                  f"{o['chosen'][0]:.4f}, worst-class {o['chosen'][1]:.4f}; the same run's last iterate "
                  f"{o['same_run_last'][0]:.4f} / {o['same_run_last'][1]:.4f}; best on test (iteration {oracle}) "
                  f"{o['oracle'][0]:.4f} / {o['oracle'][1]:.4f}", flush=True)
    for key, name in (("last", "last (all epsilon to training)"), ("chosen", "private-best, returned"),
                      ("same_run_last", "private-best run, its last iterate"), ("oracle", "best on test (oracle)")):
        acc = sum(o[key][0] for o in out) / len(out)
        worst = sum(o[key][1] for o in out) / len(out)
        print(f"mean over {len(out)} seed(s): {name:<36} test accuracy {acc:.4f}  worst-class {worst:.4f}")
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="simulations/configs/tuned/mnist-st-eps4-dp-sgd-la.toml")
    p.add_argument("--iterations", type=int, default=100)
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--eval-epsilon", type=float, default=0.5)
    p.add_argument("--validation-fraction", type=float, default=0.2)
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args(argv)
    run(a.config, a.iterations, a.eval_every, a.eval_epsilon, a.validation_fraction, a.seeds, a.threads)


if __name__ == "__main__":
    main()
