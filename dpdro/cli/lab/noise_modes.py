"""``dpdro lab noise-modes``: central, distributed (SecAgg+) and local noise on MNIST-ST through Flower."""

from __future__ import annotations

import argparse
from pathlib import Path

from .. import shared

NAME = "noise-modes"
HELP = "central, distributed (SecAgg+) and local noise on MNIST-ST through Flower; writes NOISE_MODES.md"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--iterations", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--root", default="runs/noise-modes")
    shared.add_output_arguments(p, "NOISE_MODES.md", "runs/noise-modes")
    p.add_argument("--app", default=None, help="Flower app directory (default: this dpdro checkout)")


def run(args: argparse.Namespace) -> int:
    from dpdro.simulations.noise_modes import run_noise_modes

    path = run_noise_modes(args.iterations, Path(args.root), shared.docs_dir(args), shared.app_dir(args.app),
                           args.seed)
    print(path.read_text())
    return 0
