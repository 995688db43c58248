"""``dpdro lab hazards``: one-factor changes of the tuned DP-DRO configs on MNIST-ST
(docs/explanation/ALGORITHMS.md 5.4)."""

from __future__ import annotations

import argparse
from pathlib import Path

from .. import shared

NAME = "hazards"
HELP = ("one-factor changes of the tuned DP-DRO configs on MNIST-ST (docs/explanation/ALGORITHMS.md 5.4); writes "
        "HAZARDS.md")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seeds", nargs="+", default=["0", "1", "2"])
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--root", default="runs/hazards")
    shared.add_output_arguments(p, "HAZARDS.md", "runs/hazards")
    p.add_argument("--report", action="store_true", help="run nothing: write HAZARDS.md from finished runs")


def run(args: argparse.Namespace) -> int:
    from dpdro.simulations.hazards import run_hazards, write_hazards

    seeds = [int(x) for x in args.seeds]
    docs = shared.docs_dir(args)
    path = (write_hazards(seeds, Path(args.root), docs) if args.report else
            run_hazards(seeds, Path(args.root), docs, args.jobs))
    print(path.read_text())
    return 0
