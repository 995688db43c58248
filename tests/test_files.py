"""Files a user or an attacker may hand us: run directories are never replaced
silently, an explicit data root must hold the data, and corrupt or hand-edited files give one clear line
naming the file and what to do, before any work and without overwriting anything."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dpdro.client.local_transport import LocalTransport
from dpdro.common.config import Config, ConfigError
from dpdro.common.data import ArrayDataset
from dpdro.server import rundir
from dpdro.server.engine import train
from dpdro.server.rundir import RunDir

N, K = 200, 10


def tiny_data() -> ArrayDataset:
    g = torch.Generator().manual_seed(0)
    return ArrayDataset(torch.rand((N, 1, 28, 28), generator=g, dtype=torch.float32) * 2 - 1,
                        torch.arange(N) % K, K, "tiny")


def tiny_cfg(out, **kw) -> Config:
    values = {"algorithm": "dp-sgd", "epsilon": "inf", "refresh-batch": 10, "diff-batch": 5, "num-clients": 2,
              "reproducible": True, "iterations": 2, "eval-every": 2, "checkpoint-every": 1, "threads": 1,
              "delta": 1e-3, "out-dir": str(out)}
    values.update({k.replace("_", "-"): v for k, v in kw.items()})
    return Config.from_mapping(values)


def run_tiny(cfg, resume=False):
    data = tiny_data()
    return train(cfg, LocalTransport(cfg, data), data, resume=resume)


def snapshot(folder):
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def finished_run(tmp_path):
    out = tmp_path / "done"
    run_tiny(tiny_cfg(out))
    return out


@pytest.fixture
def no_work(monkeypatch):
    """Fails the test if any data is loaded (the out-dir checks must come first)."""
    import dpdro.common.data as data

    def refuse(*a, **k):
        raise AssertionError("data were loaded before the out-dir was checked")

    # also where modules bound the names at import: a module first imported under the patch would otherwise keep
    # the stub after the test (launch.local did, failing later tests that train through the CLI)
    import dpdro.launch.local as local
    import dpdro.server.prediction as prediction
    import dpdro.simulations.sweep as sweep

    for module in (data, local, prediction, sweep):
        for name in ("load_from_config", "data_missing"):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, refuse)


def cli(*args):
    from dpdro.cli import main

    return main(list(args))


# ---- item 3: run directories are never replaced silently ----

def test_cli_refuses_a_finished_run_dir_before_loading_data(finished_run, no_work, capsys):
    before = snapshot(finished_run)
    assert cli("train", "--set", f"out-dir={finished_run}", "threads=1") == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and str(finished_run) in err
    assert "--resume" in err and "--overwrite" in err and "summary.json" in err
    assert snapshot(finished_run) == before


def test_cli_refuses_a_folder_with_other_files(tmp_path, no_work, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    assert cli("train", "--set", f"out-dir={tmp_path}") == 2
    assert "notes.txt" in capsys.readouterr().err
    assert (tmp_path / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("below", [False, True])
def test_cli_refuses_a_file_as_out_dir(tmp_path, no_work, capsys, below):
    f = tmp_path / "a-file"
    f.write_text("x")
    out = f / "run" if below else f
    assert cli("train", "--set", f"out-dir={out}") == 2
    err = capsys.readouterr().err
    assert "is a file, not a folder" in err and str(f) in err and "Traceback" not in err
    assert f.read_text() == "x"


def test_cli_resume_and_overwrite_together_are_refused(finished_run, no_work, capsys):
    assert cli("train", "--resume", str(finished_run), "--overwrite") == 2
    assert "choose one" in capsys.readouterr().err


def test_resume_without_checkpoint_is_refused_before_work(tmp_path, no_work, capsys):
    (tmp_path / "config.json").write_text(json.dumps(tiny_cfg(tmp_path).to_dict()))
    assert cli("train", "--resume", str(tmp_path)) == 2
    assert "nothing to resume" in capsys.readouterr().err


def test_train_refuses_non_empty_out_dir_and_overwrite_replaces_only_run_files(finished_run):
    (finished_run / "notes.txt").write_text("mine")
    before = snapshot(finished_run)
    with pytest.raises(ConfigError, match="not empty"):
        run_tiny(tiny_cfg(finished_run, seed=5))
    assert snapshot(finished_run) == before
    # overwrite: the old run's files go first (an interrupted overwrite can never leave the old summary)
    cfg = tiny_cfg(finished_run, seed=5, overwrite=True, iterations=1, eval_every=1, checkpoint_every=0)
    result = run_tiny(cfg)
    assert (finished_run / "notes.txt").read_text() == "mine"
    assert json.loads((finished_run / "summary.json").read_text())["seed"] == 5
    assert json.loads((finished_run / "config.json").read_text())["seed"] == 5
    assert result.summary["releases"] == {"grad": 1}
    assert set(rundir.RUN_FILES) <= set(snapshot(finished_run)) | {"checkpoint/state.npz"}


def test_overwrite_clears_the_old_summary_before_training(finished_run):
    class Stop(Exception):
        pass

    class Dies(LocalTransport):
        def run(self, queries, versions):
            raise Stop

    cfg = tiny_cfg(finished_run, seed=5, overwrite=True)
    with pytest.raises(Stop):
        train(cfg, Dies(cfg, tiny_data()), tiny_data())
    assert not (finished_run / "summary.json").exists()
    assert not (finished_run / "checkpoint" / "state.npz").exists()


def test_simulate_and_deploy_refuse_before_starting_anything(finished_run, no_work, monkeypatch):
    import subprocess

    from dpdro.launch import deploy
    from dpdro.launch.simulate import run_simulation

    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("a process was started"))
    monkeypatch.setattr(deploy, "LoopbackDeployment", lambda *a, **k: pytest.fail("a deployment was started"))
    before = snapshot(finished_run)
    cfg = tiny_cfg(finished_run, num_clients=2)
    with pytest.raises(ConfigError, match="not empty"):
        run_simulation(cfg, stream=False)
    with pytest.raises(ConfigError, match="not empty"):
        deploy.deploy_config(cfg, 2, finished_run.parent / "work")
    assert snapshot(finished_run) == before


def test_flower_run_config_carries_overwrite():
    from dpdro.launch.simulate import run_config_string

    assert "overwrite=true" in run_config_string(Config.from_mapping({"overwrite": True}))


def test_check_out_dir_accepts_missing_and_empty(tmp_path):
    rundir.check_out_dir(tmp_path / "new" / "run", resume=False, overwrite=False)
    rundir.check_out_dir(tmp_path, resume=False, overwrite=False)


def test_continue_keys_of_unfinished_runs(tmp_path, finished_run):
    assert rundir.continue_keys(tmp_path / "missing") == {}
    (tmp_path / "empty").mkdir()
    assert rundir.continue_keys(tmp_path / "empty") == {}
    assert rundir.continue_keys(finished_run) == {"resume": True}
    stopped = tmp_path / "stopped"
    stopped.mkdir()
    (stopped / "config.json").write_text("{}")
    assert rundir.continue_keys(stopped) == {"overwrite": True}
    rd = RunDir(finished_run)
    rd.checkpoint.write_bytes(rd.checkpoint.read_bytes()[:100])
    assert rundir.continue_keys(finished_run) == {"overwrite": True}


def test_a_stopped_run_resumes_through_continue_keys(tmp_path, stopped_run):
    """What a sweep does with an unfinished run: resume it from its checkpoint; it ends like an uninterrupted
    run (reproducible mode)."""
    full = run_tiny(tiny_cfg(tmp_path / "full", iterations=4, eval_every=1))
    cfg = stopped_run
    keys = rundir.continue_keys(cfg.out_dir)
    assert keys == {"resume": True}
    resumed = run_tiny(cfg.with_updates(keys), resume=True)
    assert np.array_equal(resumed.params, full.params)
    assert resumed.summary["releases"] == full.summary["releases"]


# ---- item 4: an explicit data root must hold the data ----

MNIST_FILES = {"train-images-idx3-ubyte": (2051, 30), "train-labels-idx1-ubyte": (2049, 30),
               "t10k-images-idx3-ubyte": (2051, 12), "t10k-labels-idx1-ubyte": (2049, 12)}


def idx_bytes(magic: int, n: int) -> bytes:
    """A small file in MNIST's IDX format: n images 28x28 (magic 2051) or n labels (2049)."""
    import struct

    rng = np.random.default_rng(magic + n)
    if magic == 2051:
        return struct.pack(">iiii", magic, n, 28, 28) + rng.integers(0, 256, n * 784, dtype=np.uint8).tobytes()
    return struct.pack(">ii", magic, n) + (np.arange(n) % 10).astype(np.uint8).tobytes()


