"""Run many single-node training runs, ``jobs`` processes at a time (sweeps and tuning).

Each run is a whole ``server.engine.train`` in a worker process (one torch thread each is the fast setting
on a small machine: set ``threads=1`` in the configs); a run whose data is missing is reported, not faked.
"""

from __future__ import annotations

import logging
import multiprocessing
from collections.abc import Iterable
from concurrent.futures import ProcessPoolExecutor

from ..common.config import Config


def run_one(values: dict, progress=None) -> tuple[str, str | None]:
    """Train the configuration ``values`` (kebab-case keys) in this process (continuing its checkpoint when
    key resume is set), calling ``progress`` (a ``server.engine.Progress``; the tuner's pruning hook) as the run
    goes; returns (out-dir, None), or (out-dir, message) when its data is not available (DataError). Raises
    ConfigError for a non-empty out-dir without key resume or overwrite, and whatever ``progress`` raises."""
    from ..client.local_transport import LocalTransport
    from ..common.data import DataError, load_from_config
    from ..server.engine import train
    from ..server.rundir import check_out_dir

    logging.getLogger("absl").setLevel(logging.ERROR)
    cfg = Config.from_mapping(values)
    check_out_dir(cfg.out_dir, resume=cfg.resume, overwrite=cfg.overwrite)  # before loading any data
    try:
        train_set, eval_set = load_from_config(cfg, True), load_from_config(cfg, False)
    except DataError as e:
        return cfg.out_dir, str(e)
    from ..server.node_evaluation import evaluates_on_nodes

    held_out = eval_set if evaluates_on_nodes(cfg) else None  # eval-data=nodes: the clients evaluate
    train(cfg, LocalTransport(cfg, train_set, held_out=held_out), eval_set, resume=cfg.resume, progress=progress)
    return cfg.out_dir, None


def die_with_parent() -> None:
    """Worker initialiser: on Linux, ask the kernel to send this process SIGTERM when its parent dies
    (prctl PR_SET_PDEATHSIG), so that a sweep stopped by `kill` or a scheduler does not leave its workers training
    on; elsewhere nothing (there a stopped parent's workers run until their current run ends)."""
    import ctypes
    import signal
    import sys

    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1  # linux/prctl.h
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def run_many(configs: Iterable[Config], jobs: int, desc: str) -> list[tuple[str, str | None]]:
    """Run every config, ``jobs`` at a time (1: in this process); returns run_one's results in order."""
    from tqdm import tqdm

    plans = [c.to_dict() for c in configs]
    if not plans:
        return []
    if jobs <= 1:
        return [run_one(p) for p in tqdm(plans, desc=desc, unit="run")]
    # spawn, not fork: a parent that has already run torch (the data check of a sweep starts its thread pools)
    # would fork children that deadlock on those pools' locks.
    with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn"),
                             initializer=die_with_parent) as pool:
        return list(tqdm(pool.map(run_one, plans), total=len(plans), desc=desc, unit="run"))
