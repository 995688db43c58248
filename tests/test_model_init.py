"""Public initial weights and frozen parameters (config keys init-weights and trainable, common/model_init.py):
the file loads strictly (a state_dict and a run's model.pt), its sha256 reaches summary.json, model.json and the
model card; bad files and bad trainable values are clear errors before any work; frozen parameters stay at their
initial values while the trainable ones train, and per-record gradients, noise and the ledger's dimension cover
the trainable ones only (both per-record engines); a Flower run of a frozen model equals the single-node run."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
import torch
from torch import nn

from dpdro.client.local_transport import LocalTransport
from dpdro.common.config import ConfigError
from dpdro.common.data import load_from_config
from dpdro.common.model_init import prepare_model, trainable_names
from dpdro.common.models import make_model
from dpdro.common.per_sample import FlatModel
from dpdro.server.engine import ResumeError, train
from dpdro.server.model_files import load_model

CNN_HEAD = ("head.3.weight", "head.3.bias")  # cnn's last nn.Linear(32, 10): 330 parameters
CNN_PARAMETERS = 26106


def _saved(tmp_path, state, name="public.pt") -> str:
    path = tmp_path / name
    torch.save(state, path)
    return str(path)


def test_a_state_dict_file_is_loaded_strictly_and_its_sha256_reported(tmp_path):
    public = make_model("cnn", 10, seed=3)
    path = _saved(tmp_path, public.state_dict())
    model = make_model("cnn", 10, seed=0)
    info = prepare_model(model, path, "all")
    for name, tensor in public.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name
    assert info.sha256 == hashlib.sha256(open(path, "rb").read()).hexdigest()
    assert info.facts() == {"init_weights": {"path": path, "sha256": info.sha256}, "trainable": "all",
                            "trainable_parameters": CNN_PARAMETERS, "parameters": CNN_PARAMETERS}
    # float64 runs load a float32 file: the values convert to the model's dtype
    wide = make_model("cnn", 10, seed=0, dtype=torch.float64)
    prepare_model(wide, path, "all")
    assert wide.head[3].weight.dtype == torch.float64
    assert torch.equal(wide.head[3].weight, public.head[3].weight.double())


@pytest.mark.parametrize(("change", "message"), [
    (lambda s: s.pop("features.4.bias"),
     "tensor 'features.4.bias' is missing (the file lacks 1 of the model's 12 tensors"),
    (lambda s: s.update({"head.3.weight": torch.zeros(9, 32)}),
     "tensor 'head.3.weight' has shape (9, 32) in the file, expected (10, 32)"),
    (lambda s: s.update({"head.5.weight": torch.zeros(3)}), "tensor 'head.5.weight' is not in the model"),
    (lambda s: s["head.3.bias"].__setitem__(0, float("nan")), "tensor 'head.3.bias' has a NaN or infinite entry"),
])
def test_a_file_that_does_not_fit_the_model_names_its_first_bad_tensor(tmp_path, change, message):
    state = make_model("cnn", 10, seed=3).state_dict()
    change(state)
    path = _saved(tmp_path, state)
    model = make_model("cnn", 10, seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ConfigError, match="config key 'init-weights'") as e:
        prepare_model(model, path, "head")
    assert message in str(e.value)
    # refused before the module changed: nothing loaded, nothing frozen
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    assert all(p.requires_grad for p in model.parameters())


def test_a_file_that_is_no_state_dict_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="'init-weights': got .*not a file"):
        prepare_model(make_model("cnn", 10, 0), str(tmp_path / "absent.pt"), "all")
    with pytest.raises(ConfigError, match="holds a list, not a state_dict"):
        prepare_model(make_model("cnn", 10, 0), _saved(tmp_path, [torch.zeros(2)]), "all")
    (tmp_path / "junk.pt").write_bytes(b"not a torch file")
    with pytest.raises(ConfigError, match=r"cannot be read as a state_dict with torch.load\(weights_only=True\)"):
        prepare_model(make_model("cnn", 10, 0), str(tmp_path / "junk.pt"), "all")


class ConvOnly(nn.Module):
    """(B, 1, 4, 4) -> (B, 2) logits without a Linear layer."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 4)

    def forward(self, x):
        return self.conv(x).flatten(1)


def test_trainable_selects_the_last_linear_layer_or_named_modules_and_refuses_the_rest():
    model = make_model("cnn", 10, 0)
    assert trainable_names(model, "head") == CNN_HEAD
    assert trainable_names(model, "all") == tuple(n for n, _ in model.named_parameters())
    # names select at '.' boundaries: 'head.' and 'head' are the head Sequential, 'features.0' not 'features.0x'
    assert trainable_names(model, "head.") == ("head.1.weight", "head.1.bias", *CNN_HEAD)
    assert trainable_names(model, " features.0 , head.3.bias") == ("features.0.weight", "features.0.bias",
                                                                   "head.3.bias")
    for value, cause in (("backbone", "'backbone' selects no parameter of the model"),
                         ("features.0,", "has an empty name"), ("", "has an empty name"),
                         ("head.3.w", "'head.3.w' selects no parameter")):
        with pytest.raises(ConfigError, match="config key 'trainable'") as e:
            trainable_names(model, value)
        assert cause in str(e.value) and "allowed: 'all', 'head'" in str(e.value).replace("Allowed", "allowed")
    with pytest.raises(ConfigError, match="got 'head'; the model has no nn.Linear layer"):
        trainable_names(ConvOnly(), "head")


