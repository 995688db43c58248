"""``dpdro predict``: predictions of a finished run's model (model.pt) as CSV."""

from __future__ import annotations

import argparse
from pathlib import Path

from dpdro.common.config import parse_set_args

from . import shared

NAME = "predict"
HELP = "predictions of a finished run's model (model.pt) as CSV"
DATA_HELP = ("'test' (the split the run evaluated on), 'train', 'validation' (private training records: not "
             "private, nothing written without --out); records of your own: for a csv run a .csv file (every row, "
             "the label column optional), for an image-folder run an image, a folder of images (unlabelled) or of "
             "class sub-folders (labelled); or a data root in the run's data set layout (its test split)")
OUT_HELP = ("output file (default: RUN_DIR/predictions_<data>.csv for predict, RUN_DIR/plots/confusion_<data>.png "
            "for evaluate; for --data train or validation none: nothing is written without --out)")


def add_data_arguments(p: argparse.ArgumentParser) -> None:
    """--data, --set and --out, shared with ``dpdro evaluate``."""
    p.add_argument("--data", default="test", help=DATA_HELP)
    p.add_argument("--set", nargs="*", metavar="KEY=VALUE", help="data-key overrides, e.g. max-test-records=0")
    p.add_argument("--out", help=OUT_HELP)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run", required=True, metavar="RUN_DIR", help="run directory with model.pt and model.json")
    add_data_arguments(p)
    p.add_argument("--posthoc-tau", type=float, metavar="TAU",
                   help="predict with post-hoc logit adjustment TAU instead of the run's (on the class priors the "
                        "run released; no budget spent)")


def run(args: argparse.Namespace) -> int:
    """The predictions CSV at --out, else RUN/predictions_<data>.csv; on a private split (train, validation) the
    line says NOT_PRIVATE and nothing is written without --out."""
    shared.check_out(args)
    from dpdro.server import prediction as pr

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
