"""Expected batch sizes against the number of training records n: the defaults follow n, a value the user set
above n is refused with every such key named at once and a value suggested.

n is public in dpdro: the unit of privacy replaces one record with the null record, which stays on its client,
so neighbouring data sets have the same n (server/ledger.py). A batch size, and with it the sampling rate
batch / n, derived from n therefore depends on no private value, and the ledger accounts the rate the run uses.
"""

from __future__ import annotations

from .algorithm_specs import ALGORITHM_SPECS
from .config import FIELD_BY_KEY, Config, ConfigError

BATCH_KEYS = ("refresh-batch", "diff-batch", "s-batch")
# The sampling rate a default batch falls back to when it exceeds n (n // 10 records): the rate of the largest
# batches the tuned configurations use (2048 of MNIST-ST's 30,018 records is 0.068), rounded up.
SMALL_DATA_RATE = 0.1


def read_batch_keys(algorithm: str) -> tuple[str, ...]:
    """The batch keys the algorithm reads (its AlgorithmSpec.keys), in BATCH_KEYS order."""
    spec = ALGORITHM_SPECS.get(algorithm)
    return tuple(k for k in BATCH_KEYS if spec is None or k in spec.keys)


def suggested(key: str, n: int, values: dict) -> int:
    """A batch for ``key`` that fits n records: SMALL_DATA_RATE x n (at least 1) for refresh-batch and s-batch;
    half the (suggested or fitting) refresh batch for diff-batch, the ratio clip-diff-max's default assumes."""
    if key == "diff-batch":
        refresh = values["refresh-batch"]
        return max(1, (refresh if refresh <= n else suggested("refresh-batch", n, values)) // 2)
    return max(1, int(n * SMALL_DATA_RATE))


def _is_default(cfg: Config, key: str) -> bool:
    return cfg.to_dict()[key] == FIELD_BY_KEY[key].default


def refuse_batches_above(cfg: Config, n: int, what: str) -> None:
    """ConfigError naming every batch key the algorithm reads whose value the user set above ``n`` (``what``
    says what n is: 'n = 600 training records', 'max-train-records (600)'), each with a suggested value.
    A key at its default is not refused: ``follow_n`` fits it to n."""
    values = cfg.to_dict()
    over = [k for k in read_batch_keys(cfg.algorithm) if values[k] > n and not _is_default(cfg, k)]
    if over:
        got = ", ".join(f"'{k}' = {values[k]}" for k in over)
        fix = " ".join(f"{k}={suggested(k, n, values)}" for k in over)
        raise ConfigError(f"config keys {got}: allowed: at most {what}; suggested: {fix} (sampling rate about "
                          f"{SMALL_DATA_RATE:g}; n is public, so a batch chosen from it costs no privacy)")


def follow_n(cfg: Config, n: int) -> tuple[Config, list[str]]:
    """(``cfg`` with every default batch key above n replaced by ``suggested``, one note per key replaced).
    Raises ConfigError (``refuse_batches_above``) for a value the user set above n."""
    refuse_batches_above(cfg, n, f"n = {n} training records")
    values = cfg.to_dict()
    fitted = {}
    for k in read_batch_keys(cfg.algorithm):
        if values[k] > n:
            fitted[k] = suggested(k, n, {**values, **fitted})
    notes = [f"{k}: the default {values[k]} is more than the n = {n} training records; using {v} (sampling rate "
             f"{v / n:.3g}, chosen from the public n)" for k, v in fitted.items()]
    return (cfg.with_updates(fitted) if fitted else cfg), notes
