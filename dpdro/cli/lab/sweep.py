"""``dpdro lab sweep``: a profile's grid of runs (resumable), then its results document."""

from __future__ import annotations

import argparse
from pathlib import Path

from .. import shared

NAME = "sweep"
HELP = "run a profile's grid of runs (resumable), then write the report"


def add_report_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments ``sweep`` shares with ``report``."""
    p.add_argument("--profile", default="quick", choices=("quick", "tuned", "paper", "smoke"))
    p.add_argument("--root", default="runs/sweep", help="folder of the sweep's run directories")
    shared.add_output_arguments(p, "RESULTS.md, results.csv and plots/", "runs/sweep")
    p.add_argument("--configs", default=None,
                   help="where the tuned configs are (tuned profile; default: the checkout's simulations/configs)")
    p.add_argument("--no-carry", dest="carry", action="store_false",
                   help="report only the run directories under --root; by default the previous results CSV's rows "
                        "of the same configuration (fingerprint) without a run directory here are kept")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_report_arguments(p)
    p.add_argument("--transport", default="local", choices=("local", "flower"))
    p.add_argument("--only-dataset", nargs="*", help="restrict to these datasets")
    p.add_argument("--only-method", nargs="*", help="restrict to these algorithms")
    p.add_argument("--only-epsilon", nargs="*", help="restrict to these target epsilons")
    p.add_argument("--only-seed", nargs="*", type=int, help="restrict to these seeds (e.g. one seed first)")
    p.add_argument("--jobs", type=int, default=1, help="runs in parallel (local transport)")


def configs_dir(args: argparse.Namespace) -> Path:
    """--configs, else the checkout's simulations/configs (its tuned/ folder holds the tuned configs)."""
    from dpdro.simulations.tuned import TUNED_CONFIGS

    return Path(args.configs) if args.configs else TUNED_CONFIGS.parent


def report(args: argparse.Namespace) -> Path:
    """Write the results document of the finished runs under --root (``simulations.sweep.write_report``)."""
    from dpdro.simulations.sweep import write_report

    return write_report(Path(args.root), args.profile, shared.docs_dir(args), configs_dir(args), args.carry)


def run(args: argparse.Namespace) -> int:
    from dpdro.simulations.sweep import run_sweep

    counts = run_sweep(args.profile, Path(args.root), transport=args.transport, datasets=args.only_dataset,
                       jobs=args.jobs, algorithms=args.only_method,
                       epsilons=[float(e) for e in args.only_epsilon] if args.only_epsilon else None,
                       seeds=args.only_seed, tuned_folder=configs_dir(args) / "tuned")
    print(f"sweep {args.profile}: {counts}")
    print(f"report: {report(args)}")
    return 0
