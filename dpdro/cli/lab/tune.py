"""``dpdro lab tune``: Optuna search (TPE, median pruner) with the same budget per method on a validation split,
top trials confirmed on more seeds; writes tuned configs and TUNING.md (not privacy-accounted); resumable.
``dpdro lab tune --private``: the accounted search of Papernot and Steinke (simulations/private_tune.py): a random
number of random trials, each scored by a noisy count, the best released with its epsilon_total."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dpdro.common.config import DATASETS, ConfigError, parse_set_args

from .. import shared

NAME = "tune"
HELP = ("Optuna search (TPE, median pruner) with the same budget per method on a validation split, top trials "
        "confirmed on more seeds; writes tuned configs and TUNING.md (not privacy-accounted); resumable")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dataset", nargs="+", default=["mnist-st"], choices=DATASETS, help="data sets to tune")
    p.add_argument("--epsilon", type=float, default=4.0)
    p.add_argument("--trials", type=int, default=20, help="finished (complete or pruned) trials per method, the "
                                                          "same for every method; a larger number extends a search")
    p.add_argument("--methods", nargs="+", default=None, metavar="METHOD",
                   help="methods to tune (default: every method with a search space, simulations/tune.py METHODS)")
    p.add_argument("--seed", type=int, default=0, help="seed of the search's sampler (not of the runs)")
    p.add_argument("--jobs", type=int, default=2, help="trials in parallel (1: reproducible point for point)")
    p.add_argument("--confirm-top", type=int, default=3, help="best complete trials per method confirmed")
    p.add_argument("--confirm-seeds", type=int, default=3, help="seeds each of them is judged on (the trial is "
                                                                "seed 0; 1: no confirmation runs)")
    p.add_argument("--warm-start", action="store_true",
                   help="each method's first trial is its shipped configuration (configs/handset/ when there is "
                        "one, else configs/tuned/), within the same budget")
    p.add_argument("--root", default="runs/tune", help="folder of the trials' run directories")
    p.add_argument("--configs", default="simulations/configs", help="where tuned/*.toml and *-best.toml go")
    shared.add_output_arguments(p, "TUNING.md", "runs/tune")
    p.add_argument("--report", action="store_true", help="run nothing: write configs and TUNING.md from finished "
                                                         "trials")
    p.add_argument("--transfer-from", choices=DATASETS, metavar="SOURCE",
                   help="run nothing: write tuned configs for each --dataset from SOURCE's tuned configs (which "
                        "must exist): each method keeps its searched keys, batch sizes scale and the other keys "
                        "(e.g. CelebA's 300 iterations) follow the target; the target's data are not looked at "
                        "and TUNING.md is not touched")
    p.add_argument("--probe", nargs="*", metavar="KEY=VALUE",
                   help="run nothing of the search: train one hand-set point of one --methods with a trial's "
                        "protocol (validation split, trial length, the method's fixed keys), outside the budget "
                        "(not recorded, chooses nothing; a diagnostic); --seed is the run's seed here")
    p.add_argument("--choose-posthoc-tau", action="store_true",
                   help="run nothing of the search: choose each --methods' post-hoc tau again on the data set's "
                        "validation split (models of its tuned file, trained with the search's validation split, "
                        "evaluated over --tau-grid; the search's score) and rewrite the tuned file "
                        "(simulations/posthoc_tau.py); e.g. after --transfer-from")
    p.add_argument("--tau-grid", type=float, nargs="+", metavar="TAU", default=None,
                   help="with --choose-posthoc-tau: the taus (default 0, 0.1, ..., 1, 1.25, 1.5, 2)")
    p.add_argument("--tau-seeds", type=int, default=1, metavar="N",
                   help="with --choose-posthoc-tau: validation models per method, seeds 1..N (default 1)")
    p.add_argument("--min-accuracy", type=float, default=0.0, metavar="A",
                   help="with --choose-posthoc-tau: choose only among taus with mean validation accuracy >= A")
    p.add_argument("--selection-epsilon", type=float, default=None, metavar="E",
                   help="with --choose-posthoc-tau: choose from noisy per-class counts spending epsilon E per method "
                        "(server/private_selection.py); default: noiseless, not accounted")
    g = p.add_argument_group("private search (--private; simulations/private_tune.py)")
    g.add_argument("--private", action="store_true",
                   help="the privacy-accounted search of Papernot and Steinke (ICLR 2022) for one --methods: a "
                        "secret random number of trials K, each a full run at --epsilon with a random point of the "
                        "method's space, scored by its noisy worst-class validation accuracy; the best trial is "
                        "released with epsilon_total (the whole search). --trials, --jobs, --confirm-*, --warm-start "
                        "do not apply")
    g.add_argument("--distribution", choices=("tnb", "poisson"), default="tnb",
                   help="law of K: truncated negative binomial (--eta, --gamma; Theorem 2) or Poisson (--mu; "
                        "Theorem 6); default tnb")
    g.add_argument("--eta", type=float, default=1.0, help="tnb's eta > -1 (1: truncated geometric; default 1)")
    g.add_argument("--gamma", type=float, default=0.1,
                   help="tnb's gamma in (0, 1); default 0.1 (with eta 1: E[K] = 1/gamma = 10)")
    g.add_argument("--mu", type=float, default=10.0, help="Poisson's mean mu > 0 (default 10)")
    g.add_argument("--score-noise-multiplier", type=float, default=10.0, metavar="Z",
                   help="noise multiplier of each trial's score: per-class correct and total counts + N(0, (Z "
                        "sqrt 2)^2) (default 10)")
    g.add_argument("--trial-keys", nargs="*", metavar="KEY=VALUE", default=[],
                   help="config keys set in every trial (not searched keys), e.g. iterations=100 for a short search")
    p.set_defaults(all_datasets=DATASETS)


def _methods(args: argparse.Namespace) -> list[str]:
    """--methods checked against the searchable methods (read here, not at parse time: the CLI's start-up
    imports no lab code); ConfigError naming the bad ones and what is allowed."""
    from dpdro.simulations.tune import METHODS

    methods = list(args.methods) if args.methods else list(METHODS)
    bad = [m for m in methods if m not in METHODS]
    if bad:
        raise ConfigError(f"--methods: got {', '.join(bad)}; allowed: {', '.join(METHODS)}")
    return methods


def run(args: argparse.Namespace) -> int:
    if args.private:
        return _private(args)
    try:
        import optuna  # noqa: F401
    except ImportError:
        print('dpdro: error: dpdro lab tune needs Optuna: pip install -e ".[tune]" (or pip install optuna)',
              file=sys.stderr)
        return 2
    from dpdro.simulations.tune import run_tune, searched_entries, transfer_tuned, tuning_report, write_tuned

    args.methods = _methods(args)
    root, configs, docs = Path(args.root), Path(args.configs), shared.docs_dir(args)
    if args.probe is not None:
        return _probe(args, root)
    if args.choose_posthoc_tau:
        return _posthoc_tau(args, root, configs)
    if args.transfer_from:  # no trial runs: TUNING.md (the trials of searches) is left as it is
        for ds in args.dataset:
            for method, path in transfer_tuned(ds, args.transfer_from, args.epsilon, args.methods, configs).items():
                print(f"{ds} eps {args.epsilon:g} {method}: transferred from {args.transfer_from} -> {path}")
        return 0
    for ds in args.dataset:
        if args.report:
            winners = write_tuned(ds, args.epsilon, args.methods, root, configs)
        else:
            winners = run_tune(ds, args.epsilon, args.methods, args.trials, root, configs, args.seed, args.jobs,
                               args.confirm_top, args.confirm_seeds, args.warm_start)
        for method, w in winners.items():
            print(f"{ds} eps {args.epsilon:g} {method}: trial {w['trial']} ({w['seeds']} seed(s)), validation worst "
                  f"{w['val_worst']:.4f}, two lowest {w['val_two_lowest']:.4f}, accuracy {w['val_accuracy']:.4f}")
    entries = searched_entries(root, args.all_datasets)
    if not entries:  # nothing to report: the document of an earlier search stays
        print(f"no search under {root}: {docs / 'TUNING.md'} left as it is")
        return 0
    print(f"report: {tuning_report(entries, args.methods, root, docs)}")
    return 0


def _posthoc_tau(args: argparse.Namespace, root: Path, configs: Path) -> int:
    """--choose-posthoc-tau: each method's tau chosen again on validation, its tuned file rewritten."""
    from dpdro.simulations.posthoc_tau import TAU_GRID, choose_posthoc_tau

    grid = tuple(args.tau_grid) if args.tau_grid else TAU_GRID
    for ds in args.dataset:
        choices = choose_posthoc_tau(ds, args.epsilon, args.methods, root, configs, grid, args.tau_seeds,
                                     args.jobs, args.min_accuracy, args.selection_epsilon)
        for c in choices.values():
            was = (f"{c.previous:g} (worst {c.previous_terms[0]:.4f}, two lowest {c.previous_terms[1]:.4f}, "
                   f"accuracy {c.previous_terms[2]:.4f})")
            if c.chosen is None:
                print(f"{ds} eps {args.epsilon:g} {c.method}: no tau reaches accuracy {args.min_accuracy:g}; "
                      f"{c.path} keeps {was}")
            else:
                print(f"{ds} eps {args.epsilon:g} {c.method}: posthoc-tau {c.chosen:g} (validation worst "
                      f"{c.chosen_terms[0]:.4f}, two lowest {c.chosen_terms[1]:.4f}, accuracy "
                      f"{c.chosen_terms[2]:.4f}) instead of {was} -> {c.path} (chosen on private records: not "
                      "accounted; its chosen-on-private-data says so)")
    return 0


