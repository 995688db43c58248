"""The training engine: drives an algorithm's state machine over a transport, releases noised sums,
charges the ledger, evaluates, checkpoints and writes the run directory.

The same function runs single-node (``LocalTransport``) and on Flower (``FlowerTransport``): that is
what makes a federated run equal to a single-node one (ARCHITECTURE.md sections 2-3).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import platform
import resource
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from .. import __version__
from ..common.config import AUTO, Config, ConfigError, keys_with_role
from ..common.data import ArrayDataset
from ..common.messages import Query, Reply
from ..common.models import make_model, resolve_model
from ..common.per_sample import FlatModel
from ..common.rng import site_rng
from ..common.transport import ClientFailure, Transport
from . import setup as setup_releases
from .algorithms import make_algorithm
from .allocation import allocate, proxy_variance
from .diagnostics import NoiseMonitor
from .evaluate import evaluate
from .ledger import Ledger, calibrate, check_delta, epsilon_of
from .release import aggregate, client_noise_std, noisy_mean, server_noise_std, server_view_multiplier, split_valid
from .rundir import RunDir, RunFileError, check_out_dir, read_json, write_json

log = logging.getLogger(__name__)

# Keys that do not change what a run computes: a resumed run may differ in these.
RUNTIME_KEYS = keys_with_role("runtime")
# Facts about the run that config.json holds beside the config keys (written by ``train``, skipped on resume).
RUN_FACTS = ("delta_resolved", "n", "transport", "versions")


class ResumeError(ValueError):
    """A checkpoint cannot continue this run (other config, missing or corrupt files)."""


def resolve_delta(cfg: Config, n: int) -> float:
    """delta of the config, or n^-1.1 for 'auto' (ALGORITHMS.md 5.1). In a private run, raises ConfigError for
    delta >= 1/n and logs a warning above 1/(10 n) (ledger.check_delta)."""
    delta = float(n) ** -1.1 if cfg.delta == AUTO else float(cfg.delta)
    if cfg.private:
        warning = check_delta(delta, n, cfg.delta)
        if warning:
            log.warning("%s", warning)
    return delta


@dataclass
class Progress:
    """Callbacks for the CLI layer: ``on_start(t)`` once before training (t > 0 when resuming), ``on_step(t)``
    after each iteration, ``on_eval(row)`` after each evaluation (row = metrics dict)."""

    on_start: Callable[[int], None] = lambda t: None
    on_step: Callable[[int], None] = lambda t: None
    on_eval: Callable[[dict], None] = lambda row: None


@dataclass
class RunResult:
    """What ``train`` returns: final parameters (d,), summary dict and the metrics rows."""

    params: np.ndarray
    summary: dict
    metrics: list[dict] = field(default_factory=list)


def collect_round(cfg: Config, transport: Transport, queries: Sequence[Query],
                  versions: dict[int, np.ndarray],
                  on_discard: Callable[[Query, list[Reply]], None] | None = None) -> dict[str, list[Reply]]:
    """Run ``queries`` on every client and return the valid replies, applying the failure policy.

    A client fails when it raises, times out or sends a malformed reply (``release.check_reply``); all its
    replies of the round are then discarded and it is logged by partition. Policy (config
    ``on-client-failure``): 'fail' raises ClientFailure at once; 'retry' repeats the round (attempt k) up to
    ``max-retries`` times; 'drop' goes on without the failed clients if at least ``min-clients`` remain,
    else retries like 'retry'. Nothing is released or charged for a discarded attempt; ``on_discard(query,
    replies)`` is called with the valid replies of every discarded attempt (in distributed and local noise
    modes the server has seen those noised values, which counts against the server).

    A retry never depends on record values: an honest client's reply always passes ``check_reply`` (clipping
    never overshoots its bound and the check allows the rounding of the working dtype), so only transport
    failures, timeouts, a client's own error or a faulty client discard an attempt.
    """
    for attempt in range(cfg.max_retries + 1):
        tries = [dataclasses.replace(q, attempt=attempt) for q in queries]
        result = transport.run(tries, versions)
        failures = dict(result.failures)
        for q in tries:
            _, rejected = split_valid(q, result.replies[q.qid], cfg.dtype)
            failures.update(rejected)
        if not failures:
            return result.replies
        for pid, reason in sorted(failures.items()):
            log.warning("iteration %d, attempt %d: client %d failed: %s", queries[0].iteration, attempt, pid, reason)
        valid = {qid: [r for r in rs if r.partition not in failures] for qid, rs in result.replies.items()}
        remaining = transport.num_clients - len(failures)
        if cfg.on_client_failure == "drop" and remaining >= cfg.min_clients:
            log.warning("releasing without client(s) %s (%d remain)", sorted(failures), remaining)
            return valid
        if on_discard is not None:
            for q in tries:
                if valid[q.qid]:
                    on_discard(q, valid[q.qid])
        if cfg.on_client_failure == "fail":
            break
    summary = "; ".join(f"client {pid}: {reason}" for pid, reason in sorted(failures.items()))
    raise ClientFailure(f"iteration {queries[0].iteration} ({', '.join(q.mechanism for q in queries)}) failed "
                        f"after {attempt + 1} attempt(s) with on-client-failure={cfg.on_client_failure}: {summary}")


def rss_mb() -> float:
    """Current resident set size of this process in MiB (/proc on Linux; elsewhere the peak)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize() / 2**20
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _comparable(d: dict) -> dict:
    return {k: v for k, v in d.items() if k not in RUNTIME_KEYS}


