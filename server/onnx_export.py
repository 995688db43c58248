"""``dpdro export --format onnx``: a finished run's model as an ONNX file, for runtimes without PyTorch.

The graph takes ``input`` (batch, *input_shape) in the run's dtype, scaled as in training (model.json's
``input_scaling`` and ``preprocessing``), and gives ``logits`` (batch, K) and ``predicted`` (batch,) int64 =
argmax(logits + prediction_shift): the run's own prediction, post-hoc logit adjustment included. The batch size is
free. The file's metadata (``metadata_props``) holds the class names, the prediction shift and the model format.

It needs the optional extra ``dpdro[onnx]`` (``onnx`` and ``onnxscript``, torch.onnx's exporter: about 10 MB of
wheels, 43 MB installed, measured 2026-12-02); without it ``export_onnx`` raises ``ExportUnavailable`` naming it.
Post-processing of the released model: no privacy cost.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import TYPE_CHECKING

from ..common.atomic import atomic_writer
from ..common.errors import DpdroError

if TYPE_CHECKING:  # imported in export_onnx: the CLI names a missing extra before loading torch
    from torch import nn

ONNX_FILE = "model.onnx"
EXTRA_MODULES = ("onnx", "onnxscript")  # what torch.onnx.export(dynamo=True) imports
INSTALL_HINT = "pip install 'dpdro[onnx]' (onnx and onnxscript: about 10 MB of wheels)"


class ExportUnavailable(RuntimeError, DpdroError):
    """The optional packages an export needs are not installed; the message names the extra to install."""


def missing_modules() -> list[str]:
    """The modules of the onnx extra that are not installed here."""
    return [m for m in EXTRA_MODULES if importlib.util.find_spec(m) is None]


def export_onnx(run_dir: str | Path, out: str | Path | None = None, *, module: nn.Module | None = None) -> Path:
    """Write the run's model as ONNX to ``out`` (default ``run_dir``/model.onnx), atomically; returns the path.
    ``module``: an untrained module of the architecture, for a run of ``dpdro.fit`` with a module object.
    Raises ExportUnavailable without the extra (before loading anything), RunFileError for missing model files."""
    missing = missing_modules()
    if missing:
        raise ExportUnavailable(f"dpdro export --format onnx needs the optional extra dpdro[onnx]; "
                                f"{', '.join(missing)} not installed here: {INSTALL_HINT}")
    import onnx
    import torch

    from .model_files import MODEL_FORMAT, load_model

    class Predictor(torch.nn.Module):
        """The run's model with its prediction rule: (logits, argmax(logits + shift))."""

        def __init__(self, inner: nn.Module, shift: torch.Tensor) -> None:
            super().__init__()
            self.inner = inner
            self.register_buffer("shift", shift)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            logits = self.inner(x)
            return logits, (logits + self.shift).argmax(1)

    model, spec = load_model(run_dir, module=module)
    shift = spec.prediction_shift
    k = spec.num_classes
    wrapper = Predictor(model, torch.zeros(k) if shift is None else torch.as_tensor(shift)).to(spec.torch_dtype)
    example = torch.zeros(2, *spec.input_shape, dtype=spec.torch_dtype)
    program = torch.onnx.export(wrapper.eval(), (example,), dynamo=True, verbose=False,
                                dynamic_shapes=({0: torch.export.Dim("batch")},), input_names=["input"],
                                output_names=["logits", "predicted"])
    proto = program.model_proto
    onnx.helper.set_model_props(proto, {
        "dpdro_format": MODEL_FORMAT, "classes": json.dumps(spec.classes),
        "prediction_shift": json.dumps(None if shift is None else shift.tolist()),
        "input_shape": json.dumps(spec.input_shape), "input_scaling": str(spec.raw.get("input_scaling", ""))})
    path = Path(out) if out is not None else Path(run_dir) / ONNX_FILE
    with atomic_writer(path) as f:
        onnx.save(proto, f)
    return path
