"""``dpdro simulate``: the run of ``dpdro train`` on Flower's simulation engine (``flwr run``)."""

from __future__ import annotations

import argparse

from dpdro.common.config import check_device
from dpdro.common.partition import refuse_node_local

from . import shared

NAME = "simulate"
HELP = "train on Flower's simulation engine (flwr run)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    shared.add_config_arguments(p)
    p.add_argument("--app", default=None, help="Flower app directory (default: this dpdro checkout)")
    p.add_argument("--quiet", action="store_true", help="do not stream the run's log")


def run(args: argparse.Namespace) -> int:
    cfg = shared.config_from_args(args)
    from dpdro.launch.simulate import run_simulation

    check_device(cfg.device)  # the simulated clients compute on this machine
    refuse_node_local(cfg.partition)  # before any process starts
    with shared.own_children():
        summary = run_simulation(cfg, app_dir=shared.app_dir(args.app), stream=not args.quiet)
    shared.print_summary(summary, cfg.out_dir)
    return 0