def _probe(args: argparse.Namespace, root: Path) -> int:
    """--probe: one hand-set point of one method, a trial's protocol, outside the search."""
    from dpdro.simulations.tune import run_probe

    if len(args.methods) != 1 or len(args.dataset) != 1:
        print("dpdro: error: --probe runs one point: give exactly one --methods and one --dataset, got "
              f"{args.methods} and {args.dataset}", file=sys.stderr)
        return 2
    s = run_probe(args.dataset[0], args.epsilon, args.methods[0], parse_set_args(args.probe), root, args.seed)
    per_class = ", ".join(f"{a:.3f}" for a in s["per_class_accuracy"])
    print(f"probe {args.methods[0]} (outside the search; {s['eval_split']} split, seed {s['seed']}): accuracy "
          f"{s['test_accuracy']:.4f}, worst {s['worst_class_accuracy']:.4f}; per class {per_class}")
    return 0


def trial_count(args: argparse.Namespace):
    """The law of K from --distribution, --eta, --gamma, --mu (ConfigError naming a bad one)."""
    from dpdro.server.private_tuning import TrialCount

    return TrialCount(args.distribution, eta=args.eta, gamma=args.gamma, mu=args.mu)


def _private(args: argparse.Namespace) -> int:
    """--private: one method's accounted search per --dataset (simulations/private_tune.py)."""
    from dpdro.simulations.private_tune import run_private_search

    from ..plan import privacy_plan

    args.methods = _methods(args)
    if len(args.methods) != 1:
        raise ConfigError(f"--methods: got {len(args.methods)} methods with --private; allowed: exactly one (choosing "
                          "among methods' searches would be one more selection on the private records)")
    dist = trial_count(args)
    for ds in args.dataset:
        out = run_private_search(ds, args.epsilon, args.methods[0], dist, Path(args.root), privacy_plan, args.seed,
                                 args.score_noise_multiplier, trial_keys=parse_set_args(args.trial_keys or []))
        best = out["best"]
        print(f"{ds} {args.methods[0]}: private search ({dist.describe()}), per-trial epsilon {args.epsilon:g}: "
              f"epsilon_total {out['epsilon_total']:.4f} at delta {out['delta']:.3g} ({out['theorem']})")
        if best is None:
            print("  no trial was drawn (K = 0): nothing released")
        else:
            keys = ", ".join(f"{k} {v}" for k, v in sorted(best["keys"].items()))
            print(f"  released: {best['out_dir']} ({keys}), noisy worst-class validation accuracy "
                  f"{best['noisy_worst']:.4f}")
        print(f"  released.json beside {out['record']} (the record: not for publication)")
    return 0
