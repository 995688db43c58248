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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from .. import __version__
from ..common.config import AUTO, Config, ConfigError
from ..common.data import ArrayDataset
from ..common.messages import Query, Reply
from ..common.models import make_model, resolve_model
from ..common.per_sample import FlatModel
from ..common.rng import site_rng
from .algorithms import make_algorithm
from .evaluate import evaluate
from .ledger import Ledger, calibrate
from .release import aggregate, noisy_mean, split_valid
from .rundir import RunDir, read_json, write_json
from .transport import ClientFailure, Transport

log = logging.getLogger(__name__)

# Keys that do not change what a run computes: a resumed run may differ in these.
RUNTIME_KEYS = ("resume", "out-dir", "threads", "round-timeout", "eval-every", "checkpoint-every", "chunk-size",
                "on-client-failure", "max-retries", "min-clients", "inject-fault")


class ResumeError(ValueError):
    """A checkpoint cannot continue this run (other config, missing or corrupt files)."""


def resolve_delta(cfg: Config, n: int) -> float:
    """delta of the config, or n^-1.1 for 'auto' (ALGORITHMS.md 5.1)."""
    return float(n) ** -1.1 if cfg.delta == AUTO else float(cfg.delta)


@dataclass
class Progress:
    """Callbacks for the CLI layer: ``on_step(t)`` after each iteration, ``on_eval(row)`` after each
    evaluation (row = metrics dict)."""

    on_step: Callable[[int], None] = lambda t: None
    on_eval: Callable[[dict], None] = lambda row: None


@dataclass
class RunResult:
    """What ``train`` returns: final parameters (d,), summary dict and the metrics rows."""

    params: np.ndarray
    summary: dict
    metrics: list[dict] = field(default_factory=list)


def collect_round(cfg: Config, transport: Transport, queries: Sequence[Query],
                  versions: dict[int, np.ndarray]) -> dict[str, list[Reply]]:
    """Run ``queries`` on every client and return the valid replies, applying the failure policy.

    A client fails when it raises, times out or sends a malformed reply (``release.check_reply``); all its
    replies of the round are then discarded and it is logged by partition. Policy (config
    ``on-client-failure``): 'fail' raises ClientFailure at once; 'retry' repeats the round (attempt k) up to
    ``max-retries`` times; 'drop' goes on without the failed clients if at least ``min-clients`` remain,
    else retries like 'retry'. Nothing is released or charged for a discarded attempt.
    """
    for attempt in range(cfg.max_retries + 1):
        tries = [dataclasses.replace(q, attempt=attempt) for q in queries]
        result = transport.run(tries, versions)
        failures = dict(result.failures)
        for q in tries:
            _, rejected = split_valid(q, result.replies[q.qid])
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


