"""Smoke versions of the experiment pipelines on real data: a sweep over MNIST-ST,
Fashion-MNIST-ST and CelebA, its report and plots, resumability, and the federated = single-node command."""

from __future__ import annotations

import csv
import json
import sys

import pytest

from dpdro.simulations.sweep import PROFILES, plan_runs, run_sweep, write_report

pytestmark = pytest.mark.data


def test_smoke_sweep_report_and_resume(tmp_path):
    root, docs = tmp_path / "runs", tmp_path / "docs"
    counts = run_sweep("smoke", root)
    expected = len(plan_runs(PROFILES["smoke"], root))
    assert counts == {"done": expected, "skipped": 0, "missing-data": 0} and expected == 6
    assert run_sweep("smoke", root) == {"done": 0, "skipped": expected, "missing-data": 0}  # resumable
    report = write_report(root, "smoke", docs)
    text = report.read_text()
    for ds in ("mnist-st", "fashion-mnist-st", "celeba"):
        assert f"## {ds}" in text and (docs / "plots" / f"smoke_{ds}_accuracy_vs_epsilon.png").stat().st_size > 1000
        assert (docs / "plots" / f"smoke_{ds}_training_curves.png").stat().st_size > 1000
    assert report.name == "RESULTS-smoke.md"
    rows = list(csv.DictReader(open(docs / "results-smoke.csv")))
    assert len(rows) == 6
    celeba = [r for r in rows if r["dataset"] == "celeba"]
    assert all(0.0 <= float(r["worst_accuracy"]) <= float(r["test_accuracy"]) + 1e-12 for r in celeba)
    assert all(abs(float(r["epsilon_spent"]) - 4.0) < 0.04 for r in rows)


def test_missing_dataset_rows_are_not_faked(tmp_path, monkeypatch):
    from dpdro.simulations import sweep

    monkeypatch.setitem(sweep.PROFILES, "cifar", sweep.Profile(
        "cifar", ("cifar10-st",), ("dp-sgd",), (4.0,), (0,),
        base={"iterations": 1, "data-root": str(tmp_path / "empty"), "cache-dir": str(tmp_path / "c")}))
    assert run_sweep("cifar", tmp_path / "runs") == {"done": 0, "skipped": 0, "missing-data": 1}
    text = write_report(tmp_path / "runs", "cifar", tmp_path / "docs").read_text()
    assert "not run: data not available here yet" in text


@pytest.mark.flower
def test_equivalence_command_on_mnist_st(tmp_path, flower_superlink):
    from dpdro.simulations.equivalence import compare, write_table

    row = compare("mnist-st", tmp_path, {"max-train-records": 600, "max-test-records": 200, "refresh-batch": 60,
                                         "diff-batch": 30})
    assert row["max_abs_param_diff"] <= 1e-6 and row["epsilon_diff"] <= 1e-9 and row["transport"] == "flower"
    # reproducible-for-testing reached the ServerApp through Flower's run config, and the run says what it is
    from dpdro.common.config import SEEDED_NOT_PRIVATE

    summary = json.loads((tmp_path / "mnist-st" / "flower" / "summary.json").read_text())
    assert summary["private"] is False and summary["trust_model"].startswith(SEEDED_NOT_PRIVATE)
    text = write_table([row], {"cifar10-st": "data files not available here"}, tmp_path).read_text()
    assert "| mnist-st | 600 |" in text and "cifar10-st | not run" in text


def test_equivalence_table_for_some_data_sets_keeps_the_other_rows(tmp_path):
    from dpdro.simulations.equivalence import write_table

    old = {"dataset": "mnist-st", "records": 2000, "max_abs_param_diff": 0.0, "test_accuracy_diff": 0.0,
           "worst_accuracy_diff": 0.0, "epsilon_diff": 0.0, "epsilon": 4.0}
    write_table([old], {"cifar10-st": "data files not available here"}, tmp_path)
    new = {**old, "dataset": "cifar10-st", "max_abs_param_diff": 2e-17}
    lines = write_table([new], {}, tmp_path).read_text().splitlines()
    rows = [ln for ln in lines if ln.startswith("| ") and not ln.startswith("| dataset")]
    assert rows == ["| mnist-st | 2000 | 0 | 0 | 0 | 0 | 4.0000 |",
                    "| cifar10-st | 2000 | 2e-17 | 0 | 0 | 0 | 4.0000 |"]


