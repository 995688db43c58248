"""The commands that README.md and the tutorials show run as written from a fresh clone, at small size.

Every fenced ```sh block of README.md and docs/tutorials/*.md runs, in page order, as one bash script per page
in an empty folder that looks like a clone (``.venv``, ``examples``, ``simulations`` linked to this checkout), so
that ``cd`` and variables carry from one block to the next as they do for a reader. The only change to a
command: ``dpdro train`` and ``dpdro simulate`` get small-size keys appended to their ``--set`` (2 iterations, a
few hundred records), and ```python blocks run with ``"iterations": 2``. ``make`` lines are not run (``make run``
is the main job, ``make test`` this suite). A block preceded by ``<!-- doc-commands: skip (why) -->`` is not run;
the comment says what runs its path instead.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs" / "tutorials").glob("*.md"))]
SKIP = "<!-- doc-commands: skip"
# Small-size keys for every training command (the last value of a key given twice wins).
SMALL = ("iterations=2 eval-every=1 checkpoint-every=0 max-train-records=1000 max-test-records=200 "
         "refresh-batch=64 diff-batch=32 s-batch=64")
TRAINING = re.compile(r"(?:dpdro|\$D) (?:train|simulate)\b")

pytestmark = [pytest.mark.data, pytest.mark.flower]


def fenced_blocks(text: str) -> list[tuple[str, str, bool]]:
    """(language, body, skipped) of every fenced code block of the Markdown ``text``, in order; ``skipped`` when
    the line before the fence is a doc-commands skip comment."""
    blocks = []
    for m in re.finditer(r"^```(\w*)\n(.*?)^```$", text, re.M | re.S):
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        blocks.append((m[1], m[2], before.startswith(SKIP)))
    return blocks


def small(command: str) -> str:
    """One shell command line (continuations joined) with the small-size keys appended to its ``--set`` when it
    trains; any other command unchanged. A trailing ``# comment`` is dropped."""
    if not TRAINING.search(command):
        return command
    command = re.sub(r"\s+#[^\"']*$", "", command)
    return f"{command} {SMALL}" if "--set" in command else f"{command} --set {SMALL}"


def page_script(text: str) -> tuple[str, list[str]]:
    """The bash script of a page's runnable ```sh blocks and the Python sources of its ```python blocks."""
    lines, python = ["set -euo pipefail"], []
    for language, body, skipped in fenced_blocks(text):
        if skipped:
            continue
        if language == "sh":
            for command in body.replace("\\\n", " ").splitlines():
                if command.strip() and not command.lstrip().startswith("make "):
                    lines.append(small(command))
        elif language == "python":
            python.append(re.sub(r'"iterations": \d+', '"iterations": 2', body))
    return "\n".join(lines) + "\n", python


def test_small_rewrites_only_training_commands():
    """The rewrite appends the small keys to a training command's --set (dropping its comment), adds --set when
    there is none, and leaves other commands alone."""
    assert small(".venv/bin/dpdro train --set a=1 out-dir=runs/x   # note") == (
        f".venv/bin/dpdro train --set a=1 out-dir=runs/x {SMALL}")
    assert small("$D simulate --config f.toml") == f"$D simulate --config f.toml --set {SMALL}"
    assert small(".venv/bin/dpdro predict --run runs/x   # rows") == ".venv/bin/dpdro predict --run runs/x   # rows"
    text = "```sh\nmake run\n$D train \\\n    --set k=v\n```\n\n<!-- doc-commands: skip (x) -->\n```sh\nboom\n```\n"
    script, python = page_script(text)
    assert script == f"set -euo pipefail\n$D train      --set k=v {SMALL}\n" and python == []


def test_every_page_with_commands_runs_some():
    """README.md and the tutorials each have commands this test runs (a renamed fence would silently run
    nothing), and the README's quick start keeps its two make commands."""
    readme = (ROOT / "README.md").read_text()
    assert "make run     #" in readme and "make test    #" in readme
    for page in PAGES:
        script, python = page_script(page.read_text())
        assert script.count("\n") > 1 or python, f"{page.relative_to(ROOT)}: no runnable ```sh block"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_page_commands_run_at_small_size(page, tmp_path):
    script, python = page_script(page.read_text())
    for name in ("examples", "simulations"):
        (tmp_path / name).symlink_to(ROOT / name)
    (tmp_path / ".venv").symlink_to(Path(sys.prefix))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    out = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, f"{page.name}:\n{script}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    for source in python:
        out = subprocess.run([sys.executable, "-c", source], cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=600)
        assert out.returncode == 0, f"{page.name}:\n{source}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    out_dirs = set(re.findall(r"out-dir=(\S+)", script)) | set(re.findall(r'"out-dir": "([^"]+)"', "".join(python)))
    assert out_dirs, f"{page.name}: no command names an out-dir"
    for name in sorted(out_dirs):
        assert any(tmp_path.rglob(f"{name}/summary.json")), f"{page.name}: {name}/summary.json was not written"
