"""``dpdro lab levers``: a one-factor lever table of a configuration file on its validation split
(simulations/levers.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

from .. import shared

NAME = "levers"
HELP = ("one-factor lever table of a configuration file: each --variant changes a few keys, every run trained on "
        "the training split minus the validation split and evaluated on the validation split; writes levers-NAME.md")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="the configuration file every variant starts from")
    p.add_argument("--variant", action="append", default=[], metavar="'LABEL: KEY=VALUE ...'",
                   help="a row of the table (repeat the option for more rows)")
    p.add_argument("--seeds", nargs="+", default=["0"])
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--name", default=None, help="the table's name (default: the config file's stem)")
    p.add_argument("--root", default="runs/levers", help="the runs live in ROOT/NAME (default: runs/levers)")
    shared.add_output_arguments(p, "levers-NAME.md", "runs/levers")
    p.add_argument("--against", action="append", default=[], metavar="LABEL",
                   help="also compare every row with the row of this label (repeatable); the file's row is always one")
    p.add_argument("--report", action="store_true", help="run nothing: write the table from finished runs")


def run(args: argparse.Namespace) -> int:
    from dpdro.simulations.levers import check_against, parse_variant, run_levers, write_levers

    config = Path(args.config)
    name = args.name or config.stem
    runs = Path(args.root) / name
    variants = [parse_variant(v) for v in args.variant]  # every variant parsed before any run
    check_against({"file", *(v.label for v in variants)}, args.against)
    seeds = [int(s) for s in args.seeds]
    if not args.report:
        run_levers(config, variants, seeds, runs, args.jobs)
    print(write_levers(config, variants, seeds, runs, shared.docs_dir(args), name,
                       tuple(args.against)).read_text())
    return 0