def train(cfg: Config, transport: Transport, test: ArrayDataset, *, resume: bool = False,
          progress: Progress | None = None, transport_name: str = "local") -> RunResult:
    """Run (or, with ``resume``, continue) training as configured; write the run directory.

    Raises ConfigError for a configuration the data cannot support, ResumeError for an unusable
    checkpoint, and ledger.PrivacyBudgetExceeded if a release would overspend (nothing is released then).
    """
    progress = progress or Progress()
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
    plan = algo.plan()
    if cfg.private:
        scale = calibrate(plan, cfg.epsilon, delta, cfg.accountant)
        noise = {m.name: m.relative_noise * scale for m in plan}
    else:
        log.warning("epsilon=inf: NOT PRIVATE (no clipping, no noise)")
        noise = {m.name: 0.0 for m in plan}
    ledger = Ledger(plan, noise, cfg.epsilon, delta, cfg.accountant)
    log.info("n=%d delta=%.3g noise multipliers %s", n, delta, {k: round(v, 4) for k, v in noise.items()})

    rd = RunDir(cfg.out_dir)
    rd.create()
    meta_config = {**cfg.to_dict(), "delta_resolved": delta, "n": n, "transport": transport_name,
                   "versions": _versions()}
    state = algo.init_state(model.initial().double().numpy())
    rows: list[dict] = []
    wall_before = 0.0
    if resume:
        state, rows, wall_before = _resume(rd, cfg, algo, ledger, state)
    else:
        rd.events.unlink(missing_ok=True)
        write_json(rd.config, meta_config)

    start = time.perf_counter()
    last_release: dict[str, dict] = {}

    def wall() -> float:
        return wall_before + time.perf_counter() - start

    def checkpoint() -> None:
        arrays, scalars = state.to_arrays()
        rd.save_checkpoint(arrays, {"config": cfg.to_dict(), "state": scalars, "ledger": ledger.state(),
                                    "metrics": rows, "wall_seconds": wall(), "noise": noise})

    def eval_row() -> dict:
        x, _ = algo.output(state)
        metrics = evaluate(model, x, test, cfg)
        losses = metrics.pop("losses")
        return {"iteration": state.t, "epsilon_spent": ledger.epsilon_spent(), **metrics,
                **algo.eval_extras(state, losses), **algo.diagnostics(state), "wall_seconds": wall(),
                "server_rss_mb": rss_mb()}

    if not rows:
        rows.append(eval_row())
        rd.write_metrics(rows)
        progress.on_eval(rows[-1])
    while state.t < cfg.iterations:
        t_before = state.t
        queries = algo.queries(state)
        replies = collect_round(cfg, transport, queries, algo.versions(state))
        released, events = {}, []
        for q in queries:
            total = aggregate(q, replies[q.qid])
            ledger.charge(q.mechanism, q.rate)  # raises before anything is released if it would overspend
            z = ledger.noise_multiplier(q.mechanism)
            rng = site_rng(cfg.reproducible, cfg.seed, "noise", q.iteration, q.mechanism)
            released[q.mechanism] = noisy_mean(q, total, z, n, rng)
            event = {"iteration": q.iteration, "mechanism": q.mechanism, "rate": q.rate, "noise_multiplier": z,
                     "clip": q.clip, "expected_batch": q.rate * n, "noise_std_of_mean": z * q.clip / (q.rate * n)}
            events.append(event)
            last_release[q.mechanism] = event
        rd.append_events(events)
        state = algo.apply(state, released)
        if state.t == t_before:
            continue
        progress.on_step(state.t)
        done = state.t >= cfg.iterations
        if state.t % cfg.eval_every == 0 or done:
            rows.append(eval_row())
            rd.write_metrics(rows)
            progress.on_eval(rows[-1])
            log.debug("iteration %d: epsilon %.3f, test accuracy %.4f, worst-class %.4f", state.t,
                     rows[-1]["epsilon_spent"], rows[-1]["test_accuracy"], rows[-1]["worst_class_accuracy"])
        if done or (cfg.checkpoint_every and state.t % cfg.checkpoint_every == 0):
            checkpoint()

    final = rows[-1]
    x, _ = algo.output(state)
    summary = {
        "algorithm": cfg.algorithm, "dataset": cfg.dataset, "seed": cfg.seed, "num_clients": cfg.num_clients,
        "iterations": cfg.iterations, "n": n, "epsilon_target": cfg.epsilon, "epsilon_spent": final["epsilon_spent"],
        "delta": delta, "accountant": cfg.accountant, "noise_multipliers": noise,
        "sampling_rates": {m.name: m.rate for m in plan}, "releases": dict(ledger.spent),
        "test_accuracy": final["test_accuracy"], "worst_class_accuracy": final["worst_class_accuracy"],
        "per_class_accuracy": final["per_class_accuracy"], "eval_loss": final["eval_loss"],
        **{k: final[k] for k in ("worst_group_accuracy", "per_group_accuracy") if k in final},
        "eval_dro_objective": final["eval_dro_objective"], "psi": cfg.psi, "lambda": cfg.lambda_,
        **{k: v for k, v in final.items() if k.startswith("eval_") and k not in ("eval_loss", "eval_dro_objective")},
        "output_iterate": cfg.output_iterate, "wall_seconds": wall(), "transport": transport_name,
        "private": cfg.private, "reproducible": cfg.reproducible,
        "not_accounted": ([] if cfg.private else ["everything: epsilon=inf, no clipping and no noise (not private)"])
        + ["hyper-parameters chosen by the user are not privacy-accounted"],
    }
    write_json(rd.summary, summary)
    np.save(rd.path / "final_params.npy", x)
    return RunResult(params=x, summary=summary, metrics=rows)


def _resume(rd: RunDir, cfg: Config, algo, ledger: Ledger, fresh_state):
    if not rd.checkpoint.exists():
        raise ResumeError(f"no checkpoint at {rd.checkpoint}: nothing to resume")
    arrays, meta = rd.load_checkpoint()
    saved = Config.from_mapping(meta["config"]).to_dict()
    if _comparable(saved) != _comparable(cfg.to_dict()):
        diff = sorted(k for k in _comparable(saved) if saved[k] != cfg.to_dict().get(k))
        raise ResumeError(f"checkpoint in {rd.path} was written by another configuration (differs in: "
                          f"{', '.join(diff)}); resume with the run's own config.json")
    state = type(fresh_state).from_arrays(arrays, meta["state"])
    ledger.load_state(meta["ledger"])
    rd.truncate_events(state.t)
    log.info("resumed %s at iteration %d (epsilon spent %.4f)", rd.path, state.t, ledger.epsilon_spent())
    return state, list(meta["metrics"]), float(meta["wall_seconds"])


def load_run_config(out_dir: str) -> Config:
    """The validated Config saved in a run directory's config.json (for --resume)."""
    path = RunDir(out_dir).config
    if not path.exists():
        raise ResumeError(f"no config.json in {out_dir}: not a dpdro run directory")
    saved = read_json(path)
    keys = {k: v for k, v in saved.items() if k not in ("delta_resolved", "n", "transport", "versions")}
    if keys.get("epsilon") == "inf":
        keys["epsilon"] = math.inf
    return Config.from_mapping(keys)


def _versions() -> dict:
    import dp_accounting  # noqa: F401

    try:
        import flwr

        flwr_version = flwr.__version__
    except Exception:  # flwr is optional for single-node runs
        flwr_version = None
    return {"dpdro": __version__, "torch": torch.__version__, "numpy": np.__version__, "flwr": flwr_version,
            "python": platform.python_version()}
