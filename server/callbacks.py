"""What a training run does besides releasing and updating: callbacks the engine calls at fixed points.

``server/engine.py``'s loop releases, updates the algorithm's state, charges the ledger and evaluates; everything
else it hands to its callbacks, in list order: writing metrics.csv (``MetricsFile``), reporting to the CLI
(``ProgressReport``), checkpoints (``Checkpoints``), the trained model's files (``ModelExport``) and, switched on by
config key ``tensorboard``, TensorBoard scalars (``TensorBoardScalars``). ``default_callbacks`` is the list every
run has. A callback sees the run (``TrainingRun``) and only post-processes released values: it never releases.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..common.config import Config, ConfigError
from . import checkpoint_selection
from .model_export import write_model_outputs

if TYPE_CHECKING:
    from ..common.data import ArrayDataset
    from .releaser import Releaser
    from .run_plan import RunPlan
    from .rundir import RunDir


@dataclass
class TrainingRun:
    """The state of a run as the callbacks see it: its ``plan``, run directory ``rd``, evaluation data ``test``,
    ``releaser`` (with its ledgers and noise monitor), ``setup`` (the releases before training), the algorithm's
    ``state`` (``state.t`` the iteration), the metrics ``rows`` so far, ``resumed`` (continued from a checkpoint),
    ``wall`` (seconds of training so far, earlier sessions included), ``selected`` (checkpoint-select=private-best:
    the evaluated iterate chosen so far, ``checkpoint_selection.Selected``; None otherwise) and, once the run
    finished, ``params`` (the released iterate, (d,) float64: the chosen one under private-best) and ``summary``."""

    plan: RunPlan
    rd: RunDir
    test: ArrayDataset
    releaser: Releaser
    setup: Any
    state: Any
    rows: list[dict]
    resumed: bool
    wall: Callable[[], float]
    params: Any = None
    selected: Any = None
    summary: dict = field(default_factory=dict)

    @property
    def cfg(self) -> Config:
        return self.plan.cfg


class Callback:
    """Base of the engine's callbacks; every hook does nothing unless overridden.

    on_start(run): once before the first iteration (``run.state.t`` > 0 when resuming).
    on_step(run): after each iteration.
    on_eval(run, row): after each evaluation (``row`` is ``run.rows[-1]``, the metrics dict).
    stop_requested(run): asked after each iteration but the last; True stops the run after ``on_iteration_end``.
    on_iteration_end(run, done, stop): after each iteration, once ``done`` (the last one) and ``stop`` are known.
    on_end(run): after summary.json and final_params.npy of a finished run are written.
    close(): always, last (also when the run fails or stops).
    """

    def on_start(self, run: TrainingRun) -> None:
        pass

    def on_step(self, run: TrainingRun) -> None:
        pass

    def on_eval(self, run: TrainingRun, row: dict) -> None:
        pass

    def stop_requested(self, run: TrainingRun) -> bool:
        return False

    def on_iteration_end(self, run: TrainingRun, done: bool, stop: bool) -> None:
        pass

    def on_end(self, run: TrainingRun) -> None:
        pass

    def close(self) -> None:
        pass


class MetricsFile(Callback):
    """Rewrites metrics.csv (atomically) after each evaluation."""

    def on_eval(self, run: TrainingRun, row: dict) -> None:
        run.rd.write_metrics(run.rows)


class ProgressReport(Callback):
    """Forwards to a ``Progress`` (the CLI's lines and its Ctrl-C request)."""

    def __init__(self, progress) -> None:
        self.progress = progress

    def on_start(self, run: TrainingRun) -> None:
        self.progress.on_start(run.state.t)

    def on_step(self, run: TrainingRun) -> None:
        self.progress.on_step(run.state.t)

    def on_eval(self, run: TrainingRun, row: dict) -> None:
        self.progress.on_eval(row)

    def stop_requested(self, run: TrainingRun) -> bool:
        return self.progress.stop_requested()


class Checkpoints(Callback):
    """Writes checkpoint/state.npz after the first iteration (a run stopped early can be resumed), every
    checkpoint-every iterations, the last one and one at which the run stops."""

    def on_iteration_end(self, run: TrainingRun, done: bool, stop: bool) -> None:
        t, every = run.state.t, run.cfg.checkpoint_every
        if done or stop or t == 1 or (every and t % every == 0):
            write_checkpoint(run)


def write_checkpoint(run: TrainingRun) -> None:
    """Save what resuming needs: the state, the ledgers, the metrics so far, the setup, the noise monitor and the
    iterate chosen so far (checkpoint-select=private-best)."""
    arrays, scalars = run.state.to_arrays()
    releaser, plan = run.releaser, run.plan
    arrays = {**arrays, **checkpoint_selection.checkpoint_arrays(run.selected)}
    run.rd.save_checkpoint(arrays, {**checkpoint_selection.checkpoint_meta(run.selected),
                                    "config": run.cfg.to_dict(), "state": scalars, "ledger": releaser.ledger.state(),
                                    "metrics": run.rows, "wall_seconds": run.wall(), "noise": plan.noise,
                                    "setup": run.setup.to_json(), "server_view": releaser.server_ledger.state(),
                                    "noise_monitor": releaser.monitor.state(), "events_covered": run.rd.event_count(),
                                    "init_weights_sha256": plan.initial.sha256})


class ModelExport(Callback):
    """A finished run's model.pt, model.json, plots/ and MODEL_CARD.md (``model_export.write_model_outputs``)."""

    def on_end(self, run: TrainingRun) -> None:
        write_model_outputs(run)


TENSORBOARD_DIR = "tensorboard"  # under the run directory


class TensorBoardScalars(Callback):
    """Config key tensorboard=true: every numeric metric of each evaluation as a TensorBoard scalar (step: the
    iteration) in <out-dir>/tensorboard, written with torch.utils.tensorboard. A fresh run starts the folder anew;
    a resumed one adds to it. Raises ConfigError naming the key when the tensorboard package is missing."""

    def __init__(self, cfg: Config) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise ConfigError(f"config key 'tensorboard': got true, but TensorBoard cannot be imported ({e}); install "
                              "it (pip install 'dpdro[tensorboard]') or set tensorboard=false") from None
        self.writer_class = SummaryWriter
        self.writer = None

    def on_start(self, run: TrainingRun) -> None:
        path = run.rd.path / TENSORBOARD_DIR
        if not run.resumed:
            shutil.rmtree(path, ignore_errors=True)  # a replaced run's curves are not this run's
        self.writer = self.writer_class(log_dir=str(path))

    def on_eval(self, run: TrainingRun, row: dict) -> None:
        step = int(row["iteration"])
        for key, value in row.items():
            if key != "iteration" and isinstance(value, (int, float)) and not isinstance(value, bool) \
                    and math.isfinite(value):
                self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def default_callbacks(cfg: Config, progress) -> list[Callback]:
    """The callbacks of every run, in the order they are called: metrics.csv, the progress report, checkpoints,
    TensorBoard when config key tensorboard is true, and the model's files at the end."""
    tensorboard = [TensorBoardScalars(cfg)] if cfg.tensorboard else []
    return [MetricsFile(), ProgressReport(progress), Checkpoints(), *tensorboard, ModelExport()]
