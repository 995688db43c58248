"""The feature front-end (config key features, common/scattering.py) and the models on it (scatter-linear,
scatter-cnn): kymatio imports with scipy's removed sph_harm defined from sph_harm_y; the features of real CIFAR-10
images are kymatio's Scattering2D(J=2) of them; the cache returns the same arrays and rebuilds a damaged entry;
the models take (243, 8, 8) and (81, 7, 7) features and pass the per-record check; the config pairs the front-end
with its models; a private run on CIFAR10-ST features trains end to end, single-node and on Flower alike."""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import threading
import time

import numpy as np
import pytest
import torch

from dpdro.client.local_transport import LocalTransport
from dpdro.common import scattering
from dpdro.common.config import SCATTER_MODELS, Config, ConfigError
from dpdro.common.data import load_dataset, load_from_config
from dpdro.common.models import MODELS, ModelError, make_model
from dpdro.server.engine import train

# A tiny private run on CIFAR10-ST's scattering features (500 training, 200 test records).
SCATTER_RUN = {"dataset": "cifar10-st", "features": "scatternet", "model": "scatter-linear",
               "max-train-records": 500, "max-test-records": 200, "num-clients": 2, "algorithm": "dp-sgd-la",
               "iterations": 3, "refresh-batch": 100, "lr-x": 2.0, "epsilon": 4.0, "eval-every": 3,
               "reproducible": True, "reproducible-for-testing": True, "threads": 1, "seed": 4, "dtype": "float32"}


@pytest.mark.parametrize(("m", "n", "closed_form"), [
    (0, 0, lambda az, po: np.full_like(az, 0.5 / math.sqrt(math.pi), dtype=complex)),
    (0, 1, lambda az, po: 0.5 * math.sqrt(3 / math.pi) * np.cos(po) + 0j),
    (1, 1, lambda az, po: -0.5 * math.sqrt(3 / (2 * math.pi)) * np.exp(1j * az) * np.sin(po)),
    (-1, 1, lambda az, po: 0.5 * math.sqrt(3 / (2 * math.pi)) * np.exp(-1j * az) * np.sin(po)),
    (1, 2, lambda az, po: -0.5 * math.sqrt(15 / (2 * math.pi)) * np.exp(1j * az) * np.sin(po) * np.cos(po)),
    (-2, 2, lambda az, po: 0.25 * math.sqrt(15 / (2 * math.pi)) * np.exp(-2j * az) * np.sin(po) ** 2),
])
def test_the_sph_harm_shim_is_scipys_old_function(m, n, closed_form):
    """scipy's removed sph_harm(m, n, azimuth, polar): the spherical harmonics with the Condon-Shortley phase (their
    table in scipy's sph_harm_y docs), azimuth in [-pi, 2 pi] as kymatio passes it."""
    azimuth = np.array([-2.5, -0.3, 0.0, 1.1, 4.0])
    polar = np.array([0.2, 1.0, 1.7, 2.9, 0.6])
    np.testing.assert_allclose(scattering.sph_harm(m, n, azimuth, polar), closed_form(azimuth, polar),
                               rtol=1e-12, atol=1e-14)


def test_kymatio_imports_with_the_shim():
    """Every import of kymatio pulls its 3-D module, which imports scipy.special.sph_harm (gone from scipy 1.17):
    import_kymatio defines it first; the 3-D filter bank then builds with it (its l = 1 harmonics from Y_1^m)."""
    import scipy.special

    Scattering2D = scattering.import_kymatio()
    from kymatio.scattering3d import filter_bank

    assert Scattering2D.__module__ == "kymatio.torch"
    assert filter_bank.sph_harm is scipy.special.sph_harm
    bank = filter_bank.solid_harmonic_3d(8, 8, 8, 1.0, 1, fourier=False)
    assert bank.shape == (3, 8, 8, 8) and np.isfinite(bank).all() and np.abs(bank).max() > 0


def test_without_kymatio_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "kymatio.torch", None)  # as if not installed: the import raises ImportError
    with pytest.raises(scattering.FeatureError, match=r"install the 'features' extra: pip install 'dpdro\[features\]'"):
        scattering.compute_features(torch.zeros(2, 3, 32, 32), "scatternet", None)


