"""What a run leaves, read by a newcomer: each algorithm's own summary fields and metric columns, the reference
page docs/reference/run-directory.md listing every key a real run writes, the model card's minority classes and
run-relative commands, the still-rising note, batch sizes that follow n, a missing $DPDRO_DATA_ROOT refused and
the folder read recorded, and a console process that leaves cleanly while a client thread is inside torch."""

from __future__ import annotations

import csv
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from dpdro.cli import main
from dpdro.common.algorithm_specs import ALGORITHM_SPECS, REPORTABLE
from dpdro.common.config import Config, ConfigError
from dpdro.common.data import DATASETS, DatasetSpec, register_dataset
from dpdro.common.models import MODELS, register_model

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "reference" / "run-directory.md"
DRO_ONLY = ("psi", "lambda", "dro_clip", "eval_dro_objective", "eta0", "spider_noise")


def _load_tail(split, data_root, cache_dir, download, split_seed):
    """(uint8 (N, 4, 4), labels (N,), None) of 4 classes, class k lighting row k; '-st' makes 0 and 1 rare."""
    n = 800 if split == "train" else 200
    rng = np.random.default_rng({"train": 3, "test": 4}[split])
    labels = rng.integers(0, 4, size=n)
    images = rng.integers(0, 120, size=(n, 4, 4))
    images[np.arange(n), labels, :] += 120
    return torch.from_numpy(images.astype(np.uint8)), torch.from_numpy(labels.astype(np.int64)), None


class Tiny(nn.Module):
    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(16, num_classes))

    def forward(self, x):
        return self.net(x)


KEYS = {"dataset": "tail-st", "epsilon": 4.0, "iterations": 6, "q": 2, "num-clients": 2, "eval-every": 2,
        "checkpoint-every": 0, "threads": 1, "seed": 3, "lr-x": 1.0}
