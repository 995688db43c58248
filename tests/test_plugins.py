"""Adding a plug-in takes one file plus its registration (CONTRIBUTING.md): a toy algorithm (with its own
per-record quantity), a toy data set and a toy model, each in tests/plugins/, are accepted by config validation
and train together. The registries are restored afterwards, so no other test sees the toys."""

from __future__ import annotations

import csv
import importlib.util
import json
import math
from pathlib import Path

import pytest

from dpdro.common.algorithm_specs import ALGORITHM_SPECS
from dpdro.common.config import Config, ConfigError
from dpdro.common.data import DATASETS
from dpdro.common.models import MODELS
from dpdro.common.quantities import QUANTITIES
from dpdro.server.algorithms import ALGORITHMS

PLUGINS = Path(__file__).parent / "plugins"
TOYS = ((ALGORITHM_SPECS, "toy-momentum"), (ALGORITHMS, "toy-momentum"), (QUANTITIES, "toy-ce-grad"),
        (DATASETS, "toy-blobs"), (MODELS, "toy-linear"))
TOY_RUN = {"algorithm": "toy-momentum", "dataset": "toy-blobs", "model": "auto", "epsilon": 4.0,
           "iterations": 30, "refresh-batch": 100, "diff-batch": 50, "lr-x": 0.5, "clip-x": 1.0, "num-clients": 2,
           "eval-every": 30, "checkpoint-every": 0, "reproducible": True, "reproducible-for-testing": True,
           "threads": 1, "seed": 3}


def _unregister() -> None:
    for registry, name in TOYS:
        registry.pop(name, None)


@pytest.fixture
def toys():
    """Registers the three toy plug-ins (by executing their files) and removes them afterwards."""
    _unregister()
    for name in ("toy_algorithm", "toy_dataset", "toy_model"):
        spec = importlib.util.spec_from_file_location(f"dpdro_test_plugins.{name}", PLUGINS / f"{name}.py")
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
    yield
    _unregister()


def test_config_refuses_the_toys_until_they_are_registered():
    for key, value in (("algorithm", "toy-momentum"), ("dataset", "toy-blobs"), ("model", "toy-linear")):
        with pytest.raises(ConfigError, match=f"config key '{key}': got '{value}'"):
            Config.from_mapping({key: value})
    with pytest.raises(ConfigError, match="unknown config key 'toy-beta'"):  # the toy algorithm's own key
        Config.from_mapping({"toy-beta": 0.9})


def test_a_plugin_algorithm_declares_its_own_key_in_its_file(toys):
    """The toy's key is validated, typed in its params section, ignored (with a warning) by other algorithms."""
    from dpdro.common.config import FIELD_BY_KEY, IgnoredKeyWarning

    assert FIELD_BY_KEY["toy-beta"].section == "algorithm"
    cfg = Config.from_mapping({**TOY_RUN, "toy-beta": 0.9})
    assert cfg.params.toy_beta == 0.9 and cfg.toy_beta == 0.9
    assert type(cfg.params).__dataclass_fields__["toy_beta"].type is float
    with pytest.raises(ConfigError, match=r"config key 'toy-beta': got 1\.5; allowed: a number in \[0, 1\)"):
        Config.from_mapping({**TOY_RUN, "toy-beta": 1.5})
    with pytest.warns(IgnoredKeyWarning, match="config key 'toy-beta' = 0.9 is ignored: algorithm 'dp-sgd'"):
        Config.from_mapping({"algorithm": "dp-sgd", "toy-beta": 0.9})


def test_config_accepts_registered_toys(toys):
    cfg = Config.from_mapping(TOY_RUN)
    assert (cfg.algorithm, cfg.dataset, cfg.model) == ("toy-momentum", "toy-blobs", "auto")
    assert Config.from_mapping({"model": "toy-linear"}).model == "toy-linear"
    from dpdro.common.config import FIELD_BY_KEY

    assert "'toy-momentum'" in FIELD_BY_KEY["algorithm"].allowed()


def test_toy_algorithm_data_set_and_model_train(toys, tmp_path):
    from dpdro.simulations.runner import run_one

    out = tmp_path / "toy"
    assert run_one({**TOY_RUN, "out-dir": str(out)}) == (str(out), None)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["algorithm"] == "toy-momentum" and summary["dataset"] == "toy-blobs"
    assert summary["releases"] == {"grad": 30}
    assert 0 < summary["epsilon_spent"] <= 4.0 + 1e-9 and math.isfinite(summary["noise_multipliers"]["grad"])
    # two well-separated classes: the private linear model separates them (chance is 0.5)
    assert summary["test_accuracy"] > 0.9
    with open(out / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["iteration"]) for r in rows] == [0, 30]
    assert float(rows[0]["test_accuracy"]) < summary["test_accuracy"]
