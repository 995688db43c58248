"""Single-node training: the clients in this process (``LocalTransport``) driven by the engine. One function
for ``dpdro train`` and the Python API ``dpdro.fit``, so both check, load and write the same things."""

from __future__ import annotations

from torch import nn

from ..client.local_transport import LocalTransport
from ..common.config import Config, check_device
from ..common.data import ArrayDataset, load_from_config
from ..common.model_fix import fix_model
from ..common.models import validate_model
from ..server.engine import Progress, RunResult, train
from ..server.rundir import check_out_dir


def prepare_local(cfg: Config, *, resume: bool = False, data: tuple[ArrayDataset, ArrayDataset] | None = None,
                  module: nn.Module | None = None) -> tuple[LocalTransport, ArrayDataset]:
    """(in-process transport over the training records, evaluation records) of ``cfg``, after checking the
    out-dir and the device (ConfigError, before any data is loaded). ``data``: (train, evaluation) record sets
    to use instead of loading config key ``dataset`` (the API's ``data=``); ``module``: a model object for the
    clients instead of config key ``model``. Raises DataError for missing data, ModelError for a bad module."""
    check_out_dir(cfg.out_dir, resume=resume, overwrite=cfg.overwrite)  # before loading any data
    check_device(cfg.device)
    if data is None:
        train_set, test_set = load_from_config(cfg, train=True), load_from_config(cfg, train=False)
    else:
        train_set, test_set = data
    from ..server.node_evaluation import evaluates_on_nodes

    # eval-data=nodes: the clients hold the evaluation records (partitioned as the training ones) and evaluate on
    # them; the server keeps test_set only for its shapes and class count
    held_out = test_set if evaluates_on_nodes(cfg) else None
    return LocalTransport(cfg, train_set, module, held_out), test_set


def train_local(cfg: Config, *, resume: bool = False, progress: Progress | None = None,
                data: tuple[ArrayDataset, ArrayDataset] | None = None, module: nn.Module | None = None) -> RunResult:
    """Train ``cfg`` single-node and write its run directory (``cfg.out_dir``); returns the engine's RunResult.

    ``data`` as in ``prepare_local``; ``module``: a model object to train instead of config key ``model``
    (``engine.train``). Raises what ``prepare_local`` and ``engine.train`` raise (ConfigError, DataError,
    ModelError, ResumeError, PrivacyBudgetExceeded)."""
    if module is not None:
        validate_model(fix_model(module, cfg.model_fix))  # before any data is loaded
    transport, test_set = prepare_local(cfg, resume=resume, data=data, module=module)
    return train(cfg, transport, test_set, resume=resume, progress=progress, module=module)
