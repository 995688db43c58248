"""``dpdro train``: single-node training (the clients in this process), with a progress display, Ctrl-C that
stops at an iteration boundary with a checkpoint, and ``--resume``."""

from __future__ import annotations

import argparse
import math
import os
import sys

from dpdro.common.partition import refuse_node_local

from . import shared

NAME = "train"
HELP = "train single-node (clients in this process)"
PIPED_EVERY = 10.0  # seconds between progress lines when stderr is not a terminal


def add_arguments(p: argparse.ArgumentParser) -> None:
    shared.add_config_arguments(p)
    p.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR with its saved config")


def run(args: argparse.Namespace) -> int:
    if not args.resume:
        cfg = shared.config_from_args(args)  # a configuration error answers before torch is imported
    from dpdro.launch.local import prepare_local
    from dpdro.server.engine import TrainingStopped, load_run_config, train

    if args.resume:
        cfg = load_run_config(args.resume).with_updates({"out-dir": args.resume})
        if args.overwrite:
            cfg = cfg.with_updates({"overwrite": True})
    refuse_node_local(cfg.partition)  # before any data is loaded
    with _CtrlC() as ctrl_c:
        try:
            transport, test_set = prepare_local(cfg, resume=bool(args.resume))  # out-dir, device, then the data
            close, progress = _progress_display(cfg.iterations, lambda: ctrl_c.requested, cfg.eval_split)
            try:
                result = train(cfg, transport, test_set, resume=bool(args.resume), progress=progress)
            finally:
                close()
        except TrainingStopped as e:
            print(_stopped_message(cfg.out_dir, e.iteration, e.iterations), file=sys.stderr)
            return e.exit_code
        except KeyboardInterrupt:  # a second Ctrl-C, or one before training started
            print(_stopped_message(cfg.out_dir), file=sys.stderr)
            return TrainingStopped.exit_code  # main() leaves with os._exit if a client thread was interrupted
    shared.print_summary(result.summary, cfg.out_dir, resumed=bool(args.resume))
    return 0


def _progress_display(total: int, stop_requested=lambda: False, split: str = "test"):
    """(close, Progress) of ``dpdro train``: on a terminal (stderr) a tqdm bar that starts at a resumed run's
    iteration, with the header, evaluation lines and notes above it; otherwise (piped, a log file) plain lines
    only, never carriage returns: the notes, one line per evaluation (naming ``split``, the split evaluated), and
    a progress line at most every PIPED_EVERY seconds."""
    import time

    from dpdro.server.engine import Progress, evaluation_line

    if not sys.stderr.isatty():
        last = [time.monotonic()]

        def on_step(t: int) -> None:
            if t == total or time.monotonic() - last[0] >= PIPED_EVERY:
                last[0] = time.monotonic()
                print(f"training: iteration {t} of {total}", file=sys.stderr, flush=True)

        def say(text: str) -> None:
            print(text, flush=True)

        def on_start(t: int) -> None:  # data loading and setup are not training: the interval starts here
            last[0] = time.monotonic()

        progress = Progress(on_start=on_start, on_step=on_step, on_eval=lambda row: say(evaluation_line(row, split)),
                            on_note=say, stop_requested=stop_requested)
        return (lambda: None), progress

    from tqdm import tqdm

    bar = tqdm(total=total, desc="training", unit="it", dynamic_ncols=True)

    def on_start(t: int) -> None:  # a resumed run starts at its checkpoint's iteration, not at 0
        bar.reset(total=total)
        bar.initial = bar.n = bar.last_print_n = t
        bar.refresh()

    def on_step(t: int) -> None:
        bar.update(t - bar.n)

    def on_eval(row: dict) -> None:
        eps = row["epsilon_spent"]
        shown = "inf" if eps == math.inf else f"{eps:.3f}"  # the last evaluation's, not the live spend
        bar.set_postfix_str(f"at iteration {row['iteration']}: eps={shown} acc={row['test_accuracy']:.4f} "
                            f"worst={row['worst_class_accuracy']:.4f}")
        bar.write(evaluation_line(row, split))

    return bar.close, Progress(on_start=on_start, on_step=on_step, on_eval=on_eval, on_note=bar.write,
                               stop_requested=stop_requested)


class _CtrlC:
    """SIGINT during training: the first Ctrl-C asks the engine to stop after the current iteration (it writes a
    checkpoint, then raises TrainingStopped); a second one stops at once (KeyboardInterrupt)."""

    def __init__(self) -> None:
        self.requested = False

    def __enter__(self):
        import signal

        def handler(signum, frame):
            if self.requested:
                raise KeyboardInterrupt
            self.requested = True
            print("\nCtrl-C: stopping after this iteration (a checkpoint is written); Ctrl-C again stops at once",
                  file=sys.stderr, flush=True)

        self._old = signal.signal(signal.SIGINT, handler)
        return self

    def __exit__(self, *exc) -> None:
        import signal

        signal.signal(signal.SIGINT, self._old)


def _stopped_message(out_dir: str, iteration: int | None = None, iterations: int | None = None) -> str:
    """The one line a stopped ``dpdro train`` prints: where it stopped and how to go on (or start again)."""
    from dpdro.server.rundir import RunDir, RunFileError

    rd = RunDir(out_dir)
    try:
        saved = int(rd.load_checkpoint()[1]["state"]["t"]) if rd.checkpoint.is_file() else None
    except (RunFileError, KeyError, TypeError, ValueError):
        saved = None
    where = f"at iteration {iteration} of {iterations}" if iteration is not None else "by Ctrl-C"
    if saved is None:
        return (f"dpdro: stopped {where}, before the first checkpoint: nothing to resume; start again with "
                f"--overwrite (out-dir {out_dir})")
    return f"dpdro: stopped {where}; checkpoint at iteration {saved}: resume with {_invoked()} train --resume {out_dir}"


def _invoked() -> str:
    """The dpdro command as the user typed it (e.g. .venv/bin/dpdro when the venv is not on PATH)."""
    typed = sys.argv[0] if sys.argv and sys.argv[0] else "dpdro"
    return typed if os.path.basename(typed) == "dpdro" else "dpdro"