def write_mnist(folder, gz=False):
    """Synthetic MNIST files in torchvision's layout under folder/MNIST/raw (extracted or .gz)."""
    import gzip

    raw = folder / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for name, (magic, n) in MNIST_FILES.items():
        data = idx_bytes(magic, n)
        if gz:
            (raw / (name + ".gz")).write_bytes(gzip.compress(data))
        else:
            (raw / name).write_bytes(data)
    return folder


def test_explicit_empty_data_root_is_an_error_not_the_cache(tmp_path):
    from dpdro.common.data import DataError, load_dataset

    cache = write_mnist(tmp_path / "cache")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError) as e:
        load_dataset("mnist", True, data_root=str(tmp_path / "empty"), cache_dir=str(cache))
    msg = str(e.value)
    assert str(tmp_path / "empty" / "MNIST" / "raw") in msg and "train-images-idx3-ubyte" in msg
    assert "data-root=auto" in msg


def test_cache_is_the_fallback_for_auto_only(tmp_path, monkeypatch):
    from dpdro.common.data import load_dataset

    cache = write_mnist(tmp_path / "cache")
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv("DPDRO_DATA_ROOT", str(tmp_path / "empty"))
    monkeypatch.setenv("DPDRO_CACHE_DIR", str(cache))
    assert len(load_dataset("mnist", True)) == 30 and len(load_dataset("mnist", False)) == 12


