"""The training engine: drives an algorithm's state machine over a transport, releases noised sums,
charges the ledger, evaluates, checkpoints and writes the run directory.

Its parts: ``server/releaser.py`` executes each release (failure policy, ledger, noise, event),
``server/summary.py`` writes what a finished run reports; this module holds the training loop and resuming.

The same function runs single-node (``LocalTransport``) and on Flower (``FlowerTransport``): that is
what makes a federated run equal to a single-node one (ARCHITECTURE.md sections 2-3).
"""

from __future__ import annotations

import copy
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from ..common.batches import fitted_to_n, over_n
from ..common.config import AUTO, FIELD_BY_KEY, SEEDED_NOT_PRIVATE, Config, ConfigError, keys_with_role
from ..common.data import DATASETS, ArrayDataset, resolve_data_root
from ..common.data_types import declared_classes
from ..common.errors import DpdroError, Stopped
from ..common.model_fix import fix_model
from ..common.model_init import InitialModel, prepare_model
from ..common.models import check_per_record, make_model, resolve_model, validate_model
from ..common.per_sample import FlatModel
from ..common.tabular_data import training_feature_names
from ..common.transport import Transport
from . import setup as setup_releases
from .algorithms import make_algorithm
from .allocation import allocate
from .convergence import rising_note, worst_slope
from .diagnostics import NoiseMonitor
from .evaluate import evaluate
from .ledger import Ledger, auto_delta, calibrate, check_delta
from .memory import heap_mb, rss_mb
from .model_files import describe_module_class, input_scaling, state_dict_at, write_model_files
from .release import check_distributed
from .releaser import Releaser
from .run_report import long_tailed_construction, minority_classes, write_model_card, write_run_plots
from .rundir import RunDir, RunFileError, check_out_dir, read_json, write_json
from .summary import run_summary, software_versions

log = logging.getLogger(__name__)

# Keys that do not change what a run computes: a resumed run may differ in these.
RUNTIME_KEYS = keys_with_role("runtime")
# Facts about the run that config.json holds beside the config keys (written by ``train``, skipped on resume).
# data_read: the folder the evaluation records were read from (the data root, or the cache after data-root=auto
# fell back to its copies; null for records passed from Python).
RUN_FACTS = ("delta_resolved", "n", "transport", "versions", "data_read")


class ResumeError(ValueError, DpdroError):
    """A checkpoint cannot continue this run (other config, missing or corrupt files)."""


class TrainingStopped(Stopped):
    """Training stopped at a user's request (``Progress.stop_requested``, e.g. Ctrl-C) after a checkpoint of
    iteration ``iteration`` was written to ``out_dir``: the run continues with ``dpdro train --resume out_dir``."""

    def __init__(self, iteration: int, iterations: int, out_dir: str) -> None:
        super().__init__(f"stopped at iteration {iteration} of {iterations}; checkpoint written to {out_dir}")
        self.iteration, self.iterations, self.out_dir = iteration, iterations, out_dir


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


def check_resumed_records(rd: RunDir, n: int) -> None:
    """Refuse (ResumeError, before any work) to resume a run whose clients now hold another number of training
    records than the run was planned for (config.json's ``n``): the sampling rates, delta and the checkpoint's
    ledger all rest on that n (e.g. a Flower node dropped at start-up this time, or a site's data changed)."""
    saved = read_json(rd.config).get("n") if rd.config.exists() else None
    if saved is not None and int(saved) != n:
        raise ResumeError(f"the run in {rd.path} was planned for n = {saved} training records, but its clients now "
                          f"hold n = {n}: its sampling rates, delta and ledger rest on n = {saved}, so it cannot be "
                          "resumed on other data; bring back the same nodes and data, or start again in a new "
                          "out-dir")


def follow_n(cfg: Config, n: int) -> tuple[Config, list[str]]:
    """(``cfg`` with every batch key the algorithm reads left at a default above n fitted to n, one note per key
    fitted; common/batches.py). Raises ConfigError naming every batch key set above n, with suggested values."""
    values = cfg.to_dict()
    problem = over_n(values, {k: f.default for k, f in FIELD_BY_KEY.items()}, n, f"n = {n} training records")
    if problem:
        raise ConfigError(problem)
    fitted, notes = fitted_to_n(values, n)
    return (cfg.with_updates(fitted) if fitted else cfg), notes


