"""Expected batch sizes against the number of training records n: the defaults follow n, a value the user set
above n is refused with every such key named at once and a value suggested.

n is public in dpdro: the unit of privacy replaces one record with the null record, which stays on its client,
so neighbouring data sets have the same n (server/ledger.py). A batch size, and with it the sampling rate
batch / n, derived from n therefore depends on no private value, and the ledger accounts the rate the run uses.

Plain values in, plain values out (``values``: config key -> value, ``defaults``: the keys' defaults), so that
the config's validation and the engine share one rule without importing each other.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .algorithm_specs import ALGORITHM_SPECS

BATCH_KEYS = ("refresh-batch", "diff-batch", "s-batch")
# The sampling rate a default batch falls back to when it exceeds n (n // 10 records): the rate of the largest
# batches the tuned configurations use (2048 of MNIST-ST's 30,018 records is 0.068), rounded up.
SMALL_DATA_RATE = 0.1


def read_batch_keys(algorithm: str) -> tuple[str, ...]:
    """The batch keys the algorithm reads (its AlgorithmSpec.keys), in BATCH_KEYS order."""
    spec = ALGORITHM_SPECS.get(algorithm)
    return tuple(k for k in BATCH_KEYS if spec is None or k in spec.keys)


def suggested(key: str, n: int, values: Mapping[str, Any]) -> int:
    """A batch for ``key`` that fits n records: SMALL_DATA_RATE x n (at least 1) for refresh-batch and s-batch;
    half the (suggested or fitting) refresh batch for diff-batch, the ratio clip-diff-max's default assumes."""
    if key == "diff-batch":
        refresh = values["refresh-batch"]
        return max(1, (refresh if refresh <= n else suggested("refresh-batch", n, values)) // 2)
    return max(1, int(n * SMALL_DATA_RATE))


def over_n(values: Mapping[str, Any], defaults: Mapping[str, Any], n: int, what: str) -> str | None:
    """The error (None if none) naming every batch key the algorithm (``values['algorithm']``) reads whose value
    the user set above ``n`` (``what`` says what n is: 'n = 600 training records', 'max-train-records (600)'),
    each with a suggested value. A key at its default is not an error: ``fitted_to_n`` fits it."""
    over = [k for k in read_batch_keys(values["algorithm"]) if values[k] > n and values[k] != defaults[k]]
    if not over:
        return None
    got = ", ".join(f"'{k}' = {values[k]}" for k in over)
    fix = " ".join(f"{k}={suggested(k, n, values)}" for k in over)
    return (f"config keys {got}: allowed: at most {what}; suggested: {fix} (sampling rate about "
            f"{SMALL_DATA_RATE:g}; n is public, so a batch chosen from it costs no privacy)")


def fitted_to_n(values: Mapping[str, Any], n: int) -> tuple[dict[str, int], list[str]]:
    """({key: value} for every batch key the algorithm reads that is above n, fitted by ``suggested``; one note
    per key). Call after ``over_n`` found nothing: the keys above n are then at their defaults."""
    fitted: dict[str, int] = {}
    for k in read_batch_keys(values["algorithm"]):
        if values[k] > n:
            fitted[k] = suggested(k, n, {**values, **fitted})
    notes = [f"{k}: the default {values[k]} is more than the n = {n} training records; using {v} (sampling rate "
             f"{v / n:.3g}, chosen from the public n)" for k, v in fitted.items()]
    return fitted, notes
