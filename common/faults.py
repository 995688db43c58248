"""Test hook: make one client fail, or the server keep replies, at one iteration. Not a configuration key.

A test sets ``$DPDRO_INJECT_FAULT`` = '<partition>:<iteration>:<kind>' before it trains: that client raises
(kind 'raise', or 'raise-once' on the first attempt only), sends a malformed reply ('nan') or hangs ('hang') at
that iteration; kind 'leak' makes the server keep a copy of that client's first reply of every round from that
iteration on (the memory tests). The in-process clients and the releaser read the variable; Flower's apps inherit it
from the simulation SuperLink (launch/simulate.py restarts one started with another value); a warm worker gets it
with each request, under ``RUN_CONFIG_KEY`` (``carry`` / ``adopt``). Unset, nothing is injected.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

ENV = "DPDRO_INJECT_FAULT"
RUN_CONFIG_KEY = "dpdro-inject-fault"  # how the hook crosses into a warm worker's request (never a Config key)
KINDS = ("raise", "raise-once", "nan", "hang", "leak")


def parse_fault(text: str) -> tuple[int, int, str]:
    """(partition, iteration, kind) of '<partition>:<iteration>:<kind>'. ValueError naming $DPDRO_INJECT_FAULT."""
    parts = text.split(":")
    try:
        pid, it, kind = int(parts[0]), int(parts[1]), parts[2]
        if len(parts) != 3 or pid < 0 or it < 0 or kind not in KINDS:
            raise ValueError
    except (ValueError, IndexError):
        raise ValueError(f"${ENV}: got {text!r}; allowed: '' or '<partition>:<iteration>:<kind>' with kind in "
                         f"{', '.join(KINDS)}") from None
    return pid, it, kind


def active_fault() -> tuple[int, int, str] | None:
    """The fault this process injects ($DPDRO_INJECT_FAULT), or None. ValueError for a malformed value."""
    text = os.environ.get(ENV, "")
    return parse_fault(text) if text else None


def carry() -> dict[str, str]:
    """{RUN_CONFIG_KEY: fault} to add to a warm worker's request when this process has one, else {}."""
    text = os.environ.get(ENV, "")
    return {RUN_CONFIG_KEY: text} if text else {}


def adopt(values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` without ``RUN_CONFIG_KEY``; when it is there, this process injects that fault from now on."""
    out = dict(values)
    if RUN_CONFIG_KEY in out:
        text = str(out.pop(RUN_CONFIG_KEY))
        parse_fault(text)
        os.environ[ENV] = text
    return out
