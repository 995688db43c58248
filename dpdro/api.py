"""The Python API beside the CLI: ``dpdro.fit`` trains like ``dpdro train`` (same keys, same validation, same run
directory) and hands back the trained ``nn.Module``, the privacy report and the run directory.

    import dpdro
    result = dpdro.fit({"dataset": "mnist-st", "epsilon": 4.0, "iterations": 50, "out-dir": "runs/api"})
    result.model        # nn.Module with the trained weights, in eval mode
    result.privacy      # epsilon spent, delta, trust model, what is not accounted
    result.run_dir      # config.json, metrics.csv, summary.json, model.pt, model.json, MODEL_CARD.md, plots/

torch is imported only when ``fit`` runs (``import dpdro`` stays cheap for the CLI).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dpdro.common.config import Config, ConfigError, load_toml_keys

if TYPE_CHECKING:
    import torch
    from torch import nn

    from dpdro.common.data import ArrayDataset

# What ``FitResult.privacy`` holds: the summary.json entries a user needs to state the guarantee.
PRIVACY_KEYS = ("private", "epsilon_target", "epsilon_spent", "delta", "accountant", "noise_mode", "trust_model",
                "epsilon_against_server", "noise_multipliers", "checkpoint_returned", "not_accounted")


@dataclass
class FitResult:
    """What ``fit`` returns: ``model`` (the trained nn.Module in eval mode), ``privacy`` (PRIVACY_KEYS of the
    summary), ``run_dir`` (the run directory), ``summary`` (all of summary.json) and ``metrics`` (the evaluation
    rows of metrics.csv)."""

    model: nn.Module
    privacy: dict
    run_dir: Path
    summary: dict
    metrics: list[dict] = field(default_factory=list)


def config_of(config: Config | Mapping[str, Any] | str | os.PathLike | None) -> Config:
    """A validated Config from a Config, a mapping of configuration keys (kebab-case, as on the command line),
    or the path of a TOML file of keys (as ``dpdro train --config``). Raises ConfigError naming the key."""
    if config is None:
        return Config.from_mapping({})
    if isinstance(config, Config):
        return config
    if isinstance(config, (str, os.PathLike)):
        return Config.from_mapping(load_toml_keys(config))
    if isinstance(config, Mapping):
        return Config.from_mapping(dict(config))
    raise ConfigError(f"fit: config must be a mapping of keys, a TOML file path or a Config; got "
                      f"{type(config).__name__}")


def records(x: torch.Tensor | torch.utils.data.Dataset, y: torch.Tensor | None = None,
            num_classes: int | None = None, *, groups: torch.Tensor | None = None, num_groups: int = 0,
            name: str = "python", class_names: list[str] | None = None) -> ArrayDataset:
    """Records for ``fit(data=...)``, ``evaluate`` and ``predict``: inputs ``x`` (N, *input shape) float, labels
    ``y`` (N,) integers in [0, num_classes), optional ``groups`` (N,) in [0, num_groups) for worst-group accuracy;
    or ``x`` a torch ``Dataset`` of (input, label) items (e.g. a TensorDataset, or torchvision's with a
    ToTensor transform) and no ``y``: every item is read once. ``num_classes`` is declared, never read off the
    labels (a data-dependent constant would be an unaccounted release); ``class_names`` (K,) optionally names
    them (model.json, predictions, the model card).
    Raises ValueError naming the argument for a wrong shape, dtype or range, or a missing num_classes."""
    import torch

    from dpdro.common.data import ArrayDataset

    if num_classes is None:
        raise ValueError("records: num_classes must be declared (records(x, y, num_classes) or records(dataset, "
                         "num_classes=K)); it is never read off the labels")
    if isinstance(x, torch.utils.data.Dataset):
        if y is not None:
            raise ValueError("records: with a Dataset as x, leave y out (its items are (input, label) pairs)")
        items = [x[i] for i in range(len(x))]
        if not items or not all(isinstance(it, (tuple, list)) and len(it) >= 2 for it in items):
            raise ValueError(f"records: the Dataset must hold (input, label) items; got {len(items)} items"
                             + (f", the first a {type(items[0]).__name__}" if items else ""))
        x = torch.stack([torch.as_tensor(it[0]) for it in items])
        y = torch.as_tensor([int(it[1]) for it in items])
    if y is None:
        raise ValueError("records: y (labels) is required when x is a tensor")
    x, y = torch.as_tensor(x), torch.as_tensor(y)
    if not x.is_floating_point():
        raise ValueError(f"records: x must be a float tensor (scale the inputs yourself); got dtype {x.dtype}")
    if y.dim() != 1 or len(y) != len(x) or y.is_floating_point() or y.dtype == torch.bool:
        raise ValueError(f"records: y must be integer labels of shape ({len(x)},); got {tuple(y.shape)} {y.dtype}")
    if int(num_classes) < 2:
        raise ValueError(f"records: num_classes must be at least 2; got {num_classes}")
    if len(y) and (int(y.min()) < 0 or int(y.max()) >= num_classes):
        raise ValueError(f"records: labels must lie in [0, {num_classes}); got values in [{int(y.min())}, "
                         f"{int(y.max())}]")
    if groups is not None:
        groups = torch.as_tensor(groups).long()
        if groups.shape != y.shape or (len(groups) and (int(groups.min()) < 0 or int(groups.max()) >= num_groups)):
            raise ValueError(f"records: groups must be ({len(y)},) integers in [0, num_groups={num_groups})")
    names = tuple(str(c) for c in class_names or ())
    if names and len(names) != int(num_classes):
        raise ValueError(f"records: class_names has {len(names)} names for num_classes={num_classes}")
    return ArrayDataset(x.float(), y.long(), int(num_classes), name, groups, num_groups if groups is not None else 0,
                        names)


def import_path(obj) -> str | None:
    """'package.module:QualName' when importing that gives back ``obj`` itself (then config key ``model`` can name
    it, as on the command line), else None (a lambda, a local function, a class defined in ``__main__``)."""
    import importlib

    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", "")
    if not module or module == "__main__" or "<" in qualname:
        return None
    try:
        target = importlib.import_module(module)
        for part in qualname.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError):
        return None
    return f"{module}:{qualname}" if target is obj else None


def _seeded_build(factory: Callable[..., nn.Module], num_classes: int, input_shape: tuple[int, ...],
                  seed: int) -> nn.Module:
    """``factory(num_classes[, input_shape=...])`` with torch's global generator seeded by ``seed`` (as
    ``common.models.make_model`` builds registered models), the caller's generator state restored afterwards.
    Raises ValueError when it does not return an nn.Module."""
    import inspect

    import torch
    from torch import nn

    try:
        takes_shape = "input_shape" in inspect.signature(factory).parameters
    except (TypeError, ValueError):
        takes_shape = False
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        module = factory(num_classes, **({"input_shape": input_shape} if takes_shape else {}))
    if not isinstance(module, nn.Module):
        raise ValueError(f"fit: model factory {factory!r} returned {type(module).__name__}, not an nn.Module")
    return module


def fit(config: Config | Mapping[str, Any] | str | os.PathLike | None = None, *,
        data: tuple[ArrayDataset, ArrayDataset] | None = None,
        model: str | nn.Module | Callable[[int], nn.Module] | None = None, progress=None) -> FitResult:
    """Train as ``dpdro train`` would and return the trained model, the privacy report and the run directory.

    config: a mapping of configuration keys (``dpdro keys`` lists them; e.g. {"epsilon": 2.0, "out-dir": ...}),
        a TOML file path, or a Config. Validated before any work (ConfigError names the key, value and what is
        allowed); the out-dir rules are those of the CLI (key overwrite = true to replace a run, resume = true
        to continue one).
    data: (train, evaluation) record sets (``ArrayDataset``, e.g. from ``records(x, y, num_classes)``) to train
        on instead of config key ``dataset``, which the run then records as 'python-data' (no file holds them:
        evaluate with ``dpdro.evaluate(run_dir, records(...))``); a model must be named (``model=`` or key
        ``model``), since 'auto' picks a model by data set.
    model: a registered model name or import path 'package.module:factory' (the same as key ``model``), an
        ``nn.Module`` to train (validated; its own initial parameters), or a callable
        ``factory(num_classes[, input_shape])`` (an importable one becomes key ``model``, exactly as on the
        command line; any other is built here with torch seeded by key ``seed``). model.json names the factory
        when there is one; for an object it records the class, and ``load_model(run_dir, module=...)`` needs an
        untrained module of that architecture.
    progress: an ``engine.Progress`` of callbacks (on_start, on_step, on_eval), or None.

    Returns a FitResult. Raises ConfigError, DataError, ModelError (a model that mixes records, e.g. BatchNorm
    without config key model-fix=groupnorm, which replaces it with GroupNorm in a copy: ``model`` stays as it is),
    ValueError (bad ``data``/``model`` arguments) and what training raises (PrivacyBudgetExceeded, ResumeError).
    """
    from torch import nn

    from dpdro.common.data import PYTHON_DATA, ArrayDataset, load_from_config, with_features
    from dpdro.launch.local import train_local
    from dpdro.server.model_files import load_model
    from dpdro.server.rundir import check_out_dir

    # dp-accounting's per-order convergence chatter (the CLI silences it too); the user's other loggers stay as set
    logging.getLogger("absl").setLevel(logging.ERROR)
    cfg = config_of(config)
    if isinstance(model, str):
        cfg = cfg.with_updates({"model": model})
    if data is not None:
        if not (isinstance(data, tuple) and len(data) == 2 and all(isinstance(d, ArrayDataset) for d in data)):
            raise ValueError("fit: data must be a (train, evaluation) pair of ArrayDataset, e.g. "
                             "(dpdro.records(x, y, K), dpdro.records(x_test, y_test, K))")
        if data[0].num_classes != data[1].num_classes:
            raise ValueError(f"fit: data's train and evaluation sets declare {data[0].num_classes} and "
                             f"{data[1].num_classes} classes")
        if model is None and cfg.model == "auto":
            raise ValueError("fit: with data= name a model (model= or config key model): 'auto' picks the model "
                             f"of config key dataset ({cfg.dataset!r}), not of your data")
        # what config.json, summary.json and the model card name as the data: not the default of key dataset
        cfg = cfg.with_updates({"dataset": PYTHON_DATA})
        data = tuple(with_features(d, cfg.features, cfg.cache_dir) for d in data)  # as a loaded data set
    module = None
    if isinstance(model, nn.Module):
        module = model
    elif model is not None and not isinstance(model, str):
        if not callable(model):
            raise ValueError(f"fit: model must be a model name, an nn.Module or a factory(num_classes); got "
                             f"{type(model).__name__}")
        path = import_path(model)
        if path is not None:  # the same run as `dpdro train --set model=<path>`; model.json names the factory
            cfg = cfg.with_updates({"model": path})
        else:  # built here: the number of classes and the input shape come from the loaded data
            check_out_dir(cfg.out_dir, resume=cfg.resume, overwrite=cfg.overwrite)  # before loading any data
            if data is None:
                data = (load_from_config(cfg, True), load_from_config(cfg, False))
            module = _seeded_build(model, data[1].num_classes, tuple(data[1].x.shape[1:]), cfg.seed)
    result = train_local(cfg, resume=cfg.resume, progress=progress, data=data, module=module)
    trained, _ = load_model(cfg.out_dir, module=module)
    summary = result.summary
    return FitResult(trained, {k: summary.get(k) for k in PRIVACY_KEYS}, Path(cfg.out_dir), summary, result.metrics)
