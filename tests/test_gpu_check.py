"""The GPU check script (simulations/gpu_check.py), run at tiny size on the CPU: the same code a GPU runs."""

from __future__ import annotations

import json
import math

import pytest
import torch

from dpdro.common.config import ConfigError
from dpdro.simulations import gpu_check


def test_plan_is_the_paper_profile_at_epsilon_4_seed_0(tmp_path):
    runs = gpu_check.plan(tmp_path, "cpu", 7, tiny=False)
    assert [r["algorithm"] for r in runs] == list(gpu_check.METHODS)
    for r in runs:
        assert (r["dataset"], r["epsilon"], r["seed"], r["model"], r["device"]) == ("cifar10-st", 4.0, 0, "resnet20",
                                                                                      "cpu")
        assert (r["iterations"], r["refresh-batch"], r["diff-batch"], r["q"]) == (7, 1024, 512, 10)  # paper keys
        assert r["out-dir"] == str(tmp_path / "runs" / "paper" / "cifar10-st" / r["algorithm"] / "eps4" / "seed0")


def test_bad_iterations_is_refused_before_any_work(tmp_path):
    with pytest.raises(ConfigError, match="iterations"):
        gpu_check.run_check(tmp_path / "out", "cpu", iterations=0, tiny=True)
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: cuda is a valid device here")
def test_cuda_without_a_gpu_is_refused_before_any_work(tmp_path):
    with pytest.raises(ConfigError, match="cuda"):
        gpu_check.run_check(tmp_path / "out", "cuda", iterations=2, tiny=True)
    assert not (tmp_path / "out").exists()


@pytest.mark.data
def test_tiny_check_on_cpu_writes_every_output_under_one_folder(tmp_path):
    out = tmp_path / "gpu-check"
    res = gpu_check.run_check(out, "cpu", iterations=2, tiny=True, log=lambda _: None)
    assert [r["algorithm"] for r in res["runs"]] == list(gpu_check.METHODS) and res["not_run"] == []
    for r in res["runs"]:
        run = out / "runs" / "paper" / "cifar10-st" / r["algorithm"] / "eps4" / "seed0"
        cfg = json.loads((run / "config.json").read_text())
        assert (cfg["model"], cfg["device"], cfg["iterations"]) == ("resnet20", "cpu", 2)
        assert json.loads((run / "summary.json").read_text())["epsilon_spent"] == r["epsilon_spent"]
        assert 0 < float(r["epsilon_spent"]) <= 4.0 + 1e-6
        assert 0 <= r["test_accuracy"] <= 1 and r["seconds_per_iteration"] > 0
    assert [(b["model"], b["batch"]) for b in res["bench_rows"]] == [("resnet20", 4)]
    assert all(math.isfinite(b["seconds"]) for b in res["bench_rows"])
    saved = json.loads((out / "gpu_check.json").read_text())
    assert [r["algorithm"] for r in saved["runs"]] == list(gpu_check.METHODS)
    text = (out / "GPU_CHECK.md").read_text()
    assert "| dp-double-spider |" in text and "| resnet20 | 272474 | 4 |" in text
    assert (out / "PERFORMANCE-cpu.md").exists() and (out / "PERFORMANCE-cpu.json").exists()
    assert {p.name for p in out.iterdir()} == {"runs", "gpu_check.json", "GPU_CHECK.md", "PERFORMANCE-cpu.md",
                                              "PERFORMANCE-cpu.json"}


def test_budget_leaves_runs_out_and_says_so(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr("dpdro.server.engine.train", lambda *a, **k: calls.append(a))
    monkeypatch.setattr("dpdro.simulations.bench.run_bench", lambda opts, log: {"sweep": []})
    res = gpu_check.run_check(tmp_path, "cpu", iterations=2, budget_seconds=-1.0, tiny=True, log=lambda _: None)
    assert calls == [] and res["runs"] == []
    assert [r["algorithm"] for r in res["not_run"]] == list(gpu_check.METHODS)
    assert "not run: time budget" in (tmp_path / "GPU_CHECK.md").read_text()
