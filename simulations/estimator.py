"""Estimator diagnostics of the SPIDER-type methods: where a gradient-difference release can beat a refresh.

    dpdro lab estimator --root DIR [--methods dp-double-spider recursive-spider]
        [--levels record group] [--epsilon 1 4] [--q 1 2 4 8 16] [--measure 32] [--skip 0]
        [--target-records 2000] [--trajectory-q 1] [--config FILE] [--set key=value ...]

Along one fixed trajectory of public iterates, each SPIDER block of a method (its ``spider_pairs``: the x block,
dp-double-spider's eta block, recursive-spider's v/u block, the group level's group-loss block) releases, for
phase length q, the estimate

    b_t = R_{t0} + D_{t0+1} + ... + D_t,   t0 = t - (t mod q),

R a refresh and D the differences, each a Poisson-sampled, clipped, noised mean. Its mean squared error against
the target g_t = (1/m) sum_i clip_{C}(v_i(x_t)) (the full-batch clipped value: what a refresh at rate 1 without
noise releases at x_t) splits exactly into three terms, because the batches and the noises are independent:

    E ||b_t - g_t||^2 = ||E b_t - g_t||^2                                    clipping bias
                      + sum_k (1 - r_k) / N_k * (1/m) sum_i ||c_ik||^2       sampling variance
                      + sum_k D_k (z_k S_k f(n) / N_k)^2                     DP noise

over the releases k of the phase up to t: c_ik record i's clipped vector in release k, r_k its sampling rate,
N_k = r_k n its expected batch, D_k its coordinates, z_k its noise multiplier, S_k its sensitivity (the clip, with
the clipped-count coordinate) and f(n) the float64 rounding factor (``server/release.py``). E b_t sums the
clipped means of the releases, so the bias is what clipping does to the estimate beyond the target's own clip:
zero at q = 1; with differences, the cut of the difference clip C_t = min(C_diff Delta_t, C_max) (and the change
of the refresh clip's cut over the phase). Every per-record vector comes from the clients' own code
(``client.worker.ShardWorker.record_rows``, the chunks that ``clipped_total`` clips and sums), the clip from
``common.per_sample``, the noise multipliers from the product's calibration of each q's own release plan
(``server.engine.plan_run``: equal total epsilon, the allocation rule included), the sensitivities from the
releaser's decoration of each query. The terms are computed, not sampled.

A run does not update with one estimate but with many: the per-iteration MSE says nothing of how the errors of
consecutive estimates add up. At q = 1 every estimate carries fresh noise, which averages out over iterations; in a
SPIDER phase the refresh's noise enters all q estimates of the phase and each difference's noise every later one,
so they do not. The window variance measures this: the variance (sampling + noise) of the mean of the estimates
over a window of W = lcm of the q's iterations (max(q) for 1, 2, 4, ...), the mean that W plain steps apply, from
complete phases (W / q independent ones, release k of a phase entering it with coefficient
c_k = (1/q) sum_{i=0}^{q-1-k} decay^i, decay 1 for SPIDER), with the clip bias left out. At q = 1 it is the
per-release variance / W.

The trajectory: the method's own run at ``--trajectory-q`` (default 1) through the product's releaser
(setup releases, calibrated noise, Poisson batches, warm-up), its noise and batches drawn from ``seed``; its
states (x_t, x_{t-1}, the dual variables, the group weights) are public iterates, and every q is measured at the
same ones, so the trajectory does not depend on the estimator being measured. The queries of a q-run at those
states are the algorithm's own (``queries``): the difference clip C_t is the one a run would use there. For the
target and the per-record terms, a fixed uniform subsample of ``target-records`` training records stands for the
n records (its mean for theirs; sampling rates and batch sizes are those of the n records).

The levers of server/algorithms/diff_levers.py are measured as a run would use them: with x-estimator='storm' the
x block's estimate is sum_j (1 - a)^(t - t_j) X_j over its releases (``estimate_terms``' decay) and its differences
are the algorithm's own STORM terms; with clip-diff-rule='private-quantile' the difference clip's C_diff follows the
geometric update along the measured window from the fraction of the target records under each threshold (the
count without its noise: the path a long phase's C_diff would take, not the q = 1 trajectory's constant), and the
count releases are in each q's plan, so equal epsilon includes their cost.

A measurement on the training records, not a private release: nothing it prints is covered by the ledger (like
the tuning searches, docs/research/TUNING.md). The estimate is in the units the algorithm updates with
(recursive-spider's v/u releases divided by k_t, ``release_unit``).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import io
import logging
import math
import sys
import tempfile
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..client.local_transport import LocalTransport
from ..client.worker import ShardWorker
from ..common.config import Config, ConfigError, parse_set_args
from ..common.data import ArrayDataset, load_from_config
from ..common.messages import Query
from ..common.model_init import prepare_model
from ..common.models import make_model, resolve_model
from ..common.per_sample import FlatModel, RowBlocks, clip_margin, clipped_sum_and_count, norm_upper_bound
from ..server import setup as setup_releases
from ..server.algorithms import diff_levers as levers
from ..server.algorithms import make_algorithm
from ..server.algorithms.base import Algorithm, State
from ..server.engine import plan_run, resolve_delta
from ..server.ledger import Ledger
from ..server.releaser import Releaser
from ..server.rundir import RunDir, atomic_write_bytes, write_json
from .tuned import tuned_config_path

log = logging.getLogger(__name__)

REFRESH, DIFF = "refresh", "diff"
DEFAULT_QS = (1, 2, 4, 8, 16)
TERMS = ("sampling", "noise", "clip_bias")
ROW_COLUMNS = ("method", "level", "block", "epsilon", "q", "t", "kind", "mse", "sampling", "noise", "clip_bias",
               "target_sq", "clip", "clip_fraction", "clip_ratio", "step_norm")
SUMMARY_COLUMNS = ("method", "level", "block", "epsilon", "q", "epsilon_planned", "z_refresh", "z_diff", "mse",
                   "sampling", "noise", "clip_bias", "target_sq", "mse_vs_q1", "dominant", "step_norm", "diff_clip",
                   "diff_clip_fraction", "diff_clip_ratio", "window_var", "window_vs_q1")


@dataclass(frozen=True)
class ReleaseStats:
    """One release measured on the target records (m of them).

    mean: (D,) float64, (1/m) sum_i clip_C(v_i), in the release's own units; mean_sq: (1/m) sum_i ||clip_C(v_i)||^2;
    clip_fraction: the fraction of records whose vector the clip scaled down (the product's clipped count: a record
    at C within rounding counts, ``per_sample.clip_scales``); clip_ratio: the mean of ||v_i|| / C over the records
    longer than C (nan when none); clip: C (inf: none); rate: the query's sampling rate r (of the n records);
    dim: D; sensitivity: S f(n), the per-record bound its noise is calibrated to (``Releaser.noise_sensitivity``);
    unit: the factor that turns the release into the estimator's units (``release_unit``)."""

    mean: np.ndarray
    mean_sq: float
    clip_fraction: float
    clip_ratio: float
    clip: float
    rate: float
    dim: int
    sensitivity: float
    unit: float = 1.0


