"""``dpdro deploy``: the run on a loopback deployment (SuperLink and SuperNodes on 127.0.0.1, TLS, SuperNode
authentication)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import shared

NAME = "deploy"
HELP = "run on a loopback deployment: SuperLink + SuperNodes on 127.0.0.1, TLS, SuperNode authentication"


def add_arguments(p: argparse.ArgumentParser) -> None:
    shared.add_config_arguments(p)
    p.add_argument("--nodes", type=int, default=2, help="SuperNodes (= num-clients)")
    p.add_argument("--node-data-root", action="append", metavar="DIR",
                   help="a SuperNode's own data-root, once per node in order (its --node-config data-root); "
                        "required with partition=node-local, where each node trains on all of its own data")
    p.add_argument("--work-dir", default=".flwr/deploy", help="certificates, FLWR_HOMEs, logs")
    p.add_argument("--superlink-port", type=int, default=None,
                   help="SuperLink port on 127.0.0.1 (Control API: operator only); default: first free from 18000")
    p.add_argument("--fleet-port", type=int, default=None,
                   help="port of the Fleet-only gateway the SuperNodes use; default: first free from 19092")
    p.add_argument("--supernode-port", type=int, default=None, help="first SuperNode port (default: from 19094)")
    p.add_argument("--app", default=None, help="Flower app directory (default: this dpdro checkout)")
    p.add_argument("--quiet", action="store_true", help="do not stream the run's log")


def run(args: argparse.Namespace) -> int:
    cfg = shared.config_from_args(args)
    if "num-clients" not in shared.given_keys(args):  # one partition per SuperNode
        cfg = cfg.with_updates({"num-clients": args.nodes})
    from dpdro.launch.deploy import DeploymentError, deploy_config

    try:
        with shared.own_children():
            summary, outcome = deploy_config(cfg, args.nodes, args.work_dir, app_dir=shared.app_dir(args.app),
                                             stream=not args.quiet, superlink_port=args.superlink_port,
                                             supernode_port=args.supernode_port, fleet_port=args.fleet_port,
                                             node_data_roots=args.node_data_root)
    except DeploymentError as e:
        print(f"dpdro: deployment failed: {e}", file=sys.stderr)
        return e.exit_code
    print(f"Flower run {outcome.run_id}: {outcome.status} after {outcome.seconds:.1f} s")
    shared.print_summary(summary, str(Path(cfg.out_dir).resolve()))
    return 0
