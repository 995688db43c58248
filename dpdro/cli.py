"""The ``dpdro`` command line.

    dpdro train [--config FILE.toml] [--set key=value ...]    single-node training (in-process clients)
    dpdro train --resume RUN_DIR                              continue a stopped run with its saved config
    dpdro train|simulate|deploy --overwrite ...               replace the run in a non-empty out-dir (refused
                                                              without it, before any work)
    dpdro simulate [--config FILE.toml] [--set key=value ...] the same run on Flower's simulation engine
    dpdro keys                                                every configuration key with default and help
    dpdro predict --run RUN_DIR [--data test|PATH] [--out F]   predictions of the run's model (model.pt) as CSV
    dpdro evaluate --run RUN_DIR [--data test|PATH]           accuracy, worst-class accuracy, confusion matrix PNG
                                                              (on --data train|validation: "not private (reads
                                                              private records)", nothing written without --out)
    dpdro export --run RUN_DIR [--format onnx] [--out F]      the model as ONNX (optional extra dpdro[onnx])
    dpdro tune --dataset D [--epsilon E] [--trials N]         Optuna search per method on a validation split
    dpdro noise-modes [--iterations N]                        central / distributed / local noise on Flower
    dpdro hazards [--seeds ...]                               one-factor changes of the tuned DP-DRO configs
    dpdro bench [--quick] [--device cuda]                     performance ratios; writes docs/research/PERFORMANCE.md
    dpdro certs create --out DIR [--nodes N | --node NAME ...] [--host H ...] [--force]   CA, SuperLink TLS
                                                              certificate, SuperNode authentication keys
    dpdro certs add-node --out DIR NAME                       one more SuperNode key pair
    dpdro deploy [--config FILE.toml] [--set key=value ...]   the run on a loopback deployment (TLS + node auth)

Exit status: 0 on success, 2 for a configuration or data error (message on stderr), 1 otherwise.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from dpdro.common.config import (
    FIELDS,
    SEEDED_NOT_PRIVATE,
    Config,
    ConfigError,
    check_device,
    load_toml_keys,
    parse_set_args,
)


def _load_toml(path: str) -> dict[str, Any]:
    return load_toml_keys(path)


def config_from_args(args: argparse.Namespace) -> Config:
    """Config from --config FILE then --set overrides; raises ConfigError."""
    values: dict[str, Any] = {}
    if args.config:
        values.update(_load_toml(args.config))
    values.update(parse_set_args(args.set or []))
    return Config.from_mapping(values)


PIPED_EVERY = 10.0  # seconds between progress lines when stderr is not a terminal


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


def _refuse_node_local(cfg: Config) -> None:
    """ConfigError for partition='node-local' in a command whose clients share one data set (train, simulate)."""
    if cfg.partition == "node-local":
        from dpdro.common.partition import NODE_LOCAL_ONLY_DEPLOYED

        raise ConfigError(NODE_LOCAL_ONLY_DEPLOYED)


def cmd_train(args: argparse.Namespace) -> int:
    if not args.resume:
        cfg = config_from_args(args)  # a configuration error answers before torch is imported
    from dpdro.launch.local import prepare_local
    from dpdro.server.engine import TrainingStopped, load_run_config, train

    if args.resume:
        cfg = load_run_config(args.resume).with_updates({"out-dir": args.resume})
    if args.overwrite:
        cfg = cfg.with_updates({"overwrite": True})
    _refuse_node_local(cfg)  # before any data is loaded
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
            return 130
        except KeyboardInterrupt:  # a second Ctrl-C, or one before training started
            print(_stopped_message(cfg.out_dir), file=sys.stderr)
            return 130  # main() leaves with os._exit if a client thread was interrupted mid-round
    _print_summary(result.summary, cfg.out_dir, resumed=bool(args.resume))
    return 0


def _check_out(args: argparse.Namespace) -> None:
    """ConfigError naming --out when it is an existing folder (it names the file to write), before any work."""
    if args.out and Path(args.out).is_dir():
        raise ConfigError(f"--out {args.out}: is a folder; allowed: the path of the file to write")


def cmd_predict(args: argparse.Namespace) -> int:
    """``dpdro predict``: the predictions CSV at --out, else RUN/predictions_<data>.csv; on a private split
    (train, validation) the line says NOT_PRIVATE and nothing is written without --out."""
    from dpdro.server import prediction as pr

    _check_out(args)
    p = pr.predict(args.run, args.data, parse_set_args(args.set or []), posthoc_tau=args.posthoc_tau)
    acc = pr.accuracy(p)
    what = (f"{len(p.predicted)} predictions ({args.data}, "
            + ("unlabelled" if acc is None else f"accuracy {acc:.4f} against its labels") + ")")
    private = p.privacy == pr.NOT_PRIVATE
    if private and not args.out:
        print(f"{what}: {pr.NOT_PRIVATE}; nothing written (the run directory gets nothing derived from private "
              "records; --out FILE writes them to FILE)")
        return 0
    out = Path(args.out) if args.out else Path(args.run) / f"predictions_{pr.data_label(args.data)}.csv"
    pr.write_predictions_csv(p, out)
    print(f"{what} written to {out}" + (f"; {pr.NOT_PRIVATE}" if private else ""))
    return 0


def cmd_evaluate(args: argparse.Namespace) -> int:
    """``dpdro evaluate``: accuracy, worst-class and per-class accuracy and the confusion matrix PNG (--out, else
    RUN/plots/confusion_<data>.png); on a private split (train, validation) the first line says NOT_PRIVATE and
    no PNG is written without --out."""
    from dpdro.server.prediction import NOT_PRIVATE, metrics, predict, write_confusion_png

    _check_out(args)
    taus = args.posthoc_tau or []
    if len(taus) > 1:
        return _evaluate_posthoc_taus(args, taus)
    if len(args.run) > 1:
        raise ConfigError(f"--run: got {len(args.run)} run directories; allowed: one, or several with several "
                          "--posthoc-tau values (to choose one tau for them all)")
    run = args.run[0]
    p = predict(run, args.data, parse_set_args(args.set or []), posthoc_tau=taus[0] if taus else None)
    m = metrics(p)
    png = _confusion_path(args, run)
    if png is not None:
        write_confusion_png(p, m, png, args.data)
    classes = p.spec.classes
    tau = f" (post-hoc tau {p.spec.posthoc_tau:g})" if taus else ""
    private = f"; {NOT_PRIVATE}" if m["privacy"] == NOT_PRIVATE else ""
    print(f"data {args.data}{tau}: {m['records']} records, accuracy {m['accuracy']:.4f}, worst-class accuracy "
          f"{m['worst_class_accuracy']:.4f} (class {classes[m['worst_class']]})"
          + (f", worst-group accuracy {m['worst_group_accuracy']:.4f}" if "worst_group_accuracy" in m else "")
          + private)
    print("per-class accuracy: " + ", ".join(f"{c} {a:.4f}" for c, a in zip(classes, m["per_class_accuracy"],
                                                                           strict=True)))
    print(f"confusion matrix: {png if png is not None else _NOT_WRITTEN}")
    return 0


# What evaluate prints instead of a confusion matrix's path for private records without --out.
_NOT_WRITTEN = ("not written (derived from private records: the run directory gets nothing of them; --out FILE.png "
                "writes it to FILE.png)")


def _confusion_path(args: argparse.Namespace, run: str) -> Path | None:
    """Where ``dpdro evaluate`` writes the confusion matrix of ``run``: --out, else RUN/plots/confusion_<data>.png;
    None (not written) for a private split (train, validation) without --out."""
    from dpdro.server.prediction import data_label, reads_private_records

    if args.out:
        return Path(args.out)
    return None if reads_private_records(args.data) else Path(run) / "plots" / f"confusion_{data_label(args.data)}.png"


def _evaluate_posthoc_taus(args: argparse.Namespace, taus: list[float]) -> int:
    """``dpdro evaluate --posthoc-tau T1 T2 ... [--run R1 R2 ...]``: one line per tau (each model runs once) and
    the tau the tuning score chooses among those with accuracy >= --min-accuracy
    (``simulations.objective.choose_by_terms``); with several runs (e.g. one configuration's seeds) each line is
    the mean of their terms (``mean_terms``, as ``dpdro tune`` scores a candidate over its seeds) and one tau is
    chosen for them all. Each run's confusion matrix at the chosen tau (on a private split only with --out).
    Applying a tau is post-processing; choosing it on --data validation (or train) reads private records: the
    lines say NOT_PRIVATE and how a run of the choice lists it as not accounted."""
    from dpdro.server.prediction import NOT_PRIVATE, metrics, predict_posthoc_taus, write_confusion_png
    from dpdro.simulations.objective import choose_by_terms, evaluation_terms, mean_terms

    if not 0.0 <= args.min_accuracy <= 1.0:
        raise ConfigError(f"--min-accuracy: got {args.min_accuracy}; allowed: [0, 1]")
    if args.out and len(args.run) > 1:
        raise ConfigError(f"--out: got {args.out!r} with {len(args.run)} runs; allowed: only with one --run (each "
                          "run's confusion matrix goes to its plots/ folder)")
    overrides = parse_set_args(args.set or [])
    preds = [predict_posthoc_taus(run, args.data, taus, overrides) for run in args.run]
    rows = [[metrics(p) for p in run_preds] for run_preds in preds]  # [run][tau]
    terms = [mean_terms([evaluation_terms(r[i], "accuracy") for r in rows]) for i in range(len(taus))]
    unit = "group" if "per_group_accuracy" in rows[0][0] else "class"
    mean = f"mean over {len(args.run)} runs; " if len(args.run) > 1 else ""
    private = rows[0][0]["privacy"] == NOT_PRIVATE
    cost = NOT_PRIVATE if private else "no budget"
    print(f"data {args.data}: {rows[0][0]['records']} records; {mean}post-hoc tau on the run's released priors "
          f"({cost})")
    for tau, (worst, two_lowest, acc) in zip(taus, terms, strict=True):
        print(f"  tau {tau:g}: accuracy {acc:.4f}, worst-{unit} accuracy {worst:.4f}, two lowest {two_lowest:.4f}")
    chosen = choose_by_terms(terms, args.min_accuracy)
    if chosen is None:
        print(f"chosen: none (no tau reaches accuracy {args.min_accuracy:g})")
        return 1
    pngs = [_confusion_path(args, run) for run in args.run]
    for run_preds, run_rows, png in zip(preds, rows, pngs, strict=True):
        if png is not None:
            write_confusion_png(run_preds[chosen], run_rows[chosen], png, args.data)
    caution = " (this is the test split: choose on validation, never here)" if args.data == "test" else ""
    if private:
        caution = (" (chosen on private records: not accounted; a run with this tau lists it under not_accounted "
                   "with config key chosen-on-private-data = \"posthoc-tau\")")
    written = ", ".join(str(png) for png in pngs if png is not None) or _NOT_WRITTEN
    print(f"chosen: tau {taus[chosen]:g} (worst, then the two lowest, then accuracy; among accuracy >= "
          f"{args.min_accuracy:g}){caution}; confusion matrix: {written}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from dpdro.server.onnx_export import export_onnx  # torch-free: a missing extra is named before torch loads

    path = export_onnx(args.run, args.out)
    print(f"ONNX model written to {path} (input 'input' (batch, *input_shape); outputs 'logits' and 'predicted', "
          "the run's prediction)")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    """Print the privacy plan of a configuration without training: every release kind with its count, sampling
    rate and calibrated noise multiplier, delta, and the planned epsilon under both accountants. Loads the
    training split only to count its records (n, public: fixed by the unit of privacy)."""
    cfg = config_from_args(args)  # a configuration error answers before torch is imported
    from dpdro.client.local_transport import LocalTransport
    from dpdro.common.data import load_from_config
    from dpdro.common.model_init import prepare_model
    from dpdro.common.models import make_model, resolve_model
    from dpdro.common.per_sample import FlatModel
    from dpdro.server.algorithms import make_algorithm
    from dpdro.server.engine import check_groups, check_records, follow_n, plan_run, resolve_delta
    from dpdro.server.ledger import epsilon_of
    from dpdro.server.release import check_distributed

    train_set = load_from_config(cfg, train=True)
    check_groups(cfg, train_set.num_groups)
    transport = LocalTransport(cfg, train_set)
    n = transport.num_records
    check_records(cfg, n)
    cfg, fitted = follow_n(cfg, n)  # the batches the run would use
    for text in fitted:
        print(text)
    module = make_model(resolve_model(cfg.model, cfg.dataset), train_set.num_classes, cfg.seed,
                        input_shape=tuple(train_set.x.shape[1:]), fix=cfg.model_fix)
    prepare_model(module, cfg.init_weights, cfg.trainable)  # the ledger's dimension: the trainable parameters
    dim = FlatModel(module).dim
    delta = resolve_delta(cfg, n)
    plan, noise, _ = plan_run(cfg, make_algorithm(cfg, n, dim, train_set.num_classes, train_set.num_groups), n,
                              delta)
    if cfg.private and cfg.noise_mode == "distributed":
        for warning in check_distributed(cfg, noise, transport.largest_shard):
            logging.getLogger(__name__).warning("%s", warning)
    print(f"{cfg.algorithm} on {cfg.dataset}: n = {n} training records, {cfg.iterations} iterations, "
          f"epsilon target {cfg.epsilon}, delta {delta:.3g}, accountant {cfg.accountant}")
    print(f"{'release':<16}{'count':>7}{'sampling rate':>15}{'noise multiplier':>18}")
    for m, k in plan.items():
        print(f"{m.name:<16}{k:>7}{m.rate:>15.4g}{noise[m.name]:>18.4f}")
    if cfg.private:
        counts: dict = {}
        for m, k in plan.items():
            counts[(m.rate, noise[m.name])] = counts.get((m.rate, noise[m.name]), 0) + k
        print("planned epsilon: " + ", ".join(f"{acc} {epsilon_of(counts, delta, acc):.4f}" for acc in ("pld", "rdp")))
    return 0


_STARTED = time.perf_counter()  # reset by main(): the done line's time is the command's wall time


def _print_summary(s: dict, out_dir: str, resumed: bool = False) -> None:
    """The done line: results, and the command's wall time (from the start of main(), data loading and Flower
    start-up included) beside the training loop's (summary.json wall_seconds; over all sessions of a resumed
    run)."""
    eps = s["epsilon_spent"]
    seeded = str(s.get("trust_model", "")).startswith(SEEDED_NOT_PRIVATE)  # reproducible-for-testing
    private = "" if s["private"] else f"  ({SEEDED_NOT_PRIVATE.upper() if seeded else 'NOT PRIVATE: epsilon=inf'})"
    loop = f"training loop {s['wall_seconds']:.1f} s" + (" over all sessions" if resumed else "")
    split = s.get("eval_split", "test")
    print(f"done: {s['algorithm']} on {s['dataset']}: {split} accuracy {s['test_accuracy']:.4f}, worst-class "
          f"accuracy {s['worst_class_accuracy']:.4f}, epsilon {eps if isinstance(eps, str) else round(eps, 4)} "
          f"at delta {s['delta']:.3g}, {time.perf_counter() - _STARTED:.1f} s ({loop}){private}\n"
          f"run directory: {out_dir}")
    if s.get("worst_still_rising"):  # server/convergence.py: worth training longer
        print(f"note: {s['worst_still_rising']}")


def _own_children():
    """For commands that start Flower processes: this process becomes their subreaper, and whatever is
    still below it when the command ends (also by SIGTERM or Ctrl-C) is stopped by PID."""
    import contextlib

    from dpdro.launch.processes import become_subreaper, stop_descendants

    @contextlib.contextmanager
    def scope():
        become_subreaper()
        try:
            yield
        finally:
            stop_descendants()

    return scope()


def app_dir(value: str | None) -> Path:
    """The Flower app directory: ``value`` (--app), or by default the dpdro checkout this command runs from (its
    pyproject.toml declares the app), so that simulate and deploy work from any folder (a user's data folder)."""
    if value is not None:
        return Path(value)
    return Path(__file__).resolve().parent.parent


def cmd_simulate(args: argparse.Namespace) -> int:
    from dpdro.launch.simulate import run_simulation

    cfg = config_from_args(args)
    if args.overwrite:
        cfg = cfg.with_updates({"overwrite": True})
    check_device(cfg.device)  # the simulated clients compute on this machine
    _refuse_node_local(cfg)  # before any process starts
    with _own_children():
        summary = run_simulation(cfg, app_dir=app_dir(args.app), stream=not args.quiet)
    _print_summary(summary, cfg.out_dir)
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    from dpdro.simulations.sweep import run_sweep, write_report

    counts = run_sweep(args.profile, Path(args.root), transport=args.transport, datasets=args.only_dataset,
                       jobs=args.jobs, algorithms=args.only_method,
                       epsilons=[float(e) for e in args.only_epsilon] if args.only_epsilon else None,
                       seeds=args.only_seed, tuned_folder=Path(args.configs) / "tuned")
    print(f"sweep {args.profile}: {counts}")
    print(f"report: {write_report(Path(args.root), args.profile, Path(args.docs), Path(args.configs), args.carry)}")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from dpdro.simulations.sweep import write_report

    print(f"report: {write_report(Path(args.root), args.profile, Path(args.docs), Path(args.configs), args.carry)}")
    return 0


def cmd_tune(args: argparse.Namespace) -> int:
    from dpdro.simulations.tune import run_tune, searched_entries, transfer_tuned, tuning_report, write_tuned

    try:
        import optuna  # noqa: F401
    except ImportError:
        print('dpdro: error: dpdro tune needs Optuna: pip install -e ".[tune]" (or pip install optuna)',
              file=sys.stderr)
        return 2
    root, configs = Path(args.root), Path(args.configs)
    if args.probe is not None:
        return _tune_probe(args, root)
    if args.choose_posthoc_tau:
        return _tune_posthoc_tau(args, root, configs)
    if args.transfer_from:  # no trial runs: docs/research/TUNING.md (the trials of searches) is left as it is
        for ds in args.dataset:
            for method, path in transfer_tuned(ds, args.transfer_from, args.epsilon, args.methods, configs).items():
                print(f"{ds} eps {args.epsilon:g} {method}: transferred from {args.transfer_from} -> {path}")
        return 0
    for ds in args.dataset:
        if args.report:
            winners = write_tuned(ds, args.epsilon, args.methods, root, configs)
        else:
            winners = run_tune(ds, args.epsilon, args.methods, args.trials, root, configs, args.seed, args.jobs,
                               args.confirm_top, args.confirm_seeds, args.warm_start)
        for method, w in winners.items():
            print(f"{ds} eps {args.epsilon:g} {method}: trial {w['trial']} ({w['seeds']} seed(s)), validation worst "
                  f"{w['val_worst']:.4f}, two lowest {w['val_two_lowest']:.4f}, accuracy {w['val_accuracy']:.4f}")
    entries = searched_entries(root, args.all_datasets)
    if not entries:  # nothing to report: the document of an earlier search stays
        print(f"no search under {root}: {Path(args.docs) / 'TUNING.md'} left as it is")
        return 0
    print(f"report: {tuning_report(entries, args.methods, root, Path(args.docs))}")
    return 0


def _tune_posthoc_tau(args: argparse.Namespace, root: Path, configs: Path) -> int:
    """dpdro tune --choose-posthoc-tau: each method's tau chosen again on validation, its tuned file rewritten."""
    from dpdro.simulations.posthoc_tau import TAU_GRID, choose_posthoc_tau

    grid = tuple(args.tau_grid) if args.tau_grid else TAU_GRID
    for ds in args.dataset:
        choices = choose_posthoc_tau(ds, args.epsilon, args.methods, root, configs, grid, args.tau_seeds,
                                     args.jobs, args.min_accuracy)
        for c in choices.values():
            was = (f"{c.previous:g} (worst {c.previous_terms[0]:.4f}, two lowest {c.previous_terms[1]:.4f}, "
                   f"accuracy {c.previous_terms[2]:.4f})")
            if c.chosen is None:
                print(f"{ds} eps {args.epsilon:g} {c.method}: no tau reaches accuracy {args.min_accuracy:g}; "
                      f"{c.path} keeps {was}")
            else:
                print(f"{ds} eps {args.epsilon:g} {c.method}: posthoc-tau {c.chosen:g} (validation worst "
                      f"{c.chosen_terms[0]:.4f}, two lowest {c.chosen_terms[1]:.4f}, accuracy "
                      f"{c.chosen_terms[2]:.4f}) instead of {was} -> {c.path} (chosen on private records: not "
                      "accounted; its chosen-on-private-data says so)")
    return 0


def _tune_probe(args: argparse.Namespace, root: Path) -> int:
    """dpdro tune --probe: one hand-set point of one method, a trial's protocol, outside the search."""
    from dpdro.common.config import parse_set_args
    from dpdro.simulations.tune import run_probe

    if len(args.methods) != 1 or len(args.dataset) != 1:
        print("dpdro: error: --probe runs one point: give exactly one --methods and one --dataset, got "
              f"{args.methods} and {args.dataset}", file=sys.stderr)
        return 2
    s = run_probe(args.dataset[0], args.epsilon, args.methods[0], parse_set_args(args.probe), root, args.seed)
    per_class = ", ".join(f"{a:.3f}" for a in s["per_class_accuracy"])
    print(f"probe {args.methods[0]} (outside the search; {s['eval_split']} split, seed {s['seed']}): accuracy "
          f"{s['test_accuracy']:.4f}, worst {s['worst_class_accuracy']:.4f}; per class {per_class}")
    return 0


def cmd_hazards(args: argparse.Namespace) -> int:
    from dpdro.simulations.hazards import run_hazards, write_hazards

    seeds = [int(x) for x in args.seeds]
    path = (write_hazards(seeds, Path(args.root), Path(args.docs)) if args.report else
            run_hazards(seeds, Path(args.root), Path(args.docs), args.jobs))
    print(path.read_text())
    return 0


def cmd_noise_modes(args: argparse.Namespace) -> int:
    from dpdro.simulations.noise_modes import run_noise_modes

    path = run_noise_modes(args.iterations, Path(args.root), Path(args.docs), app_dir(args.app), args.seed)
    print(path.read_text())
    return 0


def cmd_equivalence(args: argparse.Namespace) -> int:
    from dpdro.simulations.equivalence import DATASETS, run_equivalence

    rows, path = run_equivalence(args.datasets or list(DATASETS), Path(args.root), Path(args.docs))
    for r in rows:
        print(f"{r['dataset']}: max |param diff| {r['max_abs_param_diff']:.3g}, epsilon diff {r['epsilon_diff']:.3g}")
    print(f"table: {path}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from dpdro.simulations.bench import BenchOptions, run_bench

    opts = BenchOptions(quick=args.quick, device=args.device, threads=args.threads, batch=args.batch,
                        chunk_size=args.chunk_size, repeats=args.repeats, flower=not args.no_flower,
                        doc=None if args.no_doc else args.doc, app_dir=app_dir(args.app))
    run_bench(opts)
    if opts.doc:
        print(f"written: {opts.doc}")
    return 0


def cmd_certs(args: argparse.Namespace) -> int:
    from dpdro.launch.certs import CertificateExistsError, add_node_key, create_certificates

    try:
        if args.certs_command == "add-node":
            priv, pub = add_node_key(args.out, args.name, force=args.force)
            print(f"wrote {priv} (private, 0600) and {pub}; register it at the SuperLink with\n"
                  f"    flwr supernode register {pub} <connection>")
            return 0
        nodes = args.node or [f"supernode-{i + 1}" for i in range(args.nodes)]
        hosts = args.host or ["localhost", "127.0.0.1", "superlink"]
        cs = create_certificates(args.out, nodes, hosts, force=args.force)
    except (CertificateExistsError, ValueError) as e:
        print(f"dpdro: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote CA {cs.ca_cert}, SuperLink certificate {cs.server_cert} (SANs: {', '.join(hosts)}), "
          f"private keys with mode 0600, and node keys: {', '.join(str(pub) for _, pub in cs.node_keys.values())}")
    return 0


def cmd_deploy(args: argparse.Namespace) -> int:
    from dpdro.launch.deploy import DeploymentError, deploy_config

    cfg = config_from_args(args)
    if args.overwrite:
        cfg = cfg.with_updates({"overwrite": True})
    given = {a.split("=", 1)[0] for a in (args.set or [])} | (set(_load_toml(args.config)) if args.config else set())
    if "num-clients" not in given:  # one partition per SuperNode
        cfg = cfg.with_updates({"num-clients": args.nodes})
    try:
        with _own_children():
            summary, outcome = deploy_config(cfg, args.nodes, args.work_dir, app_dir=app_dir(args.app),
                                             stream=not args.quiet, superlink_port=args.superlink_port,
                                             supernode_port=args.supernode_port, fleet_port=args.fleet_port,
                                             node_data_roots=args.node_data_root)
    except DeploymentError as e:
        print(f"dpdro: deployment failed: {e}", file=sys.stderr)
        return 1
    print(f"Flower run {outcome.run_id}: {outcome.status} after {outcome.seconds:.1f} s")
    _print_summary(summary, str(Path(cfg.out_dir).resolve()))
    return 0


def cmd_audit(args: argparse.Namespace) -> int:
    if args.mode == "canary":
        return _canary_audit(args)
    from dpdro.simulations.audit import run_audit

    path = run_audit([float(e) for e in args.epsilons], args.shadows, args.records, args.iterations,
                     Path(args.root), Path(args.docs), args.algorithm)
    print(path.read_text())
    return 0


def _canary_audit(args: argparse.Namespace) -> int:
    from dpdro.simulations.canary_audit import DEFAULT_PLAN, report_lines, run_canary_audit

    for key in ("slots", "trials", "max_releases"):
        if getattr(args, key) < 1:
            print(f"dpdro: error: --{key.replace('_', '-')}: got {getattr(args, key)}; allowed: >= 1", file=sys.stderr)
            return 2
    plan = [p for p in DEFAULT_PLAN if not args.configs or p[0] in args.configs]
    if not plan:
        print(f"dpdro: error: --configs: none of {args.configs} is audited; allowed: "
              f"{', '.join(sorted({p[0] for p in DEFAULT_PLAN}))}", file=sys.stderr)
        return 2
    command = " ".join(["dpdro audit --mode canary", *(["--configs", *args.configs] if args.configs else []),
                        f"--slots {args.slots} --trials {args.trials} --max-releases {args.max_releases}"])

    def progress(rows) -> None:
        print("\n".join(report_lines(rows, command, args.slots)[-len(rows):]), flush=True)

    path, rows = run_canary_audit(Path(args.docs), slots=args.slots, trials=args.trials,
                                  max_releases=args.max_releases, plan=plan, command=command, progress=progress)
    print(f"wrote {path}")
    wrong = [r for r in rows if r.flagged != bool(r.broken)]
    for r in wrong:
        what = "a correct release exceeds its claim" if not r.broken else "a broken release was not caught"
        print(f"dpdro: audit: {what}: {r.config} {r.mechanism} ({r.noise_mode}, {r.broken or 'correct'}): bound "
              f"{r.bound.lower:.3f}, claim {r.claimed:.3f}", file=sys.stderr)
    return 1 if wrong else 0


def cmd_keys(args: argparse.Namespace) -> int:
    for f in FIELDS:
        print(f"{f.key} = {f.default!r}\n    {f.help} Allowed: {f.allowed()}.")
    return 0


OVERWRITE_HELP = ("replace the run in a non-empty out-dir (config key overwrite); without it a non-empty out-dir "
                  "is refused")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dpdro", description="Record-level differentially private DRO training.")
    sub = p.add_subparsers(dest="command", required=True)
    for name, helptext in (("train", "train single-node (clients in this process)"),
                           ("simulate", "train on Flower's simulation engine (flwr run)")):
        s = sub.add_parser(name, help=helptext)
        s.add_argument("--config", help="TOML file of configuration keys")
        s.add_argument("--set", nargs="*", metavar="KEY=VALUE", help="configuration overrides")
        s.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
        if name == "train":
            s.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR with its saved config")
        else:
            s.add_argument("--app", default=None, help="Flower app directory (default: this dpdro checkout)")
            s.add_argument("--quiet", action="store_true", help="do not stream the run's log")
    s = sub.add_parser("plan", help="print the releases, sampling rates, calibrated noise multipliers and planned "
                       "epsilon of a configuration, without training")
    s.add_argument("--config", help="TOML file of configuration keys")
    s.add_argument("--set", nargs="*", metavar="KEY=VALUE", help="configuration overrides")
    sub.add_parser("keys", help="list configuration keys")
    for name, helptext in (("predict", "predictions of a finished run's model (model.pt) as CSV"),
                           ("evaluate", "accuracy, worst-class (worst-group) accuracy and a confusion-matrix PNG of "
                                        "a finished run's model")):
        s = sub.add_parser(name, help=helptext)
        if name == "predict":
            s.add_argument("--run", required=True, metavar="RUN_DIR", help="run directory with model.pt and "
                           "model.json")
        else:
            s.add_argument("--run", required=True, nargs="+", metavar="RUN_DIR",
                           help="run directory with model.pt and model.json; several (e.g. one configuration's "
                                "seeds) only with several --posthoc-tau values: each tau's figures are their mean")
        s.add_argument("--data", default="test", help="'test' (the split the run evaluated on), 'train', "
                       "'validation' (private training records: not private, nothing written without --out); "
                       "records of your own: for a csv run a .csv file (every row, the label column "
                       "optional), for an image-folder run an image, a folder of images (unlabelled) or of class "
                       "sub-folders (labelled); or a data root in the run's data set layout (its test split)")
        s.add_argument("--set", nargs="*", metavar="KEY=VALUE", help="data-key overrides, e.g. max-test-records=0")
        s.add_argument("--out", help="output file (default: RUN_DIR/predictions_<data>.csv for predict, "
                                     "RUN_DIR/plots/confusion_<data>.png for evaluate; for --data train or "
                                     "validation none: nothing is written without --out)")
        if name == "predict":
            s.add_argument("--posthoc-tau", type=float, metavar="TAU",
                           help="predict with post-hoc logit adjustment TAU instead of the run's (on the class "
                                "priors the run released; no budget spent)")
        else:
            s.add_argument("--posthoc-tau", type=float, nargs="+", metavar="TAU",
                           help="evaluate with post-hoc logit adjustment TAU instead of the run's (on the class "
                                "priors the run released; no budget spent); several values: one line each and the "
                                "choice of the tuning score (worst class, then the two lowest, then accuracy) among "
                                "those with accuracy >= --min-accuracy, e.g. to choose TAU on --data validation (reads "
                                "private records: that choice is not accounted)")
            s.add_argument("--min-accuracy", type=float, default=0.0, metavar="A",
                           help="with several --posthoc-tau values: choose only among those with accuracy >= A")
    s = sub.add_parser("export", help="a finished run's model as an ONNX file (needs the extra dpdro[onnx])")
    s.add_argument("--run", required=True, metavar="RUN_DIR", help="run directory with model.pt and model.json")
    s.add_argument("--format", default="onnx", choices=("onnx",), help="file format (onnx: logits and the run's "
                   "prediction, batch size free)")
    s.add_argument("--out", help="output file (default: RUN_DIR/model.onnx)")
    from dpdro.simulations.tuned import TUNED_CONFIGS

    for name, helptext in (("sweep", "run a profile's grid of runs (resumable), then write the report"),
                           ("report", "write RESULTS.md, results.csv and plots from finished sweep runs")):
        s = sub.add_parser(name, help=helptext)
        s.add_argument("--profile", default="quick", choices=("quick", "tuned", "paper", "smoke"))
        s.add_argument("--root", default="runs/sweep", help="folder of the sweep's run directories")
        s.add_argument("--docs", default="docs/research", help="where RESULTS.md, results.csv and plots/ go")
        s.add_argument("--configs", default=str(TUNED_CONFIGS.parent),
                       help="where the tuned configs are (tuned profile; default: the checkout's simulations/configs)")
        s.add_argument("--no-carry", dest="carry", action="store_false",
                       help="report only the run directories under --root; by default the previous results CSV's rows "
                            "of the same configuration (fingerprint) without a run directory here are kept")
        if name == "sweep":
            s.add_argument("--transport", default="local", choices=("local", "flower"))
            s.add_argument("--only-dataset", nargs="*", help="restrict to these datasets")
            s.add_argument("--only-method", nargs="*", help="restrict to these algorithms")
            s.add_argument("--only-epsilon", nargs="*", help="restrict to these target epsilons")
            s.add_argument("--only-seed", nargs="*", type=int, help="restrict to these seeds (e.g. one seed first)")
            s.add_argument("--jobs", type=int, default=1, help="runs in parallel (local transport)")
    from dpdro.common.config import DATASETS
    from dpdro.simulations.tune import METHODS  # light: the tuner imports Optuna and torch only when it runs

    s = sub.add_parser("tune", help="Optuna search (TPE, median pruner) with the same budget per method on a "
                                    "validation split, top trials confirmed on more seeds; writes tuned configs and "
                                    "docs/research/TUNING.md (not privacy-accounted); resumable")
    s.add_argument("--dataset", nargs="+", default=["mnist-st"], choices=DATASETS, help="data sets to tune")
    s.add_argument("--epsilon", type=float, default=4.0)
    s.add_argument("--trials", type=int, default=20, help="finished (complete or pruned) trials per method, the "
                                                          "same for every method; a larger number extends a search")
    s.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    s.add_argument("--seed", type=int, default=0, help="seed of the search's sampler (not of the runs)")
    s.add_argument("--jobs", type=int, default=2, help="trials in parallel (1: reproducible point for point)")
    s.add_argument("--confirm-top", type=int, default=3, help="best complete trials per method confirmed")
    s.add_argument("--confirm-seeds", type=int, default=3, help="seeds each of them is judged on (the trial is "
                                                                "seed 0; 1: no confirmation runs)")
    s.add_argument("--warm-start", action="store_true",
                   help="each method's first trial is its shipped configuration (configs/handset/ when there is "
                        "one, else configs/tuned/), within the same budget")
    s.add_argument("--root", default="runs/tune", help="folder of the trials' run directories")
    s.add_argument("--configs", default="simulations/configs", help="where tuned/*.toml and *-best.toml go")
    s.add_argument("--docs", default="docs/research", help="where TUNING.md goes")
    s.add_argument("--report", action="store_true", help="run nothing: write configs and TUNING.md from finished "
                                                         "trials")
    s.add_argument("--transfer-from", choices=DATASETS, metavar="SOURCE",
                   help="run nothing: write tuned configs for each --dataset from SOURCE's tuned configs (which "
                        "must exist): each method keeps its searched keys, batch sizes scale and the other keys "
                        "(e.g. CelebA's 300 iterations) follow the target; the target's data are not looked at "
                        "and docs/research/TUNING.md is not touched")
    s.add_argument("--probe", nargs="*", metavar="KEY=VALUE",
                   help="run nothing of the search: train one hand-set point of one --methods with a trial's "
                        "protocol (validation split, trial length, the method's fixed keys), outside the budget "
                        "(not recorded, chooses nothing; a diagnostic); --seed is the run's seed here")
    s.add_argument("--choose-posthoc-tau", action="store_true",
                   help="run nothing of the search: choose each --methods' post-hoc tau again on the data set's "
                        "validation split (models of its tuned file, trained with the search's validation split, "
                        "evaluated over --tau-grid; the search's score) and rewrite the tuned file "
                        "(simulations/posthoc_tau.py); e.g. after --transfer-from")
    s.add_argument("--tau-grid", type=float, nargs="+", metavar="TAU", default=None,
                   help="with --choose-posthoc-tau: the taus (default 0, 0.1, ..., 1, 1.25, 1.5, 2)")
    s.add_argument("--tau-seeds", type=int, default=1, metavar="N",
                   help="with --choose-posthoc-tau: validation models per method, seeds 1..N (default 1)")
    s.add_argument("--min-accuracy", type=float, default=0.0, metavar="A",
                   help="with --choose-posthoc-tau: choose only among taus with mean validation accuracy >= A")
    s.set_defaults(all_datasets=DATASETS)
    s = sub.add_parser("audit", help="privacy audits: white-box canaries per release (--mode canary) or membership "
                                     "inference (--mode mia: loss threshold, LiRA); writes docs/research/AUDIT.md")
    s.add_argument("--mode", choices=("mia", "canary"), default="mia",
                   help="mia: membership inference on trained models; canary: empirical epsilon lower bound of "
                        "every release (and the negative controls)")
    s.add_argument("--configs", nargs="*", default=[], help="canary: audited configurations (default: all)")
    s.add_argument("--slots", type=int, default=1000, help="canary: records of each audited run")
    s.add_argument("--trials", type=int, default=200_000, help="canary: trials per release (present + absent)")
    s.add_argument("--max-releases", type=int, default=20_000,
                   help="canary: most releases per audited release kind (bounds releases with few coordinates)")
    s.add_argument("--epsilons", nargs="*", default=["1", "8", "inf"])
    s.add_argument("--shadows", type=int, default=4)
    s.add_argument("--records", type=int, default=4000)
    s.add_argument("--iterations", type=int, default=200)
    s.add_argument("--algorithm", default="dp-sgd")
    s.add_argument("--root", default="runs/audit")
    s.add_argument("--docs", default="docs/research")
    s = sub.add_parser("hazards", help="one-factor changes of the tuned DP-DRO configs on MNIST-ST (ALGORITHMS.md "
                                       "5.4); writes docs/research/HAZARDS.md")
    s.add_argument("--seeds", nargs="+", default=["0", "1", "2"])
    s.add_argument("--jobs", type=int, default=2)
    s.add_argument("--root", default="runs/hazards")
    s.add_argument("--docs", default="docs/research")
    s.add_argument("--report", action="store_true", help="run nothing: write HAZARDS.md from finished runs")
    s = sub.add_parser("noise-modes", help="central, distributed (SecAgg+) and local noise on MNIST-ST through "
                                           "Flower; writes docs/research/NOISE_MODES.md")
    s.add_argument("--iterations", type=int, default=500)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--root", default="runs/noise-modes")
    s.add_argument("--docs", default="docs/research")
    s.add_argument("--app", default=None, help="Flower app directory (default: this dpdro checkout)")
    s = sub.add_parser("equivalence", help="run each dataset single-node and on Flower; write "
                       "docs/research/EQUIVALENCE.md")
    s.add_argument("--datasets", nargs="*", help="datasets (default: all four)")
    s.add_argument("--root", default="runs/equivalence")
    s.add_argument("--docs", default="docs/research")
    s = sub.add_parser("bench", help="measure performance ratios; writes docs/research/PERFORMANCE.md")
    s.add_argument("--quick", action="store_true", help="fewer repetitions, smaller sweep (a few minutes)")
    s.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="torch device of the timed steps")
    s.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0: torch's default)")
    s.add_argument("--batch", type=int, default=256, help="records per step of ratios (a)-(c)")
    s.add_argument("--chunk-size", type=int, default=256, help="records per vectorised chunk")
    s.add_argument("--repeats", type=int, default=0, help="interleaved repetitions (0: 5 quick, 15 default)")
    s.add_argument("--no-flower", action="store_true", help="skip (d), the Flower simulation")
    s.add_argument("--doc", default="docs/research/PERFORMANCE.md", help="generated Markdown (and .json beside it)")
    s.add_argument("--no-doc", action="store_true", help="print only, write no document")
    s.add_argument("--app", default=None, help="Flower app directory (default: this dpdro checkout) for (d)")
    s = sub.add_parser("certs", help="create TLS certificates and SuperNode authentication keys (no openssl)")
    csub = s.add_subparsers(dest="certs_command", required=True)
    c = csub.add_parser("create", help="CA, SuperLink certificate and one key pair per SuperNode")
    c.add_argument("--out", required=True, help="folder for the files (created 0700)")
    c.add_argument("--nodes", type=int, default=2, help="number of SuperNode key pairs supernode-1..N")
    c.add_argument("--node", action="append", help="SuperNode key name (repeatable; overrides --nodes)")
    c.add_argument("--host", action="append", default=None,
                   help="SAN of the SuperLink certificate, DNS name or IP (repeatable; default localhost, "
                        "127.0.0.1, superlink)")
    c.add_argument("--force", action="store_true", help="replace existing files (re-register the nodes)")
    c = csub.add_parser("add-node", help="one more SuperNode key pair NAME / NAME.pub")
    c.add_argument("--out", required=True)
    c.add_argument("name")
    c.add_argument("--force", action="store_true")
    s = sub.add_parser("deploy", help="run on a loopback deployment: SuperLink + SuperNodes on 127.0.0.1, TLS, "
                                      "SuperNode authentication")
    s.add_argument("--config", help="TOML file of configuration keys")
    s.add_argument("--set", nargs="*", metavar="KEY=VALUE", help="configuration overrides")
    s.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    s.add_argument("--nodes", type=int, default=2, help="SuperNodes (= num-clients)")
    s.add_argument("--node-data-root", action="append", metavar="DIR",
                   help="a SuperNode's own data-root, once per node in order (its --node-config data-root); "
                        "required with partition=node-local, where each node trains on all of its own data")
    s.add_argument("--work-dir", default=".flwr/deploy", help="certificates, FLWR_HOMEs, logs")
    s.add_argument("--superlink-port", type=int, default=None,
                   help="SuperLink port on 127.0.0.1 (Control API: operator only); default: first free from 18000")
    s.add_argument("--fleet-port", type=int, default=None,
                   help="port of the Fleet-only gateway the SuperNodes use; default: first free from 19092")
    s.add_argument("--supernode-port", type=int, default=None, help="first SuperNode port (default: from 19094)")
    s.add_argument("--app", default=None, help="Flower app directory (default: this dpdro checkout)")
    s.add_argument("--quiet", action="store_true", help="do not stream the run's log")
    return p


def _loaded(module: str, name: str) -> tuple[type, ...]:
    """The exception class ``module.name`` if that module is imported, else () : an error of a module never
    imported cannot have been raised, and importing it here would cost `--help` and config errors torch."""
    cls = getattr(sys.modules.get(module), name, None)
    return (cls,) if cls is not None else ()


def _leave_process(code: int) -> int:
    """``code``, or, when a client thread is still running (a round interrupted by a second Ctrl-C, or a client
    abandoned after its round-timeout: ``client.local_transport.busy_client_threads``), leave the process now
    with ``code`` after flushing the output: shutting the interpreter down around a thread inside torch's C++ code
    aborts it with "terminate called without an active exception". Every file of the run directory is already
    complete (atomic writes; events.jsonl is fsynced), so nothing is lost. Only the console script calls this
    (``main()`` without argv): an in-process caller keeps its interpreter."""
    local = sys.modules.get("dpdro.client.local_transport")
    if local is None or not local.busy_client_threads():
        return code
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    global _STARTED
    _STARTED = time.perf_counter()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("absl").setLevel(logging.ERROR)  # dp-accounting's per-order convergence chatter
    args = build_parser().parse_args(argv)
    handlers = {"train": cmd_train, "simulate": cmd_simulate, "keys": cmd_keys, "plan": cmd_plan, "sweep": cmd_sweep,
                "report": cmd_report, "equivalence": cmd_equivalence, "audit": cmd_audit, "tune": cmd_tune,
                "noise-modes": cmd_noise_modes, "hazards": cmd_hazards}
    handlers["predict"] = cmd_predict
    handlers["evaluate"] = cmd_evaluate
    handlers["export"] = cmd_export
    handlers["bench"] = cmd_bench
    handlers["certs"] = cmd_certs
    handlers["deploy"] = cmd_deploy
    code = _run_command(handlers[args.command], args)
    return _leave_process(code) if argv is None else code


def _run_command(handler, args: argparse.Namespace) -> int:
    """The exit code of ``handler(args)``: a known error becomes one line on stderr and code 2."""
    from dpdro.common.data import DataError  # torch-free (common/data.py imports torch where tensors are built)

    try:
        return handler(args)
    except BrokenPipeError:  # output piped into e.g. `head`, which closed early: not an error
        sys.stderr.close()
        return 0
    except (ConfigError, DataError) as e:
        print(f"dpdro: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - CLI boundary: one clear line, traceback only with -v logging
        known = (_loaded("dpdro.common.models", "ModelError") + _loaded("dpdro.server.engine", "ResumeError")
                 + _loaded("dpdro.server.ledger", "PrivacyBudgetExceeded")
                 + _loaded("dpdro.server.rundir", "RunFileError")
                 + _loaded("dpdro.launch.simulate", "SimulationError")
                 + _loaded("dpdro.server.onnx_export", "ExportUnavailable"))
        if isinstance(e, known):
            print(f"dpdro: error: {e}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