BATCHES = {"refresh-batch": 100, "diff-batch": 50, "s-batch": 100}
# dp-sgd keeps the default refresh-batch (1024), more than tail-st's n: it follows n; dp-sgd-la averages its
# iterates (ema-decay), so its metrics.csv has the last iterate's columns too
RUNS = {"dp-sgd": {}, "dp-sgd-la": {**BATCHES, "ema-decay": 0.5}, "dp-double-spider": BATCHES,
        "recursive-spider": BATCHES}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{algorithm: run directory} of one short real `dpdro train` run of each algorithm of RUNS."""
    register_dataset("tail-st", DatasetSpec(_load_tail, 4, "tiny-4", long_tailed=True, keys=("imbalance-ratio",)))
    register_model("tiny-4")(Tiny)
    root = tmp_path_factory.mktemp("runs")
    out = {}
    try:
        for algo, extra in RUNS.items():
            run = root / algo
            keys = {**KEYS, "algorithm": algo, "imbalance-ratio": 0.1, **extra, "out-dir": run}
            assert main(["train", "--set", *[f"{k}={v}" for k, v in keys.items()]]) == 0
            out[algo] = run
        yield out
    finally:
        DATASETS.pop("tail-st", None)
        MODELS.pop("tiny-4", None)


def _summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


def _columns(run: Path) -> list[str]:
    with open(run / "metrics.csv", newline="") as f:
        return next(csv.reader(f))


# ---- each algorithm reports its own fields ----

def test_a_baseline_reports_no_dro_field_and_a_dro_method_reports_its_own(runs):
    base, dro = _summary(runs["dp-sgd"]), _summary(runs["dp-double-spider"])
    assert not set(DRO_ONLY) & set(base)
    assert not {"eta", "eval_dro_objective"} & set(_columns(runs["dp-sgd"]))
    assert set(DRO_ONLY) <= set(dro) and {"eta", "eval_dro_objective"} <= set(_columns(runs["dp-double-spider"]))
    assert (dro["psi"], dro["lambda"], dro["dro_clip"]) == ("chi2", 1.0, "product")
    rs = _summary(runs["recursive-spider"])  # KL-DRO with rho: not key psi's objective, its own instead
    assert "psi" not in rs and "eval_dro_objective" not in rs and "eval_kl_dro_objective" in rs
    assert set(rs) & set(DRO_ONLY) == {"dro_clip", "spider_noise"}


def test_every_algorithm_declares_only_known_fields():
    for spec in ALGORITHM_SPECS.values():
        assert set(spec.reports) <= set(REPORTABLE), spec.name
    with pytest.raises(ValueError, match="reports"):
        type(ALGORITHM_SPECS["dp-sgd"])("x", keys=(), quantities=(), reports=("eta_of_nothing",))


# ---- the reference page lists every key a real run writes ----

def _listed() -> list[re.Pattern]:
    """Every `name` of the page, a <placeholder> standing for any text."""
    names = set(re.findall(r"`([^`\s]+)`", PAGE.read_text()))
    return [re.compile(re.sub(r"<[^>]+>", ".+", re.escape(n).replace(r"\<", "<").replace(r"\>", ">")) + "$")
            for n in names]


def _unlisted(keys, patterns) -> list[str]:
    return sorted(k for k in keys if not any(p.match(k) for p in patterns))


def test_the_run_directory_page_lists_every_key_a_run_writes(runs):
    from dpdro.common.config import FIELD_BY_KEY

    patterns = _listed()
    for algo, run in runs.items():
        summary = _summary(run)
        by_mechanism = ("noise_multipliers", "sampling_rates", "releases")  # keyed by the plan's mechanisms
        nested = {k for name, v in summary.items() if isinstance(v, dict) and name not in by_mechanism for k in v}
        assert _unlisted(set(summary) | nested, patterns) == [], algo
        assert _unlisted(_columns(run), patterns) == [], algo
        config = json.loads((run / "config.json").read_text())
        assert _unlisted(set(config) - set(FIELD_BY_KEY), patterns) == [], algo
        assert _unlisted(json.loads((run / "model.json").read_text()), patterns) == [], algo
        events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
        assert _unlisted({k for e in events for k in e}, patterns) == [], algo
        files = {str(p.relative_to(run)) for p in run.rglob("*") if p.is_file()}
        assert _unlisted(files, patterns) == [], algo


def test_the_page_check_fails_on_an_unlisted_key():
    assert _unlisted(["server_heap_mb", "clipped_x-refresh", "made_up_field"], _listed()) == ["made_up_field"]


# ---- the model card and the plots ----

def test_the_card_names_minority_classes_as_the_accounting_treats_the_histogram(runs):
    la = _summary(runs["dp-sgd-la"])  # logit adjustment: the class histogram is released with noise
    assert la["class_prior"] == "private" and len(la["class_counts"]) == 4
    card = (runs["dp-sgd-la"] / "MODEL_CARD.md").read_text()
    line = next(ln for ln in card.splitlines() if ln.startswith("- Minority classes in training:"))
    assert "noisy counts of the class histogram release" in line and "charged in the ledger" in line
    mean = sum(max(c, 0) for c in la["class_counts"]) / 4
    minority = [k for k, c in enumerate(la["class_counts"]) if c < 0.5 * mean]
    assert minority == [0, 1]  # '-st' with ratio 0.1 keeps about 20 of their 200 records (noise std 10)
    for k in minority:
        assert f"{k} ({la['class_counts'][k]:.0f})" in line
    base = (runs["dp-sgd"] / "MODEL_CARD.md").read_text()  # no histogram released: the public construction only
    line = next(ln for ln in base.splitlines() if ln.startswith("- Minority classes in training:"))
    assert line.startswith("- Minority classes in training: 0, 1 (by tail-st's public construction")
    assert "class_counts" not in _summary(runs["dp-sgd"])


def test_the_card_uses_paths_relative_to_the_run_folder(runs):
    for run in runs.values():
        card = (run / "MODEL_CARD.md").read_text()
        assert str(run) not in card and "dpdro evaluate --run . --data test" in card


def test_the_first_step_and_the_minority_rule_come_from_the_run_files(runs):
    from dpdro.server.run_report import first_step, minority_classes

    la = _summary(runs["dp-sgd-la"])
    assert first_step(la) == "the class histogram release (noise multiplier 10)"
    assert first_step(_summary(runs["dp-sgd"])) == ""
    public = {"class_prior": "public", "priors": [0.05, 0.45, 0.5], "n": 1000}
    assert minority_classes(public)[0] == [0]
    assert minority_classes({"class_prior": "none"}) is None


# ---- the still-rising note ----

def test_still_rising_follows_the_slope_of_the_last_evaluations():
    from dpdro.server.convergence import rising_note, still_rising, worst_slope

    rising = [{"iteration": t, "worst_class_accuracy": w} for t, w in ((0, 0.0), (50, 0.2), (100, 0.4), (150, 0.6))]
    assert worst_slope(rising, 200) == pytest.approx(0.08)  # +0.4 per 100 iterations = +0.08 per tenth of 200
    assert still_rising(rising, 200) and "more iterations" in rising_note(rising, 200)
    assert "iterations 50-150 gains +0.080 per 10% of the run (20 of its 200 iterations)" in rising_note(rising, 200)
    flat = [{"iteration": t, "worst_class_accuracy": w} for t, w in ((0, 0.0), (50, 0.58), (100, 0.59), (150, 0.6))]
    assert worst_slope(flat, 200) == pytest.approx(0.004) and not still_rising(flat, 200)
    falling_last = rising[:3] + [{"iteration": 150, "worst_class_accuracy": 0.39}]
    assert not still_rising(falling_last, 200)
    assert worst_slope(rising[:2], 200) is None and rising_note(rising[:2], 200) is None
    assert "eval-split=validation" in rising_note(rising, 200, "test")
    assert "eval-split" not in rising_note(rising, 200, "validation")


def test_a_finished_run_records_the_slope_and_the_note(runs):
    s = _summary(runs["dp-sgd"])
    rows = list(csv.DictReader(open(runs["dp-sgd"] / "metrics.csv")))
    from dpdro.server.convergence import worst_slope

    assert s["worst_rising_slope"] == pytest.approx(worst_slope(rows, s["iterations"]))
    assert (s["worst_still_rising"] is not None) == (s["worst_rising_slope"] >= 0.02 and
                                                       float(rows[-1]["worst_class_accuracy"])
                                                       > float(rows[-2]["worst_class_accuracy"]))


# ---- batch sizes follow n ----

def test_default_batches_follow_n_and_set_ones_are_refused_all_at_once():
    from dpdro.server.engine import follow_n

    cfg = Config.from_mapping({"algorithm": "dp-double-spider"})  # defaults 1024 and 512
    fitted, notes = follow_n(cfg, 480)
    assert (fitted.refresh_batch, fitted.diff_batch) == (48, 24) and len(notes) == 2
    assert follow_n(cfg, 5000)[0] is cfg
    with pytest.raises(ConfigError) as e:
        follow_n(Config.from_mapping({"algorithm": "dp-double-spider", "refresh-batch": 600, "diff-batch": 700}),
                 480)
    assert "'refresh-batch' = 600, 'diff-batch' = 700" in str(e.value)
    assert "suggested: refresh-batch=48 diff-batch=24" in str(e.value)
    # a key the algorithm does not read is neither refused nor changed
    sgd = Config.from_mapping({"algorithm": "dp-sgd", "diff-batch": 5000, "max-train-records": 300})
    assert follow_n(sgd, 300)[0].diff_batch == 5000


def test_config_refuses_set_batches_above_max_train_records_naming_them_all():
    with pytest.raises(ConfigError, match="'refresh-batch' = 400, 'diff-batch' = 500.*suggested"):
        Config.from_mapping({"max-train-records": 300, "refresh-batch": 400, "diff-batch": 500})
    Config.from_mapping({"max-train-records": 300})  # the defaults follow n at training


def test_a_run_on_fewer_records_than_the_default_batch_trains_at_n_over_10(runs):
    config = json.loads((runs["dp-sgd"] / "config.json").read_text())
    assert config["n"] < 1024 and config["refresh-batch"] == config["n"] // 10
    assert _summary(runs["dp-sgd"])["sampling_rates"]["grad"] == pytest.approx(config["refresh-batch"] / config["n"])
    assert json.loads((runs["dp-sgd-la"] / "config.json").read_text())["refresh-batch"] == 100  # set: kept


# ---- the data folder ----

def test_a_missing_dpdro_data_root_is_refused(tmp_path, monkeypatch):
    from dpdro.common.data import DataError, resolve_data_root

    monkeypatch.setenv("DPDRO_DATA_ROOT", str(tmp_path / "nowhere"))
    with pytest.raises(DataError, match=r"\$DPDRO_DATA_ROOT=.*nowhere: no such folder"):
        resolve_data_root("auto")
    assert main(["train", "--set", "dataset=mnist", f"out-dir={tmp_path / 'run'}"]) == 2
    assert not (tmp_path / "run").exists()


def test_the_folder_read_is_the_cache_when_auto_falls_back_to_it(tmp_path, monkeypatch):
    from test_files import write_mnist

    from dpdro.common.data import load_dataset

    cache = write_mnist(tmp_path / "cache")
    (tmp_path / "source").mkdir()  # exists, holds no MNIST: data-root=auto falls back to the cache's copies
    monkeypatch.setenv("DPDRO_DATA_ROOT", str(tmp_path / "source"))
    monkeypatch.setenv("DPDRO_CACHE_DIR", str(cache))
    assert load_dataset("mnist", False).source == str(cache.resolve())
    source = write_mnist(tmp_path / "source")
    assert load_dataset("mnist", False).source == str(source.resolve())


def test_config_json_records_the_folder_read(runs):
    from dpdro.common.data import resolve_data_root

    config = json.loads((runs["dp-sgd"] / "config.json").read_text())
    assert config["data_read"] == str(resolve_data_root("auto").resolve())


# ---- leaving the process while a client thread is inside torch ----

def test_the_console_process_leaves_cleanly_while_a_client_thread_runs():
    """A second Ctrl-C (or a client abandoned after its round-timeout) leaves a client thread inside torch's C++
    code; shutting the interpreter down around it aborted with 'terminate called without an active exception'."""
    script = """
