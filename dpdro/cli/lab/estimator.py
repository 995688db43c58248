"""``dpdro lab estimator``: the SPIDER estimators' mean squared error under DP along one fixed trajectory,
split into sampling variance, DP noise and difference-clip bias, for several q at equal epsilon
(simulations/estimator.py; docs/research/SPIDER.md)."""

from __future__ import annotations

import argparse

from .. import shared

NAME = "estimator"
HELP = ("MSE of the SPIDER estimators (sampling, noise, clip bias) for several q at equal epsilon; "
        "writes its tables under --root")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The tool's arguments (read by simulations/estimator.py's ``run``)."""
    p.add_argument("--root", default="runs/estimator", help="folder for the tables (default: runs/estimator)")
    shared.add_output_arguments(p, "the tables", "runs/estimator")
    p.add_argument("--dataset", default="mnist-st")
    p.add_argument("--methods", nargs="+", default=["dp-double-spider", "recursive-spider"])
    p.add_argument("--levels", nargs="+", default=["record"], choices=["record", "group"])
    p.add_argument("--epsilon", nargs="+", type=float, default=[1.0, 4.0])
    p.add_argument("--q", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    p.add_argument("--measure", type=int, default=32, help="iterations measured")
    p.add_argument("--skip", type=int, default=0, help="trajectory iterations before the first measured one")
    p.add_argument("--target-records", type=int, default=2000, help="records of the full-batch target (0: all)")
    p.add_argument("--trajectory-q", type=int, default=1)
    p.add_argument("--config", help="base TOML (default: the tuned epsilon-4 file of each method)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config key override")
    p.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    from dpdro.simulations.estimator import run as run_estimator

    args.out = str(shared.docs_dir(args))
    return run_estimator(args)