class Releaser:
    """Executes the releases of a run: decorates each query (logit offset, clipped-count coordinate, client
    noise share), collects the replies under the failure policy, charges the ledger, adds the server's
    noise, normalises and records the event. One instance per run; shared by the setup and training stages.

    ``server_view`` counts, per (rate, multiplier), the releases as the server itself saw them (the
    guarantee against the server in distributed and local noise modes; ``release.server_view_multiplier``).
    """

    def __init__(self, cfg: Config, transport: Transport, ledger: Ledger, n: int, rd: RunDir) -> None:
        self.cfg, self.transport, self.ledger, self.n, self.rd = cfg, transport, ledger, n, rd
        self.offset: tuple[float, ...] = ()
        self.monitor = NoiseMonitor()
        self.server_view: Counter = Counter()
        self.quantisation_ratio = 0.0  # largest SecAgg+ rounding bound / noise std of a released sum

    def decorate(self, q: Query, *, diagnostics: bool = True) -> Query:
        """``q`` with the run's logit offset, the clipped-count coordinate (private training releases) and
        the noise std each client adds in this noise mode."""
        cfg = self.cfg
        count_scale = cfg.clip_count_scale if (cfg.private and diagnostics and math.isfinite(q.clip)) else 0.0
        q = dataclasses.replace(q, offset=self.offset, count_scale=count_scale)
        z = self.ledger.noise_multiplier(q.mechanism) if cfg.private else 0.0
        share = client_noise_std(cfg.noise_mode, z, q.sensitivity, self.transport.num_clients)
        return dataclasses.replace(q, noise_std=share)

    def run(self, raw: Sequence[Query], versions: dict[int, np.ndarray], *, setup: bool = False
            ) -> dict[str, np.ndarray]:
        """Release every query of one round; returns mechanism -> released mean (D,) float64."""
        queries = [self.decorate(q, diagnostics=not setup) for q in raw]
        for q in queries:  # refuse before anything leaves a client if the plan would be overspent
            self.ledger.check(q.mechanism, q.rate)
        replies = collect_round(self.cfg, self.transport, queries, versions, self._seen_by_server)
        m = self.transport.num_clients
        released, events = {}, []
        for q in queries:
            got = replies[q.qid]
            total, clients = aggregate(q, got), sum(r.clients for r in got)
            self.ledger.charge(q.mechanism, q.rate)  # raises before anything is released if it would overspend
            z = self.ledger.noise_multiplier(q.mechanism)
            mode = self.cfg.noise_mode
            self._seen_by_server(q, got)
            rng = site_rng(self.cfg.reproducible, self.cfg.seed, "noise", q.iteration, q.mechanism)
            std = server_noise_std(mode, z, q.sensitivity, m, clients)
            mean = noisy_mean(q, total, std, self.n, rng)
            expected = q.rate * self.n
            event = {"iteration": q.iteration, "mechanism": q.mechanism, "rate": q.rate, "noise_multiplier": z,
                     "clip": q.clip, "expected_batch": expected, "clients": clients, "noise_mode": mode,
                     "noise_std_of_mean": z * q.sensitivity / expected}
            if mode != "central" and z > 0:
                event["server_topup_std"] = std
                quantisation = getattr(self.transport, "quantisation_bound", None)
                if quantisation is not None and clients and got[0].partition < 0:
                    event["quantisation_bound"] = quantisation(q, clients)
                    ratio = event["quantisation_bound"] / (z * q.sensitivity)
                    self.quantisation_ratio = max(self.quantisation_ratio, ratio)
            if setup:
                event["phase"] = "setup"
            if q.count_scale > 0:
                event["clipped_fraction"] = float(mean[-1] / (q.count_scale * q.clip))
                mean = mean[:-1]
            released[q.mechanism] = mean
            events.append(self.monitor.observe(event))
        self.rd.append_events(events)
        return released

    def _seen_by_server(self, q: Query, replies: list[Reply]) -> None:
        """Count a set of replies the server has seen (released or discarded) against the server."""
        if not replies:
            return
        z = self.ledger.noise_multiplier(q.mechanism) if self.cfg.private else 0.0
        clients = sum(r.clients for r in replies)
        self.server_view[(q.rate, server_view_multiplier(self.cfg.noise_mode, z, self.transport.num_clients,
                                                         clients))] += 1

    def server_view_epsilon(self, delta: float, accountant: str) -> float:
        """Epsilon against the server itself of every release so far (inf in central mode)."""
        if not self.cfg.private or any(z <= 0 for (_, z) in self.server_view):
            return math.inf
        return epsilon_of(self.server_view, delta, accountant)