import sys, threading, time, torch
from dpdro.client.local_transport import CLIENT_THREAD
from dpdro.cli.entry import _leave_process
torch.set_num_threads(1)
a = torch.randn(800, 800)
def work():
    while True:
        (a @ a).sum()
threading.Thread(target=work, name=f"{CLIENT_THREAD}-0", daemon=True).start()
time.sleep(0.3)
print("dpdro: stopped", flush=True)
sys.exit(_leave_process(130) if sys.argv[1] == "leave" else 130)
"""
    left = subprocess.run([sys.executable, "-c", script, "leave"], capture_output=True, text=True, timeout=120)
    assert (left.returncode, left.stdout) == (130, "dpdro: stopped\n")
    assert "terminate called" not in left.stderr
    shut = subprocess.run([sys.executable, "-c", script, "exit"], capture_output=True, text=True, timeout=120)
    assert shut.returncode != 130 and "terminate called without an active exception" in shut.stderr


def test_the_progress_line_carries_the_worst_group_when_the_run_has_groups():
    """A run with groups (csv-group, CelebA) shows its worst group in every progress line, not only in summary.json."""
    from dpdro.server.engine import evaluation_line

    row = {"iteration": 50, "epsilon_spent": 1.25, "test_accuracy": 0.9, "worst_class_accuracy": 0.8}
    assert evaluation_line(row) == ("iteration     50  epsilon 1.2500  test accuracy 0.9000  "
                                    "worst-class accuracy 0.8000")
    assert evaluation_line({**row, "worst_group_accuracy": 0.625}, "validation").endswith(
        "validation accuracy 0.9000  worst-class accuracy 0.8000  worst-group accuracy 0.6250")