def resolve_delta(cfg: Config, n: int) -> float:
    """delta of the config, or 1/(10 n) for 'auto' (ledger.auto_delta; ALGORITHMS.md 5.1). In a private run,
    raises ConfigError for delta >= 1/n and logs a warning above 1/(10 n) (ledger.check_delta)."""
    delta = auto_delta(n) if cfg.delta == AUTO else float(cfg.delta)
    if cfg.private:
        warning = check_delta(delta, n, cfg.delta)
        if warning:
            log.warning("%s", warning)
    return delta


@dataclass
class Progress:
    """Callbacks for the CLI layer: ``on_note(text)`` for each line the engine also logs at INFO (the plan
    header: n, delta, noise multipliers; where a resumed run restarts), ``on_start(t)`` once before training
    (t > 0 when resuming), ``on_step(t)`` after each iteration, ``on_eval(row)`` after each evaluation (row =
    metrics dict). ``stop_requested()`` is asked after each iteration: True writes a checkpoint and raises
    ``TrainingStopped`` (how Ctrl-C stops a run at an iteration boundary, resumable)."""

    on_start: Callable[[int], None] = lambda t: None
    on_step: Callable[[int], None] = lambda t: None
    on_eval: Callable[[dict], None] = lambda row: None
    on_note: Callable[[str], None] = lambda text: None
    stop_requested: Callable[[], bool] = lambda: False


def plan_line(n: int, delta: float, noise: dict[str, float]) -> str:
    """The header of a run (the same line for ``dpdro train``, ``simulate`` and ``deploy``): n, delta and the
    calibrated noise multiplier of every mechanism."""
    return f"n={n} delta={delta:.3g} noise multipliers {({k: round(v, 4) for k, v in noise.items()})}"


def evaluation_line(row: dict, split: str = "test") -> str:
    """One evaluation of a run as a line (the same for ``dpdro train``, ``simulate`` and the Flower ServerApp):
    iteration, epsilon spent ("inf (not private)" for a non-private run), the accuracy and worst-class accuracy on
    ``split``, the config's eval-split (the row's keys say test_* whichever split it is)."""
    eps = row["epsilon_spent"]
    eps_text = "inf (not private)" if eps == math.inf else f"{eps:.4f}"
    return (f"iteration {row['iteration']:>6}  epsilon {eps_text}  {split} accuracy {row['test_accuracy']:.4f}  "
            f"worst-class accuracy {row['worst_class_accuracy']:.4f}")


def _note(progress: Progress, text: str) -> None:
    log.info("%s", text)
    progress.on_note(text)


@dataclass
class RunResult:
    """What ``train`` returns: final parameters (d,), summary dict and the metrics rows."""

    params: np.ndarray
    summary: dict
    metrics: list[dict] = field(default_factory=list)


def _comparable(d: dict) -> dict:
    return {k: v for k, v in d.items() if k not in RUNTIME_KEYS}