@pytest.mark.data
def test_the_features_of_real_cifar_images_are_kymatios_scattering(tmp_path):
    """CIFAR10-ST's first records: (243, 8, 8) per image, equal to Scattering2D(J=2) of the pixels p / 255 (channel
    81 c + k: colour c's coefficient k), the test split too; MNIST's 28x28 grey images give (81, 7, 7)."""
    from torchvision.datasets import CIFAR10

    cache = str(tmp_path / "cache")
    images = load_dataset("cifar10-st", True, cache_dir=cache, max_records=5)
    feats = load_dataset("cifar10-st", True, cache_dir=cache, max_records=5, features="scatternet")
    assert feats.x.shape == (5, 243, 8, 8) and feats.x.dtype == torch.float32
    assert torch.equal(feats.y, images.y)
    raw = CIFAR10(os.environ.get("DPDRO_DATA_ROOT") or str(scattering.Path(__file__).parents[2] / "shared/datasets"),
                  train=True)
    first = int(np.flatnonzero(np.asarray(raw.targets) >= 5)[0])  # the '-ST' rule keeps every record of class >= 5
    pixels = torch.from_numpy(raw.data[first]).permute(2, 0, 1).float()[None] / 255.0
    with torch.no_grad():
        expected = scattering.import_kymatio()(J=2, shape=(32, 32))(pixels).reshape(1, 243, 8, 8)
    index = int(np.flatnonzero(np.asarray(images.y) == raw.targets[first])[0])
    torch.testing.assert_close(images.x[index:index + 1], pixels * 2 - 1, rtol=0, atol=1e-6)
    torch.testing.assert_close(feats.x[index:index + 1], expected, rtol=1e-5, atol=1e-6)
    # order 0 is a low-pass average of each colour: positive, below the pixels' maximum 1
    assert float(feats.x[:, [0, 81, 162]].min()) > 0 and float(feats.x[:, [0, 81, 162]].max()) < 1
    test = load_dataset("cifar10-st", False, cache_dir=cache, max_records=3, features="scatternet")
    assert test.x.shape == (3, 243, 8, 8)
    grey = load_dataset("mnist", False, cache_dir=cache, max_records=2, features="scatternet")
    assert grey.x.shape == (2, 81, 7, 7)


def test_the_cache_returns_the_same_features_and_rebuilds_a_damaged_entry(tmp_path, monkeypatch, caplog):
    x = torch.rand(6, 3, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
    first = scattering.compute_features(x, "scatternet", tmp_path, "cifar10-st")
    (path,) = (tmp_path / "features").glob("*.npz")
    assert path.name.startswith("cifar10-st-") and path.stat().st_mode & 0o777 == 0o600
    assert path == scattering.cache_path(x, "scatternet", tmp_path, "cifar10-st")
    computed = []
    real = scattering.scatter
    monkeypatch.setattr(scattering, "scatter", lambda v: computed.append(len(v)) or real(v))
    again = scattering.compute_features(x, "scatternet", tmp_path, "cifar10-st")
    assert computed == [] and torch.equal(again, first)
    # other records (one value changed) are another entry
    other = x.clone()
    other[0, 0, 0, 0] = 0.5
    scattering.compute_features(other, "scatternet", tmp_path, "cifar10-st")
    assert computed == [6] and len(list((tmp_path / "features").glob("*.npz"))) == 2
    # a truncated entry is found (the zip's CRC or its end record) and rebuilt with the same values
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with caplog.at_level(logging.WARNING, logger="dpdro.common.scattering"):
        rebuilt = scattering.compute_features(x, "scatternet", tmp_path, "cifar10-st")
    assert computed == [6, 6] and torch.equal(rebuilt, first)
    assert "are damaged" in caplog.text and path.read_bytes() == data
    # runs started side by side compute an entry once: the second waits for the first's lock, then reads
    fresh = x.flip(0)
    slow = []
    monkeypatch.setattr(scattering, "scatter", lambda v: slow.append(len(v)) or time.sleep(0.5) or real(v))
    results = [None, None]
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(
        i, scattering.compute_features(fresh, "scatternet", tmp_path, "cifar10-st"))) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert slow == [6] and torch.equal(results[0], results[1])
    # 'none' is the records themselves; other values and non-images are clear errors
    assert scattering.compute_features(x, "none", tmp_path) is x
    with pytest.raises(ValueError, match="config key 'features': got 'pca'; allowed: none, scatternet"):
        scattering.compute_features(x, "pca", tmp_path)
    with pytest.raises(scattering.FeatureError, match=r"needs image records \(C, H, W\); these are \(5,\)"):
        scattering.compute_features(torch.zeros(2, 5), "scatternet", tmp_path)


