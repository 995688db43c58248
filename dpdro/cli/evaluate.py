"""``dpdro evaluate``: accuracy, worst-class (worst-group) and per-class accuracy and the confusion matrix PNG of
a finished run's model; with several ``--posthoc-tau`` values, the tau the tuning score chooses
(``server.objective``; no lab code)."""

from __future__ import annotations

import argparse
from pathlib import Path

from dpdro.common.config import ConfigError, parse_set_args

from . import shared
from .predict import add_data_arguments

NAME = "evaluate"
HELP = "accuracy, worst-class (worst-group) accuracy and a confusion-matrix PNG of a finished run's model"
# What evaluate prints instead of a confusion matrix's path for private records without --out.
_NOT_WRITTEN = ("not written (derived from private records: the run directory gets nothing of them; --out FILE.png "
                "writes it to FILE.png)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run", required=True, nargs="+", metavar="RUN_DIR",
                   help="run directory with model.pt and model.json; several (e.g. one configuration's seeds) only "
                        "with several --posthoc-tau values: each tau's figures are their mean")
    add_data_arguments(p)
    p.add_argument("--posthoc-tau", type=float, nargs="+", metavar="TAU",
                   help="evaluate with post-hoc logit adjustment TAU instead of the run's (on the class priors the "
                        "run released; no budget spent); several values: one line each and the choice of the "
                        "tuning score (worst class, then the two lowest, then accuracy) among those with accuracy "
                        ">= --min-accuracy, e.g. to choose TAU on --data validation (reads private records: that "
                        "choice is not accounted)")
    p.add_argument("--min-accuracy", type=float, default=0.0, metavar="A",
                   help="with several --posthoc-tau values: choose only among those with accuracy >= A")
    shared.add_format_argument(p)


def run(args: argparse.Namespace) -> int:
    """Accuracy, worst-class and per-class accuracy and the confusion matrix PNG (--out, else
    RUN/plots/confusion_<data>.png); on a private split (train, validation) the first line says NOT_PRIVATE and
    no PNG is written without --out."""
    shared.check_out(args)
    taus = args.posthoc_tau or []
    if len(taus) > 1:
        return _posthoc_taus(args, taus)
    if len(args.run) > 1:
        raise ConfigError(f"--run: got {len(args.run)} run directories; allowed: one, or several with several "
                          "--posthoc-tau values (to choose one tau for them all)")
    from dpdro.server.evaluate import worst_group_words
    from dpdro.server.prediction import NOT_PRIVATE, metrics, predict, write_confusion_png

    run_dir = args.run[0]
    p = predict(run_dir, args.data, parse_set_args(args.set or []), posthoc_tau=taus[0] if taus else None)
    m = metrics(p)
    png = _confusion_path(args, run_dir)
    if png is not None:
        write_confusion_png(p, m, png, args.data)
    classes = p.spec.classes
    if args.format == "json":
        shared.print_json({
            "data": args.data, "posthoc_tau": p.spec.posthoc_tau if taus else None, "records": m["records"],
            "accuracy": m["accuracy"], "worst_class_accuracy": m["worst_class_accuracy"],
            "worst_class": classes[m["worst_class"]],
            "per_class_accuracy": dict(zip(classes, m["per_class_accuracy"], strict=True)),
            **{k: m[k] for k in ("worst_group_accuracy", "per_group_accuracy", "worst_group_records",
                                 "per_group_records") if k in m},
            "confusion": m["confusion"], "confusion_matrix_png": png, "privacy": m["privacy"]})
        return 0
    tau = f" (post-hoc tau {p.spec.posthoc_tau:g})" if taus else ""
    private = f"; {NOT_PRIVATE}" if m["privacy"] == NOT_PRIVATE else ""
    print(f"data {args.data}{tau}: {m['records']} records, accuracy {m['accuracy']:.4f}, worst-class accuracy "
          f"{m['worst_class_accuracy']:.4f} (class {classes[m['worst_class']]})"
          + worst_group_words(m)
          + private)
    print("per-class accuracy: " + ", ".join(f"{c} {a:.4f}" for c, a in zip(classes, m["per_class_accuracy"],
                                                                           strict=True)))
    print(f"confusion matrix: {png if png is not None else _NOT_WRITTEN}")
    return 0


