"""Shared fixtures. Real-data tests use ../shared/datasets (or $DPDRO_DATA_ROOT) and decompress into a
cache inside the project (.cache/data) unless $DPDRO_CACHE_DIR says otherwise."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dpdro.common.per_sample import RowBlocks

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("DPDRO_CACHE_DIR", str(ROOT / ".cache" / "data"))
os.environ.setdefault("FLWR_HOME", str(ROOT / ".flwr"))

# A small, fast configuration on a real MNIST-ST subset (used by end-to-end tests).
SMALL = {
    "dataset": "mnist-st", "max-train-records": 3000, "max-test-records": 1000, "num-clients": 3,
    "iterations": 6, "q": 3, "refresh-batch": 300, "diff-batch": 150, "eval-every": 3,
    "reproducible": True, "reproducible-for-testing": True, "dtype": "float64", "threads": 1, "seed": 7,
}


def counting(transport):
    """The transport, with the number of queries of each round it answers appended to its ``calls`` (how many
    message rounds an algorithm makes, and how many releases each carries)."""
    transport.calls, run_round = [], transport.run
    transport.run = lambda queries, versions: transport.calls.append(len(queries)) or run_round(queries, versions)
    return transport


@pytest.fixture(scope="session")
def flower_superlink():
    """Lets Flower tests share the simulation SuperLink that run_simulation(keep_superlink=True) started in
    this process (never one started by anyone else); stops it, by PID, after the session."""
    from dpdro.launch.simulate import stop_local_superlink

    yield
    stop_local_superlink()


@pytest.fixture
def small_config(tmp_path, monkeypatch):
    """make(**keys) -> a small Config. ``inject_fault='<partition>:<iteration>:<kind>'`` (not a key: the test hook
    of common/faults.py) sets $DPDRO_INJECT_FAULT until the next make() (the fault belongs to the run made next
    with that config; a config made without it clears it)."""
    from dpdro.common.config import Config
    from dpdro.common.faults import ENV

    def make(inject_fault: str = "", **overrides):
        if inject_fault:
            monkeypatch.setenv(ENV, inject_fault)
        else:
            monkeypatch.delenv(ENV, raising=False)
        keys = {k.rstrip("_").replace("_", "-"): v for k, v in overrides.items()}
        values = {**SMALL, "out-dir": str(tmp_path / "run"), **keys}
        return Config.from_mapping(values)

    return make


class PerRecordFromGrads:
    """Mixin for a stand-in model that defines only ``losses_and_grads(flat, x, y, offset)`` (losses (B,), per-record
    gradients (B, d)): it adds FlatModel's other per-record interfaces, the gradients as two column blocks
    ([:, :1] and [:, 1:], as FlatModel's per parameter) and as RowBlocks (what dual-x reads)."""

    def losses_and_grad_blocks(self, flat, x, y, offset=None):
        losses, grads = self.losses_and_grads(flat, x, y, offset)
        return losses, [grads[:, :1], grads[:, 1:]]

    def losses_and_grad_rows(self, flat, x, y, offset=None):
        losses, blocks = self.losses_and_grad_blocks(flat, x, y, offset)
        return losses, RowBlocks(blocks)