def plan_run(cfg: Config, algo, n: int, delta: float) -> tuple[dict, dict[str, float], dict | None]:
    """(plan with the setup releases, mechanism -> calibrated noise multiplier, noise profiles or None)."""
    profiles = algo.noise_profiles() if cfg.noise_allocation == "variance" else None
    plan = {**setup_releases.mechanisms(cfg), **allocate(algo.plan(), profiles)}
    if cfg.private:
        scale = calibrate(plan, cfg.epsilon, delta, cfg.accountant)
        noise = {m.name: m.noise_at(scale) for m in plan}
    else:
        noise = {m.name: 0.0 for m in plan}
    return plan, noise, profiles


def train(cfg: Config, transport: Transport, test: ArrayDataset, *, resume: bool = False,
          progress: Progress | None = None, transport_name: str = "local") -> RunResult:
    """Run (or, with ``resume``, continue) training as configured; write the run directory.

    Raises ConfigError for a configuration the data cannot support or an out-dir that is not empty (without
    ``resume`` or config key overwrite; ``rundir.check_out_dir``), ResumeError for an unusable checkpoint,
    and ledger.PrivacyBudgetExceeded if a release would overspend (nothing is released then).
    """
    progress = progress or Progress()
    check_out_dir(cfg.out_dir, resume=resume, overwrite=cfg.overwrite)  # before calibration: nothing to lose
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    n = transport.num_records
    if n < 1:
        raise ConfigError("the clients hold no training record (n = 0)")
    for key, batch in (("refresh-batch", cfg.refresh_batch), ("diff-batch", cfg.diff_batch)):
        if batch > n:
            raise ConfigError(f"config key '{key}': got {batch}; allowed: at most n = {n} training records")
    delta = resolve_delta(cfg, n)
    dtype = torch.float64 if cfg.dtype == "float64" else torch.float32
    model = FlatModel(make_model(resolve_model(cfg.model, cfg.dataset), test.num_classes, cfg.seed, dtype))
    algo = make_algorithm(cfg, n, model.dim, test.num_classes)
    if not cfg.private:
        log.warning("epsilon=inf: NOT PRIVATE (no clipping, no noise)")
    plan, noise, profiles = plan_run(cfg, algo, n, delta)
    ledger = Ledger(plan, noise, cfg.epsilon, delta, cfg.accountant)
    log.info("n=%d delta=%.3g noise multipliers %s", n, delta, {k: round(v, 4) for k, v in noise.items()})
    for warning in algo.regime_warnings(noise):
        log.warning("%s", warning)

    rd = RunDir(cfg.out_dir)
    rd.create()
    facts = dict(zip(RUN_FACTS, (delta, n, transport_name, _versions()), strict=True))
    meta_config = {**cfg.to_dict(), **facts}
    x0 = model.initial().double().numpy()
    releaser = Releaser(cfg, transport, ledger, n, rd)
    rows: list[dict] = []
    wall_before = 0.0
    start = time.perf_counter()
    if resume:
        state, rows, wall_before, setup = _resume(rd, cfg, algo, ledger, algo.init_state(x0))
    else:
        rd.clear()  # empty unless overwrite was asked for (check_out_dir)
        write_json(rd.config, meta_config)
        setup = setup_releases.initial(cfg, test.num_classes)
        for stage in setup_releases.stages(cfg, test.num_classes):
            releaser.offset = setup.offset(cfg.tau)
            setup = setup_releases.absorb(setup, releaser.run(stage, {0: x0}, setup=True), n, cfg)
        state = algo.start_state(x0, setup.eta0)
    releaser.offset = setup.offset(cfg.tau)
    prediction_shift = _prediction_shift(cfg, setup)

    def wall() -> float:
        return wall_before + time.perf_counter() - start

    def checkpoint() -> None:
        arrays, scalars = state.to_arrays()
        rd.save_checkpoint(arrays, {"config": cfg.to_dict(), "state": scalars, "ledger": ledger.state(),
                                    "metrics": rows, "wall_seconds": wall(), "noise": noise,
                                    "setup": setup.to_json(), "server_view": _counter_json(releaser.server_view),
                                    "noise_monitor": releaser.monitor.state()})

    def eval_row() -> dict:
        x, _ = algo.output(state)
        metrics = evaluate(model, x, test, cfg, prediction_shift)
        losses = metrics.pop("losses")
        return {"iteration": state.t, "epsilon_spent": ledger.epsilon_spent(), **metrics,
                **algo.eval_extras(state, losses), **algo.diagnostics(state), **releaser.monitor.take_window(),
                "wall_seconds": wall(), "server_rss_mb": rss_mb()}

    if resume:  # what the releases so far left behind in the releaser (absent from checkpoints before 21.10)
        saved = rd.load_checkpoint()[1]
        releaser.server_view = _counter_from_json(saved.get("server_view", []))
        releaser.monitor = NoiseMonitor.from_state(saved.get("noise_monitor", {}))
    progress.on_start(state.t)
    if not rows:
        rows.append(eval_row())
        rd.write_metrics(rows)
        progress.on_eval(rows[-1])
    while state.t < cfg.iterations:
        t_before = state.t
        released = releaser.run(algo.queries(state), algo.versions(state))
        state = algo.apply(state, released)
        if state.t == t_before:
            continue
        progress.on_step(state.t)
        done = state.t >= cfg.iterations
        if state.t % cfg.eval_every == 0 or done:
            rows.append(eval_row())
            rd.write_metrics(rows)
            progress.on_eval(rows[-1])
        if done or (cfg.checkpoint_every and state.t % cfg.checkpoint_every == 0):
            checkpoint()

    releaser.monitor.close()
    spider = releaser.monitor.summary()
    if spider["phases_noise_dominated"]:
        log.warning("%d of %d SPIDER phases ended with more noise from their differences than from their refresh "
                    "(the differences only added noise): lower clip-diff / clip-diff-max or q, or raise diff-batch",
                    spider["phases_noise_dominated"], spider["phases"])
    final = rows[-1]
    x, _ = algo.output(state)
    summary = {
        "algorithm": cfg.algorithm, "dataset": cfg.dataset, "seed": cfg.seed, "num_clients": cfg.num_clients,
        "iterations": cfg.iterations, "n": n, "epsilon_target": cfg.epsilon, "epsilon_spent": final["epsilon_spent"],
        "delta": delta, "accountant": cfg.accountant, "noise_multipliers": noise,
        "noise_allocation": {"rule": cfg.noise_allocation, "relative": {m.name: m.relative_noise for m in plan
                                                                        if m.fixed_noise is None},
                             "fixed": {m.name: m.fixed_noise for m in plan if m.fixed_noise is not None},
                             **({"proxy_variance": proxy_variance(plan, noise, profiles, n)} if profiles else {})},
        "noise_mode": cfg.noise_mode, "trust_model": _trust_statement(cfg, transport_name),
        "epsilon_against_server": releaser.server_view_epsilon(delta, cfg.accountant),
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
        "output_iterate": cfg.output_iterate, "wall_seconds": wall(), "transport": transport_name,
        "private": cfg.private, "reproducible": cfg.reproducible,
        "not_accounted": _not_accounted(cfg, setup),
    }
    write_json(rd.summary, summary)
    np.save(rd.path / "final_params.npy", x)
    return RunResult(params=x, summary=summary, metrics=rows)