def release_stats(worker: ShardWorker, query: Query, versions: Mapping[int, np.ndarray], sensitivity: float,
                  unit: float = 1.0) -> ReleaseStats:
    """``ReleaseStats`` of ``query`` over every record of ``worker`` (rate 1, no noise): the per-record vectors of
    ``ShardWorker.record_rows``, clipped and summed by ``per_sample.clipped_sum_and_count`` (as ``clipped_total``
    does), their norms from the same norm bound that sets the clip factor. ``versions``: id -> (d,) parameters."""
    m = worker.num_records
    total = torch.zeros(query.dim, dtype=torch.float64)
    sq, clipped, longer, ratio = 0.0, 0, 0, 0.0
    for v in worker.record_rows(query, versions):
        if isinstance(v, RowBlocks):
            bound, dtype = v.norm_upper_bound(), v.blocks[0].dtype
        else:
            bound, dtype = norm_upper_bound(v), v.dtype
        norms = torch.where(torch.isfinite(bound), bound / (1.0 + clip_margin(dtype)), torch.zeros_like(bound))
        part, n_clipped = clipped_sum_and_count(v, query.clip)
        total += part.cpu()
        clipped += n_clipped
        if math.isfinite(query.clip):
            cut = norms > query.clip
            longer += int(cut.sum())
            ratio += float((norms[cut] / query.clip).sum())
            norms = torch.clamp(norms, max=query.clip)
        sq += float((norms.to(torch.float64) ** 2).sum())
    return ReleaseStats(total.numpy() / m, sq / m, clipped / m, ratio / longer if longer else math.nan, query.clip,
                        query.rate, query.dim, sensitivity, unit)