def check_groups(cfg: Config, num_groups: int) -> None:
    """Refuse dro-groups=attribute on a data set that declares no group attribute (num_groups 0), before any
    release: ConfigError naming the key, the data set and what is allowed."""
    if cfg.attribute_groups and num_groups == 0:
        raise ConfigError(f"config key 'dro-groups': got 'attribute'; data set {cfg.dataset!r} declares no group "
                          "attribute (allowed: 'class', or a data set with groups such as celeba)")


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
          progress: Progress | None = None, transport_name: str = "local", module: nn.Module | None = None
          ) -> RunResult:
    """Run (or, with ``resume``, continue) training as configured; write the run directory, and when the run
    finishes its model files, plots and model card (``_write_model_outputs``).

    ``module``: an untrained ``nn.Module`` to train instead of the one config key ``model`` names (the Python
    API's ``model=``); validated like every model (ModelError for layers that mix records), trained from its
    own initial parameters.

    Raises ConfigError for a configuration the data cannot support (e.g. too few records: ``check_records``) or an
    out-dir that is not empty (without
    ``resume`` or config key overwrite; ``rundir.check_out_dir``), ResumeError for an unusable checkpoint,
    and ledger.PrivacyBudgetExceeded if a release would overspend (nothing is released then).
    """
    progress = progress or Progress()
    check_out_dir(cfg.out_dir, resume=resume, overwrite=cfg.overwrite)  # before calibration: nothing to lose
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    n = transport.num_records
    check_records(cfg, n)
    if resume:
        check_resumed_records(RunDir(cfg.out_dir), n)
    cfg, fitted = follow_n(cfg, n)  # defaults above n follow it; a set value above n is refused
    delta = resolve_delta(cfg, n)
    dtype = torch.float64 if cfg.dtype == "float64" else torch.float32
    factory = None if module is not None else resolve_model(cfg.model, cfg.dataset)
    input_shape = tuple(test.x.shape[1:])
    if module is not None:  # the checks make_model runs on a registered model or an import path
        # a copy (init-weights loads into it), BatchNorm replaced as model-fix says
        module = validate_model(fix_model(copy.deepcopy(module), cfg.model_fix).to(dtype))
        check_per_record(module, input_shape, test.num_classes, describe_module_class(module))
    base = module if module is not None else make_model(factory, test.num_classes, cfg.seed, dtype, input_shape,
                                                        cfg.model_fix)
    initial = prepare_model(base, cfg.init_weights, cfg.trainable)  # before calibration: dim is the trainable count
    model = FlatModel(base)
    check_groups(cfg, test.num_groups)
    algo = make_algorithm(cfg, n, model.dim, test.num_classes, test.num_groups)
    if not cfg.private:
        log.warning("epsilon=inf: NOT PRIVATE (no clipping, no noise)")
    elif cfg.noise_from_saved_seed:
        log.warning("reproducible=true with reproducible-for-testing=true: %s (seed %d is saved in summary.json: "
                    "anyone with the run folder can subtract the noise)", SEEDED_NOT_PRIVATE, cfg.seed)
    plan, noise, profiles = plan_run(cfg, algo, n, delta)
    if cfg.private and cfg.noise_mode == "distributed":
        for warning in check_distributed(cfg, noise, transport.largest_shard):
            log.warning("%s", warning)
    ledger = Ledger(plan, noise, cfg.epsilon, delta, cfg.accountant)
    for text in fitted:
        _note(progress, text)
    _note(progress, plan_line(n, delta, noise))
    for warning in algo.regime_warnings(noise):
        log.warning("%s", warning)

    rd = RunDir(cfg.out_dir)
    rd.create()
    facts = dict(zip(RUN_FACTS, (delta, n, transport_name, software_versions(), test.source or None), strict=True))
    meta_config = {**cfg.to_dict(), **facts}
    x0 = model.initial().double().numpy()
    releaser = Releaser(cfg, transport, ledger, n, rd)
    rows: list[dict] = []
    wall_before = 0.0
    start = time.perf_counter()
    if resume:
        state, rows, wall_before, setup, lost = _resume(rd, cfg, algo, ledger, algo.init_state(x0))
    else:
        rd.clear()  # empty unless overwrite was asked for (check_out_dir)
        write_json(rd.config, meta_config)
        setup = setup_releases.initial(cfg, test.num_classes)
        for stage in setup_releases.stages(cfg, test.num_classes, test.num_groups):
            releaser.offset = setup.offset(cfg.tau)
            setup = setup_releases.absorb(setup, releaser.run(stage, {0: x0}, setup=True), n, cfg)
        state = algo.start_state(x0, setup.eta0, setup.dro_priors(cfg))
    releaser.offset = setup.offset(cfg.tau)
    prediction_shift = _prediction_shift(cfg, setup)

    def wall() -> float:
        return wall_before + time.perf_counter() - start

    def checkpoint() -> None:
        arrays, scalars = state.to_arrays()
        rd.save_checkpoint(arrays, {"config": cfg.to_dict(), "state": scalars, "ledger": ledger.state(),
                                    "metrics": rows, "wall_seconds": wall(), "noise": noise,
                                    "setup": setup.to_json(), "server_view": releaser.server_ledger.state(),
                                    "noise_monitor": releaser.monitor.state(), "events_covered": rd.event_count(),
                                    "init_weights_sha256": initial.sha256})

    def eval_row() -> dict:
        x, _ = algo.output(state)
        metrics = evaluate(model, x, test, cfg, prediction_shift)
        losses = metrics.pop("losses")
        if "eval_dro_objective" not in algo.spec.reports:  # F of key psi: only for the methods that optimise it
            metrics.pop("eval_dro_objective")
        return {"iteration": state.t, "epsilon_spent": ledger.epsilon_spent(), **metrics,
                **algo.eval_extras(state, losses), **algo.diagnostics(state), **releaser.monitor.take_window(),
                "wall_seconds": wall(), "server_rss_mb": rss_mb(), "server_heap_mb": heap_mb()}

    if resume:  # what the releases so far left behind in the releaser (absent from checkpoints before 21.10)
        saved = rd.load_checkpoint()[1]
        if saved.get("init_weights_sha256", initial.sha256) != initial.sha256:
            raise ResumeError(f"config key 'init-weights': {cfg.init_weights} now has sha256 {initial.sha256}; the "
                              f"checkpoint in {rd.path} started from a file with sha256 "
                              f"{saved['init_weights_sha256']}: resume with that file")
        seen = saved.get("server_view", [])
        # checkpoints before the server view was a Ledger hold only its (rate, z) counts
        releaser.server_ledger.load_state(seen if isinstance(seen, dict) else {"spent": {}, "extra": seen})
        releaser.monitor = NoiseMonitor.from_state(saved.get("noise_monitor", {}))
        charged = charge_lost_releases(lost, ledger, releaser.server_ledger, cfg, state.t)
        if charged:
            log.warning("%s", charged)
            progress.on_note(charged)
        _note(progress, f"resuming {rd.path} at iteration {state.t} of {cfg.iterations} (epsilon spent so far "
                        f"{ledger.epsilon_spent():.4f})")
    progress.on_start(state.t)
    if not rows:
        rows.append(eval_row())
        rd.write_metrics(rows)
        progress.on_eval(rows[-1])
    while state.t < cfg.iterations:
        t_before = state.t
        released = releaser.run(algo.queries(state), algo.versions(state))
        state = algo.advance(state, released)  # apply() under the step-size warm-up
        if state.t == t_before:
            continue
        progress.on_step(state.t)
        done = state.t >= cfg.iterations
        if state.t % cfg.eval_every == 0 or done:
            rows.append(eval_row())
            rd.write_metrics(rows)
            progress.on_eval(rows[-1])
        stop = not done and progress.stop_requested()
        # also after the first iteration: a run stopped early leaves a resumable directory
        if done or stop or state.t == 1 or (cfg.checkpoint_every and state.t % cfg.checkpoint_every == 0):
            checkpoint()
        if stop:
            raise TrainingStopped(state.t, cfg.iterations, str(rd.path))

    releaser.monitor.close()
    spider = releaser.monitor.summary()
    if spider["phases_noise_dominated"]:
        log.warning("%d of %d SPIDER phases ended with more noise from their differences than from their refresh "
                    "(the differences only added noise): lower clip-diff / clip-diff-max or q, or raise diff-batch",
                    spider["phases_noise_dominated"], spider["phases"])
    final = rows[-1]
    x, _ = algo.output(state)
    summary = run_summary(cfg, n=n, delta=delta, plan=plan, noise=noise, profiles=profiles, ledger=ledger,
                          releaser=releaser, final=final, setup=setup, spider=spider, wall_seconds=wall(),
                          transport_name=transport_name, skipped_files=test.skipped_files,
                          initial_model=initial.facts())
    rising = rising_note(rows, cfg.iterations)
    summary.update(worst_rising_slope=worst_slope(rows, cfg.iterations), worst_still_rising=rising)
    if rising:
        log.info("%s", rising)
    write_json(rd.summary, summary)
    np.save(rd.path / "final_params.npy", x)
    _write_model_outputs(rd, cfg, model, factory, x, test, setup, summary, rows, initial)
    return RunResult(params=x, summary=summary, metrics=rows)


