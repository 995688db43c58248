"""Whether a finished run's worst class was still improving at its last evaluation (the run's last lines and
summary.json say so, and suggest more iterations). Computed from metrics.csv's rows only: post-processing of
what the run already reported, no release.

Rule: the least-squares slope of worst-class accuracy (worst-group accuracy on data with groups) against
iteration over the last ``RISING_WINDOW`` evaluations, in accuracy per tenth of the run's iterations, is at least
``RISING_SLOPE``, and the last evaluation is above the one before it. With fewer evaluations nothing is said.
"""

from __future__ import annotations

import math

import numpy as np

RISING_WINDOW = 3  # the last evaluations the slope is fitted to
RISING_SLOPE = 0.02  # worst-class accuracy gained per tenth of the run's iterations (2 points of accuracy)


def worst_key(rows: list[dict]) -> str:
    """The metric the rule watches: worst_group_accuracy when the rows carry it, else worst_class_accuracy."""
    return "worst_group_accuracy" if rows and "worst_group_accuracy" in rows[-1] else "worst_class_accuracy"


def worst_slope(rows: list[dict], iterations: int) -> float | None:
    """Slope of the worst accuracy over the last RISING_WINDOW metric rows (dicts with iteration and the
    worst accuracy), in accuracy per ``iterations`` / 10 iterations; None with fewer rows or a NaN value."""
    last = rows[-RISING_WINDOW:]
    if len(last) < RISING_WINDOW or iterations < 1:
        return None
    key = worst_key(rows)
    t = np.array([float(r["iteration"]) for r in last])
    y = np.array([float(r[key]) if r.get(key) is not None else math.nan for r in last])
    if not np.all(np.isfinite(y)) or np.ptp(t) == 0:
        return None
    return float(np.polyfit(t, y, 1)[0] * iterations / 10)


def still_rising(rows: list[dict], iterations: int) -> bool:
    """Whether the worst class was still rising steeply at the last evaluation (the module's rule)."""
    slope = worst_slope(rows, iterations)
    key = worst_key(rows)
    return slope is not None and slope >= RISING_SLOPE and float(rows[-1][key]) > float(rows[-2][key])


def rising_note(rows: list[dict], iterations: int, split: str = "validation") -> str | None:
    """The line a run ends with when its worst class is still rising (None otherwise): by how much, and to train
    longer. ``split``: the config's eval-split; on 'test' the line says to choose on a validation split instead
    (a choice made on the test records makes the test figures optimistic)."""
    if not still_rising(rows, iterations):
        return None
    what = worst_key(rows).replace("_accuracy", "").replace("_", "-")
    first, last = int(rows[-RISING_WINDOW]["iteration"]), int(rows[-1]["iteration"])
    return (f"the {what} accuracy was still rising at the end: a straight line through the evaluations at "
            f"iterations {first}-{last} gains {worst_slope(rows, iterations):+.3f} per 10% of the run "
            f"({max(iterations // 10, 1)} of its {iterations} iterations); more iterations would likely raise it "
            "(key iterations; the noise is calibrated for the new number, so start a new run)"
            + ("; these are test-split figures: choose iterations with eval-split=validation, so that the test "
               "figures stay unbiased" if split == "test" else ""))
