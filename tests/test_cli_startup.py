"""What a newcomer hit at the command line.

- `dpdro --help`, `dpdro keys` and one-line configuration errors import no torch, Flower, matplotlib, tqdm or
  dp-accounting (each took 12-43 s on a loaded machine): checked through the import graph of a fresh process,
  not by timing it.
- A misspelled key or value names the nearest one instead of listing every key.
- Ctrl-C stops `dpdro train` at an iteration boundary with one line saying where and the --resume command (no
  traceback), leaving a resumable directory; the resumed run says where it restarts, prints the header line of
  `simulate` (n, delta, noise multipliers), its done line's time is the command's wall time, and piped output has
  no carriage returns.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
from conftest import ROOT, SMALL

from dpdro.common.config import Config, ConfigError

HEAVY = ("torch", "flwr", "matplotlib", "tqdm", "dp_accounting", "scipy", "torchvision", "optuna", "ray")
PROBE = f"""
HEAVY = {HEAVY!r}
import sys
from dpdro.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as e:
    code = e.code
heavy = sorted(set(m.split('.')[0] for m in sys.modules) & set(HEAVY))
lab = sorted(m for m in sys.modules if m == 'dpdro.simulations' or m.startswith('dpdro.simulations.'))
print('HEAVY=' + ','.join(heavy), file=sys.stderr)
print('LAB=' + ','.join(lab), file=sys.stderr)
sys.exit(code)
"""


def _probe(*argv: str) -> tuple[int, str, str, list[str]]:
    """(exit status, stdout, stderr without the probe's lines, heavy modules and lab (dpdro.simulations)
    modules imported) of `dpdro ARGV` in a fresh interpreter."""
    p = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, timeout=120,
                       cwd=ROOT)
    lines = p.stderr.splitlines()
    heavy = [ln for ln in lines if ln.startswith("HEAVY=")][-1][len("HEAVY="):]
    lab = [ln for ln in lines if ln.startswith("LAB=")][-1][len("LAB="):]
    return p.returncode, p.stdout, "\n".join(ln for ln in lines if not ln.startswith(("HEAVY=", "LAB="))), \
        [m for m in heavy.split(",") if m] + [m for m in lab.split(",") if m]


@pytest.mark.parametrize("argv, code, says", [
    (["--help"], 0, "usage: dpdro"),
    (["train", "--help"], 0, "--resume"),
    (["lab", "tune", "--help"], 0, "--dataset"),
    (["lab", "--help"], 0, "noise-modes"),
    (["evaluate", "--help"], 0, "--format {text,json}"),
    (["--version"], 0, "dpdro 0.1.0"),
    (["keys", "--format", "json"], 0, '"key": "iterations"'),
    (["keys"], 0, "iterations = 400"),
    (["train", "--set", "iteratons=5"], 2, "did you mean 'iterations'?"),
    (["train", "--set", "iterations=-1"], 2, "config key 'iterations': got -1"),
    (["train", "--set", "dataset=mnst"], 2, "did you mean 'mnist'?"),
    (["train", "--set", "model=cnx"], 2, "allowed: one of 'auto', 'cnn'"),
    (["simulate", "--set", "epsilon=-1"], 2, "config key 'epsilon'"),
    (["deploy", "--set", "foo=1"], 2, "unknown config key 'foo'"),
    (["plan", "--set", "q=0"], 2, "config key 'q'"),
])
def test_help_keys_and_config_errors_import_no_heavy_library(argv, code, says):
    """... nor any lab code (dpdro.simulations), also for the lab's own help and its argument errors."""
    status, out, err, heavy = _probe(*argv)
    assert status == code, err
    assert says in out + err
    assert heavy == [], f"dpdro {' '.join(argv)} imported {heavy}"
    if code == 2:
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_old_lab_names_are_hidden_aliases_that_warn():
    """`dpdro audit ...` runs `dpdro lab audit ...` after one deprecation line; the old names are not listed."""
    status, out, err, imported = _probe("audit", "--mode", "canary", "--trials", "0")
    assert status == 2 and imported == []
    assert err.splitlines() == ["dpdro: warning: 'dpdro audit' is deprecated; use 'dpdro lab audit'",
                                "dpdro: error: --trials: got 0; allowed: >= 1"]
    status, out, _, _ = _probe("--help")
    listed = {ln.split()[0] for ln in out.split("COMMAND\n", 1)[1].split("\n\n")[0].splitlines()
              if ln.startswith("    ") and not ln.startswith("     ")}
    assert listed == {"train", "simulate", "deploy", "plan", "keys", "predict", "evaluate", "export", "certs",
                      "lab"}


