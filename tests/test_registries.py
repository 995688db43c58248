"""The plug-in registries are the one place a name is declared: every other list of names is derived from them,
and a name declared in two places that disagree fails here (common/registry.py, CONTRIBUTING.md)."""

from __future__ import annotations

import numpy as np
import pytest

from dpdro.common.algorithm_specs import ALGORITHM_SPECS, AlgorithmSpec, Choice
from dpdro.common.config import FIELD_BY_KEY, ROLES, Config, keys_with_role
from dpdro.common.data import DATASETS
from dpdro.common.models import MODELS
from dpdro.common.quantities import QUANTITIES
from dpdro.common.registry import Registry
from dpdro.server.algorithms import ALGORITHMS, register_algorithm


def test_every_declared_algorithm_has_exactly_one_state_machine_and_back():
    assert sorted(ALGORITHMS) == sorted(ALGORITHM_SPECS)
    for name, cls in ALGORITHMS.items():
        assert cls.name == name and cls.spec is ALGORITHM_SPECS[name]


def test_config_allowed_values_are_the_registries():
    assert FIELD_BY_KEY["algorithm"].options == tuple(ALGORITHM_SPECS)
    assert FIELD_BY_KEY["dataset"].options == tuple(DATASETS)
    assert FIELD_BY_KEY["model"].options == ("auto", *MODELS)
    from dpdro.common import config, models

    assert config.ETA_ALGORITHMS == tuple(n for n, s in ALGORITHM_SPECS.items() if s.uses_eta)
    assert set(models.DEFAULT_MODEL) == set(DATASETS)


def test_specs_name_only_registered_keys_quantities_and_models():
    for name, spec in ALGORITHM_SPECS.items():
        assert set(spec.keys) <= set(FIELD_BY_KEY), name
        assert set(spec.quantities) <= set(QUANTITIES), name
        assert set(spec.space) | set(spec.fixed) <= set(FIELD_BY_KEY), name
        for key, dim in spec.space.items():  # both ends of a range and every choice are valid values
            for v in dim.values if isinstance(dim, Choice) else (dim.low, dim.high):
                Config.from_mapping({"algorithm": name, key: v})
    for name, spec in DATASETS.items():
        assert spec.default_model in MODELS, name
        assert all(FIELD_BY_KEY[k].role == "data" for k in spec.keys), name
        assert ("imbalance-ratio" in spec.keys) == spec.long_tailed, name


@pytest.mark.parametrize("name", list(ALGORITHM_SPECS))
def test_algorithms_query_only_their_declared_quantities(name):
    q = {"q": 2} if "q" in ALGORITHM_SPECS[name].keys else {}
    cfg = Config.from_mapping({"algorithm": name, **q, "iterations": 4})
    algo = ALGORITHMS[name](cfg, 1000, 5, 3)
    state = algo.start_state(np.zeros(5), 0.0)
    seen = set()
    for _ in range(6):  # a refresh and a difference step, every stage
        queries = algo.queries(state)
        seen |= {q.quantity for q in queries}
        state = algo.apply(state, {q.mechanism: np.zeros(q.dim) for q in queries})
    assert seen and seen <= set(ALGORITHM_SPECS[name].quantities)


def test_derived_lists_of_the_tuner_and_tables():
    from dpdro.simulations import tables, tune

    assert set(tune.SPACES) == {n for n, s in ALGORITHM_SPECS.items() if s.space}
    assert tune.METHODS == tables.BASELINES + tables.DRO_METHODS
    assert set(tables.DRO_METHODS) == {n for n, s in ALGORITHM_SPECS.items() if s.dro}


