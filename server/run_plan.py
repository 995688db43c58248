"""A run's plan: everything decided before the first release, and the checks that refuse a run before any work.

``plan_training`` builds a ``RunPlan`` (the model to train and its initial parameters, the algorithm with its
problem, every release with its count and sampling rate, and the noise multipliers calibrated to the target) from a
configuration and the public facts of the data (n, classes, groups, input shape). ``server/engine.py`` trains a
plan; nothing here releases anything.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass

import torch
from torch import nn

from ..common import ddg
from ..common.batches import fitted_to_n, over_n
from ..common.config import AUTO, Config, ConfigError, field_by_key
from ..common.ddg import DdgGeometry
from ..common.feature_norm import norm_modules
from ..common.model_fix import fix_model
from ..common.model_init import InitialModel, prepare_model
from ..common.models import check_per_record, make_model, resolve_model, validate_model
from ..common.noise_modes import noise_mode
from ..common.per_sample import FlatModel
from . import node_evaluation
from . import setup as setup_releases
from .algorithms import Algorithm, make_algorithm
from .allocation import allocate
from .ledger import ACCOUNTANTS, Mechanism, auto_delta, calibrate, check_delta, epsilon_of
from .model_files import describe_module_class
from .node_sampling import check_local_steps, check_node_noise, ledger_node_rate, local_step_mechanisms, unit_plan

log = logging.getLogger(__name__)

# The fewest training records a private run accepts: below 10, the default delta = 1/(10 n) is above 0.01, and
# (epsilon, delta)-DP with such a delta is met by a mechanism that publishes the whole data set with probability
# delta. The tests' smallest private runs use 20 to 30 records.
MIN_PRIVATE_RECORDS = 10


def check_records(cfg: Config, n: int) -> None:
    """Refuse a run on ``n`` training records (public) before any work: ConfigError for n = 0, and for a private
    run on fewer than ``MIN_PRIVATE_RECORDS``, naming n, the minimum and why."""
    if n < 1:
        raise ConfigError("the clients hold no training record (n = 0)")
    if cfg.private and n < MIN_PRIVATE_RECORDS:
        raise ConfigError(f"n = {n} training records: a private run needs at least {MIN_PRIVATE_RECORDS}. With fewer, "
                          f"the default delta = 1/(10 n) = {auto_delta(n):.3g} is above 0.01, and (epsilon, delta)-DP "
                          "with such a delta is met by publishing the whole data set with probability delta: add "
                          "records (check max-train-records), or train without privacy (epsilon=inf)")


def follow_n(cfg: Config, n: int) -> tuple[Config, list[str]]:
    """(``cfg`` with every batch key the algorithm reads left at a default above n fitted to n, one note per key
    fitted; common/batches.py). Raises ConfigError naming every batch key set above n, with suggested values."""
    values = cfg.to_dict()
    problem = over_n(values, {k: f.default for k, f in field_by_key().items()}, n, f"n = {n} training records")
    if problem:
        raise ConfigError(problem)
    fitted, notes = fitted_to_n(values, n)
    return (cfg.with_updates(fitted) if fitted else cfg), notes


def resolve_delta(cfg: Config, n: int) -> float:
    """delta of the config, or 1/(10 n) for 'auto' (ledger.auto_delta; docs/explanation/ALGORITHMS.md 5.1). In a private
    run, raises ConfigError for delta >= 1/n and logs a warning above 1/(10 n) (ledger.check_delta)."""
    if cfg.privacy_unit == "node":  # the unit is a node: delta against the m nodes (ALGORITHMS.md 5.9)
        n = cfg.num_clients
    delta = auto_delta(n) if cfg.delta == AUTO else float(cfg.delta)
    if cfg.private:
        warning = check_delta(delta, n, cfg.delta)
        if warning:
            log.warning("%s", warning)
    return delta


def check_groups(cfg: Config, num_groups: int) -> None:
    """Refuse dro-groups=attribute on a data set that declares no group attribute (num_groups 0), before any
    release: ConfigError naming the key, the data set and what is allowed."""
    if cfg.attribute_groups and num_groups == 0:
        raise ConfigError(f"config key 'dro-groups': got 'attribute'; data set {cfg.dataset!r} declares no group "
                          "attribute (allowed: 'class', or a data set with groups such as celeba)")


def ddg_geometry(cfg: Config, dim: int) -> DdgGeometry | None:
    """noise-mode=distributed-discrete: the run's ``common.ddg.DdgGeometry`` for a model of ``dim`` trainable
    parameters (every release is at most dim + 2 long: the eta coordinate and the clipped-count coordinate), its
    shares calibrated for num-clients, the granularity from ``ddg.granularity``; None in any other mode or when not
    private."""
    if not (cfg.private and noise_mode(cfg.noise_mode).discrete):
        return None
    padded = ddg.padded_dim(dim + 2)
    return DdgGeometry(ddg.granularity(padded), padded, cfg.num_clients)


def plan_run(cfg: Config, algo, n: int, delta: float) -> tuple[dict, dict[str, float], dict | None]:
    """(plan with the setup releases, mechanism -> calibrated noise multiplier, noise profiles or None). With
    noise-mode=distributed-discrete the multipliers are calibrated with that mechanism's accounting
    (``ddg_geometry``)."""
    profiles = algo.noise_profiles() if cfg.noise_allocation == "variance" else None
    plan = {**setup_releases.mechanisms(cfg), **allocate(algo.plan(), profiles),
            **node_evaluation.mechanisms(cfg, delta)}  # eval-data=nodes: the evaluations, at fixed noise
    plan = unit_plan(plan, cfg.privacy_unit, cfg.node_sampling_rate)  # node unit: every release at rate p over nodes
    if cfg.private:
        scale = calibrate(plan, cfg.epsilon, delta, cfg.accountant,
                          ledger_node_rate(cfg.privacy_unit, cfg.node_sampling_rate),
                          ddg_geometry(cfg, getattr(algo, "dim", 0)))
        noise = {m.name: m.noise_at(scale) for m in plan}
        if cfg.privacy_unit == "node":  # the releases the plan makes (q = 1 plans no difference)
            check_node_noise({m.name: noise[m.name] for m, k in plan.items() if k > 0}, cfg.node_sampling_rate,
                             cfg.num_clients)
    else:
        noise = {m.name: 0.0 for m in plan}
    return plan, noise, profiles


@dataclass
class RunPlan:
    """What ``plan_training`` decided: ``n`` training records (public), the resolved ``delta``, the ``model`` to
    train (a FlatModel over the trainable parameters, dimension ``model.dim``) with its registry ``factory`` (None
    for a module given in Python) and ``initial`` preparation (init-weights, trainable), the ``algo`` state
    machine, ``releases`` (Mechanism -> count, the setup releases included), ``noise`` (mechanism name ->
    calibrated noise multiplier; all 0 when epsilon = inf) and the noise ``profiles`` of the variance allocation
    (None for noise-allocation=ratios), and ``notes``, one per batch key fitted to n. ``cfg`` is the configuration
    the run uses: the given one with batches left at a default above n fitted to n (``follow_n``)."""

    cfg: Config
    n: int
    delta: float
    model: FlatModel
    factory: str | None
    initial: InitialModel
    algo: Algorithm
    releases: dict[Mechanism, int]
    noise: dict[str, float]
    profiles: dict | None
    notes: list[str]
    ddg: DdgGeometry | None = None


def plan_training(cfg: Config, n: int, num_classes: int, num_groups: int, input_shape: tuple[int, ...],
                  module: nn.Module | None = None) -> RunPlan:
    """Plan a run of ``cfg`` on ``n`` training records with ``num_classes`` classes, ``num_groups`` declared groups
    (0: none) and records of shape ``input_shape``: check the batches against n, resolve delta, build the model
    (``module``: an untrained nn.Module given in Python instead of config key ``model``, validated like every model
    and copied), the algorithm, and calibrate the noise of every release to the target.

    Raises ConfigError for a batch set above n, a bad delta, dro-groups=attribute without groups or a model that cannot
    be built (ModelError for layers that mix records); checks nothing of the run directory."""
    cfg, notes = follow_n(cfg, n)  # defaults above n follow it; a set value above n is refused
    delta = resolve_delta(cfg, n)
    dtype = torch.float64 if cfg.dtype == "float64" else torch.float32
    factory = None if module is not None else resolve_model(cfg.model, cfg.dataset)
    if module is not None:  # the checks make_model runs on a registered model or an import path
        # a copy (init-weights loads into it), BatchNorm replaced as model-fix says
        module = validate_model(fix_model(copy.deepcopy(module), cfg.model_fix).to(dtype))
        check_per_record(module, input_shape, num_classes, describe_module_class(module))
    base = module if module is not None else make_model(factory, num_classes, cfg.seed, dtype, input_shape,
                                                        cfg.model_fix)
    initial = prepare_model(base, cfg.init_weights, cfg.trainable)  # before calibration: dim is the trainable count
    model = FlatModel(base)
    if cfg.feature_norm == "private" and not norm_modules(base):
        raise ConfigError(f"config key 'feature-norm': got 'private' with model {cfg.model!r}, which has no "
                          "ScatterNorm input layer to take the released statistics; allowed there: 'groupnorm' (or "
                          "model scatter-linear or scatter-cnn)")
    check_groups(cfg, num_groups)
    algo = make_algorithm(cfg, n, model.dim, num_classes, num_groups)
    check_local_steps(cfg, [m.name for m in algo.mechanisms()])
    releases, noise, profiles = plan_run(cfg, algo, n, delta)
    return RunPlan(cfg, n, delta, model, factory, initial, algo, releases, noise, profiles, notes,
                   ddg_geometry(cfg, model.dim))


def planned_epsilon(plan: RunPlan) -> dict[str, float] | None:
    """accountant ('pld', 'rdp') -> the epsilon that the plan's releases spend at its calibrated noise multipliers
    and delta (the calibrated accountant's is within its tolerance below epsilon); None for a non-private run."""
    if not plan.cfg.private:
        return None
    counts: dict[tuple[float, float], int] = {}
    for m, k in plan.releases.items():
        counts[(m.rate, plan.noise[m.name])] = counts.get((m.rate, plan.noise[m.name]), 0) + k
    if plan.ddg is not None:  # the distributed discrete Gaussian has its own accounting (ledger.epsilon_of)
        return {"ddg": epsilon_of(counts, plan.delta, plan.cfg.accountant, 1.0, plan.ddg)}
    return {acc: epsilon_of(counts, plan.delta, acc) for acc in ACCOUNTANTS}


def epsilon_split(plan: RunPlan) -> dict | None:
    """The run's epsilon in its two parts when it evaluates on the nodes (eval-data=nodes, or checkpoint-select=
    private-best): ``evaluations`` (the planned node evaluations alone: with private-best, the selection's cost),
    ``training`` (every other release alone), both at the plan's delta under the run's accountant; they compose
    to the planned epsilon (``planned_epsilon``), which is at most the sum. ``checkpoint_select`` and
    ``evaluations_count`` (the candidates of private-best) come with them. None for a non-private run or one
    evaluated on the server."""
    if not plan.cfg.private or not node_evaluation.evaluates_on_nodes(plan.cfg):
        return None
    cfg, rate = plan.cfg, ledger_node_rate(plan.cfg.privacy_unit, plan.cfg.node_sampling_rate)
    parts: dict[str, dict[tuple[float, float], int]] = {"evaluations": {}, "training": {}}
    for m, k in plan.releases.items():
        part = parts["evaluations" if m.name == node_evaluation.EVAL_MECHANISM else "training"]
        part[(m.rate, plan.noise[m.name])] = part.get((m.rate, plan.noise[m.name]), 0) + k
    return {"checkpoint_select": cfg.checkpoint_select,
            "evaluations_count": sum(parts["evaluations"].values()),
            **{name: epsilon_of(c, plan.delta, cfg.accountant, rate) for name, c in parts.items()}}


def describe_ddg(plan: RunPlan) -> dict | None:
    """noise-mode=distributed-discrete: the planned mechanism (None otherwise): the clip in grid steps c', the
    padded dimension and shares of the analysis, the wrap-around probability per release, the shortfall policy and,
    per release of the plan, the bits per coordinate a release of the model's dimension needs at its sampling rate
    (``ddg.release_bits``; config key ddg-bits when set: ConfigError if below). Releases of fewer coordinates (the
    setup histograms) are sized when made; summary.json reports the bits every release used."""
    g = plan.ddg
    if g is None:
        return None
    from ..common.noise_modes import check_ddg_bits

    bits = {m.name: check_ddg_bits(plan.cfg, ddg.release_bits(g.dim, plan.n, m.rate, g.c_over_gamma,
                                                              g.sigma(plan.noise[m.name]), g.shares,
                                                              plan.cfg.ddg_wrap_probability), m.name)
            for m in plan.releases}
    return {"clip_in_grid_steps": g.c_over_gamma, "padded_dimension": g.dim, "shares": g.shares,
            "wrap_probability": plan.cfg.ddg_wrap_probability, "shortfall_policy": plan.cfg.ddg_shortfall,
            "bits_per_coordinate": bits}


def describe_plan(plan: RunPlan) -> dict:
    """The plan as one JSON-friendly dict (what ``dpdro plan`` prints): algorithm, dataset, n (training records),
    fitted (one line per batch key fitted to n), iterations, epsilon_target, delta, accountant, noise_mode;
    model (factory, module_class, dtype, parameters, trainable_parameters, trainable, init_weights); problem
    (num_classes, num_groups, dro: whether the algorithm optimises a DRO objective, keys: every config key the
    algorithm reads with its value); releases (name, count, sampling_rate, noise_multiplier, in plan order) and
    planned_epsilon (``planned_epsilon``); unit (privacy_unit, node_sampling_rate, num_clients, local_steps: the
    local SGD of local-epochs and the releases it replaces, or None); epsilon_split (``epsilon_split``: evaluations
    and training apart, when the run evaluates on the nodes); with noise-mode=distributed-discrete, ddg
    (``describe_ddg``). Reads only what the plan decided: releases nothing."""
    cfg, algo = plan.cfg, plan.algo
    values = cfg.to_dict()
    local = local_step_mechanisms(cfg)
    return {"algorithm": cfg.algorithm, "dataset": cfg.dataset, "n": plan.n, "fitted": list(plan.notes),
            "iterations": cfg.iterations, "epsilon_target": cfg.epsilon, "delta": plan.delta,
            "accountant": cfg.accountant, "noise_mode": cfg.noise_mode,
            "model": {"factory": plan.factory, "module_class": describe_module_class(plan.model.module),
                      "dtype": cfg.dtype, **plan.initial.facts()},
            "problem": {"num_classes": algo.num_classes, "num_groups": algo.num_groups, "dro": bool(algo.spec.dro),
                        "keys": {k: values[k] for k in algo.spec.keys}},
            "releases": [{"name": m.name, "count": k, "sampling_rate": m.rate, "noise_multiplier": plan.noise[m.name]}
                         for m, k in plan.releases.items()],
            "planned_epsilon": planned_epsilon(plan), "epsilon_split": epsilon_split(plan),
            "unit": {"privacy_unit": cfg.privacy_unit, "node_sampling_rate": cfg.node_sampling_rate,
                     "num_clients": cfg.num_clients,
                     "local_steps": ({"epochs": cfg.local_epochs, "lr": cfg.local_lr, "batch": cfg.local_batch,
                                      "releases": list(local)} if local else None)},
            **({"ddg": describe_ddg(plan)} if plan.ddg is not None else {})}
