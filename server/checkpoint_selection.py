"""Checkpoint selection on a validation split of the private records (config key checkpoint-select=private-best):
the run returns the evaluated iterate with the best noisy validation score instead of the last one.

Mechanism. Every evaluation of such a run (at the start, every eval-every iterations and at the end:
``node_evaluation.evaluations``) is a node evaluation (server/node_evaluation.py): the clients' per-class correct
and total counts on their validation records, released with Gaussian noise and charged to the run's ledger at
eval-epsilon (or eval-noise-multiplier). The number of evaluations is fixed by iterations and eval-every, both
public, so the plan holds every one of them before training and calibration fits training into the rest of the
target epsilon (``run_plan.plan_training``): training and selection compose to the run's epsilon.

Choice. Candidate j is the iterate evaluated at evaluation j; its score is ``objective.validation_objective`` of
its noisy per-class accuracies and noisy accuracy (the worst-class accuracy, ties broken by the two lowest classes'
mean, then the accuracy: the score of ``dpdro lab tune``), computed from the released counts only, so the choice,
and returning the chosen iterate, are post-processing of released values (Dwork and Roth 2014, Proposition 2.1):
they cost nothing beyond the evaluations. The first of equal scores wins. An evaluation whose noisy counts give no
class a total of at least 1 has no score and is never chosen over one that has. The node evaluation releases
per-class counts only, so a data set with groups is selected by its worst class, not its worst group.

The noisy score of the chosen checkpoint is biased upwards (it is the maximum of noisy scores): summary.json
reports it as the score that won, not as an estimate of the model's accuracy.

Resuming. The chosen iterate so far and its evaluation's iteration and score travel in the checkpoint
(``checkpoint_arrays``, ``checkpoint_meta``); a resumed run recomputes the choice from the checkpoint's metric rows
and refuses (ResumeError) a checkpoint whose saved choice disagrees or is missing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..common.errors import DpdroError
from .objective import validation_objective

PARAMS_KEY = "selected_params"  # the chosen iterate (d,) in checkpoint/state.npz
META_KEY = "checkpoint_selection"  # its iteration and score in the checkpoint's meta


class SelectionResumeError(ValueError, DpdroError):
    """A checkpoint's saved choice of private-best disagrees with its metric rows, or is missing."""


def score(row: dict) -> float:
    """The noisy validation score of an evaluation row (``objective.validation_objective`` of its
    per_class_accuracy and test_accuracy, the noisy figures of a node evaluation); -inf when the row has no
    accuracy to score (no class with a noisy total of at least 1: every figure NaN)."""
    accuracy = float(row["test_accuracy"])
    if math.isnan(accuracy):
        return -math.inf
    try:
        return validation_objective(row["per_class_accuracy"], accuracy)
    except ValueError:  # no class has an accuracy
        return -math.inf


@dataclass(frozen=True)
class Selected:
    """The chosen iterate so far: ``params`` (d,) float64, the ``iteration`` it was evaluated at and its
    ``score`` (``score``)."""

    iteration: int
    score: float
    params: np.ndarray


def offer(best: Selected | None, row: dict, params: np.ndarray) -> Selected:
    """The better of ``best`` and the iterate ``params`` (d,) evaluated in ``row``; ``best`` on a tie (the first
    of equal scores wins). ``params`` is copied when it wins."""
    s = score(row)
    if best is not None and not s > best.score:
        return best
    return Selected(int(row["iteration"]), s, np.array(params, dtype=np.float64, copy=True))


def best_index(rows: list[dict]) -> int:
    """Index of the row ``offer`` ends at over ``rows`` (the first of the highest scores). ValueError for no
    rows."""
    if not rows:
        raise ValueError("no evaluation rows to select from")
    scores = [score(r) for r in rows]
    return scores.index(max(scores))


def checkpoint_arrays(best: Selected | None) -> dict[str, np.ndarray]:
    """What a checkpoint's arrays hold of the choice so far ({} before the first evaluation or for 'last')."""
    return {} if best is None else {PARAMS_KEY: best.params}


def checkpoint_meta(best: Selected | None) -> dict:
    """What a checkpoint's meta holds of the choice so far ({} before the first evaluation or for 'last')."""
    return {} if best is None else {META_KEY: {"iteration": best.iteration, "score": best.score}}


def from_checkpoint(params: np.ndarray | None, meta: dict, rows: list[dict], where: str) -> Selected | None:
    """The choice saved in a checkpoint: its arrays' ``PARAMS_KEY`` entry ``params`` (None when absent) and its
    ``meta``, checked against its metric ``rows``: None when there are no rows. Raises SelectionResumeError naming
    ``where`` (the checkpoint) when the rows have a choice and the checkpoint holds none (a checkpoint written by
    checkpoint-select=last) or another one."""
    if not rows:
        return None
    saved = meta.get(META_KEY)
    if params is None or not isinstance(saved, dict):
        raise SelectionResumeError(f"checkpoint {where} holds no chosen iterate of checkpoint-select=private-best: "
                                   "it cannot be resumed with it; start again in a new out-dir")
    i = best_index(rows)
    expected = int(rows[i]["iteration"])
    if int(saved.get("iteration", -1)) != expected:
        raise SelectionResumeError(f"checkpoint {where}: its chosen iterate was evaluated at iteration "
                                   f"{saved.get('iteration')}, but its metric rows choose iteration {expected}: the "
                                   "checkpoint is inconsistent; start again in a new out-dir")
    return Selected(expected, score(rows[i]), np.asarray(params, dtype=np.float64))


def returned(cfg, rows: list[dict], best: Selected | None, evaluations_epsilon: float) -> dict:
    """summary.json's ``checkpoint_returned``: which evaluated iterate the run returned (``iteration``), by which
    rule (``rule``: config key checkpoint-select) and whether its choice is privacy-accounted (``accounted``: 'last'
    chooses nothing; private-best reads only charged noisy counts) and ``evaluations_epsilon``, what the run's node
    evaluations alone spend at its delta (their part of the run's epsilon; 0 when it made none). For private-best
    also the number of ``candidates`` (evaluations) it was chosen among, its noisy ``score`` (biased upwards: the
    maximum of noisy scores) and the noisy worst-class accuracy of its evaluation with its standard error."""
    if best is None:
        return {"rule": cfg.checkpoint_select, "iteration": int(rows[-1]["iteration"]), "accounted": True,
                "evaluations_epsilon": evaluations_epsilon}
    row = next(r for r in rows if int(r["iteration"]) == best.iteration)
    return {"rule": cfg.checkpoint_select, "iteration": best.iteration, "accounted": True,
            "candidates": len(rows), "score": best.score,
            "noisy_worst_class_accuracy": row["worst_class_accuracy"],
            "noisy_worst_class_accuracy_se": row.get("worst_class_accuracy_se", math.nan),
            "evaluations_epsilon": evaluations_epsilon}
