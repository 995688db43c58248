"""Configuration schema: defaults, validation messages, a property test (any mapping builds a Config or
raises ConfigError), and agreement of pyproject.toml's Flower run config with the defaults."""

from __future__ import annotations

import math
import re
import tomllib
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dpdro.common.config import AUTO, FIELD_BY_KEY, FIELDS, Config, ConfigError, default_toml_table, parse_set_args

ROOT = Path(__file__).resolve().parent.parent


def test_defaults():
    cfg = Config.from_mapping({})
    assert Config.from_mapping(None) == cfg
    for f in FIELDS:
        assert getattr(cfg, f.attr) == f.default, f.key
    assert cfg.lambda_ == 1.0 and cfg.psi == "chi2" and cfg.epsilon == 4.0 and cfg.delta == AUTO
    assert cfg.algorithm == "dp-double-spider" and cfg.dataset == "mnist-st"
    assert cfg.private
    assert cfg.to_dict() == {f.key: f.default for f in FIELDS}
    assert Config.from_mapping(cfg.to_dict()) == cfg


BAD = [
    ("epsilon", 0),
    ("epsilon", 0.0),
    ("epsilon", -1),
    ("epsilon", "-inf"),
    ("epsilon", math.nan),
    ("delta", 1.5),
    ("delta", 0.0),
    ("delta", 1.0),
    ("clip-x", 0),
    ("clip-x", -0.5),
    ("q", 0),
    ("q", 2.5),
    ("refresh-batch", 0),
    ("dataset", "foo"),
    ("algorithm", "dp-sgd-magic"),
    ("psi", "tv"),
    ("lambda", "abc"),
    ("lambda", None),
    ("lambda", [1.0]),
    ("iterations", "ten"),
    ("lr-x", True),
    ("download", "maybe"),
    ("download", 2),
    ("cvar-alpha", 1.0),
    ("seed", -1),
    ("accountant", "moments"),
    ("warmup-iterations", -1),
    ("warmup-iterations", 2.5),
    ("s-clip-units", "percent"),
    ("loss-clamp", "smooth"),
]


@pytest.mark.parametrize("key,value", BAD, ids=[f"{k}={v!r}" for k, v in BAD])
def test_out_of_range_values_raise_config_error(key, value):
    with pytest.raises(ConfigError) as info:
        Config.from_mapping({key: value})
    msg = str(info.value)
    assert f"'{key}'" in msg
    assert "allowed" in msg
    assert repr(value) in msg or str(value) in msg


def test_unknown_keys_raise():
    with pytest.raises(ConfigError, match="learning-rate"):
        Config.from_mapping({"learning-rate": 0.1})
    with pytest.raises(ConfigError, match="lambda_"):
        Config.from_mapping({"lambda_": 1.0})  # attribute names are not keys
    cfg = Config.from_mapping({"learning-rate": 0.1}, ignore_unknown=True)
    assert cfg == Config.from_mapping({})


def test_accepted_conversions():
    cfg = Config.from_mapping({"epsilon": "inf", "delta": " Auto ", "q": "5", "iterations": 20.0,
                               "download": "true", "reproducible": 1, "lambda": "0.25", "refresh-batch": 64,
                               "diff-batch": 32, "max-train-records": 64})
    assert math.isinf(cfg.epsilon) and not cfg.private
    assert cfg.delta == AUTO
    assert cfg.q == 5 and isinstance(cfg.q, int)
    assert cfg.iterations == 20 and isinstance(cfg.iterations, int)
    assert cfg.download is True and cfg.reproducible is True
    assert cfg.lambda_ == 0.25
    assert Config.from_mapping({"epsilon": math.inf}).epsilon == math.inf
    assert Config.from_mapping({"delta": 1e-6}).delta == 1e-6


def test_combination_checks_and_updates():
    with pytest.raises(ConfigError, match="refresh-batch"):
        Config.from_mapping({"max-train-records": 100, "refresh-batch": 200, "diff-batch": 50})
    with pytest.raises(ConfigError, match="diff-batch"):
        Config.from_mapping({"max-train-records": 100, "refresh-batch": 50, "diff-batch": 200})
    cfg = Config.from_mapping({})
    new = cfg.with_updates({"psi": "kl", "lambda": 2})
    assert new.psi == "kl" and new.lambda_ == 2.0 and cfg.psi == "chi2"
    with pytest.raises(ConfigError):
        cfg.with_updates({"psi": "nope"})