def _write_model_outputs(rd: RunDir, cfg: Config, model: FlatModel, factory: str | None, x: np.ndarray,
                         test: ArrayDataset, setup, summary: dict, rows: list[dict], initial: InitialModel) -> None:
    """model.pt and model.json (server/model_files.py), plots/ and MODEL_CARD.md (server/run_report.py) of a
    finished run: post-processing of the released iterate ``x`` (d,) of the trainable parameters (the frozen ones,
    from ``initial``'s preparation, are saved as the module holds them) and of the reported metrics."""
    params = model.unflatten(torch.as_tensor(x).to(model.dtype))
    shift = _prediction_shift(cfg, setup)
    named = list(test.class_names) or declared_classes(cfg.classes)  # user data: names in label order
    classes = named if len(named) == test.num_classes else [str(k) for k in range(test.num_classes)]
    meta = {"factory": factory, "module_class": describe_module_class(model.module), "model_fix": cfg.model_fix,
            "num_classes": test.num_classes, "classes": classes, "input_shape": list(test.x.shape[1:]),
            "dtype": cfg.dtype, **initial.facts(), "dataset": cfg.dataset, "data": test.name,
            "input_scaling": input_scaling(test.name, cfg.to_dict()),
            # the declared keys that turn a user's file into model inputs (column order, public bounds, image size
            # and scaling, class order): what scoring new records by hand needs
            "preprocessing": {k: v for k, v in cfg.to_dict().items()
                              if k.startswith(("csv-", "image-")) or k == "classes"},
            "priors": list(setup.priors) if setup.priors is not None else None, "posthoc_tau": cfg.posthoc_tau,
            "prediction_shift": None if shift is None else shift.tolist(), "logit_adjust_tau": cfg.tau,
            "eval_split": cfg.eval_split, "algorithm": cfg.algorithm,
            "private": cfg.private and not cfg.noise_from_saved_seed,
            "epsilon_spent": summary["epsilon_spent"], "delta": summary["delta"]}
    if cfg.dataset == "csv":  # the training file's feature columns in input order: other files are read by name
        names = training_feature_names(resolve_data_root(cfg.data_root), cfg.to_dict())
        if names is not None and len(names) == int(test.x.shape[1]):
            meta["feature_names"] = names
    write_model_files(rd.path, state_dict_at(model.module, params), meta)
    spec = DATASETS.get_entry(cfg.dataset) if cfg.dataset in DATASETS else None
    construction = long_tailed_construction(cfg.dataset, test.num_classes, cfg.imbalance_ratio,
                                            spec is not None and spec.long_tailed)
    minority = minority_classes(summary, construction)
    plots = write_run_plots(rd.path, rows, summary, classes, minority)
    write_model_card(rd.path, summary, meta, plots, minority)