def _confusion_path(args: argparse.Namespace, run: str) -> Path | None:
    """Where ``dpdro evaluate`` writes the confusion matrix of ``run``: --out, else RUN/plots/confusion_<data>.png;
    None (not written) for a private split (train, validation) without --out."""
    from dpdro.server.prediction import data_label, reads_private_records

    if args.out:
        return Path(args.out)
    return None if reads_private_records(args.data) else Path(run) / "plots" / f"confusion_{data_label(args.data)}.png"


def _posthoc_taus(args: argparse.Namespace, taus: list[float]) -> int:
    """``dpdro evaluate --posthoc-tau T1 T2 ... [--run R1 R2 ...]``: one line per tau (each model runs once) and
    the tau the tuning score chooses among those with accuracy >= --min-accuracy
    (``server.objective.choose_by_terms``); with several runs (e.g. one configuration's seeds) each line is
    the mean of their terms (``mean_terms``, as ``dpdro lab tune`` scores a candidate over its seeds) and one tau
    is chosen for them all. Each run's confusion matrix at the chosen tau (on a private split only with --out).
    Applying a tau is post-processing; choosing it on --data validation (or train) reads private records: the
    lines say NOT_PRIVATE and how a run of the choice lists it as not accounted. Exit status 1 when no tau
    reaches --min-accuracy."""
    if not 0.0 <= args.min_accuracy <= 1.0:
        raise ConfigError(f"--min-accuracy: got {args.min_accuracy}; allowed: [0, 1]")
    if args.out and len(args.run) > 1:
        raise ConfigError(f"--out: got {args.out!r} with {len(args.run)} runs; allowed: only with one --run (each "
                          "run's confusion matrix goes to its plots/ folder)")
    from dpdro.server.objective import choose_by_terms, evaluation_terms, mean_terms
    from dpdro.server.prediction import NOT_PRIVATE, metrics, predict_posthoc_taus, write_confusion_png

    overrides = parse_set_args(args.set or [])
    preds = [predict_posthoc_taus(run, args.data, taus, overrides) for run in args.run]
    rows = [[metrics(p) for p in run_preds] for run_preds in preds]  # [run][tau]
    terms = [mean_terms([evaluation_terms(r[i], "accuracy") for r in rows]) for i in range(len(taus))]
    unit = "group" if "per_group_accuracy" in rows[0][0] else "class"
    private = rows[0][0]["privacy"] == NOT_PRIVATE
    chosen = choose_by_terms(terms, args.min_accuracy)
    pngs = [_confusion_path(args, run) for run in args.run] if chosen is not None else []
    for run_preds, run_rows, png in zip(preds, rows, pngs, strict=False):  # none without a choice
        if png is not None:
            write_confusion_png(run_preds[chosen], run_rows[chosen], png, args.data)
    if args.format == "json":
        shared.print_json({
            "data": args.data, "records": rows[0][0]["records"], "runs": args.run, "unit": unit,
            "taus": [{"tau": tau, "accuracy": acc, f"worst_{unit}_accuracy": worst, "two_lowest": two_lowest}
                     for tau, (worst, two_lowest, acc) in zip(taus, terms, strict=True)],
            "min_accuracy": args.min_accuracy, "chosen_tau": None if chosen is None else taus[chosen],
            "confusion_matrix_pngs": [png for png in pngs if png is not None], "privacy": rows[0][0]["privacy"]})
        return 0 if chosen is not None else 1
    mean = f"mean over {len(args.run)} runs; " if len(args.run) > 1 else ""
    print(f"data {args.data}: {rows[0][0]['records']} records; {mean}post-hoc tau on the run's released priors "
          f"({NOT_PRIVATE if private else 'no budget'})")
    for tau, (worst, two_lowest, acc) in zip(taus, terms, strict=True):
        print(f"  tau {tau:g}: accuracy {acc:.4f}, worst-{unit} accuracy {worst:.4f}, two lowest {two_lowest:.4f}")
    if chosen is None:
        print(f"chosen: none (no tau reaches accuracy {args.min_accuracy:g})")
        return 1
    caution = " (this is the test split: choose on validation, never here)" if args.data == "test" else ""
    if private:
        caution = (" (chosen on private records: not accounted; a run with this tau lists it under not_accounted "
                   "with config key chosen-on-private-data = \"posthoc-tau\")")
    written = ", ".join(str(png) for png in pngs if png is not None) or _NOT_WRITTEN
    print(f"chosen: tau {taus[chosen]:g} (worst, then the two lowest, then accuracy; among accuracy >= "
          f"{args.min_accuracy:g}){caution}; confusion matrix: {written}")
    return 0