def test_reproducible_private_run_is_refused_unless_for_testing(tmp_path, capsys):
    """reproducible=true with a finite epsilon derives noise and samples from the saved seed: refused before any
    work, naming the key, the value, why and what is allowed, unless reproducible-for-testing=true says the run
    is a test (it is then marked not private); with epsilon=inf nothing is hidden and no extra key is needed."""
    from dpdro.cli import main

    with pytest.raises(ConfigError) as refused:
        Config.from_mapping({"reproducible": True, "epsilon": 2.0})
    msg = str(refused.value)
    for part in ("config key 'reproducible': got true with epsilon=2", "allowed with a finite epsilon: false only",
                 "summary.json saves", "subtract it", "reproducible-for-testing=true", "epsilon=inf"):
        assert part in msg
    out = tmp_path / "run"
    assert main(["train", "--set", "reproducible=true", f"out-dir={out}"]) == 2
    assert "reproducible-for-testing" in capsys.readouterr().err and not out.exists()
    cfg = Config.from_mapping({"reproducible": True, "reproducible-for-testing": True, "epsilon": 2.0})
    assert cfg.private and cfg.noise_from_saved_seed
    assert not Config.from_mapping({"reproducible": True, "epsilon": "inf"}).noise_from_saved_seed
    assert not Config.from_mapping({"reproducible-for-testing": True}).noise_from_saved_seed


def test_parse_set_args():
    out = parse_set_args(["psi=kl", "lambda = 0.5", "out-dir='runs/x=1'", 'dataset="mnist"'])
    assert out == {"psi": "kl", "lambda": "0.5", "out-dir": "runs/x=1", "dataset": "mnist"}
    cfg = Config.from_mapping(out)
    assert cfg.psi == "kl" and cfg.lambda_ == 0.5 and cfg.out_dir == "runs/x=1"
    with pytest.raises(ConfigError):
        parse_set_args(["psi"])


def test_huge_int_for_a_float_key_raises_config_error():
    """A Python int beyond the float range (e.g. from JSON) must give ConfigError, not OverflowError."""
    for key in ("epsilon", "lambda", "seed"):
        with pytest.raises(ConfigError, match=key):
            Config.from_mapping({key: 10**400})
    with pytest.raises(ConfigError, match="refresh-batch"):
        Config.from_mapping({"refresh-batch": 10**400})


# ---- property test ----

PROP_KEYS = ["epsilon", "delta", "q", "lambda", "psi", "download", "refresh-batch", "max-train-records",
             "cvar-alpha", "seed", "dataset", "eta-init"]
VALUES = st.one_of(
    st.integers(min_value=-(2**63), max_value=2**63),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.text(max_size=12),
    st.sampled_from(["auto", "inf", "-inf", "nan", "1", "0", "true", "false", "1e400", "chi2", "kl", "0.5",
                     "mnist", " 3 ", "1_000"]),
    st.none(),
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(PROP_KEYS), VALUES, max_size=5))
def test_any_mapping_builds_or_raises_config_error(mapping):
    try:
        cfg = Config.from_mapping(mapping)
    except ConfigError as e:
        msg = str(e)
        assert "allowed" in msg
        # names a key: one of the mapping's, or (combination checks) one whose default clashes with it
        assert any(f"'{k}'" in msg for k in FIELD_BY_KEY)
        return
    # a built config holds valid values only: re-validating it is the identity
    assert Config.from_mapping(cfg.to_dict()) == cfg
    for key in mapping:
        f = FIELD_BY_KEY[key]
        v = getattr(cfg, f.attr)
        if f.kind == "float" and v != AUTO:
            assert isinstance(v, float) and not math.isnan(v)
        if f.kind == "int":
            assert isinstance(v, int) and not isinstance(v, bool)
        if f.kind == "bool":
            assert isinstance(v, bool)


# ---- pyproject.toml ----

def test_pyproject_flower_config_equals_defaults():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    table = data["tool"]["flwr"]["app"]["config"]
    defaults = {f.key: f.default for f in FIELDS}
    assert list(table) == list(defaults)  # same keys, same order
    assert table == defaults
    for key, value in table.items():
        assert type(value) is type(defaults[key]), key  # ints stay ints, floats floats, 'auto' a string
    assert table["delta"] == "auto" and table["data-root"] == "auto"
    # the generator produces the same table
    assert tomllib.loads(default_toml_table()) == defaults
    # and the table builds the default config
    assert Config.from_mapping(table) == Config.from_mapping({})


@pytest.mark.parametrize("path", sorted((ROOT / "simulations" / "configs").rglob("*.toml")),
                         ids=lambda p: str(p.relative_to(ROOT / "simulations" / "configs")))
