"""``dpdro plan``: the privacy plan of a configuration without training: every release kind with its count,
sampling rate and calibrated noise multiplier, delta, and the planned epsilon under both accountants."""

from __future__ import annotations

import argparse
import logging

from . import shared

NAME = "plan"
HELP = ("print the releases, sampling rates, calibrated noise multipliers and planned epsilon of a configuration, "
        "without training")


def add_arguments(p: argparse.ArgumentParser) -> None:
    shared.add_config_arguments(p, overwrite=False)
    shared.add_format_argument(p)


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
    from dpdro.common.noise_modes import noise_mode
    from dpdro.common.per_sample import FlatModel
    from dpdro.server.algorithms import make_algorithm
    from dpdro.server.engine import check_groups, check_records, follow_n, plan_run, resolve_delta
    from dpdro.server.ledger import epsilon_of

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
    if cfg.private:
        for warning in noise_mode(cfg.noise_mode).check(cfg, noise, transport.largest_shard):
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


def run(args: argparse.Namespace) -> int:
    cfg = shared.config_from_args(args)  # a configuration error answers before torch is imported
    p = privacy_plan(cfg)
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
    return 0
