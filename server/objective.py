"""What ``dpdro lab tune`` maximises and ``dpdro evaluate --posthoc-tau`` chooses by: a validation score that
still orders runs when every worst class is at 0.

A run's validation figures are reduced to three terms, compared in this order (lexicographically):

1. the worst-class accuracy (CelebA: worst-group accuracy, over the groups instead of the classes);
2. the mean of the two lowest class (group) accuracies: it separates runs that all lose one class entirely,
   where the first term is 0 for every run and, alone, would leave the choice to the third;
3. the validation accuracy (over all validation records).

Optuna's sampler and pruner need one number, so ``validation_objective`` packs the three terms, each rounded to
4 decimals (integers 0..10^4: a difference below 10^-4 is below one record of 10,000), as the mixed-radix
number (W B^2 + M B + A) / B^3 with B = 10^4 + 1. Two runs compare by this number exactly as by the terms
lexicographically (distinct integers below 2^53 stay distinct and ordered in float64), and the score stays
within 10^-4 of the worst-class accuracy, so it reads like one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

_RESOLUTION = 10_000  # the terms are compared to 4 decimals
_BASE = _RESOLUTION + 1


def objective_terms(per_unit_accuracy: Sequence[float], accuracy: float) -> tuple[float, float, float]:
    """(worst, mean of the two lowest, accuracy) of one evaluation.

    per_unit_accuracy: the accuracy of every class (or group), floats in [0, 1]; NaN (a class absent from the
    validation split) is left out. accuracy: the overall validation accuracy in [0, 1]. With a single unit
    the two-lowest mean is that unit's accuracy.

    Raises ValueError when no unit has an accuracy or a value lies outside [0, 1].
    """
    units = sorted(float(a) for a in per_unit_accuracy if not math.isnan(float(a)))
    if not units:
        raise ValueError(f"per-class accuracies: got {list(per_unit_accuracy)!r}; allowed: at least one number "
                         "in [0, 1]")
    for name, value in (("per-class accuracy", units[0]), ("per-class accuracy", units[-1]),
                        ("accuracy", float(accuracy))):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name}: got {value}; allowed: [0, 1]")
    return units[0], sum(units[:2]) / len(units[:2]), float(accuracy)


def pack_terms(terms: Sequence[float]) -> float:
    """The score of (worst, two-lowest mean, accuracy): (W B^2 + M B + A) / B^3 with each term rounded to an
    integer of 0..10^4 and B = 10^4 + 1 (module docstring). Monotone in the lexicographic order of the
    rounded terms; in [0, 1)."""
    worst, two_lowest, accuracy = (round(float(t) * _RESOLUTION) for t in terms)
    return (worst * _BASE**2 + two_lowest * _BASE + accuracy) / _BASE**3


def validation_objective(per_unit_accuracy: Sequence[float], accuracy: float) -> float:
    """The tuning score of one evaluation on the validation split (higher is better): worst-class accuracy,
    ties broken by the mean of the two lowest class accuracies, then by the accuracy (module docstring).

    per_unit_accuracy: per-class accuracies, or per-group accuracies where the data set has groups (CelebA);
    accuracy: overall validation accuracy. Raises ValueError as ``objective_terms``."""
    return pack_terms(objective_terms(per_unit_accuracy, accuracy))


def evaluation_terms(row: Mapping, accuracy_key: str = "test_accuracy") -> tuple[float, float, float]:
    """``objective_terms`` of a metrics row or a summary.json (the engine names the evaluated split's figures
    test_accuracy / per_class_accuracy / per_group_accuracy whichever split it evaluates; a
    ``server.prediction.metrics`` dict names its accuracy 'accuracy', ``accuracy_key``): over the groups when
    the row has per_group_accuracy, else over the classes. Raises KeyError for a row without them."""
    units = row["per_group_accuracy"] if row.get("per_group_accuracy") is not None else row["per_class_accuracy"]
    return objective_terms(units, row[accuracy_key])


def choose_by_objective(evaluations: Sequence[Mapping], min_accuracy: float = 0.0) -> int | None:
    """Index of the evaluation with the highest ``validation_objective`` among those whose accuracy is at least
    ``min_accuracy`` (the first of equal scores), or None when none is. The rule ``dpdro evaluate --posthoc-tau
    T1 T2 ...`` applies to choose a post-hoc tau on the validation split (a goal with an accuracy floor).

    evaluations: ``server.prediction.metrics`` dicts (keys accuracy, per_class_accuracy, optionally
    per_group_accuracy: the groups count instead of the classes, as in tuning). min_accuracy in [0, 1], else
    ValueError."""
    return choose_by_terms([evaluation_terms(m, "accuracy") for m in evaluations], min_accuracy)


def mean_terms(terms: Sequence[Sequence[float]]) -> tuple[float, float, float]:
    """The term-wise mean of several evaluations' (worst, two-lowest mean, accuracy), e.g. of one configuration's
    seeds: the mean of the worst-class accuracies, as ``dpdro lab tune`` scores a candidate over its confirmation
    seeds (not the worst class of the mean accuracies). Raises ValueError for an empty sequence."""
    if not terms:
        raise ValueError("evaluations: got none; allowed: at least one (worst, two lowest, accuracy)")
    return tuple(sum(col) / len(terms) for col in zip(*terms, strict=True))  # type: ignore[return-value]


def choose_by_terms(terms: Sequence[Sequence[float]], min_accuracy: float = 0.0) -> int | None:
    """Index of the (worst, two-lowest mean, accuracy) triple with the highest ``pack_terms`` score among those
    whose accuracy is at least ``min_accuracy`` (the first of equal scores), or None when none is.
    min_accuracy in [0, 1], else ValueError."""
    if not 0.0 <= min_accuracy <= 1.0:
        raise ValueError(f"min-accuracy: got {min_accuracy}; allowed: [0, 1]")
    best, best_score = None, -1.0
    for i, t in enumerate(terms):
        if t[2] < min_accuracy:
            continue
        score = pack_terms(t)
        if score > best_score:
            best, best_score = i, score
    return best