@pytest.mark.parametrize(("name", "shape", "parameters"), [
    ("scatter-linear", (243, 8, 8), 155_530), ("scatter-cnn", (243, 8, 8), 187_210),
    ("scatter-linear", (81, 7, 7), 39_700), ("scatter-cnn", (81, 7, 7), 33_066)])
def test_the_scatter_models_take_features_and_pass_the_per_record_check(name, shape, parameters):
    model = make_model(name, 10, seed=0, input_shape=shape)  # make_model runs check_per_record
    assert sum(p.numel() for p in model.parameters()) == parameters
    assert model(torch.randn(4, *shape)).shape == (4, 10)
    # the normalisation is each record's own: a record's logits do not depend on the batch or on its scale
    x = torch.randn(4, *shape)
    torch.testing.assert_close(model(x[:1]), model(x)[:1])
    torch.testing.assert_close(model(3 * x), model(x), rtol=1e-4, atol=1e-4)
    assert not any(p.requires_grad for p in model.norm.parameters())
    with pytest.raises(ModelError, match="set config key features=scatternet"):
        make_model(name, 10, seed=0, input_shape=(3, 32, 32))


def test_the_config_pairs_the_front_end_with_its_models():
    assert set(SCATTER_MODELS) <= set(MODELS) and scattering.FEATURES == ("none", "scatternet")
    for model in ("cnn32", "auto"):
        with pytest.raises(ConfigError, match="config key 'model': got '.*'.*allowed with features='scatternet': "
                                              "'scatter-linear', 'scatter-cnn' or an import path"):
            Config.from_mapping({"dataset": "cifar10-st", "features": "scatternet", "model": model})
    with pytest.raises(ConfigError, match="config key 'features': got 'none' with model='scatter-cnn'; allowed "
                                          "with that model: 'scatternet'"):
        Config.from_mapping({"dataset": "cifar10-st", "model": "scatter-cnn"})
    with pytest.raises(ConfigError, match="config key 'features': got 'wavelets'"):
        Config.from_mapping({"features": "wavelets"})
    cfg = Config.from_mapping({"dataset": "cifar10-st", "features": "scatternet", "model": "scatter-cnn"})
    assert cfg.features == "scatternet"


def _tiny_run(small_config, **keys):
    cfg = small_config(**{**SCATTER_RUN, **keys})
    return train(cfg, LocalTransport(cfg, load_from_config(cfg, True)), load_from_config(cfg, False))


@pytest.mark.data
def test_a_private_run_on_cifar_features_trains_end_to_end(small_config, tmp_path):
    """features=scatternet, model=scatter-linear on 500 CIFAR10-ST records: the clients and the evaluation read
    (243, 8, 8) features, the ledger covers the linear layer, model.json says what the input is, and dpdro predict
    recomputes the test split's features (from the cache) for the same accuracy."""
    from dpdro.server.prediction import predict

    result = _tiny_run(small_config, out_dir=str(tmp_path / "run"))
    s = result.summary
    assert result.params.shape == (155_530,) and 3.9 < s["epsilon_spent"] <= 4.0
    assert 0.0 <= s["test_accuracy"] <= 1.0
    meta = json.load(open(tmp_path / "run" / "model.json"))
    assert meta["input_shape"] == [243, 8, 8] and "Scattering2D(J=2, L=8) of (x + 1) / 2" in meta["input_scaling"]
    predictions = predict(tmp_path / "run", "test")
    assert predictions.labels.shape == (200,)
    assert float(np.mean(predictions.predicted == predictions.labels)) == pytest.approx(s["test_accuracy"])


@pytest.mark.data
@pytest.mark.flower
def test_a_flower_run_on_features_equals_the_single_node_run(small_config, tmp_path, flower_superlink):
    """Each node computes (or reads from its cache) the features of its own shard: the Flower simulation's
    iterate, accuracy and epsilon are the single-node run's."""
    from dpdro.launch.simulate import run_simulation

    local = _tiny_run(small_config, out_dir=str(tmp_path / "local"), dtype="float64")
    summary = run_simulation(small_config(**{**SCATTER_RUN, "dtype": "float64", "out-dir": str(tmp_path / "flower")}),
                             stream=False, keep_superlink=True)
    flower_params = np.load(tmp_path / "flower" / "final_params.npy")
    assert summary["transport"] == "flower" and flower_params.shape == (155_530,)
    assert np.max(np.abs(flower_params - local.params)) <= 1e-6
    assert summary["test_accuracy"] == local.summary["test_accuracy"]
    assert summary["epsilon_spent"] == pytest.approx(local.summary["epsilon_spent"], rel=1e-12)