@pytest.mark.parametrize("engine", ["torch.func", "opacus"])
def test_per_record_gradients_cover_the_trainable_parameters_only(engine):
    if engine == "opacus":
        pytest.importorskip("opacus")
    full = FlatModel(make_model("cnn", 10, 0), engine)
    model = make_model("cnn", 10, 0)
    info = prepare_model(model, "", "head")
    flat = FlatModel(model, engine)
    assert flat.dim == info.trainable_count == 330 and flat.names == list(CNN_HEAD)
    assert torch.equal(flat.initial(), torch.cat([model.head[3].weight.reshape(-1), model.head[3].bias]))
    gen = torch.Generator().manual_seed(1)
    x, y = torch.rand((6, 1, 28, 28), generator=gen) * 2 - 1, torch.arange(6)
    losses, grads = flat.losses_and_grads(flat.initial(), x, y)
    full_losses, full_grads = full.losses_and_grads(full.initial(), x, y)
    assert grads.shape == (6, 330)
    # the same per-record gradients as the trainable columns of the whole model's
    assert torch.allclose(grads, full_grads[:, -330:], atol=1e-6) and torch.allclose(losses, full_losses)
    # a step of the trainable vector changes the logits; the frozen backbone stays the module's own
    moved = flat.initial() + 0.1
    assert not torch.allclose(flat.logits(moved, x), flat.logits(flat.initial(), x))
    assert all(not p.requires_grad for n, p in model.named_parameters() if n not in CNN_HEAD)


# A short private run on a tiny real MNIST-ST subset.
TINY = {"dataset": "mnist-st", "model": "cnn", "max-train-records": 300, "max-test-records": 200, "num-clients": 2,
        "algorithm": "dp-sgd", "iterations": 3, "refresh-batch": 60, "lr-x": 2.0, "epsilon": 4.0,
        "eval-every": 3, "reproducible": True, "reproducible-for-testing": True, "threads": 1, "seed": 4}


def _run(small_config, **keys):
    cfg = small_config(**{**TINY, **keys})
    transport = LocalTransport(cfg, load_from_config(cfg, True))
    dims, run_round = [], transport.run
    transport.run = lambda queries, versions: dims.extend(q.dim for q in queries) or run_round(queries, versions)
    return train(cfg, transport, load_from_config(cfg, False)), dims


@pytest.mark.data
def test_a_private_run_from_public_weights_trains_only_the_head(small_config, tmp_path):
    """A run's model.pt as init-weights with trainable=head: the frozen tensors of the new model.pt are the file's,
    the head moved; the noised releases and the ledger are of the 330 head parameters; summary.json, model.json
    and the card carry the file's sha256."""
    public = make_model("cnn", 10, seed=9)
    pretrained = tmp_path / "pre"
    pretrained.mkdir()
    path = _saved(pretrained, public.state_dict(), "model.pt")
    sha = hashlib.sha256(open(path, "rb").read()).hexdigest()
    result, dims = _run(small_config, out_dir=str(tmp_path / "run"), **{"init-weights": path, "trainable": "head"})
    assert set(dims) == {330} and len(dims) == 3  # the noised vectors: the head only
    assert result.params.shape == (330,)
    s = result.summary
    assert s["init_weights"] == {"path": path, "sha256": sha} and s["trainable"] == "head"
    assert (s["trainable_parameters"], s["parameters"]) == (330, CNN_PARAMETERS)
    assert any(item.startswith(f"initial weights: init-weights {path}") for item in s["not_accounted"])
    assert 3.9 < s["epsilon_spent"] <= 4.0
    saved = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    for name, tensor in public.state_dict().items():
        assert torch.equal(saved[name], tensor) == (name not in CNN_HEAD), name
    # dpdro.load_model (which dpdro predict and the ONNX export use) rebuilds the whole model, frozen part included
    loaded, _ = load_model(tmp_path / "run")
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in saved.items())
    assert torch.equal(loaded.features[0].weight, public.features[0].weight)
    meta = json.load(open(tmp_path / "run" / "model.json"))
    assert meta["init_weights"]["sha256"] == sha and meta["trainable_parameters"] == 330
    card = (tmp_path / "run" / "MODEL_CARD.md").read_text()
    assert f"(sha256 {sha})" in card and f"head (330 of {CNN_PARAMETERS} parameters)" in card
    # the run's own model.pt starts the next run: the ledger's dimension is that of the selected parameters
    again, dims = _run(small_config, out_dir=str(tmp_path / "again"),
                       **{"init-weights": str(tmp_path / "run" / "model.pt"), "trainable": "features.0"})
    assert set(dims) == {1040} and again.summary["trainable_parameters"] == 1040
    second = torch.load(tmp_path / "again" / "model.pt", weights_only=True)
    for name, tensor in saved.items():
        assert torch.equal(second[name], tensor) == (not name.startswith("features.0.")), name


