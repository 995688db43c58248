"""``dpdro plan``: the run plan of a configuration without training (``server.run_plan.RunPlan``): the model, the
problem, every release kind with its count, sampling rate and calibrated noise multiplier, delta, and the planned
epsilon under both accountants; with --private-search, the epsilon_total of a private hyper-parameter search
whose trials are this configuration (server/private_tuning.py)."""

from __future__ import annotations

import argparse
import logging
import textwrap

from dpdro.common.config import ConfigError

from . import shared

NAME = "plan"
HELP = ("print the run plan of a configuration without training: model, problem, releases with their sampling "
        "rates and calibrated noise multipliers, delta and planned epsilon")


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
        for warning in noise_mode(plan.cfg.noise_mode).check(plan.cfg, plan.noise, transport.largest_shard, plan):
            logging.getLogger(__name__).warning("%s", warning)
    return describe_plan(plan)


def search_plan(plan: dict, distribution: str, eta: float, gamma: float, mu: float, score_noise: float) -> dict:
    """epsilon_total (and the rest of ``private_tuning.search_epsilon``) of a private search whose trials each
    spend ``plan``'s releases plus one noisy score at ``score_noise``, at the plan's delta. ConfigError for a
    non-private plan or a bad parameter."""
    from dpdro.server.private_tuning import TrialCount, score_counts, search_epsilon

    if plan["planned_epsilon"] is None:
        raise ConfigError("--private-search: the configuration is not private (epsilon = inf); allowed: a finite "
                          "epsilon")
    if plan.get("ddg"):  # its trials' releases are not subsampled Gaussians: the search's composition does not apply
        raise ConfigError(f"--private-search: config key 'noise-mode' is {plan['noise_mode']!r}; allowed: central, "
                          "distributed or local (the search composes subsampled Gaussian releases)")
    dist = TrialCount(distribution, eta=eta, gamma=gamma, mu=mu)
    counts = score_counts(score_noise)
    for r in plan["releases"]:
        counts[(r["sampling_rate"], r["noise_multiplier"])] += r["count"]
    return {**search_epsilon(dist, counts, plan["delta"]), "score_noise_multiplier": score_noise,
            "describe": dist.describe()}


def run(args: argparse.Namespace) -> int:
    cfg = shared.config_from_args(args)  # a configuration error answers before torch is imported
    if args.private_search:  # the search's parameters too, before the data are loaded
        from dpdro.server.private_tuning import TrialCount, score_counts

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
    m, problem = p["model"], p["problem"]
    print(f"{p['algorithm']} on {p['dataset']}: n = {p['n']} training records, {p['iterations']} iterations, "
          f"epsilon target {p['epsilon_target']}, delta {p['delta']:.3g}, accountant {p['accountant']}")
    print(f"model: {m['factory'] or m['module_class']} ({m['module_class']}, {m['dtype']}), "
          f"{m['trainable_parameters']} trainable of {m['parameters']} parameters")
    groups = f", {problem['num_groups']} groups" if problem["num_groups"] else ""
    print(textwrap.fill(f"problem: {problem['num_classes']} classes{groups}, "
                        f"{'DRO' if problem['dro'] else 'average'} loss; "
                        + ", ".join(f"{k}={v}" for k, v in problem["keys"].items()), 118, subsequent_indent="  "))
    u = p["unit"]
    if u["privacy_unit"] == "node" or u["node_sampling_rate"] < 1:
        unit = ("node (one node's whole data; delta against the nodes)" if u["privacy_unit"] == "node"
                else "record")
        local = u["local_steps"]
        steps = (f"; local steps: {local['epochs']} epoch(s) of SGD at step {local['lr']:g} in batches of "
                 f"{local['batch']} on {', '.join(local['releases'])}" if local else "")
        print(f"privacy unit: {unit}, {u['num_clients']} nodes, node sampling rate {u['node_sampling_rate']:g} "
              f"({u['node_sampling_rate'] * u['num_clients']:.3g} expected a release){steps}")
    print(f"{'release':<16}{'count':>7}{'sampling rate':>15}{'noise multiplier':>18}")
    for r in p["releases"]:
        print(f"{r['name']:<16}{r['count']:>7}{r['sampling_rate']:>15.4g}{r['noise_multiplier']:>18.4f}")
    if p["planned_epsilon"] is not None:
        print("planned epsilon: " + ", ".join(f"{acc} {eps:.4f}" for acc, eps in p["planned_epsilon"].items()))
    if p.get("epsilon_split"):
        e = p["epsilon_split"]
        what = ("checkpoint selection (checkpoint-select=private-best, the best of them by noisy validation counts)"
                if e["checkpoint_select"] == "private-best" else "node evaluation")
        print(textwrap.fill(f"of which {what}: {e['evaluations_count']} eval-counts releases, epsilon "
                            f"{e['evaluations']:.4f} on their own; training: epsilon {e['training']:.4f} on its own "
                            f"({p['accountant']}; together the planned epsilon above)", 118, subsequent_indent="  "))
    if p.get("ddg"):
        d = p["ddg"]
        print(textwrap.fill(
            f"noise mode {p['noise_mode']}: distributed discrete Gaussian, clip = {d['clip_in_grid_steps']:.4g} grid "
            f"steps, padded dimension {d['padded_dimension']}, shares of {d['shares']} clients; bits per coordinate "
            "(model-sized release): " + ", ".join(f"{k} {b}" for k, b in d["bits_per_coordinate"].items())
            + f"; modular wrap-around probability <= {d['wrap_probability']:g} per release; shortfall policy "
            f"{d['shortfall_policy']}", 118, subsequent_indent="  "))
    if "private_search" in p:
        s = p["private_search"]
        print(f"private search, {s['describe']}, each trial this plan plus a noisy score (noise multiplier "
              f"{s['score_noise_multiplier']:g}; per trial rdp {s['epsilon_per_trial_rdp']:.4f}): epsilon_total "
              f"{s['epsilon_total']:.4f} at delta {s['delta']:.3g} ({s['theorem']}, order {s['order']:g})")
    return 0