def _prediction_shift(cfg: Config, setup) -> np.ndarray | None:
    """-posthoc_tau log(pi) (K,), added to the logits at prediction (post-hoc logit adjustment), or None."""
    if cfg.posthoc_tau == 0 or setup.priors is None:
        return None
    return -cfg.posthoc_tau * np.log(np.asarray(setup.priors))


def _trust_statement(cfg: Config, transport_name: str) -> str:
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


def _not_accounted(cfg: Config, setup) -> list[str]:
    out = [] if cfg.private else ["everything: epsilon=inf, no clipping and no noise (not private)"]
    if setup.prior_source == "public":
        out.append("class priors: declared public by the user (class-prior-values), not released from the data")
    if cfg.eval_split == "validation":
        out.append("validation metrics: computed on held-out training records and reported without noise (for "
                   "tuning only)")
    if cfg.noise_mode == "distributed":
        out.append("SecAgg+ quantisation: the rounding of each client's noised sum (bounded and reported per "
                   "release) is not modelled by the Gaussian accounting")
    if cfg.private:  # assumptions every private run makes (README, 'What is private')
        out += ["n and the clients' shard sizes: treated as public (released exactly in the summary)",
                "floating-point Gaussian sampling: the accounting assumes exact Gaussians (Mironov 2012)"]
    return out + ["hyper-parameters chosen by the user are not privacy-accounted"]


