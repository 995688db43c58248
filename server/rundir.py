"""The run directory (ARCHITECTURE.md section 6): config.json, metrics.csv, summary.json, events.jsonl,
checkpoint/ and plots/. Every whole-file write is atomic (temporary file, then rename)."""

from __future__ import annotations

import csv
import io
import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np

METRIC_COLUMNS = ("iteration", "epsilon_spent", "eval_loss", "eval_dro_objective", "test_accuracy",
                  "worst_class_accuracy", "wall_seconds", "server_rss_mb")


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


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a crash leaves either the old or the new file, never a torn one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_json(path: Path, obj: Any) -> None:
    """Atomically write ``obj`` as JSON (inf as the string 'inf', NaN as null)."""
    atomic_write_bytes(path, (json.dumps(_jsonable(obj), indent=2, sort_keys=True) + "\n").encode())


def read_json(path: Path) -> Any:
    """The JSON value stored at ``path`` (as written by ``write_json``)."""
    with open(path) as f:
        return json.load(f)


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

    def write_metrics(self, rows: list[dict]) -> None:
        """Rewrite metrics.csv atomically: METRIC_COLUMNS, then the algorithm's scalar diagnostics and
        objectives (e.g. eta, lambda, s, step_norm) in sorted order; lists are left out."""
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
        """Append ledger events (one JSON object per line); flushed at every call."""
        with open(self.events, "a") as f:
            for e in events:
                f.write(json.dumps(_jsonable(e), sort_keys=True) + "\n")

    def truncate_events(self, upto_iteration: int) -> None:
        """Keep only the setup events and events of iterations < upto_iteration (used when resuming from a
        checkpoint)."""
        if not self.events.exists():
            return
        def kept(event: dict) -> bool:
            return event["iteration"] < upto_iteration or event.get("phase") == "setup"

        keep = [line for line in self.events.read_text().splitlines() if line and kept(json.loads(line))]
        atomic_write_bytes(self.events, ("\n".join(keep) + ("\n" if keep else "")).encode())

    def save_checkpoint(self, arrays: dict[str, np.ndarray], meta: dict) -> None:
        """Atomically write the checkpoint: arrays plus a JSON ``meta`` entry."""
        buf = io.BytesIO()
        np.savez(buf, __meta__=np.frombuffer(json.dumps(_jsonable(meta)).encode(), dtype=np.uint8), **arrays)
        atomic_write_bytes(self.checkpoint, buf.getvalue())

    def load_checkpoint(self) -> tuple[dict[str, np.ndarray], dict]:
        """(arrays, meta) as written by ``save_checkpoint``."""
        with np.load(self.checkpoint) as z:
            arrays = {k: z[k] for k in z.files if k != "__meta__"}
            meta = json.loads(bytes(z["__meta__"]).decode())
        return arrays, meta


def _fmt(v: Any) -> Any:
    if isinstance(v, float):
        return "inf" if math.isinf(v) else f"{v:.6g}"
    return v