def release_unit(algo: Algorithm, state: State, mechanism: str) -> float:
    """The factor that turns a release of ``mechanism`` at ``state`` into the estimator ``apply`` accumulates:
    1 / k_t for recursive-spider's v/u releases (``vu_scale``: lambda_t / s_{t-1} with rs-clip-units=relative),
    1 for every other release."""
    scale = getattr(algo, "vu_scale", None)
    return 1.0 / scale(state) if scale is not None and mechanism.startswith("vu-") else 1.0


def estimate_terms(refresh: ReleaseStats, diffs: Sequence[ReleaseStats], target: ReleaseStats, n: int,
                   z_refresh: float, z_diff: float, decay: float = 1.0) -> dict[str, float]:
    """The three terms (module docstring) of the estimate R + D_1 + ... + D_k against ``target`` (the refresh at
    the estimate's own point), for n records and noise multipliers z_refresh, z_diff: {'clip_bias', 'sampling',
    'noise', 'mse' (their sum), 'target_sq' (||target||^2)}, all in the estimator's units squared. ``decay``:
    1 - a of x-estimator='storm' (server/algorithms/diff_levers.py), whose estimate is
    sum_j decay^(k - j) X_j over the releases X_0 = R, X_j = D_j (each term and its variance weighted so); 1: SPIDER."""
    releases = [(refresh, z_refresh), *((d, z_diff) for d in diffs)]
    k = len(diffs)
    weights = [decay ** (k - j) for j in range(k + 1)]
    expected = sum(w * s.unit * s.mean for w, (s, _) in zip(weights, releases, strict=True))
    goal = target.unit * target.mean
    bias = float(np.sum((expected - goal) ** 2))
    parts = [release_variance(s, z, n) for s, z in releases]
    sampling = sum(w**2 * p[0] for w, p in zip(weights, parts, strict=True))
    noise = sum(w**2 * p[1] for w, p in zip(weights, parts, strict=True))
    return {"mse": bias + sampling + noise, "sampling": sampling, "noise": noise, "clip_bias": bias,
            "target_sq": float(np.sum(goal**2))}


def release_variance(stats: ReleaseStats, z: float, n: int) -> tuple[float, float]:
    """(sampling, noise) variance of one release of n records at noise multiplier z, in the estimator's units
    squared: (1 - r) / (r n) times the mean squared clipped norm, and D (z S / (r n))^2 (module docstring)."""
    unit_sq = stats.unit**2
    sampling = unit_sq * (1.0 - stats.rate) / (stats.rate * n) * stats.mean_sq
    noise = unit_sq * stats.dim * (z * stats.sensitivity / (stats.rate * n)) ** 2 if z > 0 else 0.0
    return sampling, noise


def phase_mean_variance(releases: Sequence[tuple[ReleaseStats, float]], n: int, decay: float = 1.0) -> float:
    """Variance (sampling + noise) of the mean of one phase's q estimates b_{t0} .. b_{t0+q-1}, the phase's releases
    ``(stats, z)`` in order (refresh first, q of them in all): release k enters estimates t0+k .. t0+q-1 with weights
    decay^(t - t0 - k) (``estimate_terms``), so its coefficient in the mean is c_k = (1/q) sum_{i=0}^{q-1-k} decay^i
    and the variance is sum_k c_k^2 Var(release k), the releases' batches and noises being independent."""
    q = len(releases)
    return sum((sum(decay**i for i in range(q - k)) / q) ** 2 * sum(release_variance(s, z, n))
               for k, (s, z) in enumerate(releases))