def test_every_shipped_config_file_is_valid(path):
    """The config files the README and docs point to (main, tuned, hand-set) load and validate as they are."""
    from dpdro.common.config import load_toml_keys

    keys = load_toml_keys(path)
    cfg = Config.from_mapping(keys)
    assert cfg.algorithm == keys["algorithm"] and cfg.dataset == keys["dataset"]


@pytest.mark.parametrize("path", sorted((ROOT / "simulations" / "configs").rglob("*.toml")),
                         ids=lambda p: str(p.relative_to(ROOT / "simulations" / "configs")))
def test_every_shipped_choice_made_on_private_data_is_marked(path):
    """A file whose keys a search chose on a validation split of its data set (first line SEARCH_MARK, or a best
    file of the search) says so in key chosen-on-private-data, and so does one whose post-hoc tau was re-chosen on
    it (RECHOSEN_MARK), whose keys a lever table chose on it (LEVERS_MARK: hyper-parameters, and the post-hoc tau
    when the line names it) or whose method was (best files, main.toml): a run of it lists each as not accounted.
    Transferred and hand-set files chose nothing on their data set's records and carry no mark."""
    from dpdro.common.config import load_toml_keys
    from dpdro.simulations.tuned import LEVERS_MARK, RECHOSEN_MARK, SEARCH_MARK, leading_comments

    text = path.read_text()
    keys = load_toml_keys(path)
    best = path.parent.name == "configs"  # main.toml and <dataset>-eps<e>-best.toml
    expected = set()
    if text.startswith(SEARCH_MARK) or best:
        expected |= {"hyper-parameters"} | ({"posthoc-tau"} if "posthoc-tau" in keys else set())
    if any(RECHOSEN_MARK in line for line in leading_comments(text)):
        expected.add("posthoc-tau")
    for line in leading_comments(text):
        if LEVERS_MARK in line:
            expected |= {"hyper-parameters"} | ({"posthoc-tau"} if "posthoc-tau" in line else set())
    if best:
        expected.add("model")
    assert set(Config.from_mapping(keys).chosen_on_private) == expected


SHIPPED = sorted((ROOT / "simulations" / "configs").rglob("*.toml")) + sorted((ROOT / "examples").rglob("*.toml"))


def test_there_are_shipped_configuration_files():
    assert len(SHIPPED) >= 30  # the tuned, handset and example files (a moved folder would empty the next test)


@pytest.mark.filterwarnings("ignore::dpdro.common.config.IgnoredKeyWarning")  # e.g. the tuner's shared s-batch
@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_shipped_configuration_file_loads_unchanged(path):
    """Each key of each file under simulations/configs and examples/ keeps its name and its value."""
    from dpdro.common.config import load_toml_keys

    keys = load_toml_keys(path)
    values = Config.from_mapping(keys).to_dict()
    assert keys and all(values[k] == FIELD_BY_KEY[k].parse(v) for k, v in keys.items())


def test_every_invalid_key_is_reported_at_once_with_suggestions():
    with pytest.raises(ConfigError) as err:
        Config.from_mapping({"epsilonn": 1, "q": 0, "psi": "chi", "lambda": "abc", "clip-x": 1.0})
    msg = str(err.value)
    assert msg.startswith("4 configuration errors:\n")
    assert "unknown config key 'epsilonn' (did you mean 'epsilon'?)" in msg
    assert "config key 'q': got 0; allowed: an integer in [1, 1e+07]" in msg
    assert "config key 'psi': got 'chi' (did you mean 'chi2'?)" in msg
    assert "config key 'lambda': got 'abc'" in msg
    # combinations too, each check's own message
    with pytest.raises(ConfigError) as err:
        Config.from_mapping({"epsilon": math.inf, "noise-mode": "local", "algorithm": "recursive-spider",
                             "lambda0": 5.0})
    assert str(err.value).startswith("2 configuration errors:\n")
    assert "config key 'noise-mode': got 'local'; allowed with epsilon=inf" in str(err.value)
    assert "config keys 'lambda0', 'lambda-init', 'lambda-max': got 5.0, 1.0, 10.0" in str(err.value)


def test_a_key_the_chosen_algorithm_ignores_is_a_warning_naming_it(recwarn):
    from dpdro.common.config import IgnoredKeyWarning

    with pytest.warns(IgnoredKeyWarning, match=r"^config key 'q' = 3 is ignored: algorithm 'dp-sgd' does not read it$"):
        Config.from_mapping({"algorithm": "dp-sgd", "q": 3})
    recwarn.clear()
    Config.from_mapping({"algorithm": "dp-sgd", "q": 5, "lr-x": 3.0})  # a default value, a key every run reads
    Config.from_mapping({"algorithm": "dp-double-spider", "q": 3}).with_updates({"algorithm": "dp-sgd"})
    assert not [w for w in recwarn if issubclass(w.category, IgnoredKeyWarning)]
    # the lambda range is recursive-spider's own check: other algorithms ignore those keys
    assert Config.from_mapping({"algorithm": "dp-sgd", "lambda0": 5.0}, warn=False).lambda0 == 5.0


