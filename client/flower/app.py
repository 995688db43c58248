"""The Flower ClientApp: answers 'query.hello' (partition id and shard size) and 'query.release' (clipped
sums over the node's Poisson sample) with the same ``ShardWorker`` the single-node transport uses, and
'train' messages of Flower's SecAgg+ protocol (noise-mode=distributed): the secaggplus_mod runs the key
agreement and masking stages itself and calls ``secure_release`` for the node's noised sums, which it
quantises and masks before they leave the node (server/flower/secagg.py).

Per-node state lives in ``context.state`` (the model versions this node holds). The shard and worker are
cached per process, keyed by the data configuration and partition: in simulation one process serves many
nodes (docs/explanation/FLOWER.md 3.4), so the cache never stands in for per-node state.

Deployment starts a new ``flwr-clientapp`` process for every message (docs/explanation/FLOWER.md 3.4), so start-up
must be cheap: this module never imports torch itself, and in a deployment the computation runs in the node's *warm
worker* (``client/flower/warm.py``), a long-lived process that keeps torch, the shard and the model across
messages (node config ``warm-seconds``; where it cannot be reached the ClientApp computes the reply itself).
The node's shard is written once to a local file ``<cache-dir>/shards/<key>.npz`` (key: a hash of the
configuration keys that shape the data, and the partition) and read from there later instead of rebuilding the
data set. The file stays on the node. A site's own ``data-root`` and ``cache-dir`` may be given in its node
config (``flower-supernode --node-config 'data-root="/data" ...'``); they override the run config's values on
that node.

Node-local data (config key ``partition = "node-local"``): the node's shard is every record of the data its node
config points at (``data-root``, required then; ``dataset`` optional, checked against the run's), read on the
node; nothing is partitioned centrally and the records never leave the node: the server learns only the shard size
(the 'hello' reply, public as n is) and the clipped, noised sums of releases. Its shard cache is keyed, as for
any user files, also by their names, sizes and modification times (``data.data_fingerprint``).
"""

from __future__ import annotations

import logging
import os

from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.client.mod import secaggplus_mod
from flwr.clientapp import ClientApp

from ...common import faults
from ...common.atomic import atomic_writer
from ...common.config import Config, keys_with_role
from ...common.errors import DpdroError
from ...common.flower.wire import pack_replies, unpack_queries
from ...common.partition import is_node_local

app = ClientApp()
log = logging.getLogger(__name__)

_WORKERS: dict[tuple, object] = {}


def _run_key(cfg: Config) -> tuple:
    """Cache key of a worker: the whole configuration (a worker computes with every key it holds)."""
    return tuple(sorted((k, str(v)) for k, v in cfg.to_dict().items()))


KEEP_VERSIONS = 3  # SPIDER needs the current and previous iterate; one spare


class PartitionError(ValueError, DpdroError):
    """The node's partition settings disagree with the run's configuration."""


NODE_KEYS = ("data-root", "cache-dir")  # node-config keys that override the run config on this node
# The keys that can change which records a node holds (role 'data' in common/config.py): the shard-cache key.
DATA_KEYS = keys_with_role("data")


def _config(context: Context) -> Config:
    """The run config with this node's own data-root and cache-dir. PartitionError when the node's declared
    ``dataset`` is not the run's, or when the run is node-local and the node config names no data-root (the node
    would otherwise read the server's path)."""
    cfg = Config.from_mapping(dict(context.run_config), ignore_unknown=True, warn=False)
    node = context.node_config
    if "dataset" in node and str(node["dataset"]) != cfg.dataset:
        raise PartitionError(f"node config dataset={node['dataset']!r}, but the run trains on dataset="
                             f"{cfg.dataset!r}: this site holds other data than the run expects")
    if is_node_local(cfg.partition) and "data-root" not in node:
        raise PartitionError("partition='node-local' but this node's node config sets no data-root: start the "
                             "SuperNode with --node-config \"data-root='/site/data' ...\" (where this site keeps "
                             "its records)")
    local = {k: str(node[k]) for k in NODE_KEYS if k in node}
    return cfg.with_updates(local) if local else cfg