def window_variance(phases: Sequence[float], q: int, window: int) -> float:
    """Variance of the mean of the estimates over ``window`` iterations (a multiple of q): window / q independent
    phases, each with the mean of its phase variances ``phases`` (``phase_mean_variance``), so (q / window) times
    that mean; nan without a complete phase."""
    return q / window * float(np.mean(phases)) if phases else math.nan


@dataclass
class Trajectory:
    """The recorded run: ``states`` before every round (t, stage) from t = 0 up to the last measured iteration;
    ``releaser``: its releaser (after the run: it decorates queries as the run's were, with the run's logit
    offset); ``algo``: its algorithm; ``n``, ``delta``, ``dim``; ``noise``: its calibrated multipliers."""

    states: list[State]
    releaser: Releaser
    algo: Algorithm
    n: int
    delta: float
    dim: int
    noise: dict[str, float]


def _model_dim_and_x0(cfg: Config, train: ArrayDataset) -> tuple[int, np.ndarray]:
    """(trainable parameters d, initial flat parameters x0 (d,) float64): the engine's initial model."""
    dtype = torch.float64 if cfg.dtype == "float64" else torch.float32
    base = make_model(resolve_model(cfg.model, cfg.dataset), train.num_classes, cfg.seed, dtype,
                      tuple(train.x.shape[1:]), cfg.model_fix)
    prepare_model(base, cfg.init_weights, cfg.trainable)
    model = FlatModel(base)
    return model.dim, model.initial().double().numpy()


def record_trajectory(cfg: Config, train: ArrayDataset, iterations: int) -> Trajectory:
    """Run ``cfg`` for ``iterations`` iterations through the product's releaser (setup releases, ledger,
    calibrated noise of the whole configured plan, the clients' Poisson batches) and keep every state before a
    round. The events go to a temporary run directory. ValueError for iterations beyond cfg's plan."""
    if not 1 <= iterations <= cfg.iterations:
        raise ValueError(f"the trajectory needs 1 to iterations = {cfg.iterations} iterations, got {iterations}")
    n = len(train)
    delta = resolve_delta(cfg, n)
    dim, x0 = _model_dim_and_x0(cfg, train)
    algo = make_algorithm(cfg, n, dim, train.num_classes, train.num_groups)
    plan, noise, _ = plan_run(cfg, algo, n, delta)
    transport = LocalTransport(cfg, train)
    states: list[State] = []
    with tempfile.TemporaryDirectory(prefix="dpdro-estimator-") as tmp:
        rd = RunDir(tmp)
        releaser = Releaser(cfg, transport, Ledger(plan, noise, cfg.epsilon, delta, cfg.accountant), n, rd)
        setup = setup_releases.release_all(releaser, cfg, x0, n, train.num_classes, train.num_groups)
        state = algo.start_state(x0, setup.eta0, setup.dro_priors(cfg))
        releaser.offset = setup.offset(cfg.tau)
        while state.t < iterations:
            states.append(state)
            state = algo.advance(state, releaser.run(algo.queries(state), algo.versions(state)))
    transport.close()
    return Trajectory(states, releaser, algo, n, delta, dim, noise)


def noise_plan(cfg: Config, n: int, dim: int, num_classes: int, num_groups: int,
               delta: float) -> tuple[dict[str, float], float]:
    """(mechanism -> calibrated noise multiplier, epsilon the whole plan spends by the ledger) of ``cfg``'s own
    release plan: ``engine.plan_run`` (setup releases, the noise-allocation rule, calibration), the epsilon from a
    ``Ledger`` of that plan (``epsilon_if_completed``; inf when not private)."""
    algo = make_algorithm(cfg, n, dim, num_classes, num_groups)
    plan, noise, _ = plan_run(cfg, algo, n, delta)
    return noise, Ledger(plan, noise, cfg.epsilon, delta, cfg.accountant).epsilon_if_completed()


@dataclass
class Diagnosis:
    """What ``diagnose`` measured: ``rows`` (one per block, q and t; ``ROW_COLUMNS``), ``summary`` (one per block
    and q, averaged over t; ``SUMMARY_COLUMNS``), ``facts`` (n, delta, records, trajectory, noise per q) and the
    ``trajectory`` itself."""

    rows: list[dict]
    summary: list[dict]
    facts: dict
    trajectory: Trajectory