def test_sections_are_typed_and_hold_every_key_once():
    from dpdro.common.config import CORE_FIELDS, SECTIONS

    cfg = Config.from_mapping({"algorithm": "recursive-spider", "epsilon": 2, "rho": 0.3})
    assert cfg.privacy.epsilon == 2.0 and cfg.params.rho == 0.3 and cfg.rho == 0.3
    assert cfg.data.dataset == "mnist-st" and cfg.runtime.out_dir == "runs/latest" and cfg.training.lr_x == 1.0
    assert {f.section for f in FIELDS} == set(SECTIONS)
    seen = [a for s in ("data", "training", "privacy", "runtime") for a in type(getattr(cfg, s)).__dataclass_fields__]
    assert sorted(seen) == sorted(f.attr for f in CORE_FIELDS)
    types = {name: f.type for name, f in type(cfg.privacy).__dataclass_fields__.items()}
    assert types["epsilon"] is float and types["accountant"] is str and types["delta"] == float | str
    own = set(type(cfg.params).__dataclass_fields__)
    assert {"q", "diff_batch", "rho", "lambda0", "s_min", "dro_level"} <= own  # its own and the shared SPIDER keys
    assert not own & {"lr_x", "epsilon", "clip_eta", "lr_p"}  # keys every run reads, other algorithms' keys
    with pytest.raises(AttributeError, match="immutable"):
        cfg.q = 3
    with pytest.raises(AttributeError, match="no key 'nope'"):
        cfg.nope  # noqa: B018
    import pickle

    assert pickle.loads(pickle.dumps(cfg)) == cfg and hash(pickle.loads(pickle.dumps(cfg))) == hash(cfg)


def test_an_algorithm_cannot_redeclare_a_key():
    from dpdro.common.algorithm_specs import ALGORITHM_SPECS, AlgorithmSpec, declare_algorithm
    from dpdro.common.config import fields
    from dpdro.common.config_schema import param

    with pytest.raises(ValueError, match="config key 'q' is already declared otherwise"):
        declare_algorithm(AlgorithmSpec("toy-q", keys=("q",), quantities=(), params=(param("q", "int", 7, "."),)))
    with pytest.raises(ValueError, match="params 'rho' are not in its keys"):
        AlgorithmSpec("toy-keys", keys=(), quantities=(), params=(FIELD_BY_KEY["rho"],))
    declare_algorithm(AlgorithmSpec("toy-eps", keys=("epsilon",), quantities=(),
                                    params=(param("epsilon", "float", 1.0, "."),)))
    try:
        with pytest.raises(ValueError, match="algorithm params 'epsilon' are keys every run reads"):
            fields()
    finally:
        ALGORITHM_SPECS.pop("toy-eps")


def test_an_old_run_directory_config_still_loads(tmp_path):
    """config.json of a run written before the retired key inject-fault left the schema and before tensorboard
    existed: --resume reads it as the same configuration."""
    import json

    from dpdro.server.engine import load_run_config

    old = {k: v for k, v in Config.from_mapping({"q": 3}).to_dict().items() if k != "tensorboard"}
    saved = {**old, "inject-fault": "", "delta_resolved": 1e-5, "n": 10_000, "transport": "local", "versions": {}}
    (tmp_path / "config.json").write_text(json.dumps(saved))
    assert load_run_config(str(tmp_path)) == Config.from_mapping({"q": 3, "overwrite": False})


def test_unknown_key_names_other_libraries_terms_and_typos_of_them():
    """Opacus' and TF Privacy's names (batch_size, max_grad_norm, noise_multiplier), also misspelt, point to
    dpdro's keys; other unknown keys get difflib's nearest key."""
    from dpdro.common.config import OTHER_LIBRARIES_NAMES, unknown_keys_message

    message = unknown_keys_message(["batch_size", "bacth-size", "max_grad_norm", "lr-xx"])
    assert message.count("dpdro's name: 'refresh-batch'") == 2
    assert "'max_grad_norm' (dpdro's name: 'clip-x')" in message
    assert "'lr-xx' (did you mean 'lr-x'?)" in message
    known = set(FIELD_BY_KEY)
    for hint in OTHER_LIBRARIES_NAMES.values():  # every suggested name is a real key
        assert set(re.findall(r"'([a-z0-9-]+)'", hint)) <= known, hint