def shard_cache_path(cfg: Config, pid: int):
    """Local file of partition ``pid``'s shard: ``<cache-dir>/shards/<dataset>-<hash>-p<pid>-of-<N>.npz``,
    the hash over every configuration key that can change the data (``DATA_KEYS``) and, for user files, their
    ``data_fingerprint`` (names, sizes, modification times). None for user code (no cache: its data may change
    unseen)."""
    import hashlib
    import json

    from ...common.data import data_fingerprint, resolve_cache_dir

    files = data_fingerprint(cfg)
    if files is None:
        return None
    values = {k: v for k, v in sorted(cfg.to_dict().items()) if k in DATA_KEYS} | ({"files": files} if files else {})
    digest = hashlib.sha256(json.dumps(values, sort_keys=True, default=str).encode()).hexdigest()[:20]
    return resolve_cache_dir(cfg.cache_dir) / "shards" / f"{cfg.dataset}-{digest}-p{pid}-of-{cfg.num_clients}.npz"


def _load_shard(cfg: Config, pid: int):
    """The node's shard (ArrayDataset): from its local cache file when present, else built from the data
    set and partition and written to that file atomically (a failed write only costs the cache)."""
    import zipfile

    import numpy as np
    import torch

    from ...common.data import ArrayDataset, load_from_config
    from ...common.partition import make_partition

    path = shard_cache_path(cfg, pid)
    if path is not None and path.is_file():
        try:
            with np.load(path, allow_pickle=False) as z:
                groups = torch.from_numpy(z["groups"]) if int(z["num_groups"]) else None
                return ArrayDataset(torch.from_numpy(z["x"]), torch.from_numpy(z["y"]), int(z["num_classes"]),
                                    str(z["name"]), groups, int(z["num_groups"]))
        except (OSError, EOFError, ValueError, KeyError, zipfile.BadZipFile) as e:  # truncated: not a zip
            log.warning("shard cache %s unreadable (%s): rebuilding it", path, e)
    if is_node_local(cfg.partition):
        shard = _all_local_records(cfg)
    else:
        train = load_from_config(cfg, train=True)
        shard = train.subset(make_partition(cfg.data, train.y.numpy())[pid])
    if path is None:
        return shard
    try:
        groups = shard.groups.numpy() if shard.groups is not None else np.zeros(0, np.int64)
        with atomic_writer(path, mode=0o600) as f:  # the node's own records: readable by the node's user only
            np.savez(f, x=shard.x.numpy(), y=shard.y.numpy(), num_classes=shard.num_classes, name=shard.name,
                     groups=groups, num_groups=shard.num_groups if shard.groups is not None else 0)
    except OSError as e:
        log.warning("could not write shard cache %s: %s", path, e)
    return shard


def _load_held_out(cfg: Config, pid: int):
    """The node's held-out records for eval-data=nodes (common/eval_counts.py), None otherwise: with
    partition=node-local its own data's evaluation split (eval-split: test or validation), kept out of training
    (``_all_local_records``); else its part of the evaluation split, partitioned as the training records. A node
    whose data has no evaluation split holds none (it says so when asked to evaluate)."""
    from ...common.data import DataError, load_from_config
    from ...common.eval_counts import evaluates_on_nodes
    from ...common.partition import make_partition

    if not evaluates_on_nodes(cfg):
        return None
    try:
        records = load_from_config(cfg, train=False)
    except DataError as e:
        log.warning("partition %d: no held-out records to evaluate on (%s)", pid, e)
        return None
    if is_node_local(cfg.partition):
        return records
    return records.subset(make_partition(cfg.data, records.y.numpy())[pid])