def test_explicit_cifar_root_does_not_fall_back_to_cache(tmp_path):
    import pickle

    from dpdro.common.data import CIFAR_DIR, CIFAR_TEST, DataError, load_dataset

    folder = tmp_path / "cache" / CIFAR_DIR
    folder.mkdir(parents=True)
    for name in CIFAR_TEST:
        (folder / name).write_bytes(pickle.dumps({b"data": np.zeros((4, 3072), np.uint8), b"labels": [0, 1, 2, 3]}))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="CIFAR-10 not found") as e:
        load_dataset("cifar10", False, data_root=str(tmp_path / "empty"), cache_dir=str(tmp_path / "cache"))
    assert str(tmp_path / "cache") not in str(e.value)


def test_flower_paths_pin_auto_to_where_the_data_are(tmp_path, monkeypatch):
    from dpdro.common.data import DataError, pin_data_paths

    cache = write_mnist(tmp_path / "cache")
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv("DPDRO_DATA_ROOT", str(tmp_path / "empty"))
    cfg = Config.from_mapping({"dataset": "mnist", "cache-dir": str(cache)})
    assert pin_data_paths(cfg).data_root == str(cache.resolve())  # auto: the cache stands in, as locally
    explicit = cfg.with_updates({"data-root": str(tmp_path / "empty")})
    with pytest.raises(DataError, match="not found in data-root"):
        pin_data_paths(explicit)
    source = write_mnist(tmp_path / "src", gz=False)
    assert pin_data_paths(cfg.with_updates({"data-root": str(source)})).data_root == str(source.resolve())


