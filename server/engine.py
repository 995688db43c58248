"""The training engine: drives an algorithm's state machine over a transport, releases noised sums,
charges the ledger, evaluates, and writes the run directory.

``train`` plans a run (``server/run_plan.py``: model, algorithm, releases, calibrated noise) and trains the plan
(``train_plan``). Its parts: ``server/releaser.py`` executes each release (failure policy, ledger, noise, event),
``server/callbacks.py`` does everything else at fixed points of the loop (metrics.csv, progress, checkpoints, the
model's files, TensorBoard), ``server/summary.py`` writes what a finished run reports; this module holds the
training loop and resuming.

The same function runs single-node (``LocalTransport``) and on Flower (``FlowerTransport``): that is
what makes a federated run equal to a single-node one (docs/explanation/ARCHITECTURE.md sections 2-3).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from ..common.config import SEEDED_NOT_PRIVATE, Config, ConfigError, PrivacyConfig, keys_with_role
from ..common.data import ArrayDataset
from ..common.errors import DpdroError, Stopped
from ..common.feature_norm import apply_stats, channels
from ..common.noise_modes import noise_mode
from ..common.partition import is_node_local
from ..common.transport import Transport
from . import checkpoint_selection, node_evaluation
from . import setup as setup_releases
from .callbacks import Callback, TrainingRun, default_callbacks
from .convergence import rising_note, worst_slope
from .diagnostics import NoiseMonitor
from .evaluate import evaluate, node_of_records, worst_group_words
from .ledger import Ledger
from .memory import heap_mb, rss_mb
from .model_export import prediction_shift
from .node_sampling import ledger_node_rate
from .releaser import Releaser
from .run_plan import (  # noqa: F401  (MIN_PRIVATE_RECORDS, check_groups, follow_n, plan_run, resolve_delta:
    MIN_PRIVATE_RECORDS,  # re-exported for their callers)
    RunPlan,
    check_groups,
    check_records,
    follow_n,
    plan_run,
    plan_training,
    resolve_delta,
)
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
    if "test_accuracy_se" in row:  # eval-data=nodes: noisy counts, each figure with its standard error
        return f"iteration {row['iteration']:>6}  epsilon {eps_text}  {split} (on the nodes) " + \
            node_evaluation.metrics_text(row)
    group = worst_group_words(row, sep="  ")
    if "worst_node_accuracy" in row:  # dro-groups=node or site
        group += (f"  worst-node accuracy {row['worst_node_accuracy']:.4f} (spread "
                  f"{row['node_accuracy_spread']:.4f})")
    if "worst_site_accuracy" in row:  # dro-groups=site
        group += f"  worst-site accuracy {row['worst_site_accuracy']:.4f}"
    return (f"iteration {row['iteration']:>6}  epsilon {eps_text}  {split} accuracy {row['test_accuracy']:.4f}  "
            f"worst-class accuracy {row['worst_class_accuracy']:.4f}{group}")


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


def train(cfg: Config, transport: Transport, test: ArrayDataset, *, resume: bool = False,
          progress: Progress | None = None, transport_name: str = "local", module: nn.Module | None = None,
          callbacks: list[Callback] | None = None) -> RunResult:
    """Run (or, with ``resume``, continue) training as configured: plan it (``run_plan.plan_training``), then
    train the plan (``train_plan``) with the default callbacks (metrics.csv, ``progress``, checkpoints, TensorBoard
    when config key tensorboard is true, and the model's files, plots and card once it finishes) plus
    ``callbacks``.

    ``module``: an untrained ``nn.Module`` to train instead of the one config key ``model`` names (the Python
    API's ``model=``); validated like every model (ModelError for layers that mix records), trained from its
    own initial parameters.

    Raises ConfigError for a configuration the data cannot support (e.g. too few records: ``check_records``) or an
    out-dir that is not empty (without ``resume`` or config key overwrite; ``rundir.check_out_dir``), ResumeError
    for an unusable checkpoint, and ledger.PrivacyBudgetExceeded if a release would overspend (nothing is
    released then).
    """
    progress = progress or Progress()
    check_out_dir(cfg.out_dir, resume=resume, overwrite=cfg.overwrite)  # before calibration: nothing to lose
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    n = transport.num_records
    check_records(cfg, n)
    if resume:
        check_resumed_records(RunDir(cfg.out_dir), n)
    plan = plan_training(cfg, n, test.num_classes, test.num_groups, tuple(test.x.shape[1:]), module)
    cfg = plan.cfg  # batches left at a default above n follow it (``run_plan.follow_n``)
    everything = [*default_callbacks(cfg, progress), *(callbacks or [])]  # before any work: a missing TensorBoard
    if not cfg.private:
        log.warning("epsilon=inf: NOT PRIVATE (no clipping, no noise)")
    elif cfg.noise_from_saved_seed:
        log.warning("reproducible=true with reproducible-for-testing=true: %s (seed %d is saved in summary.json: "
                    "anyone with the run folder can subtract the noise)", SEEDED_NOT_PRIVATE, cfg.seed)
    if cfg.private:
        for warning in noise_mode(cfg.noise_mode).check(cfg, plan.noise, transport.largest_shard, plan):
            log.warning("%s", warning)
    for text in plan.notes:
        _note(progress, text)
    _note(progress, plan_line(n, plan.delta, plan.noise))
    for warning in plan.algo.regime_warnings(plan.noise):
        log.warning("%s", warning)
    return train_plan(plan, transport, test, everything, resume=resume, transport_name=transport_name,
                      progress=progress)


def train_plan(plan: RunPlan, transport: Transport, test: ArrayDataset, callbacks: list[Callback], *,
               resume: bool = False, transport_name: str = "local", progress: Progress | None = None) -> RunResult:
    """Train ``plan`` over ``transport``, evaluating on ``test``: create the run directory, make the setup releases
    (or resume from the checkpoint), then release and update until the plan's last iteration, calling
    ``callbacks`` (server/callbacks.py: ``default_callbacks`` for what every run writes) at each point; write
    summary.json and final_params.npy. ``progress`` receives the note of a resumed run's charged releases.

    Raises ResumeError for an unusable checkpoint, ledger.PrivacyBudgetExceeded if a release would overspend
    (nothing is released then) and TrainingStopped when a callback asked to stop (after a checkpoint)."""
    progress = progress or Progress()
    run, lost = _start(plan, transport, test, resume, transport_name)
    try:
        if resume:
            _restore_releaser(run, lost, progress)
        for cb in callbacks:
            cb.on_start(run)
        if not run.rows:
            _evaluated(run, callbacks)
        _iterate(run, callbacks)
        _finish(run, callbacks, transport_name)
    finally:
        for cb in callbacks:
            cb.close()
    return RunResult(params=run.params, summary=run.summary, metrics=run.rows)


def _start(plan: RunPlan, transport: Transport, test: ArrayDataset, resume: bool, transport_name: str
           ) -> tuple[TrainingRun, list[dict]]:
    """The run before its first iteration, and the events of releases made after the checkpoint it resumes from
    ([] for a new run): the ledger, the run directory (config.json with ``RUN_FACTS``), the releaser, and the
    setup releases with the algorithm's start state (or the checkpoint's state, rows and setup)."""
    cfg, algo = plan.cfg, plan.algo
    ledger = Ledger(plan.releases, plan.noise, cfg.epsilon, plan.delta, cfg.accountant,
                    ledger_node_rate(cfg.privacy_unit, cfg.node_sampling_rate), plan.ddg)
    rd = RunDir(cfg.out_dir)
    rd.create()
    x0 = plan.model.initial().double().numpy()
    releaser = Releaser(cfg, transport, ledger, plan.n, rd)
    rows: list[dict] = []
    wall_before, lost = 0.0, []
    start = time.perf_counter()
    selected = None
    if resume:
        state, rows, wall_before, setup, lost, selected = _resume(rd, cfg, algo, ledger, algo.init_state(x0))
    else:
        rd.clear()  # empty unless overwrite was asked for (check_out_dir)
        facts = (plan.delta, plan.n, transport_name, software_versions(), test.source or None)
        write_json(rd.config, {**cfg.to_dict(), **dict(zip(RUN_FACTS, facts, strict=True))})
        setup = setup_releases.release_all(releaser, cfg, x0, plan.n, test.num_classes, test.num_groups,
                                           channels(plan.model.module))
        state = algo.start_state(x0, setup.eta0, setup.dro_priors(cfg))
    releaser.offset = setup.offset(cfg.tau)
    if setup.feature_stats is not None:  # the released channel statistics: every query carries them to the nodes
        releaser.feature_norm = setup.feature_stats
        apply_stats(plan.model.module, setup.feature_stats)
    run = TrainingRun(plan, rd, test, releaser, setup, state, rows, resume,
                      wall=lambda: wall_before + time.perf_counter() - start, selected=selected)
    return run, lost


def _eval_row(run: TrainingRun, x: np.ndarray) -> dict:
    """The metrics row of the run's current output ``x`` (d,) (metrics.csv): test metrics with the prediction shift,
    the algorithm's extras and diagnostics, the noise monitor's window, epsilon spent, wall time and memory. With
    ema-decay > 0 and evaluation on the server, also the last iterate's accuracy and worst-class accuracy
    (``last_iterate_*``): the same trajectory with and without the average, a paired comparison at no privacy cost."""
    algo, releaser = run.plan.algo, run.releaser
    shift = prediction_shift(run.cfg.training, run.setup)
    if node_evaluation.evaluates_on_nodes(run.cfg):  # a charged release of the nodes' noisy counts
        metrics = node_evaluation.evaluate_on_nodes(releaser, run.state.t, x, run.test.num_classes, shift)
        extras = {}
    else:
        node_of = _test_nodes(run)
        metrics = evaluate(run.plan.model, x, run.test, run.cfg.training, shift, node_of=node_of,
                           num_nodes=run.cfg.num_clients, num_sites=run.cfg.num_sites)
        extras = algo.eval_extras(run.state, metrics.pop("losses"))
        if "eval_dro_objective" not in algo.spec.reports:  # F of key psi: only for the methods that optimise it
            metrics.pop("eval_dro_objective")
        if run.cfg.ema_decay > 0:
            extras.update(_last_iterate_figures(run, shift))
    return {"iteration": run.state.t, "epsilon_spent": releaser.ledger.epsilon_spent(), **metrics,
            **extras, **algo.diagnostics(run.state),
            **releaser.monitor.take_window(), "wall_seconds": run.wall(), "server_rss_mb": rss_mb(),
            "server_heap_mb": heap_mb()}


def _last_iterate_figures(run: TrainingRun, shift) -> dict:
    """Accuracy and worst-class accuracy of the last iterate x_t (the algorithm's ``output``, not the average that
    ema-decay returns), on the server's own evaluation split: no release (no per-node figures: only these two are
    kept)."""
    last, _ = run.plan.algo.output(run.state)
    m = evaluate(run.plan.model, last, run.test, run.cfg.training, shift)
    return {"last_iterate_accuracy": m["test_accuracy"], "last_iterate_worst_class_accuracy": m["worst_class_accuracy"]}


def _test_nodes(run: TrainingRun) -> np.ndarray | None:
    """Each evaluation record's node (server/evaluate.node_of_records) when the run's DRO groups are made of nodes
    (dro-groups=node or site) and the server evaluates a centrally partitioned split; else None (no per-node figures:
    with partition=node-local the server holds no node's records). The server's own split: no release."""
    cfg = run.cfg
    if not cfg.node_groups or is_node_local(cfg.partition):
        return None
    return node_of_records(cfg.data, run.test.y.numpy())


def _evaluated(run: TrainingRun, callbacks: list[Callback]) -> None:
    """Evaluate now: append the row, offer the evaluated iterate to checkpoint-select=private-best
    (server/checkpoint_selection.py: post-processing of the row's noisy counts) and hand the row to every
    callback."""
    x, _ = run.plan.algo.returned(run.state)
    run.rows.append(_eval_row(run, x))
    if run.cfg.checkpoint_select == "private-best":
        run.selected = checkpoint_selection.offer(run.selected, run.rows[-1], x)
    for cb in callbacks:
        cb.on_eval(run, run.rows[-1])


def _iterate(run: TrainingRun, callbacks: list[Callback]) -> None:
    """Release and update until the plan's last iteration, evaluating every eval-every iterations and at the end;
    raises TrainingStopped after the iteration at which a callback asked to stop."""
    cfg, algo, releaser = run.cfg, run.plan.algo, run.releaser
    while run.state.t < cfg.iterations:
        t_before = run.state.t
        released = releaser.run(algo.queries(run.state), algo.versions(run.state))
        run.state = algo.advance(run.state, released)  # apply() under the step-size warm-up
        if run.state.t == t_before:
            continue
        for cb in callbacks:
            cb.on_step(run)
        done = run.state.t >= cfg.iterations
        if run.state.t % cfg.eval_every == 0 or done:
            _evaluated(run, callbacks)
        stop = not done and any([cb.stop_requested(run) for cb in callbacks])
        for cb in callbacks:
            cb.on_iteration_end(run, done, stop)
        if stop:
            raise TrainingStopped(run.state.t, cfg.iterations, str(run.rd.path))


def _finish(run: TrainingRun, callbacks: list[Callback], transport_name: str) -> None:
    """The finished run's outputs: the released iterate (``run.params``), summary.json (``run.summary``, with the
    noise monitor's SPIDER summary and the worst class's trend) and final_params.npy; then ``on_end``."""
    cfg, plan, releaser, rows = run.cfg, run.plan, run.releaser, run.rows
    releaser.monitor.close()
    spider = releaser.monitor.summary()
    if spider["phases_noise_dominated"]:
        log.warning("%d of %d SPIDER phases ended with more noise from their differences than from their refresh "
                    "(the differences only added noise): lower clip-diff / clip-diff-max or q, or raise "
                    "diff-batch", spider["phases_noise_dominated"], spider["phases"])
    run.params, _ = plan.algo.returned(run.state)
    final = rows[-1]
    if run.selected is not None:  # checkpoint-select=private-best: the chosen iterate, its (noisy) figures
        run.params = run.selected.params
        chosen = next(r for r in rows if int(r["iteration"]) == run.selected.iteration)
        final = {**chosen, "epsilon_spent": rows[-1]["epsilon_spent"]}
    run.summary = run_summary(cfg, n=plan.n, delta=plan.delta, plan=plan.releases, noise=plan.noise,
                              profiles=plan.profiles, ledger=releaser.ledger, releaser=releaser, final=final,
                              setup=run.setup, spider=spider, wall_seconds=run.wall(), transport_name=transport_name,
                              skipped_files=run.test.skipped_files, initial_model=plan.initial.facts())
    rising = rising_note(rows, cfg.iterations, cfg.eval_split)
    run.summary.update(worst_rising_slope=worst_slope(rows, cfg.iterations), worst_still_rising=rising,
                       checkpoint_returned=checkpoint_selection.returned(
                           cfg, rows, run.selected, node_evaluation.evaluations_epsilon(releaser.ledger, plan.delta)))
    if rising:
        log.info("%s", rising)
    write_json(run.rd.summary, run.summary)
    np.save(run.rd.path / "final_params.npy", run.params)
    for cb in callbacks:
        cb.on_end(run)


def _restore_releaser(run: TrainingRun, lost: list[dict], progress: Progress) -> None:
    """What the releases so far left behind in the releaser of a resumed run (its server view and noise monitor),
    and the charge of the releases made after the checkpoint (``charge_lost_releases``)."""
    cfg, rd, releaser = run.cfg, run.rd, run.releaser
    saved = rd.load_checkpoint()[1]
    initial = run.plan.initial
    if saved.get("init_weights_sha256", initial.sha256) != initial.sha256:
        raise ResumeError(f"config key 'init-weights': {cfg.init_weights} now has sha256 {initial.sha256}; the "
                          f"checkpoint in {rd.path} started from a file with sha256 "
                          f"{saved['init_weights_sha256']}: resume with that file")
    seen = saved.get("server_view", [])
    # checkpoints before the server view was a Ledger hold only its (rate, z) counts
    releaser.server_ledger.load_state(seen if isinstance(seen, dict) else {"spent": {}, "extra": seen})
    releaser.monitor = NoiseMonitor.from_state(saved.get("noise_monitor", {}))
    done = rd.read_events(warn=False) if releaser.ledger.ddg is not None and rd.events.exists() else []
    for e in done:  # the bits per coordinate of the DDG releases so far (summary.json)
        if "ddg_bits" in e:
            releaser.ddg_bits[e["mechanism"]] = max(releaser.ddg_bits.get(e["mechanism"], 0), int(e["ddg_bits"]))
    charged = charge_lost_releases(lost, releaser.ledger, releaser.server_ledger, cfg.privacy, run.state.t)
    if charged:
        log.warning("%s", charged)
        progress.on_note(charged)
    _note(progress, f"resuming {rd.path} at iteration {run.state.t} of {cfg.iterations} (epsilon spent so far "
                    f"{releaser.ledger.epsilon_spent():.4f})")


def _resume(rd: RunDir, cfg: Config, algo, ledger: Ledger, fresh_state):
    """(state, metric rows, wall seconds so far, SetupResult, events made after it, the iterate chosen so far
    by checkpoint-select=private-best or None) of the checkpoint in ``rd``."""
    if not rd.checkpoint.exists():
        raise ResumeError(f"no checkpoint at {rd.checkpoint}: nothing to resume")
    arrays, meta = rd.load_checkpoint()
    try:
        saved = Config.from_mapping(meta["config"], warn=False).to_dict()
    except (KeyError, TypeError, ConfigError) as e:
        raise RunFileError(f"checkpoint {rd.checkpoint} holds no valid configuration ({e}): it cannot be resumed; "
                           "start again with --overwrite (or in a new out-dir)") from None
    if _comparable(saved) != _comparable(cfg.to_dict()):
        diff = sorted(k for k in _comparable(saved) if saved[k] != cfg.to_dict().get(k))
        raise ResumeError(f"checkpoint in {rd.path} was written by another configuration (differs in: "
                          f"{', '.join(diff)}); resume with the run's own config.json")
    if node_evaluation.evaluates_on_nodes(cfg) and saved.get("eval-every") != cfg.eval_every:
        raise ResumeError(f"config key 'eval-every': got {cfg.eval_every}; the run in {rd.path} was planned with "
                          f"eval-every = {saved.get('eval-every')}, and with eval-data=nodes (or checkpoint-select="
                          "private-best) every evaluation is a planned, charged release: resume with the run's own "
                          "eval-every")
    chosen = arrays.pop(checkpoint_selection.PARAMS_KEY, None)  # private-best's chosen iterate, not the state's
    try:
        state = type(fresh_state).from_arrays(arrays, meta["state"])
        ledger.load_state(meta["ledger"])
        rows, wall_before = list(meta["metrics"]), float(meta["wall_seconds"])
    except (KeyError, TypeError, ValueError) as e:
        raise RunFileError(f"checkpoint {rd.checkpoint} is incomplete ({type(e).__name__}: {e}): it cannot be "
                           "resumed; start again with --overwrite (or in a new out-dir)") from None
    selected = None
    if cfg.checkpoint_select == "private-best":
        try:
            selected = checkpoint_selection.from_checkpoint(chosen, meta, rows, str(rd.checkpoint))
        except checkpoint_selection.SelectionResumeError as e:
            raise ResumeError(str(e)) from None
    lost = rd.journal_since(meta.get("events_covered"), state.t)
    setup = setup_releases.SetupResult.from_json(meta.get("setup", {}))
    return state, rows, wall_before, setup, lost, selected


def charge_lost_releases(lost: list[dict], ledger: Ledger, server_ledger: Ledger, privacy: PrivacyConfig,
                         checkpoint_t: int) -> str | None:
    """Charge, on both ledgers, the releases made after the checkpoint a run resumes from (``lost``: events of
    ``RunDir.journal_since``): they were made, their values may have been seen (evaluation lines, the server in
    distributed and local noise modes), and the resumed run makes its own releases for those iterations again.

    Returns the note to show when there were any (None otherwise). Raises ResumeError, releasing nothing, when
    the releases so far plus the rest of the plan would spend more than the target epsilon.
    """
    released = [e for e in lost if not e.get("discarded")]
    for e in released:  # a DDG release missing shares (ddg-shortfall=charge) was charged at its smaller multiplier
        ledger.record(float(e["rate"]), float(e.get("charged_noise_multiplier", e["noise_multiplier"])))
    for e in lost:  # what the server saw: 0 (no noise) in central mode
        server_ledger.record(float(e["rate"]), float(e.get("server_view_multiplier", 0.0)))
    if not released:
        return None
    last = max(e["iteration"] for e in released)
    span = f"iteration {last}" if last == checkpoint_t else f"iterations {checkpoint_t}-{last}"
    # in distributed and local mode the server's own ledger must fit too (its guard would stop the run later)
    trusted = noise_mode(privacy.noise_mode).trusts_server
    checked = [("", ledger)] + ([] if trusted else [(" against the server", server_ledger)])
    for against, book in checked:
        completed = book.epsilon_if_completed()
        if ledger.private and completed > book.epsilon:
            raise ResumeError(
                f"{len(released)} release(s) of {span} were made after the last checkpoint "
                f"(iteration {checkpoint_t}) by the run that stopped without one; they are charged, and with them "
                f"finishing the plan would spend epsilon{against} {completed:.4f} > target "
                f"{privacy.epsilon:g} (spent so far: {book.epsilon_spent():.4f}). Nothing was released. The checkpoint "
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
        return Config.from_mapping(keys, warn=False).with_updates({"overwrite": False})  # saved: warned at start
    except ConfigError as e:
        raise RunFileError(f"{path}: {e}; restore the file, or start the run again in a new out-dir") from None

