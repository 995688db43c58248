"""``dpdro export --format onnx``: the ONNX file's logits equal the torch model's to 1e-5 and
its 'predicted' output equals ``dpdro predict`` (post-hoc adjustment included), for any batch size; without the
optional extra dpdro[onnx] the command says which extra to install, before any work."""

from __future__ import annotations

import csv
import importlib.util
import json

import numpy as np
import pytest
import torch
from test_user_data import CSV_KEYS, HEADER, IMAGE_KEYS, PRIVATE_RUN, easy_rows, write_csv, write_images

from dpdro.cli import main
from dpdro.server import onnx_export
from dpdro.server.model_files import load_model
from dpdro.server.prediction import load_data

RUN = {**PRIVATE_RUN, "iterations": 6, "eval-every": 6, "posthoc-tau": 1.0}
HAVE_EXTRA = not onnx_export.missing_modules()


def _train(tmp_path, kind: str):
    if kind == "csv":
        write_csv(tmp_path / "data" / "train.csv", easy_rows(200, 1), HEADER)
        write_csv(tmp_path / "data" / "test.csv", easy_rows(50, 2), HEADER)
        keys = {**RUN, **CSV_KEYS}
    else:  # the default image model (convnet: convolutions, GroupNorm)
        write_images(tmp_path / "data" / "train", 100, 1)
        write_images(tmp_path / "data" / "test", 25, 2)
        keys = {**RUN, **IMAGE_KEYS}
    run = tmp_path / "run"
    keys |= {"data-root": tmp_path / "data", "out-dir": run}
    assert main(["train", "--set"] + [f"{k}={v}" for k, v in keys.items()]) == 0
    return run


def _run_onnx(path, x: np.ndarray) -> list[np.ndarray]:
    """Outputs of the ONNX file on ``x``: onnxruntime when installed, else onnx's reference evaluator."""
    if importlib.util.find_spec("onnxruntime") is not None:
        import onnxruntime

        session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        return session.run(None, {"input": x})
    from onnx.reference import ReferenceEvaluator

    return ReferenceEvaluator(str(path)).run(None, {"input": x})


@pytest.mark.skipif(not HAVE_EXTRA, reason="optional extra dpdro[onnx] (onnx, onnxscript) not installed: "
                                           "pip install 'dpdro[onnx]'")
@pytest.mark.parametrize("kind", ["csv", "images"])
def test_onnx_export_gives_the_torch_logits_and_the_runs_predictions(tmp_path, kind, capsys):
    run = _train(tmp_path, kind)
    capsys.readouterr()
    assert main(["export", "--run", str(run), "--format", "onnx"]) == 0
    assert "ONNX model written to" in capsys.readouterr().out
    model, spec = load_model(run)
    assert spec.prediction_shift is not None  # the adjustment is in play, so 'predicted' must include it
    x = load_data(run, "test").x
    with torch.no_grad():
        logits = model(x.to(spec.torch_dtype)).numpy()
    assert main(["predict", "--run", str(run), "--data", "test"]) == 0
    predicted = [int(r["predicted"]) for r in csv.DictReader(open(run / "predictions_test.csv"))]
    for batch in (x, x[:3]):  # the batch size is free
        onnx_logits, onnx_predicted = _run_onnx(run / "model.onnx", batch.numpy())
        np.testing.assert_allclose(onnx_logits, logits[:len(batch)], rtol=0, atol=1e-5)
        assert onnx_predicted.tolist() == predicted[:len(batch)]
    import onnx

    props = {p.key: p.value for p in onnx.load(str(run / "model.onnx")).metadata_props}
    assert json.loads(props["classes"]) == spec.classes
    assert json.loads(props["prediction_shift"]) == pytest.approx(spec.prediction_shift.tolist())


def test_export_without_the_extra_names_it_before_any_work(tmp_path, capsys, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "onnxscript" else
                        real(name, *a))
    assert main(["export", "--run", str(tmp_path / "no-run")]) == 2
    err = capsys.readouterr().err
    assert "needs the optional extra dpdro[onnx]; " in err and "onnxscript not installed here: pip install " \
        "'dpdro[onnx]'" in err
