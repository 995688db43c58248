"""``dpdro lab equivalence``: each data set single-node and on Flower, compared."""

from __future__ import annotations

import argparse
from pathlib import Path

from .. import shared

NAME = "equivalence"
HELP = "run each dataset single-node and on Flower; write EQUIVALENCE.md"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--datasets", nargs="*", help="datasets (default: all four)")
    p.add_argument("--root", default="runs/equivalence")
    shared.add_output_arguments(p, "EQUIVALENCE.md", "runs/equivalence")


def run(args: argparse.Namespace) -> int:
    from dpdro.simulations.equivalence import DATASETS, run_equivalence

    rows, path = run_equivalence(args.datasets or list(DATASETS), Path(args.root), shared.docs_dir(args))
    for r in rows:
        print(f"{r['dataset']}: max |param diff| {r['max_abs_param_diff']:.3g}, epsilon diff {r['epsilon_diff']:.3g}")
    print(f"table: {path}")
    return 0