def check_request(cfg: Config, qs: Sequence[int], measure: int, skip: int, target_records: int,
                  trajectory_q: int) -> None:
    """Refuse a diagnosis that cannot run, before any work: ValueError (a ConfigError for a config key) naming
    the argument, the value and what is allowed."""
    if not qs or any(int(q) != q or q < 1 for q in qs):
        raise ValueError(f"q: got {list(qs)}; allowed: one or more integers >= 1")
    if measure < 1:
        raise ValueError(f"measure: got {measure}; allowed: an integer >= 1 (iterations measured)")
    lcm = math.lcm(*qs)
    if skip < 0 or skip % lcm:
        raise ValueError(f"skip: got {skip}; allowed: a multiple of every q (of {lcm}), so that each q starts a "
                         "phase at the first measured iteration")
    if skip + measure > cfg.iterations:
        raise ConfigError(f"config key 'iterations': got {cfg.iterations}; allowed: at least skip + measure = "
                          f"{skip + measure} (the plan whose noise is measured)")
    if target_records < 0:
        raise ValueError(f"target-records: got {target_records}; allowed: 0 (every record) or more")
    if trajectory_q < 1:
        raise ValueError(f"trajectory-q: got {trajectory_q}; allowed: an integer >= 1")
    if cfg.private and cfg.noise_mode != "central":
        raise ConfigError(f"config key 'noise-mode': got {cfg.noise_mode!r}; allowed here: 'central' (the noise terms "
                          "are those of a central release)")


def _pairs(algo: Algorithm) -> list[tuple[str, str]]:
    pairs = algo.spider_pairs()
    if not pairs:
        raise ConfigError(f"config key 'algorithm': got {algo.name!r}; allowed: a SPIDER-type method (one with "
                          "refresh and difference releases, e.g. dp-double-spider, recursive-spider)")
    return pairs


def measure_releases(keys: Mapping[str, Any], trajectory: Trajectory, worker: ShardWorker, ts: range,
                     with_diffs: bool, num_classes: int, num_groups: int) -> dict[tuple[str, int, str], ReleaseStats]:
    """(refresh mechanism, t, 'refresh' | 'diff') -> ``ReleaseStats`` on ``worker``'s records of every SPIDER
    block's refresh at each t in ``ts`` and (``with_diffs``) its difference at each t > ts.start, at the
    trajectory's states: the queries that a q = 1 run and a run of one long phase of the configuration ``keys``
    would send there, decorated by the trajectory's releaser."""
    n, dim = trajectory.n, trajectory.dim
    every = make_algorithm(Config.from_mapping({**keys, "q": 1}), n, dim, num_classes, num_groups)
    long = make_algorithm(Config.from_mapping({**keys, "q": ts.stop + 1}), n, dim, num_classes, num_groups)
    pairs = _pairs(every)
    refresh_names = {r: r for r, _ in pairs}
    diff_names = {d: r for r, d in pairs}
    releaser = trajectory.releaser
    out: dict[tuple[str, int, str], ReleaseStats] = {}
    quantile = levers.quantile_rule(long.cfg)
    clip_diff = long.cfg.clip_diff
    for state in trajectory.states:
        if state.t not in ts:
            continue
        wanted = [(q, refresh_names[q.mechanism], REFRESH) for q in every.queries(state)
                  if q.mechanism in refresh_names]
        if with_diffs and state.t > ts.start:
            if quantile and hasattr(state, "clip_diff"):  # the long phase's own C_diff path (noise-free count)
                state = dataclasses.replace(state, clip_diff=clip_diff)
            diff_queries = long.queries(state)
            wanted += [(q, diff_names[q.mechanism], DIFF) for q in diff_queries if q.mechanism in diff_names]
            for q in diff_queries:
                if q.count_only:
                    under = 1.0 - release_stats(worker, dataclasses.replace(q, count_only=False), every.versions(
                        state), 1.0).clip_fraction
                    clip_diff = levers.next_clip_diff(levers.clip_diff_now(long.cfg, clip_diff), under,
                                                      long.cfg.clip_diff_quantile, long.cfg.clip_diff_quantile_lr)
        for query, block, kind in wanted:
            query = releaser.decorate(query)
            sensitivity = releaser.noise_sensitivity(query)
            measured = Query(query.iteration, query.mechanism, query.quantity, query.points, query.rate, query.clip,
                             query.dim, coefs=query.coefs, extra=query.extra, offset=query.offset)
            out[(block, state.t, kind)] = release_stats(worker, measured, every.versions(state), sensitivity,
                                                        release_unit(every, state, query.mechanism))
            log.debug("measured %s at t=%d (%s)", query.mechanism, state.t, kind)
    return out