def _all_local_records(cfg: Config):
    """Node-local data: every record the node's data-root holds, its training and test splits together (a single
    CSV file's or image folder's held-out part included): nobody evaluates on a site's records (the server
    evaluates on its own data), so none is left out of training. With eval-data=nodes only its training split: the
    evaluation split is the node's held-out records."""
    import torch

    from ...common.data import ArrayDataset, load_from_config
    from ...common.eval_counts import evaluates_on_nodes

    if evaluates_on_nodes(cfg):  # eval-data=nodes: the evaluation split is held out (``_load_held_out``)
        return load_from_config(cfg, "train")
    parts = [load_from_config(cfg, "train"), load_from_config(cfg, "test")]
    a, b = parts
    if a.num_classes != b.num_classes:
        raise PartitionError(f"this node's data at {cfg.data_root}: its training split has {a.num_classes} classes, "
                             f"its test split {b.num_classes}; declare them with config key 'classes'")
    groups = torch.cat([a.groups, b.groups]) if a.groups is not None and b.groups is not None else None
    return ArrayDataset(torch.cat([a.x, b.x]), torch.cat([a.y, b.y]), a.num_classes, a.name, groups,
                        a.num_groups if groups is not None else 0)


def _num_records(cfg: Config, pid: int) -> int:
    """Shard size without importing torch when the cache file exists (the 'hello' message)."""
    import zipfile

    import numpy as np

    key = (_run_key(cfg), pid)
    if key not in _WORKERS:
        path = shard_cache_path(cfg, pid)
        if path is not None and path.is_file():
            try:
                with np.load(path, allow_pickle=False) as z:
                    return int(z["y"].shape[0])
            except (OSError, EOFError, ValueError, KeyError, zipfile.BadZipFile):
                pass
    return _worker(cfg, pid).num_records


def _partition(context: Context, cfg: Config) -> int:
    pid = int(context.node_config.get("partition-id", -1))
    parts = int(context.node_config.get("num-partitions", cfg.num_clients))
    if parts != cfg.num_clients or not 0 <= pid < cfg.num_clients:
        raise PartitionError(f"node_config partition-id={pid} num-partitions={parts} does not fit the run's "
                             f"num-clients={cfg.num_clients}")
    return pid


def _worker(cfg: Config, pid: int):
    from ..worker import ShardWorker

    run_key = _run_key(cfg)
    key = (run_key, pid)
    if key not in _WORKERS:
        if cfg.threads:
            import torch

            torch.set_num_threads(cfg.threads)
        shard = _load_shard(cfg, pid)
        for old in [k for k in _WORKERS if k[0] != run_key]:  # shards of an earlier run: free them
            del _WORKERS[old]
        _WORKERS[key] = ShardWorker(cfg, shard, pid, held_out=_load_held_out(cfg, pid))
    return _WORKERS[key]


def _warm_endpoint(context: Context):
    """(endpoint, idle seconds) of this node's warm worker (client/flower/warm.py), or None where there is none:
    outside a deployment's ``flwr-clientapp`` process, or with node config warm-seconds=0."""
    from . import warm

    idle = warm.idle_seconds(context.node_config)
    if idle == 0 or not warm.in_deployment():
        return None
    return warm.Endpoint.for_node(context.node_id, os.getppid()), idle


def _on_warm_worker(context: Context, request: dict):
    """``request``'s value computed by this node's warm worker; None where there is none or it cannot be
    reached (the caller computes it here then). Exceptions of the computation itself are raised."""
    from . import warm

    try:
        where = _warm_endpoint(context)
        if where is None:
            return None
        return warm.call(where[0], where[1], os.getppid(), request)
    except (warm.WarmUnavailable, OSError) as e:  # OSError: e.g. no writable temporary folder for the socket
        log.warning("computing in the ClientApp process: %s", e)
        return None