@pytest.mark.data
def test_a_bad_file_is_refused_before_the_run_directory_is_written(small_config, tmp_path):
    state = make_model("cnn", 10, seed=3).state_dict()
    state["head.3.weight"] = torch.zeros(10, 31)
    path = _saved(tmp_path, state)
    with pytest.raises(ConfigError, match=r"'head.3.weight' has shape \(10, 31\) in the file, expected \(10, 32\)"):
        _run(small_config, out_dir=str(tmp_path / "run"), **{"init-weights": path})
    assert not (tmp_path / "run").exists()


@pytest.mark.data
def test_resuming_with_another_file_at_the_same_path_is_refused(small_config, tmp_path):
    path = _saved(tmp_path, make_model("cnn", 10, seed=9).state_dict())
    keys = {"out_dir": str(tmp_path / "run"), "init-weights": path, "trainable": "head"}
    _run(small_config, **keys)
    _saved(tmp_path, make_model("cnn", 10, seed=10).state_dict())  # the same path, other weights
    cfg = small_config(**{**TINY, **keys})
    with pytest.raises(ResumeError, match="config key 'init-weights': .* now has sha256 .*resume with that file"):
        train(cfg, LocalTransport(cfg, load_from_config(cfg, True)), load_from_config(cfg, False), resume=True)


@pytest.mark.data
def test_a_node_reads_the_file_only_for_what_the_model_versions_do_not_carry(small_config, tmp_path):
    """trainable=all: the server's x0 (every parameter) reaches the nodes as model version 0, so a node never
    opens the file (absent here); a frozen backbone is not in the versions, so the node loads it from the file."""
    from dpdro.client.worker import ShardWorker

    cfg = small_config(**{**TINY, "init-weights": str(tmp_path / "only-on-the-server.pt")})
    shard = load_from_config(cfg, True)
    assert ShardWorker(cfg, shard, 0).model.dim == CNN_PARAMETERS
    with pytest.raises(ConfigError, match="only-on-the-server.pt', which is not a file"):
        ShardWorker(cfg.with_updates({"trainable": "head"}), shard, 0)
    public = make_model("cnn", 10, seed=9)
    path = _saved(tmp_path, public.state_dict())
    node = ShardWorker(cfg.with_updates({"init-weights": path, "trainable": "head"}), shard, 0).model
    assert node.dim == 330 and torch.equal(node.module.features[0].weight, public.features[0].weight)


@pytest.mark.data
@pytest.mark.flower
def test_a_flower_run_of_a_frozen_model_from_public_weights_equals_the_single_node_run(small_config, tmp_path,
                                                                                     flower_superlink):
    """The nodes get the trainable parameters as model versions and read the file for the frozen backbone: the
    Flower simulation's iterate, accuracy and epsilon are the single-node run's."""
    from dpdro.launch.simulate import run_simulation

    path = _saved(tmp_path, make_model("cnn", 10, seed=9).state_dict())
    keys = {**TINY, "init-weights": path, "trainable": "head"}
    local, _ = _run(small_config, out_dir=str(tmp_path / "local"), **keys)
    summary = run_simulation(small_config(**{**keys, "out-dir": str(tmp_path / "flower")}), stream=False,
                             keep_superlink=True)
    flower_params = np.load(tmp_path / "flower" / "final_params.npy")
    assert summary["transport"] == "flower" and flower_params.shape == (330,)
    assert np.max(np.abs(flower_params - local.params)) <= 1e-6
    assert summary["test_accuracy"] == local.summary["test_accuracy"]
    assert summary["epsilon_spent"] == pytest.approx(local.summary["epsilon_spent"], rel=1e-12)
    assert summary["init_weights"] == local.summary["init_weights"]


@pytest.mark.data
def test_dpdro_plan_calibrates_for_the_trainable_dimension(small_config, capsys):
    """With variance allocation the noise of each mechanism depends on the dimension: `dpdro plan` prints the
    multipliers of the 330 trainable parameters, which differ from those of the whole model."""
    from dpdro.cli import main
    from dpdro.server.algorithms import make_algorithm
    from dpdro.server.engine import plan_run, resolve_delta

    keys = {**TINY, "algorithm": "dp-double-spider", "q": 3, "diff-batch": 30, "trainable": "head"}
    assert main(["plan", "--set", *[f"{k}={v}" for k, v in keys.items()]]) == 0
    out = capsys.readouterr().out
    cfg = small_config(**keys)
    n = int(out.split("n = ")[1].split(" ")[0])
    noise = {dim: plan_run(cfg, make_algorithm(cfg, n, dim, 10, 0), n, resolve_delta(cfg, n))[1]
             for dim in (330, CNN_PARAMETERS)}
    assert noise[330] != noise[CNN_PARAMETERS]
    for name, z in noise[330].items():
        assert f"{z:.4f}" in out, name