def test_keys_json_is_every_key_in_strict_json(capsys):
    import json

    from dpdro.cli import main
    from dpdro.common.config import FIELDS

    assert main(["keys", "--format", "json"]) == 0
    keys = json.loads(capsys.readouterr().out)["keys"]  # strict: infinity is the string 'inf'
    assert [k["key"] for k in keys] == [f.key for f in FIELDS]
    assert {k["key"]: k["default"] for k in keys}["weight-cap"] == "inf"


def test_errors_are_one_line_with_their_exit_code_and_the_traceback_only_with_verbose(monkeypatch, capsys):
    """A DpdroError: its class's exit code (common/errors.py); an unexpected error: one line and 1; -v (before
    or after the command) adds the traceback."""
    from dpdro.cli import keys, main
    from dpdro.common.errors import EXIT_FAILURE, EXIT_USAGE, RunFailed

    def boom(args):
        raise RuntimeError("boom")

    monkeypatch.setattr(keys, "run", boom)
    assert main(["keys"]) == EXIT_FAILURE
    err = capsys.readouterr().err
    assert err == "dpdro: error: RuntimeError: boom (dpdro -v ... prints the traceback)\n"
    with pytest.raises(RuntimeError, match="boom"):
        main(["-v", "keys"])

    def failed(args):
        raise RunFailed("the link went down")

    monkeypatch.setattr(keys, "run", failed)
    assert main(["keys"]) == EXIT_FAILURE and capsys.readouterr().err == "dpdro: error: the link went down\n"
    assert main(["train", "--set", "iterations=-1"]) == EXIT_USAGE
    assert "Traceback" not in capsys.readouterr().err
    assert main(["train", "-v", "--set", "iterations=-1"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("Traceback") and err.splitlines()[-1].startswith("dpdro: error: config key 'iterations'")


def test_builtin_model_names_are_the_registry_of_a_fresh_import():
    """config.BUILTIN_MODELS stands in for MODELS until common/models.py (torch) is imported: it must list
    exactly what that module registers."""
    code = ("from dpdro.common.config import BUILTIN_MODELS; from dpdro.common.models import MODELS; "
            "print(list(BUILTIN_MODELS) == list(MODELS.names()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.stdout.strip() == "True", out.stderr


def test_misspelled_key_names_the_nearest_key_not_all_of_them():
    with pytest.raises(ConfigError) as e:
        Config.from_mapping({"clip_x": 1.0, "xyzzy": 2})
    msg = str(e.value)
    assert "'clip_x' (did you mean 'clip-x'?)" in msg
    assert "'xyzzy'" in msg and "'xyzzy' (did you mean" not in msg
    assert "refresh-batch" not in msg  # no longer every key on one line


def _set_args(keys: dict) -> list[str]:
    return ["--set", *(f"{k}={v}" for k, v in keys.items())]


@pytest.mark.data
def test_ctrl_c_stops_with_one_line_and_resume_says_where_it_restarts(tmp_path, capsys, monkeypatch):
    """Ctrl-C in a real `dpdro train` (SIGINT, output piped): one line naming the iteration and the --resume
    command, exit 130, no traceback, no carriage return, a checkpoint at that iteration, the header line; then
    --resume says where it restarts (stopped again after one iteration, to keep the test short)."""
    from dpdro.cli import main
    from dpdro.cli import train as train_command

    keys = {**SMALL, "max-train-records": 600, "max-test-records": 100, "num-clients": 2, "iterations": 400,
            "refresh-batch": 60, "diff-batch": 30, "dtype": "float32", "checkpoint-every": 1000,
            "eval-every": 1000}
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "dpdro.cli", "train", *_set_args({**keys, "out-dir": str(run)})]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        deadline = time.monotonic() + 300
        while not (run / "checkpoint" / "state.npz").is_file():  # written after the first iteration
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "\r" not in out + err
    stop = [ln for ln in err.splitlines() if ln.startswith("dpdro: stopped")]
    assert len(stop) == 1, err
    m = re.fullmatch(rf"dpdro: stopped at iteration (\d+) of 400; checkpoint at iteration (\d+): resume with "
                     rf"dpdro train --resume {re.escape(str(run))}", stop[0])
    assert m and m.group(1) == m.group(2), stop[0]
    stopped = int(m.group(1))
    assert 1 <= stopped < 400
    assert re.search(r"^n=600 delta=0\.000167 noise multipliers \{'eta-refresh': ", out, re.M), out

    real = train_command._progress_display
    monkeypatch.setattr(train_command, "_progress_display",
                        lambda total, stop, split: real(total, lambda: True, split))
    assert main(["train", "--resume", str(run)]) == 130
    got = capsys.readouterr()
    assert f"resuming {run} at iteration {stopped} of 400 (epsilon spent so far " in got.out
    assert got.err.strip().splitlines()[-1] == (f"dpdro: stopped at iteration {stopped + 1} of 400; checkpoint at "
                                                f"iteration {stopped + 1}: resume with dpdro train --resume {run}")


@pytest.mark.data
def test_stop_request_checkpoints_the_first_iteration_and_cli_resume_completes(small_config, tmp_path, capsys):
    """The engine side of Ctrl-C: a stop requested during the first iteration writes its checkpoint (resumable
    even with checkpoint-every larger than the run) and raises TrainingStopped; `dpdro train --resume` then
    finishes with the parameters of an uninterrupted run, and its done line's time is the command's wall time."""
    import numpy as np

    from dpdro.cli import main
    from dpdro.client.local_transport import LocalTransport
    from dpdro.common.data import load_from_config
    from dpdro.server.engine import Progress, TrainingStopped, train

    cfg = small_config(out_dir=str(tmp_path / "r"), checkpoint_every=1000)
    ds_train, ds_test = load_from_config(cfg, True), load_from_config(cfg, False)
    notes: list[str] = []
    with pytest.raises(TrainingStopped) as e:
        train(cfg, LocalTransport(cfg, ds_train), ds_test, progress=Progress(stop_requested=lambda: True,
                                                                             on_note=notes.append))
    assert (e.value.iteration, e.value.iterations) == (1, 6)
    assert notes == [f"n=3000 delta=3.33e-05 noise multipliers {notes[0].split('multipliers ')[1]}"]
    started = time.perf_counter()
    assert main(["train", "--resume", cfg.out_dir]) == 0
    wall = time.perf_counter() - started
    out = capsys.readouterr().out
    assert re.search(rf"^resuming {re.escape(cfg.out_dir)} at iteration 1 of 6 \(epsilon spent so far \d\.\d{{4}}\)$",
                     out, re.M), out
    assert notes[0] in out.splitlines()  # the same header line
    done = re.search(r"done: .*, ([\d.]+) s \(training loop ([\d.]+) s over all sessions\)", out)
    assert done and 0 < float(done.group(1)) <= wall + 0.05, out
    full = train(small_config(out_dir=str(tmp_path / "f"), checkpoint_every=1000), LocalTransport(cfg, ds_train),
                 ds_test)
    assert np.array_equal(np.load(tmp_path / "r" / "final_params.npy"), full.params)


def test_piped_progress_writes_lines_without_carriage_returns(capsys):
    """Not a terminal: the header, evaluations and progress as whole lines; the tqdm bar only on a TTY."""
    from dpdro.cli.train import _progress_display

    close, progress = _progress_display(3)
    progress.on_note("n=10 delta=0.01 noise multipliers {'x': 1.0}")
    progress.on_start(0)
    for t in (1, 2, 3):
        progress.on_step(t)
    progress.on_eval({"iteration": 3, "epsilon_spent": 0.5, "test_accuracy": 0.25, "worst_class_accuracy": 0.125})
    close()
    got = capsys.readouterr()
    assert "\r" not in got.out + got.err
    assert got.out.splitlines() == ["n=10 delta=0.01 noise multipliers {'x': 1.0}",
                                    "iteration      3  epsilon 0.5000  test accuracy 0.2500  worst-class accuracy "
                                    "0.1250"]
    assert got.err.splitlines() == ["training: iteration 3 of 3"]
    # a run evaluated on its validation split says so
    close, progress = _progress_display(3, split="validation")
    progress.on_eval({"iteration": 3, "epsilon_spent": 0.5, "test_accuracy": 0.25, "worst_class_accuracy": 0.125})
    close()
    assert "epsilon 0.5000  validation accuracy 0.2500  worst-class" in capsys.readouterr().out


def test_stopped_message_without_checkpoint_says_start_again(tmp_path):
    from dpdro.cli.train import _stopped_message

    msg = _stopped_message(str(tmp_path / "none"))
    assert msg == (f"dpdro: stopped by Ctrl-C, before the first checkpoint: nothing to resume; start again with "
                   f"--overwrite (out-dir {tmp_path / 'none'})")


def test_progress_bar_of_a_resumed_run_starts_at_its_checkpoint(monkeypatch):
    """On a terminal the bar's count starts at the resumed iteration, not at 0."""
    from dpdro.cli.train import _progress_display

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    close, progress = _progress_display(400)
    progress.on_start(120)
    progress.on_step(121)
    bar = close.__self__
    assert (bar.n, bar.initial, bar.total) == (121, 120, 400)
    close()



def test_flower_commands_find_the_app_from_any_folder(tmp_path, monkeypatch):
    """simulate, deploy, noise-modes and bench default --app to this checkout, not the current folder (a user
    runs them from the folder of their data; with '.' flwr failed: no pyproject.toml there)."""
    from pathlib import Path

    from dpdro.cli.shared import app_dir

    monkeypatch.chdir(tmp_path)
    assert app_dir(None) == ROOT and "[tool.flwr.app]" in (app_dir(None) / "pyproject.toml").read_text()
    assert app_dir("elsewhere") == Path("elsewhere")


def test_no_lab_tool_writes_into_docs_by_default():
    """Each lab tool's document goes under its --root in runs/ (bench: runs/bench/) unless --docs DIR or
    --write-docs (the checkout's docs/) asks for it."""
    from pathlib import Path

    from dpdro.cli import build_parser, lab
    from dpdro.cli.lab import bench
    from dpdro.cli.shared import CHECKOUT, docs_dir

    parser = build_parser()
    required = {"levers": ["--config", "some.toml"]}  # the tools whose parser needs an argument
    for tool in lab.TOOLS:
        if tool is bench:
            assert bench.document(parser.parse_args(["lab", "bench"])) == "runs/bench/PERFORMANCE.md"
            assert bench.document(parser.parse_args(["lab", "bench", "--write-docs"])) == str(
                CHECKOUT / "docs" / "research" / "PERFORMANCE.md")
            continue
        base = ["lab", tool.NAME, *required.get(tool.NAME, [])]
        args = parser.parse_args(base)
        assert docs_dir(args) == Path(args.root) and args.root.startswith("runs/"), tool.NAME
        assert docs_dir(parser.parse_args([*base, "--write-docs"])) == CHECKOUT / "docs" / "research"
        assert docs_dir(parser.parse_args([*base, "--docs", "elsewhere"])) == Path("elsewhere")


def test_the_console_script_prints_a_warning_as_one_dpdro_line():
    """A key the chosen algorithm ignores is one 'dpdro: warning:' line on stderr, not Python's
    'file.py:61: IgnoredKeyWarning' form."""
    dpdro = os.path.join(os.path.dirname(sys.executable), "dpdro")
    out = subprocess.run([str(dpdro), "plan", "--set", "algorithm=dp-sgd", "q=3", "dataset=mnist-st"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "dpdro: warning: config key 'q' = 3 is ignored: algorithm 'dp-sgd' does not read it" in out.stderr
    assert "IgnoredKeyWarning" not in out.stderr