# ---- item 9: corrupt or hand-edited files: one clear line naming the file, nothing overwritten ----

@pytest.fixture
def stopped_run(tmp_path):
    """A run stopped in iteration 3 of 4 (checkpoint after iteration 2), as a crash leaves it."""
    class Stop(Exception):
        pass

    class StopsAt3(LocalTransport):
        def run(self, queries, versions):
            if queries[0].iteration >= 3:
                raise Stop
            return super().run(queries, versions)

    cfg = tiny_cfg(tmp_path / "stopped", iterations=4, eval_every=1)
    with pytest.raises(Stop):
        train(cfg, StopsAt3(cfg, tiny_data()), tiny_data())
    return cfg


def one_line_error(capsys, *parts):
    err = capsys.readouterr().err.strip()
    assert err.startswith("dpdro: error:") and "\n" not in err and "Traceback" not in err, err
    for part in parts:
        assert part in err, (part, err)
    return err


def test_truncated_checkpoint_is_one_clear_line(stopped_run, capsys):
    rd = RunDir(stopped_run.out_dir)
    rd.checkpoint.write_bytes(rd.checkpoint.read_bytes()[:-200])
    before = snapshot(rd.path)
    assert cli("train", "--resume", str(rd.path)) == 2
    one_line_error(capsys, str(rd.checkpoint), "--overwrite")
    assert snapshot(rd.path) == before
    with pytest.raises(rundir.RunFileError, match="state.npz"):
        run_tiny(stopped_run, resume=True)


def test_checkpoint_without_meta_is_one_clear_line(stopped_run, capsys):
    rd = RunDir(stopped_run.out_dir)
    np.savez(rd.checkpoint, x=np.zeros(3))  # a valid zip, but not ours
    assert cli("train", "--resume", str(rd.path)) == 2
    one_line_error(capsys, str(rd.checkpoint))


@pytest.mark.parametrize("text, says", [("{\"epsilon\": 4.0, \"seed\"", "not valid JSON"),
                                        ("[1, 2]", "not a JSON object"),
                                        ("{\"epsilon\": \"lots\"}", "epsilon")])
def test_invalid_config_json_is_one_clear_line(stopped_run, capsys, text, says):
    rd = RunDir(stopped_run.out_dir)
    rd.config.write_text(text)
    before = snapshot(rd.path)
    assert cli("train", "--resume", str(rd.path)) == 2
    one_line_error(capsys, str(rd.config), says)
    assert snapshot(rd.path) == before


def test_torn_last_event_line_is_ignored_with_a_warning(stopped_run, tmp_path, caplog):
    import logging

    rd = RunDir(stopped_run.out_dir)
    kept = rd.events.read_text()
    with open(rd.events, "a") as f:
        f.write('{"iteration": 3, "mechanism": "gra')  # an append cut short by the crash
    with caplog.at_level(logging.WARNING, logger="dpdro"):
        resumed = run_tiny(stopped_run, resume=True)
    assert "torn last line" in caplog.text and str(rd.events) in caplog.text
    full = run_tiny(tiny_cfg(tmp_path / "full", iterations=4, eval_every=1))
    assert np.array_equal(resumed.params, full.params)
    events = [json.loads(line) for line in rd.events.read_text().splitlines()]
    full_events = [json.loads(line) for line in (tmp_path / "full" / "events.jsonl").read_text().splitlines()]
    assert [(e["iteration"], e["mechanism"]) for e in events] == [(e["iteration"], e["mechanism"])
                                                                   for e in full_events]
    assert rd.events.read_text().startswith(kept)


def test_damaged_event_line_inside_the_file_is_one_clear_line(stopped_run, capsys):
    rd = RunDir(stopped_run.out_dir)
    lines = rd.events.read_text().splitlines()
    rd.events.write_text("\n".join(["{oops"] + lines[1:]) + "\n")
    before = snapshot(rd.path)
    assert cli("train", "--resume", str(rd.path)) == 2
    one_line_error(capsys, str(rd.events), "line 1")
    assert snapshot(rd.path) == before


