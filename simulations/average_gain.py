"""What the iterate average (config key ema-decay) gained over the last iterate, on the same trajectories.

    python -m dpdro.simulations.average_gain RUN_DIR [RUN_DIR ...]

Each run trained with ema-decay > 0 and evaluated on the server, so every row of its metrics.csv holds both the
average's figures (test_accuracy, worst_class_accuracy; on the run's eval-split) and the last iterate's
(last_iterate_*). The two models come from one trajectory, one set of noise draws: their difference is paired,
free of the run-to-run spread that unpaired seeds carry. Prints a table per run (final row), then the mean paired
difference with its 95 % t interval over the runs ('better' only where it excludes 0). A benchmark script, not a
test; post-processing of finished runs, no privacy cost.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

from .tables import CONFIDENCE, interval_word, mean_interval, mean_std

FIGURES = (("worst class", "worst_class_accuracy", "last_iterate_worst_class_accuracy"),
           ("accuracy", "test_accuracy", "last_iterate_accuracy"))
COLUMNS = ("iteration", *(column for _, average, last in FIGURES for column in (average, last)))


def final_row(run: Path) -> dict[str, float]:
    """The ``COLUMNS`` of the last row of ``run``/metrics.csv, as floats. Raises ValueError naming the run when it
    has no rows or no last-iterate columns (trained without ema-decay, or evaluated on the nodes)."""
    path = run / "metrics.csv"
    rows = list(csv.DictReader(path.open())) if path.is_file() else []
    if not rows:
        raise ValueError(f"{run}: no metrics.csv rows (not a finished run directory)")
    if "last_iterate_accuracy" not in rows[-1]:
        raise ValueError(f"{run}: metrics.csv has no last_iterate_* columns; allowed: runs trained with ema-decay > 0 "
                         "and evaluated on the server")
    return {k: float(rows[-1][k]) for k in COLUMNS}


def paired_lines(runs: list[Path]) -> list[str]:
    """The markdown table (one row per run: iteration, average and last iterate) and one line per figure with the
    mean paired difference (average minus last iterate) and its interval."""
    rows = [(run, final_row(run)) for run in runs]
    lines = ["| run | iteration | worst class: average | last iterate | accuracy: average | last iterate |",
             "|---|---|---|---|---|---|"]
    for run, r in rows:
        lines.append(f"| {run.name} | {int(r['iteration'])} | {r['worst_class_accuracy']:.3f} | "
                     f"{r['last_iterate_worst_class_accuracy']:.3f} | {r['test_accuracy']:.3f} | "
                     f"{r['last_iterate_accuracy']:.3f} |")
    lines.append("")
    for label, avg, last in FIGURES:
        diffs = [r[avg] - r[last] for _, r in rows]
        m, s = mean_std(diffs)
        ci = mean_interval(diffs)
        if ci is None:
            lines.append(f"- {label}: average minus last iterate {m:+.3f} (one run: no interval)")
            continue
        lines.append(f"- {label}: average minus last iterate {m:+.3f} +/- {s:.3f} over {len(diffs)} runs, "
                     f"{interval_word(*ci)}, {CONFIDENCE:.0%} interval [{ci[0]:+.3f}, {ci[1]:+.3f}]")
    return lines


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m dpdro.simulations.average_gain", description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", type=Path, help="run directories trained with ema-decay > 0")
    a = p.parse_args(argv)
    try:
        print("\n".join(paired_lines(a.runs)))
    except ValueError as e:
        print(f"average_gain: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
