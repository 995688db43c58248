"""Selections on a validation split of the private records through noisy counts: a post-hoc tau
or a checkpoint chosen among T candidates from the candidates' per-class correct and total counts released with
Gaussian noise, the same release as the node evaluation (server/node_evaluation.py), accounted with dp-accounting.

Mechanism. Candidate j (a tau, a checkpoint, a model) has the (2K,) count vector v_j = [c_j, t_j] on the same
validation records (common/eval_counts.count_vector). The release is v_j + N(0, sigma^2 I) for every j, sigma =
z sqrt(2). One record changes each v_j by at most sqrt(2) in L2 (server/node_evaluation.py, "Sensitivity"), so the
T releases are T Gaussian mechanisms of noise multiplier z on the same records: their composition is the DpEvent
SelfComposedDpEvent(PoissonSampledDpEvent(1, GaussianDpEvent(z)), T) (equivalently one Gaussian of the stacked
(2KT,) vector with sensitivity sqrt(2T)), which ``selection_noise_multiplier`` calibrates to the selection's
epsilon at delta (``ledger.calibrate``). The choice (``objective.choose_by_terms`` on the noisy terms) is
post-processing. Selecting the argmax of noisy scores is also what "report noisy max" does, but releasing every
noisy count keeps the figures printable beside the choice at no extra cost.

What stays outside: the candidates themselves (e.g. validation models trained by separate runs, each with its own
epsilon) and the composition of this selection with the final run's epsilon, which summary.json's not_accounted
states (config key chosen-on-private-data item 'posthoc-tau-noisy').
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .ledger import Mechanism, calibrate, epsilon_of
from .node_evaluation import metrics_from_counts, noisy_counts
from .objective import choose_by_terms, evaluation_terms

SELECTION_MECHANISM = "selection-counts"


def selection_noise_multiplier(candidates: int, epsilon: float, delta: float, accountant: str = "pld") -> float:
    """Noise multiplier z at which ``candidates`` count releases on the same records spend epsilon in
    [0.99 epsilon, epsilon] at ``delta``. ValueError for candidates < 1 or a non-positive epsilon."""
    if candidates < 1:
        raise ValueError(f"a selection needs at least one candidate, got {candidates}")
    return calibrate({Mechanism(SELECTION_MECHANISM, 1.0): candidates}, epsilon, delta, accountant)


@dataclass(frozen=True)
class NoisyCounts:
    """Released count vectors of T candidates: their ``metrics`` (``node_evaluation.metrics_from_counts``, with
    standard errors), the noise multiplier ``z``, the std of each released count and the ``epsilon`` the T releases
    spend at ``delta`` (dp-accounting, composed)."""

    metrics: list[dict]
    z: float
    noise_std: float
    epsilon: float
    delta: float


def release_counts(counts: Sequence[np.ndarray], epsilon: float, delta: float, rng: np.random.Generator,
                   accountant: str = "pld") -> NoisyCounts:
    """Release the count vectors ``counts`` (T of (2K,), on the same records) with the noise at which the T releases
    spend ``epsilon`` at ``delta`` (module docstring). ``rng``: the noise source (``common.rng.secret_rng()`` for a
    private choice). Raises ValueError for no candidate, vectors of unequal or odd length, or a bad epsilon."""
    if not len(counts):
        raise ValueError("a selection needs at least one candidate")
    sizes = {np.asarray(c).shape for c in counts}
    if len(sizes) != 1:
        raise ValueError(f"candidates' count vectors must have one shape, got {sorted(sizes)}")
    z = selection_noise_multiplier(len(counts), epsilon, delta, accountant)
    std = float(z * np.sqrt(2.0))
    released = [metrics_from_counts(noisy_counts(c, std, rng), std) for c in counts]
    return NoisyCounts(released, z, std, epsilon_of({(1.0, z): len(counts)}, delta, accountant), delta)


def choose_privately(counts: Sequence[np.ndarray], epsilon: float, delta: float, rng: np.random.Generator,
                     min_accuracy: float = 0.0, accountant: str = "pld") -> tuple[int | None, NoisyCounts]:
    """(index chosen by the search's score ``objective.choose_by_terms`` on the noisy counts, or None when no
    candidate reaches ``min_accuracy``; the release) for candidates with count vectors ``counts``. Raises as
    ``release_counts``."""
    release = release_counts(counts, epsilon, delta, rng, accountant)
    return choose_by_terms([evaluation_terms(m) for m in release.metrics], min_accuracy), release
