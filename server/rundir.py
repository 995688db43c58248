"""The run directory (docs/explanation/ARCHITECTURE.md section 6): config.json, metrics.csv, summary.json, events.jsonl,
checkpoint/ and plots/. Every whole-file write is atomic and durable
(``common.atomic``)."""

from __future__ import annotations

import csv
import io
import json
import logging
import math
import os
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from ..common.atomic import atomic_write_bytes
from ..common.config import ConfigError
from ..common.errors import DpdroError

log = logging.getLogger(__name__)

# The columns of every run's metrics.csv, first and in this order; then the columns of this run only (the
# algorithm's: AlgorithmSpec.reports, its diagnostics and eval_extras; the releases' clipped_* and noise_ratio_*;
# worst_group_accuracy on data with groups), sorted. docs/reference/run-directory.md lists them all.
METRIC_COLUMNS = ("iteration", "epsilon_spent", "eval_loss", "test_accuracy", "worst_class_accuracy", "wall_seconds",
                  "server_rss_mb", "server_heap_mb")


def _jsonable(v: Any) -> Any:
    if isinstance(v, float) and math.isinf(v):
        return "inf" if v > 0 else "-inf"
    if isinstance(v, float) and math.isnan(v):
        return None
    if isinstance(v, dict):
        return {k: _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, np.generic):
        return _jsonable(v.item())
    return v


def write_json(path: Path, obj: Any) -> None:
    """Atomically write ``obj`` as JSON (inf as the string 'inf', NaN as null)."""
    atomic_write_bytes(path, (json.dumps(_jsonable(obj), indent=2, sort_keys=True) + "\n").encode())


class RunFileError(ValueError, DpdroError):
    """A file of a run directory is missing, truncated or not what dpdro wrote; the message names the file
    and what to do."""


def read_json(path: Path) -> Any:
    """The JSON value stored at ``path`` (as written by ``write_json``). Raises RunFileError naming the file
    when it is not valid JSON (e.g. hand-edited or cut short); FileNotFoundError when it is missing."""
    try:
        with open(path) as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RunFileError(f"{path} is not valid JSON ({e}): restore it from the run's own output, or start the "
                           "run again in a new out-dir") from None


# What ``train`` writes into a run directory (``RunDir.clear`` removes exactly these, nothing else).
RUN_FILES = ("config.json", "metrics.csv", "summary.json", "events.jsonl", "final_params.npy",
             "checkpoint/state.npz", "model.pt", "model.json", "MODEL_CARD.md", "plots/training_curves.png",
             "plots/per_class_accuracy.png")


def check_out_dir(path: str | os.PathLike, *, resume: bool, overwrite: bool) -> None:
    """Refuse, before any work, an out-dir that this run would damage or cannot use.

    Fresh run: out-dir must be missing or an empty folder, unless ``overwrite`` (then the previous run's
    files, RUN_FILES, are replaced and other files are left alone). Resume: out-dir must hold config.json
    and a readable checkpoint/state.npz. Always: out-dir and its nearest existing parent must be folders,
    and that parent writable. Raises ConfigError naming the path and the options (--resume, --overwrite,
    config keys resume / overwrite).
    """
    p = Path(path)
    if resume and overwrite:
        raise ConfigError(f"out-dir {p}: resume and overwrite are both set; choose one (resume continues the run "
                          "there, overwrite replaces it)")
    if p.exists() and not p.is_dir():
        raise ConfigError(f"out-dir {p}: is a file, not a folder; choose a new or empty folder for the run")
    parent = p
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(f"out-dir {p}: {parent} is a file, not a folder; choose another out-dir")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"out-dir {p}: {parent} is not writable; choose another out-dir")
    rd = RunDir(p)
    if resume:
        if not rd.config.is_file() or not rd.checkpoint.is_file():
            missing = rd.config if not rd.config.is_file() else rd.checkpoint
            raise ConfigError(f"out-dir {p}: nothing to resume ({missing} is missing); run without resume to "
                              "start a new run")
        rd.verify_checkpoint()
        if rd.events.is_file():
            rd.read_events(warn=False)  # a damaged line is refused now, before any work
        return
    if p.is_dir() and not overwrite:
        entries = sorted(e.name for e in p.iterdir())
        if entries:
            shown = ", ".join(entries[:12]) + (", ..." if len(entries) > 12 else "")  # a whole run: 10 entries
            raise ConfigError(f"out-dir {p} is not empty ({shown}): pass --resume to continue the run there, "
                              "--overwrite to replace it (config key resume or overwrite = true), or choose a "
                              "new out-dir")


