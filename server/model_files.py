"""The trained model of a run as files anyone can load: ``model.pt`` (the ``state_dict``) and
``model.json`` (how to build the module it fits and how to predict with it), and the loader and prediction
helpers that ``dpdro predict`` / ``dpdro evaluate`` and users share.

model.json holds: ``factory`` (the config value ``model``: a registered name, or an import path once that is
supported, or null for a module object passed to ``dpdro.fit``), ``model_fix`` (config key ``model-fix``, applied
again when the module is rebuilt), ``num_classes``, ``classes`` (names),
``input_shape`` (one record, e.g. [1, 28, 28]), ``dtype``, the ``dataset`` and its input scaling, and what
prediction needs beyond the weights: ``priors`` (the class priors released in the run, or declared public) and
``posthoc_tau``; the prediction is argmax(logits - posthoc_tau log priors) (``prediction_shift``), exactly as
the run's own evaluation. Both files are post-processing of the released iterate: no privacy cost.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..common.atomic import atomic_write_bytes
from ..common.data import describe_input_scaling
from ..common.model_fix import fix_model
from ..common.models import make_model, validate_model
from ..common.scattering import feature_description
from .rundir import RunFileError, read_json, write_json

MODEL_FORMAT = "dpdro-model/1"
MODEL_PT = "model.pt"
MODEL_JSON = "model.json"


def input_scaling(dataset: str, options: dict | None = None) -> str:
    """How records of ``dataset`` (an ArrayDataset name) are turned into model inputs, in words (model.json): the
    data set's ``DatasetSpec.input_scaling`` (``options``, the run's configuration keys, say it for the user data
    sets csv and image-folder), then the feature front-end (key features)."""
    front_end = feature_description(str((options or {}).get("features", "none")))
    scaling = describe_input_scaling(dataset, options or {})
    return f"{scaling}; {front_end}" if front_end else scaling


@dataclass(frozen=True)
class ModelSpec:
    """The contents of model.json (see the module docstring); ``prediction_shift`` is (K,) float64 or None."""

    factory: str | None
    num_classes: int
    classes: list[str]
    input_shape: list[int]
    dtype: str
    priors: list[float] | None
    posthoc_tau: float
    raw: dict

    @property
    def prediction_shift(self) -> np.ndarray | None:
        """-posthoc_tau log(priors) (K,) added to the logits before the argmax, or None (plain argmax)."""
        if self.posthoc_tau == 0 or self.priors is None:
            return None
        return -self.posthoc_tau * np.log(np.asarray(self.priors, dtype=np.float64))

    @property
    def model_fix(self) -> str:
        """Config key ``model-fix`` of the run ('none' for runs from before the key): applied again when the
        module is rebuilt, so that model.pt's keys fit."""
        return str(self.raw.get("model_fix", "none"))

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch.float64 if self.dtype == "float64" else torch.float32