def mnist_gz_source(tmp_path, monkeypatch):
    """Synthetic .gz MNIST source files, with torchvision's md5 list pointed at them."""
    import hashlib

    from torchvision import datasets

    root = write_mnist(tmp_path / "src", gz=True)
    raw = root / "MNIST" / "raw"
    monkeypatch.setattr(datasets.MNIST, "resources", [
        (f"https://example.invalid/{name}.gz", hashlib.md5((raw / f"{name}.gz").read_bytes()).hexdigest())
        for name in MNIST_FILES])
    return root


def test_truncated_extracted_file_in_data_root_names_it(tmp_path):
    from dpdro.common.data import DataError, load_dataset

    root = write_mnist(tmp_path / "root")
    damaged = root / "MNIST" / "raw" / "train-images-idx3-ubyte"
    damaged.write_bytes(damaged.read_bytes()[:-100])
    with pytest.raises(DataError, match="truncated or damaged") as e:
        load_dataset("mnist", True, data_root=str(root), cache_dir=str(tmp_path / "cache"))
    assert str(damaged) in str(e.value) and "replace it" in str(e.value)


@pytest.mark.parametrize("damage", ["truncate", "flip", "no-record"])
def test_damaged_cache_entry_is_rebuilt_from_intact_source(tmp_path, monkeypatch, caplog, damage):
    import logging

    from dpdro.common.cache_files import record_path
    from dpdro.common.data import load_dataset

    root, cache = mnist_gz_source(tmp_path, monkeypatch), tmp_path / "cache"
    first = load_dataset("mnist", True, data_root=str(root), cache_dir=str(cache))
    entry = cache / "MNIST" / "raw" / "train-images-idx3-ubyte"
    assert record_path(entry).is_file()
    data = entry.read_bytes()
    if damage == "truncate":
        entry.write_bytes(data[:-100])
    elif damage == "flip":  # same size, other content: found by the checksum
        entry.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
    else:  # a copy made before records existed: rebuilt once, from the source
        record_path(entry).unlink()
    with caplog.at_level(logging.INFO, logger="dpdro"):
        again = load_dataset("mnist", True, data_root=str(root), cache_dir=str(cache))
    assert "rebuilding it from" in caplog.text and str(entry) in caplog.text
    assert {r.levelname for r in caplog.records if "rebuilding" in r.getMessage()} == {
        "INFO" if damage == "no-record" else "WARNING"}
    assert torch.equal(again.x, first.x) and torch.equal(again.y, first.y)
    assert entry.read_bytes() == data and record_path(entry).is_file()
    assert not list(entry.parent.glob("*.part"))


def test_damaged_cache_entry_without_source_names_it(tmp_path, monkeypatch):
    from dpdro.common.data import DataError, load_dataset

    cache = write_mnist(tmp_path / "cache")  # extracted copies only (e.g. from an earlier download)
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv("DPDRO_DATA_ROOT", str(tmp_path / "empty"))
    monkeypatch.setenv("DPDRO_CACHE_DIR", str(cache))
    entry = cache / "MNIST" / "raw" / "t10k-labels-idx1-ubyte"
    entry.write_bytes(entry.read_bytes()[:-3])
    before = snapshot(cache)
    with pytest.raises(DataError, match="delete it") as e:
        load_dataset("mnist", False)
    assert str(entry) in str(e.value)
    assert snapshot(cache) == before


def test_a_damaged_cache_does_not_break_a_run_whose_data_root_is_intact(tmp_path, monkeypatch):
    """The cached copy is rebuilt even when an old copy (no record) is truncated."""
    from dpdro.common.data import load_dataset

    root, cache = mnist_gz_source(tmp_path, monkeypatch), tmp_path / "cache"
    write_mnist(cache)
    entry = cache / "MNIST" / "raw" / "train-labels-idx1-ubyte"
    entry.write_bytes(entry.read_bytes()[:-5])
    assert len(load_dataset("mnist", True, data_root=str(root), cache_dir=str(cache))) == 30


