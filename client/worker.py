"""The work of one client on one query: Poisson-sample its records, compute the per-record quantity at
one point (refresh) or two points (difference), clip each record's vector and sum (ALGORITHMS.md 5.3).

Nothing here knows about Flower: the in-process transport and the ClientApp call the same code.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from ..common.data import ArrayDataset
from ..common.messages import Query, Reply
from ..common.models import make_model
from ..common.per_sample import FlatModel, clip_rows
from ..common.quantities import QUANTITIES, Problem
from ..common.rng import site_rng


def torch_dtype(name: str) -> torch.dtype:
    """torch dtype for config key ``dtype``."""
    return {"float32": torch.float32, "float64": torch.float64}[name]


class ShardWorker:
    """Answers queries on one client's shard.

    Args:
        cfg: the run's Config.
        shard: the client's records.
        partition: the client's partition id (enters the sampling seed in reproducible mode).
    """

    def __init__(self, cfg, shard: ArrayDataset, partition: int) -> None:
        self.cfg = cfg
        self.partition = partition
        self.dtype = torch_dtype(cfg.dtype)
        self.device = torch.device(cfg.device)
        self.x = shard.x.to(self.device, self.dtype)
        self.y = shard.y.to(self.device)
        self.model = FlatModel(make_model(cfg.model, shard.num_classes, cfg.seed, self.dtype).to(self.device))
        self.problem = Problem.from_config(cfg)

    @property
    def num_records(self) -> int:
        return int(self.y.shape[0])

    def sample(self, query: Query) -> np.ndarray:
        """Indices of this shard's Poisson sample for ``query``: each record independently with prob. rate."""
        rng = site_rng(self.cfg.reproducible, self.cfg.seed, "sample", query.iteration, query.mechanism,
                       self.partition)
        return np.flatnonzero(rng.random(self.num_records) < query.rate)

    def answer(self, query: Query, versions: Mapping[int, np.ndarray]) -> Reply:
        """Sum of clipped per-record vectors over this shard's sample. ``versions`` maps the query's model
        version ids to flat parameter arrays (d,). Raises KeyError if a version is missing."""
        fn = QUANTITIES[query.quantity]
        flats = [torch.as_tensor(versions[p.version]).to(self.device, self.dtype) for p in query.points]
        idx = self.sample(query)
        total = torch.zeros(query.dim, dtype=torch.float64, device=self.device)
        for start in range(0, len(idx), self.cfg.chunk_size):
            rows = torch.as_tensor(idx[start:start + self.cfg.chunk_size], device=self.device)
            xb, yb = self.x[rows], self.y[rows]
            v = fn(self.model, flats[0], query.points[0].scalar, xb, yb, self.problem)
            if len(query.points) == 2:
                v = v - fn(self.model, flats[1], query.points[1].scalar, xb, yb, self.problem)
            total += clip_rows(v.detach(), query.clip).sum(0).to(torch.float64)
        return Reply(query.qid, self.partition, total.cpu().numpy(), int(len(idx)))