def test_a_name_declared_twice_or_not_at_all_is_refused():
    with pytest.raises(ValueError, match="algorithm 'dp-sgd' is already registered"):
        register_algorithm(AlgorithmSpec("dp-sgd", keys=(), quantities=()))
    with pytest.raises(ValueError, match="unknown algorithm 'not-declared'; allowed: dp-double-spider"):
        register_algorithm("not-declared")
    with pytest.raises(ValueError, match="already registered"):
        ALGORITHMS.register("dp-sgd")(ALGORITHMS["dp-sgd"])
    for registry, name in ((DATASETS, "mnist"), (MODELS, "cnn"), (QUANTITIES, "dual-x")):
        with pytest.raises(ValueError, match=f"{registry.kind} '{name}' is already registered"):
            registry.register(name, registry[name])
    r = Registry("toy")
    r.register("a", 1)
    with pytest.raises(ValueError, match="unknown toy 'b'; allowed: a"):
        r.get_entry("b")


def test_every_key_has_one_role_and_the_derived_key_lists():
    from dpdro.client.flower.app import DATA_KEYS
    from dpdro.server.engine import RUNTIME_KEYS

    assert {f.role for f in FIELD_BY_KEY.values()} == set(ROLES)
    assert RUNTIME_KEYS == keys_with_role("runtime")
    # a resumed run may change exactly these (they change how it runs, not what it computes)
    assert set(RUNTIME_KEYS) == {"resume", "overwrite", "out-dir", "threads", "round-timeout", "eval-every",
                                 "checkpoint-every", "chunk-size", "on-client-failure", "max-retries", "min-clients",
                                 "per-record-engine", "tensorboard"}
    # every key that decides which records a node holds is in the client's shard-cache key
    assert {"dataset", "data-root", "cache-dir", "download", "imbalance-ratio", "split-seed", "max-train-records",
            "validation-fraction", "num-clients", "partition", "dirichlet-alpha", "seed"} <= set(DATA_KEYS)
    assert not {"lr-x", "clip-x", "epsilon", "iterations", "out-dir"} & set(DATA_KEYS)
    with pytest.raises(ValueError, match="unknown role"):
        keys_with_role("nonsense")


def test_data_set_and_partition_specifics_come_from_their_registries(tmp_path, monkeypatch):
    """What prediction and the model files need of a data set is a field of its DatasetSpec (input scaling,
    model.json's preprocessing keys, the reader of a user's own records), and node-local is a partition entry:
    nothing tests the names, so a new data set or partition is one entry."""
    from dpdro.common.data import BUILTIN_INPUT_SCALING, DatasetSpec, describe_input_scaling, input_keys
    from dpdro.common.partition import PARTITIONS, is_node_local

    assert describe_input_scaling("mnist-st", {}) == BUILTIN_INPUT_SCALING
    assert describe_input_scaling("csv", {"csv-bounds": "0:1"}) == (
        "feature columns clipped to the declared public bounds (csv-bounds 0:1) and scaled to [-1, 1]: "
        "2 (clip(x, lo, hi) - lo) / (hi - lo) - 1")
    assert describe_input_scaling("csv", {}) == "as dpdro loads data set 'csv'"  # no csv-bounds given
    assert describe_input_scaling("pkg.mod:load", {}) == "as dpdro loads data set 'pkg.mod:load'"
    assert input_keys() == ("classes", "image-size", "image-channels", "image-mean", "image-std", "csv-label",
                            "csv-features", "csv-group", "csv-bounds")
    assert {n for n, s in DATASETS.items() if s.own_records is not None} == {"csv", "image-folder"}
    (tmp_path / "train").mkdir()
    (tmp_path / "images").mkdir()
    csv, images = DATASETS["csv"].own_records, DATASETS["image-folder"].own_records
    assert csv.is_data_root(tmp_path) and not csv.is_data_root(tmp_path / "x.csv")
    assert images.is_data_root(tmp_path) and not images.is_data_root(tmp_path / "images")
    # a plug-in data set states its own scaling and keys in its spec
    monkeypatch.setitem(DATASETS, "toy-scaled", DatasetSpec(lambda *a: None, 2, "mlp", input_scaling="x / 7",
                                                            input_keys=("toy-key",)))
    assert describe_input_scaling("toy-scaled", {}) == "x / 7" and input_keys()[-1] == "toy-key"
    assert [n for n in PARTITIONS if is_node_local(n)] == ["node-local"]
    assert FIELD_BY_KEY["partition"].options == PARTITIONS.names() == ("iid", "dirichlet", "node-local")