def state_dict_at(module: nn.Module, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``module``'s state_dict with its parameters replaced by ``params`` (name -> tensor, as
    ``FlatModel.unflatten`` gives them) and its buffers as they are; every tensor a fresh contiguous copy."""
    state = {k: v.detach().clone() for k, v in module.state_dict().items()}
    for name, value in params.items():
        if name not in state:
            raise KeyError(f"parameter {name!r} is not in the module's state_dict")
        state[name] = value.detach().clone().contiguous()
    return state


def write_model_files(run_dir: Path, state: dict[str, torch.Tensor], meta: dict) -> None:
    """Atomically write ``run_dir``/model.pt (``state``, a state_dict) and model.json (``meta`` plus the format
    tag and the file name of the weights)."""
    buf = io.BytesIO()
    torch.save(state, buf)
    atomic_write_bytes(Path(run_dir) / MODEL_PT, buf.getvalue())
    write_json(Path(run_dir) / MODEL_JSON, {"format": MODEL_FORMAT, "state_dict": MODEL_PT, **meta})


def read_model_spec(run_dir: str | Path) -> ModelSpec:
    """The ModelSpec of ``run_dir``/model.json. Raises RunFileError naming the file when it is missing (a run
    that did not finish, or one from before model files existed) or not a dpdro model description."""
    path = Path(run_dir) / MODEL_JSON
    if not path.is_file():
        raise RunFileError(f"{path} is missing: {run_dir} holds no finished dpdro run with a model (runs write "
                           f"{MODEL_JSON} and {MODEL_PT} when they finish)")
    raw = read_json(path)
    try:
        if raw.get("format") != MODEL_FORMAT:
            raise ValueError(f"format {raw.get('format')!r}, expected {MODEL_FORMAT!r}")
        return ModelSpec(raw["factory"], int(raw["num_classes"]), [str(c) for c in raw["classes"]],
                         [int(s) for s in raw["input_shape"]], str(raw["dtype"]),
                         None if raw["priors"] is None else [float(p) for p in raw["priors"]],
                         float(raw["posthoc_tau"]), raw)
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise RunFileError(f"{path} is not a dpdro model description ({type(e).__name__}: {e}); restore it from "
                           "the run's own output") from None


def load_model(run_dir: str | Path, module: nn.Module | None = None) -> tuple[nn.Module, ModelSpec]:
    """(the trained model in eval mode, its ModelSpec) of a finished run: a fresh module built from model.json
    (``make_model(factory, num_classes, seed, dtype, input_shape, model_fix)``: a registered name, or an import path
    that must import here; BatchNorm replaced again when the run set model-fix) with model.pt loaded into it
    (strictly: every key must fit).

    ``module``: an untrained module of the same architecture to load the weights into instead, required when
    the run trained a module object passed to ``dpdro.fit`` (model.json's factory is null then); with the run's
    model-fix, a fixed copy of it is loaded and returned (``module`` itself is left as it is).
    Raises RunFileError for missing or unreadable files, ValueError when no module can be built."""
    spec = read_model_spec(run_dir)
    if module is None:
        if spec.factory is None:
            raise ValueError(f"{Path(run_dir) / MODEL_JSON}: the run trained a module object passed to dpdro.fit "
                             f"({spec.raw.get('module_class')}); build that architecture and pass it as module=")
        module = make_model(spec.factory, spec.num_classes, seed=0, dtype=spec.torch_dtype,
                            input_shape=tuple(spec.input_shape), fix=spec.model_fix)
    else:
        module = validate_model(fix_model(module, spec.model_fix).to(spec.torch_dtype))
    path = Path(run_dir) / MODEL_PT
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise RunFileError(f"{path} is missing: restore it from the run's own output") from None
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        raise RunFileError(f"{path} is unreadable ({type(e).__name__}: {e}): restore it from the run's own "
                           "output") from None
    module.load_state_dict(state, strict=True)
    return module.eval(), spec


def predict_logits(module: nn.Module, x: torch.Tensor, dtype: torch.dtype, batch: int = 2048) -> torch.Tensor:
    """Logits (N, K) of ``module`` on inputs ``x`` (N, *input_shape), in batches of ``batch`` records (the run's
    evaluation uses the same batches, so the predictions repeat its accuracy exactly)."""
    with torch.no_grad():
        return torch.cat([module(x[s:s + batch].to(dtype)) for s in range(0, len(x), batch)])


def predict_classes(logits: torch.Tensor, shift: np.ndarray | None) -> np.ndarray:
    """Predicted class (N,) int64: argmax of logits (N, K) plus ``shift`` (K,) when given (post-hoc logit
    adjustment, as the run's evaluation does)."""
    if shift is not None:
        logits = logits + torch.as_tensor(shift).to(logits.dtype)
    return logits.argmax(1).numpy()


def describe_module_class(module: nn.Module) -> str:
    """'module:QualName' of a module's class (for model.json when the module was passed as an object)."""
    cls = type(module)
    return f"{cls.__module__}:{cls.__qualname__}"

