"""``dpdro plan``: the privacy plan of a configuration without training: every release kind with its count,
sampling rate and calibrated noise multiplier, delta, and the planned epsilon under both accountants; with
--private-search, the epsilon_total of a private hyper-parameter search whose trials are this configuration
(server/private_selection.py)."""

from __future__ import annotations

import argparse
import logging

from dpdro.common.config import ConfigError

from . import shared

NAME = "plan"
HELP = ("print the releases, sampling rates, calibrated noise multipliers and planned epsilon of a configuration, "
        "without training")


def add_arguments(p: argparse.ArgumentParser) -> None:
    shared.add_config_arguments(p, overwrite=False)
    shared.add_format_argument(p)
    g = p.add_argument_group("private search (dpdro lab tune --private)")
    g.add_argument("--private-search", action="store_true",
                   help="also print epsilon_total of a private search (Papernot and Steinke 2022) whose every trial "
                        "is this configuration plus its noisy score")
    g.add_argument("--distribution", choices=("tnb", "poisson"), default="tnb",
                   help="law of the number of trials: truncated negative binomial (--eta, --gamma) or Poisson (--mu)")
    g.add_argument("--eta", type=float, default=1.0, help="tnb's eta > -1 (default 1)")
    g.add_argument("--gamma", type=float, default=0.1, help="tnb's gamma in (0, 1) (default 0.1)")
    g.add_argument("--mu", type=float, default=10.0, help="Poisson's mean (default 10)")
    g.add_argument("--score-noise-multiplier", type=float, default=10.0, metavar="Z",
                   help="noise multiplier of each trial's noisy score (default 10)")


def privacy_plan(cfg) -> dict:
    """The plan of ``cfg`` as a dict: algorithm, dataset, n (training records), fitted (a line per batch size
    fitted to n, as the run fits it), iterations, epsilon_target,
    delta, accountant, releases (name, count, sampling_rate, noise_multiplier) and planned_epsilon (accountant ->
    epsilon; None for a non-private run). Loads the training split only to count its records (n, public: fixed by
    the unit of privacy). Raises ConfigError / DataError as training would, before any release."""
    from dpdro.client.local_transport import LocalTransport
    from dpdro.common.data import load_from_config
    from dpdro.common.model_init import prepare_model
    from dpdro.common.models import make_model, resolve_model
    from dpdro.common.per_sample import FlatModel
    from dpdro.server.algorithms import make_algorithm
    from dpdro.server.engine import check_groups, check_records, follow_n, plan_run, resolve_delta
    from dpdro.server.ledger import epsilon_of
    from dpdro.server.release import check_distributed

    train_set = load_from_config(cfg, train=True)
    check_groups(cfg, train_set.num_groups)
    transport = LocalTransport(cfg, train_set)
    n = transport.num_records
    check_records(cfg, n)
    cfg, fitted = follow_n(cfg, n)  # the batches the run would use
    module = make_model(resolve_model(cfg.model, cfg.dataset), train_set.num_classes, cfg.seed,
                        input_shape=tuple(train_set.x.shape[1:]), fix=cfg.model_fix)
    prepare_model(module, cfg.init_weights, cfg.trainable)  # the ledger's dimension: the trainable parameters
    dim = FlatModel(module).dim
    delta = resolve_delta(cfg, n)
    plan, noise, _ = plan_run(cfg, make_algorithm(cfg, n, dim, train_set.num_classes, train_set.num_groups), n,
                              delta)
    if cfg.private and cfg.noise_mode == "distributed":
        for warning in check_distributed(cfg, noise, transport.largest_shard):
            logging.getLogger(__name__).warning("%s", warning)
    planned = None
    if cfg.private:
        counts: dict = {}
        for m, k in plan.items():
            counts[(m.rate, noise[m.name])] = counts.get((m.rate, noise[m.name]), 0) + k
        planned = {acc: epsilon_of(counts, delta, acc) for acc in ("pld", "rdp")}
    return {"algorithm": cfg.algorithm, "dataset": cfg.dataset, "n": n, "fitted": list(fitted),
            "iterations": cfg.iterations,
            "epsilon_target": cfg.epsilon, "delta": delta, "accountant": cfg.accountant,
            "releases": [{"name": m.name, "count": k, "sampling_rate": m.rate, "noise_multiplier": noise[m.name]}
                         for m, k in plan.items()],
            "planned_epsilon": planned}


def search_plan(plan: dict, distribution: str, eta: float, gamma: float, mu: float, score_noise: float) -> dict:
    """epsilon_total (and the rest of ``private_selection.search_epsilon``) of a private search whose trials each
    spend ``plan``'s releases plus one noisy score at ``score_noise``, at the plan's delta. ConfigError for a
    non-private plan or a bad parameter."""
    from dpdro.server.private_selection import TrialCount, score_counts, search_epsilon

    if plan["planned_epsilon"] is None:
        raise ConfigError("--private-search: the configuration is not private (epsilon = inf); allowed: a finite "
                          "epsilon")
    dist = TrialCount(distribution, eta=eta, gamma=gamma, mu=mu)
    counts = score_counts(score_noise)
    for r in plan["releases"]:
        counts[(r["sampling_rate"], r["noise_multiplier"])] += r["count"]
    return {**search_epsilon(dist, counts, plan["delta"]), "score_noise_multiplier": score_noise,
            "describe": dist.describe()}


def run(args: argparse.Namespace) -> int:
    cfg = shared.config_from_args(args)  # a configuration error answers before torch is imported
    if args.private_search:  # the search's parameters too, before the data are loaded
        from dpdro.server.private_selection import TrialCount, score_counts

        TrialCount(args.distribution, eta=args.eta, gamma=args.gamma, mu=args.mu)
        score_counts(args.score_noise_multiplier)
    p = privacy_plan(cfg)
    if args.private_search:
        p["private_search"] = search_plan(p, args.distribution, args.eta, args.gamma, args.mu,
                                          args.score_noise_multiplier)
    if args.format == "json":
        shared.print_json(p)
        return 0
    for text in p["fitted"]:
        print(text)
    print(f"{p['algorithm']} on {p['dataset']}: n = {p['n']} training records, {p['iterations']} iterations, "
          f"epsilon target {p['epsilon_target']}, delta {p['delta']:.3g}, accountant {p['accountant']}")
    print(f"{'release':<16}{'count':>7}{'sampling rate':>15}{'noise multiplier':>18}")
    for r in p["releases"]:
        print(f"{r['name']:<16}{r['count']:>7}{r['sampling_rate']:>15.4g}{r['noise_multiplier']:>18.4f}")
    if p["planned_epsilon"] is not None:
        print("planned epsilon: " + ", ".join(f"{acc} {eps:.4f}" for acc, eps in p["planned_epsilon"].items()))
    if "private_search" in p:
        s = p["private_search"]
        print(f"private search, {s['describe']}, each trial this plan plus a noisy score (noise multiplier "
              f"{s['score_noise_multiplier']:g}; per trial rdp {s['epsilon_per_trial_rdp']:.4f}): epsilon_total "
              f"{s['epsilon_total']:.4f} at delta {s['delta']:.3g} ({s['theorem']}, order {s['order']:g})")
    return 0
