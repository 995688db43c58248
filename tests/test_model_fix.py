"""Config key model-fix: BatchNorm replaced with GroupNorm as Opacus' ModuleValidator.fix does, before the
per-record check, and applied wherever the model is built (make_model, dpdro.fit's module, load_model)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import dpdro
from dpdro.common import config, model_fix
from dpdro.common.config import Config, ConfigError
from dpdro.common.model_fix import fix_model
from dpdro.common.models import ModelError, check_per_record, make_model, validate_model
from dpdro.server.engine import load_run_config
from dpdro.server.model_files import load_model

PLUGINS = Path(__file__).parent / "plugins"
TINY_RUN = {"algorithm": "dp-sgd", "epsilon": 4.0, "iterations": 6, "refresh-batch": 40, "diff-batch": 20,
            "lr-x": 0.5, "clip-x": 1.0, "eval-every": 6, "checkpoint-every": 0, "reproducible": True,
            "reproducible-for-testing": True, "threads": 1, "seed": 3}


class Blocks(nn.Module):
    """BatchNorm1d/2d/3d in nested containers, channel counts 3, 6, 16, 48, 64, 100 (gcd(32, C) = 1, 2, 16, 16,
    32, 4 groups), beside layers the fix must leave alone."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 6, 3), nn.BatchNorm2d(6), nn.ReLU(), nn.Conv2d(6, 48, 1),
                                  nn.BatchNorm2d(48, eps=1e-3))
        self.inner = nn.ModuleDict({"a": nn.Sequential(nn.Conv3d(1, 3, 1), nn.BatchNorm3d(3)),
                                    "b": nn.ModuleList([nn.Linear(4, 100), nn.BatchNorm1d(100)])})
        self.head = nn.Sequential(nn.Linear(48, 16), nn.BatchNorm1d(16), nn.LayerNorm(16), nn.Linear(16, 64),
                                  nn.BatchNorm1d(64), nn.GroupNorm(8, 64))


def _norms(model: nn.Module) -> dict[str, tuple]:
    return {name: (type(m).__name__, getattr(m, "num_groups", None), getattr(m, "num_channels", None),
                   getattr(m, "affine", None)) for name, m in model.named_modules() if "Norm" in type(m).__name__}


def _opacus_models() -> list[nn.Module]:
    torchvision = pytest.importorskip("torchvision")
    return [Blocks(), nn.Sequential(nn.Linear(5, 12), nn.BatchNorm1d(12), nn.Tanh(), nn.Linear(12, 2)),
            torchvision.models.resnet18(weights=None, num_classes=10)]


def test_groupnorm_fix_builds_what_opacus_module_validator_fix_builds():
    """Every BatchNorm becomes GroupNorm(gcd(32, C), C, affine), the rule of opacus/validators/batch_norm.py, in
    the same place of the tree; every other tensor is copied unchanged (same state_dict, key order included)."""
    validator = pytest.importorskip("opacus.validators").ModuleValidator
    for model in _opacus_models():
        ours, theirs = fix_model(model, "groupnorm"), validator.fix(model)
        assert str(ours) == str(theirs)
        assert _norms(ours) == _norms(theirs)
        a, b = ours.state_dict(), theirs.state_dict()
        assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
        assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in ours.modules())
    groups = {name: g for name, (_, g, _, _) in _norms(fix_model(Blocks(), "groupnorm")).items()}
    assert groups == {"stem.1": 2, "stem.4": 16, "inner.a.1": 1, "inner.b.1": 4, "head.1": 16, "head.2": None,
                      "head.4": 32, "head.5": 8}