def diagnose(keys: Mapping[str, Any], train: ArrayDataset, qs: Sequence[int] = DEFAULT_QS, measure: int = 32,
             skip: int = 0, target_records: int = 2000, trajectory_q: int = 1, seed: int = 0) -> Diagnosis:
    """Measure the estimator of the configuration ``keys`` (kebab-case config keys; its q is replaced by each of
    ``qs``) on the training records ``train``, at iterations skip .. skip + measure - 1 of the trajectory of its
    run at q = ``trajectory_q`` (noise and batches drawn from ``seed``, reproducibly), against the full-batch
    target on ``target_records`` records of ``train`` drawn uniformly from ``seed`` (0 or >= n: all of them).

    Returns a ``Diagnosis``. Raises ConfigError for a bad key (or a method without SPIDER blocks) and ValueError
    for a bad argument (``check_request``), both before any work."""
    base = {**keys, "reproducible": True, "reproducible-for-testing": True, "seed": seed}
    cfg = Config.from_mapping(base)
    check_request(cfg, qs, measure, skip, target_records, trajectory_q)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    n = len(train)
    trajectory_cfg = Config.from_mapping({**base, "q": trajectory_q})
    _pairs(make_algorithm(trajectory_cfg, n, 1, train.num_classes, train.num_groups))
    log.info("trajectory: %s at q=%d, %d iterations", cfg.algorithm, trajectory_q, skip + measure)
    trajectory = record_trajectory(trajectory_cfg, train, skip + measure)
    rng = np.random.default_rng(seed)
    m = n if target_records == 0 or target_records >= n else target_records
    idx = np.arange(n) if m == n else np.sort(rng.choice(n, size=m, replace=False))
    worker = ShardWorker(cfg, train.subset(idx), 0)
    ts = range(skip, skip + measure)
    log.info("measuring %d iterations on %d target records", measure, m)
    stats = measure_releases(base, trajectory, worker, ts, max(qs) > 1, train.num_classes, train.num_groups)
    pairs = _pairs(trajectory.algo)
    step = {s.t: trajectory.algo.diagnostics(s).get("step_norm", math.nan) for s in trajectory.states
            if s.stage == 0}
    rows, plans, windows = [], {}, {}
    for q in qs:
        q_cfg = Config.from_mapping({**base, "q": q})
        noise, eps = noise_plan(q_cfg, n, trajectory.dim, train.num_classes, train.num_groups, trajectory.delta)
        plans[q] = {"noise": noise, "epsilon_planned": eps}
        for ref, diff in pairs:
            decay = 1.0 - levers.storm_a(q_cfg) if ref == "x-refresh" else 1.0
            for t in ts:
                t0 = t - t % q
                terms = estimate_terms(stats[(ref, t0, REFRESH)], [stats[(ref, k, DIFF)] for k in range(t0 + 1, t + 1)],
                                       stats[(ref, t, REFRESH)], n, noise[ref], noise[diff], decay)
                kind = REFRESH if t == t0 else DIFF
                this = stats[(ref, t, kind)]
                rows.append({"method": cfg.algorithm, "level": cfg.dro_level, "block": block_name(ref),
                             "epsilon": cfg.epsilon, "q": q, "t": t, "kind": kind, **terms, "clip": this.clip,
                             "clip_fraction": this.clip_fraction, "clip_ratio": this.clip_ratio,
                             "step_norm": step.get(t, math.nan)})
            phases = [phase_mean_variance([(stats[(ref, t0, REFRESH)], noise[ref]),
                                           *((stats[(ref, k, DIFF)], noise[diff]) for k in range(t0 + 1, t0 + q))],
                                          n, decay)
                      for t0 in ts if t0 % q == 0 and t0 + q - 1 in ts]  # complete phases only
            windows[(block_name(ref), q)] = window_variance(phases, q, math.lcm(*qs))
    facts = {"n": n, "delta": trajectory.delta, "target_records": m, "dim": trajectory.dim, "seed": seed,
             "iterations_planned": cfg.iterations, "measured": [skip, skip + measure - 1],
             "trajectory": f"{cfg.algorithm} at q={trajectory_q}, dro-level={cfg.dro_level}, epsilon={cfg.epsilon:g}",
             "trajectory_noise": trajectory.noise, "plans": plans, "keys": {k: _plain(v) for k, v in keys.items()}}
    return Diagnosis(rows, summarise(rows, plans, pairs, windows), facts, trajectory)


