"""What the ``flwr`` CLI prints with ``--format json``, read one way for every launcher (simulate, deploy,
compose): the id of a started run and the status of a run. The containerised CLI may print lines before the
JSON object, so parsing starts at the first '{' (a no-op for the plain CLI)."""

from __future__ import annotations

import json
import subprocess


def _json(stdout: str) -> dict:
    start = stdout.find("{")
    if start < 0:
        raise ValueError("no JSON object in the output")
    return json.loads(stdout[start:])


def started_run_id(out: subprocess.CompletedProcess) -> str | None:
    """The run id of ``flwr run ... --format json``, or None when no run was started (``require_run_id`` raises
    instead)."""
    try:
        return str(_json(out.stdout)["run-id"])
    except (ValueError, KeyError):
        return None


def require_run_id(out: subprocess.CompletedProcess, error: type[Exception]) -> str:
    """The run id of ``flwr run ... --format json``; raises ``error`` (the caller's: SimulationError,
    DeploymentError) with the tails of the output when no run was started."""
    run_id = started_run_id(out)
    if run_id is None:
        raise error(f"flwr run did not start a run:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    return run_id


def run_status(out: subprocess.CompletedProcess) -> tuple[str, str]:
    """(status, status-details) from ``flwr ls --run-id ID --format json``; ('unknown', the output's tails) when it
    cannot be read."""
    try:
        run = _json(out.stdout)["runs"][0]
        return run["status"], run.get("status-details", "")
    except (ValueError, KeyError, IndexError):
        return "unknown", out.stdout[-500:] + out.stderr[-500:]