def test_groupnorm_fix_replaces_every_batchnorm_and_leaves_the_rest_and_the_original_alone():
    shared = nn.BatchNorm2d(4)
    frozen = nn.BatchNorm2d(4)
    frozen.requires_grad_(False)
    model = nn.Sequential(nn.Conv2d(1, 4, 3), shared, nn.BatchNorm2d(4, affine=False), frozen, shared,
                          nn.SyncBatchNorm(4), nn.Flatten(), nn.Linear(4 * 6 * 6, 3)).double()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fixed = fix_model(model, "groupnorm")
    assert [type(m).__name__ for m in fixed] == ["Conv2d", "GroupNorm", "GroupNorm", "GroupNorm", "GroupNorm",
                                                 "GroupNorm", "Flatten", "Linear"]
    assert fixed[1] is fixed[4] and fixed[1].num_groups == 4 and fixed[1].num_channels == 4  # gcd(32, 4)
    assert not fixed[2].affine and fixed[3].affine and fixed[1].weight.dtype == torch.float64
    assert torch.equal(fixed[0].weight, model[0].weight) and fixed[0].weight is not model[0].weight
    assert torch.equal(fixed[7].bias, model[7].bias)
    # the user's model is untouched: same layers, same tensors
    assert isinstance(model[1], nn.BatchNorm2d)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert fix_model(model, "none") is model
    assert isinstance(fix_model(nn.BatchNorm1d(64), "groupnorm"), nn.GroupNorm)  # a BatchNorm as the whole model
    with pytest.raises(ValueError, match="layer '0' is a LazyBatchNorm2d that has not been initialised"):
        fix_model(nn.Sequential(nn.LazyBatchNorm2d()), "groupnorm")


def test_the_fixed_model_passes_the_per_record_check_the_original_fails():
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(8, 5), nn.BatchNorm1d(5))
    with pytest.raises(ModelError, match=r"layer '1' is BatchNorm2d.*model-fix=groupnorm"):
        validate_model(model)
    fixed = validate_model(fix_model(model, "groupnorm"))
    check_per_record(fixed, (3, 8, 8), 5, "fixed")  # raises if a record's output depends on the others
    x = torch.randn(4, 3, 8, 8)
    assert torch.allclose(fixed(x)[:1], fixed(x[:1]), atol=1e-6)


def test_bad_model_fix_value_is_refused_naming_key_value_and_choices():
    with pytest.raises(ConfigError, match=r"config key 'model-fix': got 'batchnorm'.*'none', 'groupnorm'"):
        Config.from_mapping({"model-fix": "batchnorm"})
    with pytest.raises(ValueError, match="config key 'model-fix': got 'group'; allowed: none, groupnorm"):
        fix_model(nn.Linear(2, 2), "group")
    assert Config.from_mapping({}).model_fix == "none"
    assert config.MODEL_FIXES == model_fix.MODEL_FIXES


@pytest.fixture
def user_code(monkeypatch):
    monkeypatch.syspath_prepend(str(PLUGINS))


def test_user_batchnorm_model_is_refused_without_the_key_and_trains_with_it(user_code, tmp_path):
    """model=user_code:batchnorm_channels (an import path, as on the command line): refused before any work with
    a message naming the fix; with model-fix=groupnorm it trains, model.json records the fix, and load_model
    rebuilds the GroupNorm model that model.pt fits."""
    from dpdro.simulations.runner import run_one

    keys = {**TINY_RUN, "dataset": "user_code:blobs", "model": "user_code:batchnorm_channels"}
    with pytest.raises(ModelError, match=r"layer '3' is BatchNorm1d.*Set config key model-fix=groupnorm"):
        run_one({**keys, "out-dir": str(tmp_path / "refused")})
    assert not (tmp_path / "refused" / "summary.json").exists()
    out = tmp_path / "fixed"
    assert run_one({**keys, "model-fix": "groupnorm", "out-dir": str(out)}) == (str(out), None)
    summary = json.loads((out / "summary.json").read_text())
    assert 0 < summary["epsilon_spent"] <= 4.0 + 1e-9 and summary["test_accuracy"] > 1 / 3
    meta = json.loads((out / "model.json").read_text())
    assert meta["model_fix"] == "groupnorm" and meta["parameters"] == (2 * 32 + 32) + 2 * 4 + (32 * 3 + 3)
    assert "with every BatchNorm replaced by GroupNorm" in (out / "MODEL_CARD.md").read_text()
    model, _ = load_model(out)
    assert isinstance(model[3], nn.GroupNorm) and model[3].num_groups == 4 and model[3].num_channels == 4
    assert load_run_config(out).model_fix == "groupnorm"


