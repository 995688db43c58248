"""``dpdro plan``: the run plan of a configuration without training (``server.run_plan.RunPlan``): the model, the
problem, every release kind with its count, sampling rate and calibrated noise multiplier, delta, and the planned
epsilon under both accountants."""

from __future__ import annotations

import argparse
import logging
import textwrap

from . import shared

NAME = "plan"
HELP = ("print the run plan of a configuration without training: model, problem, releases with their sampling "
        "rates and calibrated noise multipliers, delta and planned epsilon")


def add_arguments(p: argparse.ArgumentParser) -> None:
    shared.add_config_arguments(p, overwrite=False)
    shared.add_format_argument(p)


def privacy_plan(cfg) -> dict:
    """The run plan of ``cfg`` as a dict (``server.run_plan.describe_plan``): the model, the problem, every release
    with its count, sampling rate and calibrated noise multiplier, delta and the planned epsilon under both
    accountants, planned exactly as training plans it (``plan_training``). Loads the training split only for its
    public facts (n: fixed by the unit of privacy; classes, groups, record shape). Raises ConfigError / DataError
    as training would, before any release."""
    from dpdro.client.local_transport import LocalTransport
    from dpdro.common.data import load_from_config
    from dpdro.common.noise_modes import noise_mode
    from dpdro.server.run_plan import check_groups, check_records, describe_plan, plan_training

    train_set = load_from_config(cfg, train=True)
    check_groups(cfg, train_set.num_groups)
    transport = LocalTransport(cfg, train_set)
    check_records(cfg, transport.num_records)
    plan = plan_training(cfg, transport.num_records, train_set.num_classes, train_set.num_groups,
                         tuple(train_set.x.shape[1:]))
    if plan.cfg.private:
        for warning in noise_mode(plan.cfg.noise_mode).check(plan.cfg, plan.noise, transport.largest_shard):
            logging.getLogger(__name__).warning("%s", warning)
    return describe_plan(plan)


def run(args: argparse.Namespace) -> int:
    cfg = shared.config_from_args(args)  # a configuration error answers before torch is imported
    p = privacy_plan(cfg)
    if args.format == "json":
        shared.print_json(p)
        return 0
    for text in p["fitted"]:
        print(text)
    m, problem = p["model"], p["problem"]
    print(f"{p['algorithm']} on {p['dataset']}: n = {p['n']} training records, {p['iterations']} iterations, "
          f"epsilon target {p['epsilon_target']}, delta {p['delta']:.3g}, accountant {p['accountant']}")
    print(f"model: {m['factory'] or m['module_class']} ({m['module_class']}, {m['dtype']}), "
          f"{m['trainable_parameters']} trainable of {m['parameters']} parameters")
    groups = f", {problem['num_groups']} groups" if problem["num_groups"] else ""
    print(textwrap.fill(f"problem: {problem['num_classes']} classes{groups}, "
                        f"{'DRO' if problem['dro'] else 'average'} loss; "
                        + ", ".join(f"{k}={v}" for k, v in problem["keys"].items()), 118, subsequent_indent="  "))
    print(f"{'release':<16}{'count':>7}{'sampling rate':>15}{'noise multiplier':>18}")
    for r in p["releases"]:
        print(f"{r['name']:<16}{r['count']:>7}{r['sampling_rate']:>15.4g}{r['noise_multiplier']:>18.4f}")
    if p["planned_epsilon"] is not None:
        print("planned epsilon: " + ", ".join(f"{acc} {eps:.4f}" for acc, eps in p["planned_epsilon"].items()))
    return 0