def continue_keys(path: str | os.PathLike) -> dict[str, bool]:
    """Config keys with which a tool re-runs one of its own unfinished run directories (sweep, tune, hazards,
    noise-modes skip finished ones): ``{"resume": True}`` when it holds config.json and a readable checkpoint
    (the run goes on from there, as ``--resume`` would), ``{"overwrite": True}`` when it holds anything else
    (a run stopped before its first checkpoint, or one whose checkpoint is damaged: started again), ``{}``
    for a missing or empty folder."""
    rd = RunDir(path)
    if not rd.path.is_dir() or not any(rd.path.iterdir()):
        return {}
    if rd.config.is_file() and rd.checkpoint.is_file():
        try:
            rd.verify_checkpoint()
            return {"resume": True}
        except RunFileError as e:
            log.warning("%s; starting that run again", e)
    return {"overwrite": True}


class RunDir:
    """Paths and writers of one run directory."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.config = self.path / "config.json"
        self.metrics = self.path / "metrics.csv"
        self.summary = self.path / "summary.json"
        self.events = self.path / "events.jsonl"
        self.checkpoint = self.path / "checkpoint" / "state.npz"
        self.plots = self.path / "plots"

    def create(self) -> None:
        """Create the run directory (and its parents) if missing."""
        self.path.mkdir(parents=True, exist_ok=True)

    def clear(self) -> None:
        """Remove the files a previous run wrote here (RUN_FILES), so that none of them (e.g. an old
        summary.json) can pass for this run's; other files are left alone."""
        for name in RUN_FILES:
            (self.path / name).unlink(missing_ok=True)

    def write_metrics(self, rows: list[dict]) -> None:
        """Rewrite metrics.csv atomically: METRIC_COLUMNS, then the run's own scalar columns (the algorithm's
        diagnostics and objectives, e.g. eval_dro_objective, eta, lambda, s, step_norm) in sorted order; lists are
        left out."""
        extra = sorted({k for r in rows for k, v in r.items()
                        if k not in METRIC_COLUMNS and not isinstance(v, (list, tuple, np.ndarray))})
        columns = list(METRIC_COLUMNS) + extra
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
        w.writeheader()
        for r in rows:
            w.writerow({k: _fmt(r.get(k)) for k in columns})
        atomic_write_bytes(self.metrics, buf.getvalue().encode())

    def append_events(self, events: list[dict]) -> None:
        """Append ledger events (one JSON object per line) and make them durable (fsync) before returning: the
        releaser calls this before a round's released values leave it, so events.jsonl is a write-ahead journal of
        every release made, which a crash cannot erase (``journal_since``)."""
        with open(self.events, "a") as f:
            for e in events:
                f.write(json.dumps(_jsonable(e), sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def event_count(self) -> int:
        """Number of complete events in events.jsonl (0 when there is none): what a checkpoint covers."""
        return len(self.read_events(warn=False)) if self.events.exists() else 0

    def journal_since(self, covered: int | None, iteration: int) -> list[dict]:
        """The events made after a checkpoint (resuming from it): every event past its first ``covered`` ones, or,
        for a checkpoint that did not record ``covered``, every training event of an iteration >= ``iteration``.
        Those releases were made (their values may have been published, e.g. in evaluation lines) but the
        checkpoint's state does not include them: the caller charges them. The file is rewritten atomically with
        each of them marked ``"abandoned": true`` (and a torn last line dropped); nothing is removed, so a second
        crash before the next checkpoint finds them again and charges them again against the same checkpoint."""
        if not self.events.exists():
            return []
        events = self.read_events()
        if covered is None:
            lost = [i for i, e in enumerate(events) if e["iteration"] >= iteration and e.get("phase") != "setup"]
        else:
            lost = list(range(min(int(covered), len(events)), len(events)))
        for i in lost:
            events[i] = {**events[i], "abandoned": True}
        text = "".join(json.dumps(e, sort_keys=True) + "\n" for e in events)
        atomic_write_bytes(self.events, text.encode())
        return [events[i] for i in lost]

    def read_events(self, warn: bool = True) -> list[dict]:
        """The events of events.jsonl, in order. A torn last line (no newline: an append cut short by a
        crash) is ignored, with a warning if ``warn``; any other unreadable line raises RunFileError naming
        the line."""
        text = self.events.read_bytes().decode("utf-8", errors="replace")
        lines = text.split("\n")
        events = []
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                event = json.loads(line)
                if not isinstance(event, dict) or "iteration" not in event:
                    raise ValueError("not an event object")
            except ValueError as e:
                if number == len(lines):  # the last line has no newline: an interrupted append
                    if warn:
                        log.warning("%s: ignoring its torn last line %d (an append cut short): %.60r",
                                    self.events, number, line)
                    continue
                raise RunFileError(f"{self.events} line {number} is not a dpdro event ({e}): the file was edited "
                                   "or damaged; restore it, or start the run again in a new out-dir") from None
            events.append(event)
        return events

    def save_checkpoint(self, arrays: dict[str, np.ndarray], meta: dict) -> None:
        """Atomically write the checkpoint: arrays plus a JSON ``meta`` entry."""
        buf = io.BytesIO()
        np.savez(buf, __meta__=np.frombuffer(json.dumps(_jsonable(meta)).encode(), dtype=np.uint8), **arrays)
        atomic_write_bytes(self.checkpoint, buf.getvalue())

    def load_checkpoint(self) -> tuple[dict[str, np.ndarray], dict]:
        """(arrays, meta) as written by ``save_checkpoint``. Raises RunFileError naming the file when it is
        truncated, corrupt or not a dpdro checkpoint."""
        try:
            with np.load(self.checkpoint) as z:
                arrays = {k: z[k] for k in z.files if k != "__meta__"}
                meta = json.loads(bytes(z["__meta__"]).decode())
            if not isinstance(meta, dict):
                raise ValueError("its meta entry is not an object")
        except (OSError, EOFError, ValueError, KeyError, zipfile.BadZipFile) as e:
            raise self._bad_checkpoint(e) from None
        return arrays, meta

    def verify_checkpoint(self) -> None:
        """Raise RunFileError if checkpoint/state.npz is not a complete zip file (CRC of every member checked)."""
        try:
            with zipfile.ZipFile(self.checkpoint) as z:
                bad = z.testzip()
                if bad is not None:
                    raise ValueError(f"member {bad} fails its CRC check")
                if "__meta__.npy" not in z.namelist():
                    raise ValueError("no __meta__ entry")
        except (OSError, EOFError, ValueError, zipfile.BadZipFile) as e:
            raise self._bad_checkpoint(e) from None

    def _bad_checkpoint(self, e: Exception) -> RunFileError:
        return RunFileError(f"checkpoint {self.checkpoint} is unreadable ({type(e).__name__}: {e}): it is truncated "
                            "or damaged and cannot be resumed; start again with --overwrite (or in a new out-dir)")


def _fmt(v: Any) -> Any:
    if isinstance(v, float):
        return "inf" if math.isinf(v) else f"{v:.6g}"
    return v
