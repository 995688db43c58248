"""What a finished run reports: the summary.json of a run directory, with the trust statement (who its epsilon
holds against) and the list of what is not privacy-accounted (README: 'What is private')."""

from __future__ import annotations

import platform

import numpy as np
import torch

from .. import __version__
from ..common.config import Config
from .allocation import proxy_variance
from .ledger import Ledger
from .releaser import Releaser


def run_summary(cfg: Config, *, n: int, delta: float, plan: dict, noise: dict[str, float], profiles: dict | None,
                ledger: Ledger, releaser: Releaser, final: dict, setup, spider: dict, wall_seconds: float,
                transport_name: str) -> dict:
    """summary.json of a finished run: the config's headline keys, the privacy accounting (target, spent, noise,
    against the server), the final evaluation row ``final`` and the setup releases' results (``setup``)."""
    return {
        "algorithm": cfg.algorithm, "dataset": cfg.dataset, "seed": cfg.seed, "num_clients": cfg.num_clients,
        "iterations": cfg.iterations, "n": n, "epsilon_target": cfg.epsilon, "epsilon_spent": final["epsilon_spent"],
        "delta": delta, "accountant": cfg.accountant, "noise_multipliers": noise,
        "noise_allocation": {"rule": cfg.noise_allocation, "relative": {m.name: m.relative_noise for m in plan
                                                                        if m.fixed_noise is None},
                             "fixed": {m.name: m.fixed_noise for m in plan if m.fixed_noise is not None},
                             **({"proxy_variance": proxy_variance(plan, noise, profiles, n)} if profiles else {})},
        "noise_mode": cfg.noise_mode, "trust_model": trust_statement(cfg, transport_name),
        "epsilon_against_server": releaser.epsilon_against_server(),
        **({"max_quantisation_over_noise": releaser.quantisation_ratio} if releaser.quantisation_ratio else {}),
        "sampling_rates": {m.name: m.rate for m in plan}, "releases": dict(ledger.spent),
        "eval_split": cfg.eval_split,
        "test_accuracy": final["test_accuracy"], "worst_class_accuracy": final["worst_class_accuracy"],
        "per_class_accuracy": final["per_class_accuracy"], "eval_loss": final["eval_loss"],
        **{k: final[k] for k in ("worst_group_accuracy", "per_group_accuracy") if k in final},
        "eval_dro_objective": final["eval_dro_objective"], "psi": cfg.psi, "lambda": cfg.lambda_,
        **{k: v for k, v in final.items() if k.startswith("eval_") and k not in ("eval_loss", "eval_dro_objective")},
        "logit_adjust_tau": cfg.tau, "posthoc_tau": cfg.posthoc_tau, "class_prior": setup.prior_source,
        "priors": list(setup.priors) if setup.priors is not None else None, "eta0": setup.eta0,
        "dro_clip": cfg.dro_clip, "spider_noise": spider,
        "output_iterate": cfg.output_iterate, "wall_seconds": wall_seconds, "transport": transport_name,
        "private": cfg.private, "reproducible": cfg.reproducible,
        "not_accounted": not_accounted(cfg, setup),
    }


def trust_statement(cfg: Config, transport_name: str) -> str:
    """Who the epsilon of this run holds against (README: noise modes)."""
    if not cfg.private:
        return "not private: no noise anywhere"
    if cfg.noise_mode == "central":
        return ("central: the server saw every client's clipped sum without noise (trusted); epsilon holds for "
                "everything it released")
    if cfg.noise_mode == "local":
        return "local: every client noised its own sum; epsilon holds against everyone, the server included"
    where = ("the server saw only SecAgg+ sums of the clients' noised sums" if transport_name == "flower" else
             "in-process run: noise placed as in distributed mode, but no secure aggregation took place")
    return (f"distributed: {where}; epsilon holds for everything released, epsilon_against_server against the "
            "server itself (weaker where shares were missing and the server topped them up)")


def not_accounted(cfg: Config, setup) -> list[str]:
    out = [] if cfg.private else ["everything: epsilon=inf, no clipping and no noise (not private)"]
    if setup.prior_source == "public":
        out.append("class priors: declared public by the user (class-prior-values), not released from the data")
    if cfg.eval_split == "validation":
        out.append("validation metrics: computed on held-out training records and reported without noise (for "
                   "tuning only)")
    if cfg.noise_mode == "distributed":
        out.append("SecAgg+ quantisation: the rounding of each client's noised sum (bounded and reported per "
                   "release) is not modelled by the Gaussian accounting")
    # n and the shard sizes are not listed: the unit (one record replaced with the null record, which stays on its
    # client) keeps them the same in neighbouring data sets (server/ledger.py)
    if cfg.private:  # assumptions every private run makes (README, 'What is private')
        out.append("floating-point Gaussian sampling: the accounting assumes exact Gaussians (Mironov 2012)")
    return out + ["hyper-parameters chosen by the user are not privacy-accounted"]


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
