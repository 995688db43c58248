"""What a finished run reports: the summary.json of a run directory, with the trust statement (who its epsilon
holds against) and the list of what is not privacy-accounted (docs/explanation/privacy.md)."""

from __future__ import annotations

import platform

import numpy as np
import torch

from .. import __version__
from ..common.algorithm_specs import ALGORITHM_SPECS
from ..common.config import SEEDED_NOT_PRIVATE, Config
from ..common.eval_counts import evaluates_on_nodes
from ..common.noise_modes import noise_mode
from .allocation import proxy_variance
from .ledger import Ledger
from .releaser import Releaser


def run_summary(cfg: Config, *, n: int, delta: float, plan: dict, noise: dict[str, float], profiles: dict | None,
                ledger: Ledger, releaser: Releaser, final: dict, setup, spider: dict, wall_seconds: float,
                transport_name: str, skipped_files: int = 0, initial_model: dict | None = None) -> dict:
    """summary.json of a finished run: the config's headline keys, the privacy accounting (target, spent, noise,
    against the server), the final evaluation row ``final``, the setup releases' results (``setup``) and
    ``skipped_files``, the files of the data set's folders not read as records (``ArrayDataset.skipped_files``),
    and ``initial_model`` (``model_init.InitialModel.facts``: the init-weights file and its sha256, trainable and the
    parameter counts) when given.

    ``private`` is true only when the outputs are differentially private: a finite epsilon and secret seeds. A
    run with noise derived from the saved seed (reproducible-for-testing) has ``private`` false while its epsilon
    figures are those its mechanism would have with secret seeds."""
    return {
        "algorithm": cfg.algorithm, "dataset": cfg.dataset, "seed": cfg.seed, "num_clients": cfg.num_clients,
        "iterations": cfg.iterations, "n": n, "epsilon_target": cfg.epsilon, "epsilon_spent": final["epsilon_spent"],
        "skipped_files": skipped_files,
        "delta": delta, "accountant": cfg.accountant, "noise_multipliers": noise,
        "noise_allocation": {"rule": cfg.noise_allocation, "relative": {m.name: m.relative_noise for m in plan
                                                                        if m.fixed_noise is None},
                             "fixed": {m.name: m.fixed_noise for m in plan if m.fixed_noise is not None},
                             **({"proxy_variance": proxy_variance(plan, noise, profiles, n)} if profiles else {})},
        "noise_mode": cfg.noise_mode, "trust_model": trust_statement(cfg, transport_name),
        "privacy_unit": cfg.privacy_unit, "node_sampling_rate": cfg.node_sampling_rate,
        "epsilon_against_server": releaser.epsilon_against_server(),
        **({"ddg": ddg_facts(cfg, ledger, releaser)} if ledger.ddg is not None else {}),
        **({"max_quantisation_over_noise": releaser.quantisation_ratio} if releaser.quantisation_ratio else {}),
        "sampling_rates": {m.name: m.rate for m in plan}, "releases": dict(ledger.spent),
        # releases charged outside the plan: those made after a checkpoint by a run that stopped without one
        "releases_beyond_plan": sum(ledger.extra.values()),
        "eval_split": cfg.eval_split,
        "test_accuracy": final["test_accuracy"], "worst_class_accuracy": final["worst_class_accuracy"],
        "per_class_accuracy": final["per_class_accuracy"], "eval_loss": final["eval_loss"],
        **{k: final[k] for k in ("worst_group_accuracy", "per_group_accuracy", "worst_group_records",
                                  "per_group_records") if k in final},
        # dro-groups=node: the model on each node's part of the server's split (server/evaluate.node_metrics)
        **{k: final[k] for k in ("worst_node_accuracy", "node_accuracy_spread", "per_node_accuracy",
                                 "worst_site_accuracy", "per_site_accuracy") if k in final},
        # eval-data=nodes: where the figures come from and their standard errors (server/node_evaluation.py)
        "eval_data": "nodes" if evaluates_on_nodes(cfg) else "server",
        **{k: final[k] for k in ("test_accuracy_se", "worst_class_accuracy_se", "per_class_accuracy_se") if k in final},
        **{k: v for k, v in final.items() if k.startswith("eval_") and k != "eval_loss"},
        **algorithm_fields(cfg, setup, spider),
        "logit_adjust_tau": cfg.tau, "posthoc_tau": cfg.posthoc_tau, "class_prior": setup.prior_source,
        "priors": list(setup.priors) if setup.priors is not None else None,
        **({"class_counts": list(setup.counts)} if setup.counts is not None else {}),
        **({"group_counts": list(setup.group_counts)} if setup.group_counts is not None else {}),
        "output_iterate": cfg.output_iterate, "wall_seconds": wall_seconds, "transport": transport_name,
        "private": cfg.private and not cfg.noise_from_saved_seed, "reproducible": cfg.reproducible,
        **(initial_model or {}), "not_accounted": not_accounted(cfg, setup),
    }


def ddg_facts(cfg: Config, ledger: Ledger, releaser: Releaser) -> dict:
    """noise-mode=distributed-discrete: what summary.json states about the mechanism (``common.ddg``): the
    accounting, the granularity c' (the clip in grid steps), the padded dimension and shares it is analysed for,
    the bits per coordinate of each mechanism's releases (the most it used), the wrap-around probability per
    release and the shortfall policy."""
    g = ledger.ddg
    return {"mechanism": "distributed discrete Gaussian (Kairouz, Liu and Steinke, ICML 2021)",
            "accounting": "RDP of KLS Proposition 14 with Zhu and Wang's Poisson subsampling bound, converted by "
                          "dp-accounting (config key accountant not used)",
            "clip_in_grid_steps": g.c_over_gamma, "padded_dimension": g.dim, "shares": g.shares,
            "bits_per_coordinate": dict(releaser.ddg_bits), "wrap_probability": cfg.ddg_wrap_probability,
            "shortfall_policy": cfg.ddg_shortfall}