def test_truncated_cifar_batch_names_it(tmp_path):
    from dpdro.common.data import CIFAR_DIR, DataError, load_dataset

    folder = tmp_path / "root" / CIFAR_DIR
    folder.mkdir(parents=True)
    (folder / "test_batch").write_bytes(b"")
    with pytest.raises(DataError, match="test_batch"):
        load_dataset("cifar10", False, data_root=str(tmp_path / "root"), cache_dir=str(tmp_path / "c"))


def write_celeba_subset(root, n=16):
    from PIL import Image

    from dpdro.common.data import CELEBA_SUBSET_DIR

    folder = root / "celeba" / CELEBA_SUBSET_DIR
    folder.mkdir(parents=True)
    attrs = ["Blond_Hair", "Male"]
    lines = [str(n), " ".join(attrs)]
    rng = np.random.default_rng(0)
    for i in range(n):
        name = f"{i:06d}.jpg"
        Image.fromarray(rng.integers(0, 256, (109, 89, 3), dtype=np.uint8)).save(folder / name)
        lines.append(f"{name} {1 if i % 2 else -1} {1 if i % 4 < 2 else -1}")
    (root / "celeba" / "list_attr_celeba.txt").write_text("\n".join(lines) + "\n")
    return root


def test_damaged_celeba_cache_is_rebuilt(tmp_path, caplog):
    import logging

    from dpdro.common.data import CELEBA_SIZE, load_dataset

    root, cache = write_celeba_subset(tmp_path / "root"), tmp_path / "cache"
    first = load_dataset("celeba", "train", data_root=str(root), cache_dir=str(cache))
    entry = cache / f"celeba_subset_{CELEBA_SIZE}.npz"
    entry.write_bytes(entry.read_bytes()[: entry.stat().st_size // 2])
    with caplog.at_level(logging.WARNING, logger="dpdro"):
        again = load_dataset("celeba", "train", data_root=str(root), cache_dir=str(cache))
    assert "rebuilding it" in caplog.text and torch.equal(again.x, first.x)


def test_truncated_shard_cache_is_rebuilt(tmp_path, monkeypatch):
    from dpdro.client.flower.app import _load_shard, shard_cache_path

    root = write_mnist(tmp_path / "root")
    cfg = Config.from_mapping({"dataset": "mnist", "data-root": str(root), "cache-dir": str(tmp_path / "cache"),
                               "num-clients": 2})
    first = _load_shard(cfg, 0)
    path = shard_cache_path(cfg, 0)
    path.write_bytes(path.read_bytes()[:100])
    again = _load_shard(cfg, 0)
    assert torch.equal(again.x, first.x) and len(again) == len(first) > 0


def test_resume_on_another_number_of_records_is_refused_before_any_work(stopped_run):
    """A resumed run whose clients hold another n (a node dropped at start-up this time, a site's data changed)
    used to go on with the checkpoint's ledger, whose releases were made at the old sampling rates, read at the
    new ones. It is now refused before anything is released, naming both n."""
    from dpdro.server.engine import ResumeError

    rd = RunDir(stopped_run.out_dir)
    before = rd.events.read_text()
    fewer = tiny_data()
    fewer = ArrayDataset(fewer.x[: N - 20], fewer.y[: N - 20], K, "tiny")
    with pytest.raises(ResumeError, match=f"planned for n = {N} training records, but its clients now hold "
                                          f"n = {N - 20}"):
        train(stopped_run, LocalTransport(stopped_run, fewer), tiny_data(), resume=True)
    assert rd.events.read_text() == before
    resumed = train(stopped_run, LocalTransport(stopped_run, tiny_data()), tiny_data(), resume=True)
    assert resumed.metrics[-1]["iteration"] == 4
