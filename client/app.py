"""The Flower ClientApp: answers 'query.hello' (partition id and shard size) and 'query.release' (clipped
sums over the node's Poisson sample) with the same ``ShardWorker`` the single-node transport uses.

Per-node state lives in ``context.state`` (the model versions this node holds). The shard and worker are
cached per process, keyed by the data configuration and partition: in simulation one process serves many
nodes (FLOWER.md 3.4), so the cache never stands in for per-node state.
"""

from __future__ import annotations

import logging

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

from ..common.config import Config
from ..common.wire import pack_replies, unpack_queries

app = ClientApp()
log = logging.getLogger(__name__)

_WORKERS: dict[tuple, object] = {}
_DATA_KEYS = ("dataset", "data-root", "cache-dir", "download", "imbalance-ratio", "max-train-records", "num-clients",
              "partition", "dirichlet-alpha", "seed", "model", "psi", "lambda", "cvar-alpha", "eta-scale", "dtype",
              "device", "chunk-size", "reproducible")
KEEP_VERSIONS = 3  # SPIDER needs the current and previous iterate; one spare


class PartitionError(ValueError):
    """The node's partition settings disagree with the run's configuration."""


def _config(context: Context) -> Config:
    return Config.from_mapping(dict(context.run_config), ignore_unknown=True)


def _partition(context: Context, cfg: Config) -> int:
    pid = int(context.node_config.get("partition-id", -1))
    parts = int(context.node_config.get("num-partitions", cfg.num_clients))
    if parts != cfg.num_clients or not 0 <= pid < cfg.num_clients:
        raise PartitionError(f"node_config partition-id={pid} num-partitions={parts} does not fit the run's "
                             f"num-clients={cfg.num_clients}")
    return pid


def _worker(cfg: Config, pid: int):
    from ..client.worker import ShardWorker
    from ..common.data import load_from_config
    from ..common.partition import make_partition

    run_key = tuple(cfg.to_dict()[k] for k in _DATA_KEYS)
    key = (run_key, pid)
    if key not in _WORKERS:
        if cfg.threads:
            import torch

            torch.set_num_threads(cfg.threads)
        train = load_from_config(cfg, train=True)
        idx = make_partition(cfg, train.y.numpy())[pid]
        for old in [k for k in _WORKERS if k[0] != run_key]:  # shards of an earlier run: free them
            del _WORKERS[old]
        _WORKERS[key] = ShardWorker(cfg, train.subset(idx), pid)
    return _WORKERS[key]


@app.query("hello")
def hello(msg: Message, context: Context) -> Message:
    cfg = _config(context)
    pid = _partition(context, cfg)
    worker = _worker(cfg, pid)
    context.state["versions"] = ArrayRecord({})
    return Message(RecordDict({"hello": ConfigRecord({"partition": pid, "num-records": worker.num_records})}),
                   reply_to=msg)


@app.query("release")
def release(msg: Message, context: Context) -> Message:
    cfg = _config(context)
    pid = _partition(context, cfg)
    worker = _worker(cfg, pid)
    queries, incoming = unpack_queries(msg.content)
    held = context.state["versions"] if "versions" in context.state else ArrayRecord({})
    versions = {int(k): a.numpy() for k, a in held.items()}
    versions.update(incoming)
    missing = sorted({v for q in queries for v in q.versions} - set(versions))
    if missing:  # the server resends them (e.g. after this node restarted)
        raise KeyError(f"missing model versions {missing}")
    replies = [worker.answer(q, versions) for q in queries]
    newest = sorted(versions)[-KEEP_VERSIONS:]
    from flwr.app import Array

    context.state["versions"] = ArrayRecord({str(k): Array(versions[k]) for k in newest})
    return Message(pack_replies(replies), reply_to=msg)