def block_name(refresh: str) -> str:
    """The block of a SPIDER pair, named by its refresh mechanism without '-refresh' ('x-refresh' -> 'x')."""
    return refresh.removesuffix("-refresh")


def summarise(rows: list[dict], plans: Mapping[int, dict], pairs: Sequence[tuple[str, str]],
              windows: Mapping[tuple[str, int], float] | None = None) -> list[dict]:
    """One row per (method, level, block, epsilon, q): the means over t of mse and its terms, the term with the
    largest mean ('dominant'; 'none' when all are 0), mse relative to q = 1's (when measured), the planned epsilon
    and noise multipliers, the mean step length Delta_t, the mean clip, clipped fraction and cut ratio of the
    difference releases, and the window variance ``windows[(block, q)]`` (nan when absent) and its ratio to
    q = 1's."""
    windows = windows or {}
    out = []
    refresh_of = {block_name(r): (r, d) for r, d in pairs}
    keys = sorted({(r["method"], r["level"], r["block"], r["epsilon"], r["q"]) for r in rows},
                  key=lambda k: (k[0], k[1], k[2], k[3], k[4]))
    for method, level, block, eps, q in keys:
        mine = [r for r in rows if (r["method"], r["level"], r["block"], r["epsilon"], r["q"]) ==
                (method, level, block, eps, q)]
        means = {k: float(np.mean([r[k] for r in mine])) for k in ("mse", *TERMS, "target_sq")}
        diffs = [r for r in mine if r["kind"] == DIFF]
        ref, diff = refresh_of[block]
        out.append({"method": method, "level": level, "block": block, "epsilon": eps, "q": q,
                    "epsilon_planned": plans[q]["epsilon_planned"], "z_refresh": plans[q]["noise"][ref],
                    "z_diff": plans[q]["noise"][diff], **means, "mse_vs_q1": math.nan,
                    "dominant": max(TERMS, key=lambda k: means[k]) if max(means[k] for k in TERMS) > 0 else "none",
                    "step_norm": _mean([r["step_norm"] for r in mine]),
                    "diff_clip": _mean([r["clip"] for r in diffs]),
                    "diff_clip_fraction": _mean([r["clip_fraction"] for r in diffs]),
                    "diff_clip_ratio": _mean([r["clip_ratio"] for r in diffs]),
                    "window_var": windows.get((block, q), math.nan), "window_vs_q1": math.nan})
    for row in out:
        first = [o for o in out if o["q"] == 1 and all(o[k] == row[k] for k in ("method", "level", "block", "epsilon"))]
        if first and first[0]["mse"] > 0:
            row["mse_vs_q1"] = row["mse"] / first[0]["mse"]
        if first and first[0]["window_var"] > 0:
            row["window_vs_q1"] = row["window_var"] / first[0]["window_var"]
    return out