def _counter_json(c: Counter) -> list:
    return [[r, z if math.isfinite(z) else "inf", k] for (r, z), k in c.items()]


def _counter_from_json(items: list) -> Counter:
    return Counter({(float(r), float(z)): int(k) for r, z, k in items})


def _resume(rd: RunDir, cfg: Config, algo, ledger: Ledger, fresh_state):
    """(state, metric rows, wall seconds so far, SetupResult) of the checkpoint in ``rd``."""
    if not rd.checkpoint.exists():
        raise ResumeError(f"no checkpoint at {rd.checkpoint}: nothing to resume")
    arrays, meta = rd.load_checkpoint()
    try:
        saved = Config.from_mapping(meta["config"]).to_dict()
    except (KeyError, TypeError, ConfigError) as e:
        raise RunFileError(f"checkpoint {rd.checkpoint} holds no valid configuration ({e}): it cannot be resumed; "
                           "start again with --overwrite (or in a new out-dir)") from None
    if _comparable(saved) != _comparable(cfg.to_dict()):
        diff = sorted(k for k in _comparable(saved) if saved[k] != cfg.to_dict().get(k))
        raise ResumeError(f"checkpoint in {rd.path} was written by another configuration (differs in: "
                          f"{', '.join(diff)}); resume with the run's own config.json")
    try:
        state = type(fresh_state).from_arrays(arrays, meta["state"])
        ledger.load_state(meta["ledger"])
        rows, wall_before = list(meta["metrics"]), float(meta["wall_seconds"])
    except (KeyError, TypeError, ValueError) as e:
        raise RunFileError(f"checkpoint {rd.checkpoint} is incomplete ({type(e).__name__}: {e}): it cannot be "
                           "resumed; start again with --overwrite (or in a new out-dir)") from None
    rd.truncate_events(state.t)
    log.info("resumed %s at iteration %d (epsilon spent %.4f)", rd.path, state.t, ledger.epsilon_spent())
    setup = setup_releases.SetupResult.from_json(meta.get("setup", {}))
    return state, rows, wall_before, setup


def load_run_config(out_dir: str) -> Config:
    """The validated Config saved in a run directory's config.json (for --resume)."""
    path = RunDir(out_dir).config
    if not path.exists():
        raise ResumeError(f"no config.json in {out_dir}: not a dpdro run directory")
    saved = read_json(path)
    if not isinstance(saved, dict):
        raise RunFileError(f"{path} is not a JSON object of configuration keys: restore it, or start the run "
                           "again in a new out-dir")
    keys = {k: v for k, v in saved.items() if k not in RUN_FACTS}
    if keys.get("epsilon") == "inf":
        keys["epsilon"] = math.inf
    try:
        return Config.from_mapping(keys).with_updates({"overwrite": False})
    except ConfigError as e:
        raise RunFileError(f"{path}: {e}; restore the file, or start the run again in a new out-dir") from None


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    import dp_accounting  # noqa: F401

    try:  # read from the installed metadata: the core never imports Flower
        flwr_version = version("flwr")
    except PackageNotFoundError:  # flwr is optional for single-node runs
        flwr_version = None
    return {"dpdro": __version__, "torch": torch.__version__, "numpy": np.__version__, "flwr": flwr_version,
            "python": platform.python_version()}