def test_a_fixed_batchnorm1d_with_one_value_a_group_is_refused_naming_layernorm(user_code, tmp_path):
    """Opacus' rule on a BatchNorm1d of 8 features: GroupNorm(8, 8), one value a group, cannot normalise a record;
    the probe refuses it before any work, naming the way out."""
    from dpdro.simulations.runner import run_one

    keys = {**TINY_RUN, "dataset": "user_code:blobs", "model": "user_code:BatchNormNet", "model-fix": "groupnorm"}
    with pytest.raises(ModelError, match=r"groups hold one value each .* use nn.LayerNorm\(C\) there"):
        run_one({**keys, "out-dir": str(tmp_path / "run")})
    assert not (tmp_path / "run" / "summary.json").exists()


def test_fit_fixes_a_module_object_in_a_copy_and_hands_back_the_fixed_model(tmp_path):
    """dpdro.fit(model=<nn.Module with BatchNorm>): refused without the key (message names it); with it the run
    trains a GroupNorm copy, the user's module keeps its BatchNorm, and the returned model is the fixed one."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(60, 1, 4, 4, generator=g)
    y = (x.mean((1, 2, 3)) > 0).long()
    data = (dpdro.records(x, y, 2), dpdro.records(x, y, 2))
    module = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Tanh(), nn.Flatten(), nn.Linear(16, 2))
    keys = {**TINY_RUN, "refresh-batch": 20, "diff-batch": 10}
    with pytest.raises(ModelError, match="model-fix=groupnorm"):
        dpdro.fit({**keys, "out-dir": str(tmp_path / "a")}, data=data, model=module)
    result = dpdro.fit({**keys, "model-fix": "groupnorm", "out-dir": str(tmp_path / "b")}, data=data, model=module)
    assert isinstance(module[1], nn.BatchNorm2d) and isinstance(result.model[1], nn.GroupNorm)
    assert result.model[1].num_groups == 4 and not torch.equal(result.model[4].weight, module[4].weight)
    assert json.loads((tmp_path / "b" / "model.json").read_text())["model_fix"] == "groupnorm"


def test_make_model_applies_the_fix_before_the_probe(user_code):
    with pytest.raises(ModelError, match="model-fix=groupnorm"):
        make_model("user_code:batchnorm_channels", 3, 0, input_shape=(2,))
    model = make_model("user_code:batchnorm_channels", 3, 0, input_shape=(2,), fix="groupnorm")
    assert isinstance(model[3], nn.GroupNorm)
    again = make_model("user_code:batchnorm_channels", 3, 0, input_shape=(2,), fix="groupnorm")
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters(), strict=True))


@pytest.mark.slow
@pytest.mark.data
def test_the_resnet18_example_trains_torchvision_resnet18_with_groupnorm(tmp_path):
    """examples/fit_resnet18.py (about a minute on the project's 2-core machine): torchvision's resnet18, 20
    BatchNorm layers, trains privately once model-fix=groupnorm replaced them."""
    import subprocess
    import sys

    example = Path(__file__).parent.parent / "examples" / "fit_resnet18.py"
    done = subprocess.run([sys.executable, str(example), str(tmp_path / "run")], capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "the trained model has 20 GroupNorm and 0 BatchNorm layers" in done.stdout
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["n"] == 1000 and 3.9 < summary["epsilon_spent"] <= 4.0 + 1e-9
    assert json.loads((tmp_path / "run" / "model.json").read_text())["parameters"] == 11_181_642