def _mean(values: list[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return float(np.mean(finite)) if finite else math.nan


def _plain(v: Any) -> Any:
    return v if isinstance(v, (bool, int, float, str)) else str(v)


def csv_text(rows: list[dict], columns: Sequence[str]) -> str:
    """``rows`` as CSV with ``columns`` (floats with 6 significant digits)."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(columns), extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: f"{r[k]:.6g}" if isinstance(r[k], float) else r[k] for k in columns})
    return buf.getvalue()


def table_text(summary: list[dict]) -> str:
    """The summary as a Markdown table: per block and q the noise multipliers, the target's mean squared norm
    ||g||^2, the mean terms, the dominant one, mse and window variance against q = 1's, the mean step Delta_t and
    the difference clip's statistics."""
    head = ("| method | level | block | eps | q | z ref / diff | \\|g\\|^2 | mse | sampling | noise | clip bias | "
            "dominant | mse / q=1 | window / q=1 | step | diff clip | clipped | cut ratio |")
    lines = [head, "|" + "---|" * (head.replace("\\|", "").count("|") - 1)]  # \| is a pipe inside a cell
    for r in summary:
        lines.append(f"| {r['method']} | {r['level']} | {r['block']} | {r['epsilon']:g} | {r['q']} | "
                     f"{r['z_refresh']:.3g} / {r['z_diff']:.3g} | {r['target_sq']:.3g} | {r['mse']:.3g} | "
                     f"{r['sampling']:.3g} | {r['noise']:.3g} | {r['clip_bias']:.3g} | {r['dominant']} | "
                     f"{r['mse_vs_q1']:.3g} | {r['window_vs_q1']:.3g} | {r['step_norm']:.3g} | {r['diff_clip']:.3g} | "
                     f"{r['diff_clip_fraction']:.3g} | {r['diff_clip_ratio']:.3g} |")
    return "\n".join(lines) + "\n"


def method_keys(dataset: str, method: str, config: str | None, sets: Mapping[str, Any]) -> dict[str, Any]:
    """The base keys of ``method``: those of ``config`` (a TOML file) if given, else the tuned epsilon-4 file of
    (dataset, method) when there is one (``simulations/configs/tuned/``), else none; then algorithm, dataset and
    ``sets``. ConfigError for a file that is missing or not TOML."""
    path = Path(config) if config else tuned_config_path(dataset, 4.0, method)
    keys: dict[str, Any] = {}
    if config or path.exists():
        try:
            keys = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ConfigError(f"--config: cannot read {path} as TOML ({e})") from None
    return {**keys, "algorithm": method, "dataset": dataset, **sets}


def run(args: argparse.Namespace, error=None) -> int:
    """The command (module docstring): writes estimator.csv (every row), estimator-summary.csv, estimator.json
    (rows, summary and facts) and estimator.md (the summary table) into --out, and prints the table. A bad
    request goes to ``error`` (argparse's, which exits 2) or raises ConfigError/ValueError."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("absl").setLevel(logging.ERROR)  # dp-accounting's per-order convergence chatter
    try:
        sets = {"threads": 1, **parse_set_args(args.set)}
        jobs = []
        for method in args.methods:
            for level in args.levels:
                for eps in args.epsilon:
                    keys = {**method_keys(args.dataset, method, args.config, sets), "dro-level": level,
                            "epsilon": eps}
                    check_request(Config.from_mapping({**keys, "reproducible": True,
                                                       "reproducible-for-testing": True}),
                                  args.q, args.measure, args.skip, args.target_records, args.trajectory_q)
                    jobs.append(keys)
    except (ConfigError, ValueError) as e:
        if error is not None:
            error(str(e))
        raise e if isinstance(e, ConfigError) else ConfigError(str(e)) from e
    train = load_from_config(Config.from_mapping(jobs[0]), train=True)
    rows, summary, facts = [], [], []
    for keys in jobs:
        d = diagnose(keys, train, args.q, args.measure, args.skip, args.target_records, args.trajectory_q, args.seed)
        rows += d.rows
        summary += d.summary
        facts.append(d.facts)
        print(table_text(d.summary), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out / "estimator.csv", csv_text(rows, ROW_COLUMNS).encode())
    atomic_write_bytes(out / "estimator-summary.csv", csv_text(summary, SUMMARY_COLUMNS).encode())
    atomic_write_bytes(out / "estimator.md", table_text(summary).encode())
    write_json(out / "estimator.json", {"command": " ".join(sys.argv), "rows": rows, "summary": summary,
                                        "runs": facts})
    print(table_text(summary))
    return 0