@app.query("hello")
def hello(msg: Message, context: Context) -> Message:
    """This node's partition id and shard size (public: the unit of privacy fixes it, server/ledger.py); resets its
    cache of model versions. In a deployment this starts the node's warm worker, which builds the shard and model
    for the releases.
    A node that cannot take part (its data cannot be loaded, e.g. its data folder is missing, or its node
    config does not fit the run) answers with its partition id (-1 if its node config names none) and the error
    (key 'error') instead of a size, so that the server names the partition and applies on-client-failure."""
    pid = int(context.node_config.get("partition-id", -1))  # named in an error before it is checked
    try:
        cfg = _config(context)
        pid = _partition(context, cfg)
        request = {"op": "records", "config": cfg.to_dict() | faults.carry(), "partition": pid}
        num_records = _on_warm_worker(context, request)
        if num_records is None:
            num_records = _num_records(cfg, pid)
    except Exception as e:  # noqa: BLE001 - any error: reported with the partition; the server's policy decides
        log.warning("partition %d cannot take part: %s: %s", pid, type(e).__name__, e)
        answer = {"partition": pid, "error": f"{type(e).__name__}: {e}"}
    else:
        answer = {"partition": pid, "num-records": num_records}
    context.state["versions"] = ArrayRecord({})
    return Message(RecordDict({"hello": ConfigRecord(answer)}), reply_to=msg)


def _answer(context: Context, queries, incoming):
    """This node's replies to ``queries``, with the model versions it holds plus ``incoming``; keeps the
    newest versions in ``context.state``. Raises KeyError if a referenced version is missing."""
    cfg = _config(context)
    pid = _partition(context, cfg)
    held = context.state["versions"] if "versions" in context.state else ArrayRecord({})
    versions = {int(k): a.numpy() for k, a in held.items()}
    versions.update(incoming)
    needed = {v for q in queries for v in q.versions}
    missing = sorted(needed - set(versions))
    if missing:  # the server resends them (e.g. after this node restarted)
        raise KeyError(f"missing model versions {missing}")
    replies = _on_warm_worker(context, {"op": "answer", "config": cfg.to_dict() | faults.carry(), "partition": pid,
                                        "queries": queries, "versions": {v: versions[v] for v in needed}})
    if replies is None:
        worker = _worker(cfg, pid)
        replies = [worker.answer(q, versions) for q in queries]
    newest = sorted(versions)[-KEEP_VERSIONS:]
    context.state["versions"] = ArrayRecord({str(k): Array(versions[k]) for k in newest})
    return replies


@app.query("release")
def release(msg: Message, context: Context) -> Message:
    """Clipped sums of this node for the queries of one round (central and local noise modes)."""
    queries, incoming = unpack_queries(msg.content)
    return Message(pack_replies(_answer(context, queries, incoming)), reply_to=msg)


@app.train(mods=[secaggplus_mod])
def secure_release(msg: Message, context: Context) -> Message:
    """Stage 2 of SecAgg+: the node's noised sums (each query's divided by its sensitivity) as the legacy
    FitRes parameters, num_examples 1; the mod quantises and masks them, and no other field carries data."""
    import flwr.compat.common.recorddict_compat as compat
    import numpy as np
    from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays

    from ...common.codec import decode_config, to_units

    fitins = compat.recorddict_to_fitins(msg.content, keep_input=True)
    queries, version_ids = decode_config(fitins.config)
    arrays = parameters_to_ndarrays(fitins.parameters)
    replies = _answer(context, queries, dict(zip(version_ids, arrays, strict=True)))
    for r in replies:
        if not np.all(np.isfinite(r.total)):  # the server cannot inspect a masked reply: refuse here
            raise ValueError(f"reply to {r.qid} contains NaN or Inf; not sent")
    res = FitRes(Status(Code.OK, ""), ndarrays_to_parameters(to_units(queries, replies)), 1, {})
    return Message(compat.fitres_to_recorddict(res, keep_input=False), reply_to=msg)
