"""The Flower ServerApp: reads the run config, connects to the nodes and runs the same engine as the
single-node CLI over a ``FlowerTransport``. Progress goes to the run's log (``flwr log`` / ``--stream``)."""

from __future__ import annotations

import logging
import sys

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from ...common.config import Config

app = ServerApp()


def _print_eval(row: dict, split: str) -> None:
    from ..engine import evaluation_line

    print(f"[dpdro] {evaluation_line(row, split)}  ({row['wall_seconds']:.0f} s)", flush=True)


@app.main()
def main(grid: Grid, context: Context) -> None:
    from ...common.data import load_from_config
    from ...common.noise_modes import noise_mode
    from ..engine import Progress, train
    from ..rundir import check_out_dir
    from .transport import FlowerTransport

    ours = logging.getLogger("dpdro")  # our logger only: the root logger carries Flower's HTTP chatter
    if not ours.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("[dpdro] %(message)s"))
        ours.addHandler(handler)
    ours.setLevel(logging.INFO)
    ours.propagate = False
    logging.getLogger("absl").setLevel(logging.ERROR)
    cfg = Config.from_mapping(dict(context.run_config), warn=False)  # warned by the launcher
    check_out_dir(cfg.out_dir, resume=cfg.resume, overwrite=cfg.overwrite)  # before loading any data
    test = load_from_config(cfg, train=False)
    transport = FlowerTransport(grid, cfg.num_clients, cfg.round_timeout, context=context,
                                secure=noise_mode(cfg.noise_mode).secure_aggregation, num_shares=cfg.secagg_num_shares,
                                threshold=cfg.secagg_threshold, on_client_failure=cfg.on_client_failure,
                                max_retries=cfg.max_retries, min_clients=cfg.min_clients)
    progress = Progress(on_eval=lambda row: _print_eval(row, cfg.eval_split))
    result = train(cfg, transport, test, resume=cfg.resume, progress=progress, transport_name="flower")
    s = result.summary
    print(f"[dpdro] done: {cfg.eval_split} accuracy {s['test_accuracy']:.4f}, worst-class accuracy "
          f"{s['worst_class_accuracy']:.4f}, epsilon {s['epsilon_spent']:.4f}, {s['wall_seconds']:.1f} s; "
          f"run directory {cfg.out_dir}", flush=True)