def algorithm_fields(cfg: Config, setup, spider: dict) -> dict:
    """The summary fields of ``REPORTABLE`` that the run's algorithm declares (``AlgorithmSpec.reports``) other than
    eval_dro_objective, which comes with the evaluation row: a baseline's summary carries no DRO setting it never
    used."""
    values = {"psi": cfg.psi, "lambda": cfg.lambda_, "dro_clip": cfg.dro_clip, "eta0": setup.eta0,
              "spider_noise": spider}
    return {k: values[k] for k in ALGORITHM_SPECS[cfg.algorithm].reports if k in values}


def trust_statement(cfg: Config, transport_name: str) -> str:
    """Who the epsilon of this run holds against (docs/explanation/privacy.md, 'Noise mode')."""
    if not cfg.private:
        return "not private: no noise anywhere"
    if cfg.noise_from_saved_seed:
        return (f"{SEEDED_NOT_PRIVATE}: reproducible=true (reproducible-for-testing): every noise draw and Poisson "
                "sample derives from the seed saved in summary.json, so anyone with it can subtract the noise; "
                "epsilon is what the same mechanism would give with secret seeds")
    return noise_mode(cfg.noise_mode).trust_statement(transport_name)


def not_accounted(cfg: Config, setup) -> list[str]:
    """What this run's epsilon does not cover (docs/explanation/privacy.md), one sentence each; ``setup`` gives the
    prior source. Includes each choice that config key chosen-on-private-data says was made on private records."""
    out = [] if cfg.private else ["everything: epsilon=inf, no clipping and no noise (not private)"]
    if cfg.noise_from_saved_seed:
        out.append(f"everything: {SEEDED_NOT_PRIVATE} (reproducible=true, for testing): the noise and samples can "
                   "be recomputed from the seed in summary.json")
    if cfg.init_weights:
        out.append(f"initial weights: init-weights {cfg.init_weights} (sha256 in init_weights), declared trained on "
                   "public data by the user, not on the private records")
    if setup.prior_source == "public":
        out.append("class priors: declared public by the user (class-prior-values), not released from the data")
    if cfg.eval_split == "validation" and not evaluates_on_nodes(cfg):  # on the nodes: noisy counts, charged
        out.append("validation metrics: computed on held-out training records and reported without noise (for "
                   "tuning only)")
    out += noise_mode(cfg.noise_mode).not_accounted() if cfg.private else []
    if cfg.private and cfg.privacy_unit == "node":
        out.append("n and the shard sizes: released exactly (config.json, summary.json) and used to fit the batch "
                   "keys; with privacy-unit=node a neighbouring data set changes one node's records and their number, "
                   "which the epsilon does not cover")
    # with privacy-unit=record, n and the shard sizes are not listed: the unit (one record replaced with the null
    # record, which stays on its client) keeps them the same in neighbouring data sets (server/ledger.py)
    if cfg.private and cfg.secure_noise:  # assumptions every private run makes (docs/explanation/privacy.md)
        out += ["floating-point Gaussian sampling: the accounting assumes exact Gaussians; with secure-noise=true the "
                "noise is the sum of 4 draws built of OS CSPRNG bytes (Opacus' secure_mode; Holohan and Braghin 2021), "
                "which resists the floating-point attacks of Mironov 2012 but is not an exact Gaussian either"]
    elif cfg.private:
        out += ["floating-point Gaussian sampling: the accounting assumes exact Gaussians; dpdro does not protect "
                "against floating-point attacks on the Gaussian mechanism (Mironov 2012) unless secure-noise=true"]
    out += [CHOSEN_ON_PRIVATE_TEXT[item] for item in cfg.chosen_on_private]
    if "hyper-parameters" not in cfg.chosen_on_private:
        out.append("hyper-parameters: not privacy-accounted (if you chose them on the private records, that choice "
                   "leaks too; config key chosen-on-private-data records such choices)")
    return out


# What not_accounted says for each item of config key chosen-on-private-data (common.config.CHOSEN_ON_PRIVATE).
CHOSEN_ON_PRIVATE_TEXT = {
    "hyper-parameters": "hyper-parameters chosen on a validation split of the private training records (a search "
                        "such as dpdro tune, whose trials docs/research/TUNING.md lists): not accounted",
    "model": "the method or model kept, among several trained, for its metrics on a validation split of the private "
             "training records: not accounted",
    "posthoc-tau": "post-hoc tau chosen on a validation split of the private training records: not accounted "
                   "(applying a tau is post-processing; choosing it on private records is not)",
    "posthoc-tau-noisy": "post-hoc tau chosen on a validation split of the private training records from noisy "
                         "per-class counts (server/private_selection.py; its epsilon is in the tuned file's comment): "
                         "differentially private by itself and composed with, not included in, this run's epsilon",
}


def software_versions() -> dict:
    """Versions of dpdro and the libraries a run's results depend on (config.json 'versions')."""
    from importlib.metadata import PackageNotFoundError, version

    import dp_accounting  # noqa: F401

    try:  # read from the installed metadata: the core never imports Flower
        flwr_version = version("flwr")
    except PackageNotFoundError:  # flwr is optional for single-node runs
        flwr_version = None
    return {"dpdro": __version__, "torch": torch.__version__, "numpy": np.__version__, "flwr": flwr_version,
            "python": platform.python_version()}