def _prediction_shift(cfg: Config, setup) -> np.ndarray | None:
    """-posthoc_tau log(pi) (K,), added to the logits at prediction (post-hoc logit adjustment), or None."""
    if cfg.posthoc_tau == 0 or setup.priors is None:
        return None
    return -cfg.posthoc_tau * np.log(np.asarray(setup.priors))


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
    lost = rd.journal_since(meta.get("events_covered"), state.t)
    setup = setup_releases.SetupResult.from_json(meta.get("setup", {}))
    return state, rows, wall_before, setup, lost


def charge_lost_releases(lost: list[dict], ledger: Ledger, server_ledger: Ledger, cfg: Config,
                         checkpoint_t: int) -> str | None:
    """Charge, on both ledgers, the releases made after the checkpoint a run resumes from (``lost``: events of
    ``RunDir.journal_since``): they were made, their values may have been seen (evaluation lines, the server in
    distributed and local noise modes), and the resumed run makes its own releases for those iterations again.

    Returns the note to show when there were any (None otherwise). Raises ResumeError, releasing nothing, when
    the releases so far plus the rest of the plan would spend more than the target epsilon.
    """
    released = [e for e in lost if not e.get("discarded")]
    for e in released:
        ledger.record(float(e["rate"]), float(e["noise_multiplier"]))
    for e in lost:  # what the server saw: 0 (no noise) in central mode
        server_ledger.record(float(e["rate"]), float(e.get("server_view_multiplier", 0.0)))
    if not released:
        return None
    last = max(e["iteration"] for e in released)
    span = f"iteration {last}" if last == checkpoint_t else f"iterations {checkpoint_t}-{last}"
    # in distributed and local mode the server's own ledger must fit too (its guard would stop the run later)
    checked = [("", ledger)] + ([(" against the server", server_ledger)] if cfg.noise_mode != "central" else [])
    for against, book in checked:
        completed = book.epsilon_if_completed()
        if ledger.private and completed > book.epsilon:
            raise ResumeError(
                f"{len(released)} release(s) of {span} were made after the last checkpoint "
                f"(iteration {checkpoint_t}) by the run that stopped without one; they are charged, and with them "
                f"finishing the plan would spend epsilon{against} {completed:.4f} > target "
                f"{cfg.epsilon:g} (spent so far: {book.epsilon_spent():.4f}). Nothing was released. The checkpoint "
                "cannot be finished within the budget: start again in a new out-dir (a smaller checkpoint-every "
                "bounds what a crash costs)")
    return (f"charged {len(released)} release(s) of {span} made after the last "
            f"checkpoint (they are not undone by resuming; events.jsonl marks them abandoned): epsilon spent so far "
            f"{ledger.epsilon_spent():.4f}")


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