def test_audit_smoke_on_real_data(tmp_path):
    from dpdro.simulations.audit import run_audit

    path = run_audit([float("inf"), 8.0], shadows=1, records=200, iterations=2, root=tmp_path / "runs",
                     docs=tmp_path / "docs")
    rows = [line for line in path.read_text().splitlines() if line.startswith("| inf") or line.startswith("| 8 ")]
    assert len(rows) == 2
    for row in rows:
        values = [float(v) for v in row.strip("|").split("|")[1:]]
        assert all(0.0 <= v <= 1.0 for v in values)


def test_plan_runs_filters_methods_and_epsilons(tmp_path):
    """--only-method / --only-epsilon keep exactly the runs asked for (the tuned profile's grid is big)."""
    from dpdro.simulations.sweep import Profile

    profile = Profile("grid", ("mnist-st",), ("dp-sgd", "dp-sgd-la"), (1.0, 4.0, 8.0), (0, 1),
                      base={"iterations": 1})
    assert len(plan_runs(profile, tmp_path)) == 12
    cfgs = plan_runs(profile, tmp_path, algorithms=["dp-sgd-la"], epsilons=[1.0, 8.0])
    assert [(c.algorithm, c.epsilon, c.seed) for c in cfgs] == [
        ("dp-sgd-la", 1.0, 0), ("dp-sgd-la", 1.0, 1), ("dp-sgd-la", 8.0, 0), ("dp-sgd-la", 8.0, 1)]
    cfgs = plan_runs(profile, tmp_path, epsilons=[4.0], seeds=[1])  # --only-seed: one seed of every method first
    assert [(c.algorithm, c.epsilon, c.seed) for c in cfgs] == [("dp-sgd", 4.0, 1), ("dp-sgd-la", 4.0, 1)]


def test_run_many_in_parallel_after_torch_ran_in_the_parent(tmp_path):
    """Parallel runs start from spawned processes: a parent whose torch thread pool is already running (the
    sweep's data check) must not hang its workers (forked children deadlocked on the pool's locks)."""
    import json
    import os
    import signal

    import torch

    from dpdro.common.config import Config
    from dpdro.simulations.runner import run_many

    torch.set_num_threads(2)
    float((torch.randn(256, 256) @ torch.randn(256, 256)).sum())  # starts the intra-op pool here
    cfgs = [Config.from_mapping({"dataset": "mnist-st", "algorithm": "dp-sgd", "iterations": 2,
                                 "max-train-records": 600, "refresh-batch": 64, "diff-batch": 32, "s-batch": 64,
                                 "eval-every": 2, "threads": 1, "seed": s, "out-dir": str(tmp_path / f"r{s}")})
            for s in (0, 1)]

    def hung(*_):  # fail instead of hanging: kill the pool's workers so that the executor can shut down
        import multiprocessing

        for child in multiprocessing.active_children():
            child.kill()
        raise TimeoutError("run_many hung")

    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(int(os.environ.get("DPDRO_TEST_HANG_S", "240")))  # seconds before the test fails as hung
    try:
        out = run_many(cfgs, 2, "test")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert out == [(c.out_dir, None) for c in cfgs]
    for c in cfgs:
        s = json.loads((tmp_path / f"r{c.seed}" / "summary.json").read_text())
        assert s["iterations"] == 2 and s["seed"] == c.seed and abs(float(s["epsilon_spent"]) - 4.0) < 0.04


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG) is Linux only")
def test_workers_of_a_killed_sweep_stop_with_it(tmp_path):
    """A sweep stopped with `kill` used to leave its spawned workers training on (found after killing a
    `dpdro lab levers`): run_many's workers now get SIGTERM when their parent dies."""
    import os
    import signal
    import subprocess
    import textwrap
    import time

    pid_file = tmp_path / "worker.pid"
    script = tmp_path / "sweep.py"  # a file, not -c: spawned workers import their function from the main module
    script.write_text(textwrap.dedent(f"""
        import multiprocessing, os, time
        from concurrent.futures import ProcessPoolExecutor
        from dpdro.simulations.runner import die_with_parent

        def work(_):
            open({str(pid_file)!r}, "w").write(str(os.getpid()))
            time.sleep(120)

        if __name__ == "__main__":
            with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                                     initializer=die_with_parent) as pool:
                list(pool.map(work, [0]))
        """))
    parent = subprocess.Popen([sys.executable, str(script)])
    deadline = time.time() + 60
    while not pid_file.exists() or not pid_file.read_text():
        assert time.time() < deadline, "the worker never started"
        time.sleep(0.2)
    worker = int(pid_file.read_text())
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.time() + 20
    while time.time() < deadline:
        try:
            os.kill(worker, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    os.kill(worker, signal.SIGKILL)
    raise AssertionError("the worker outlived its killed parent")
