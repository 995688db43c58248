"""Evaluation on the nodes (config key eval-data=nodes): the server releases the sum over nodes of per-class correct
and total counts on the nodes' own held-out records, with Gaussian noise charged to the run's ledger, and derives
accuracy, per-class and worst-class accuracy, each with its standard error, from the noisy counts (docs/explanation/
ALGORITHMS.md 5.6). The node's side is common/eval_counts.py.

Mechanism. The released vector is v = [c_0 .. c_{K-1}, t_0 .. t_{K-1}] + N(0, sigma^2 I_{2K}), c_k the number of
held-out records of class k the model classifies correctly and t_k the number of held-out records of class k, summed
over the nodes. It is one release at sampling rate 1 (every held-out record, no sampling) of a Gaussian with noise
multiplier z: sigma = z S f(n), S = sqrt(2), f the float64 rounding factor of ``release.sum_rounding_factor`` (the
counts are exact small integers, so f only adds a little noise). Its DpEvent is that of every release,
PoissonSampledDpEvent(1, GaussianDpEvent(z)) (server/ledger.py), charged under the mechanism name
``EVAL_MECHANISM`` with a fixed noise multiplier (``Mechanism.fixed_noise``) that calibration leaves alone.

Sensitivity S = sqrt(2). Unit of privacy: one record replaced with the null record (server/ledger.py,
``NEIGHBOURING_RELATION``). A held-out record of class y adds e_y to the totals and, when the model classifies it
correctly, e_y to the correct counts; the null record adds nothing. So the two vectors differ by e_y (t_y only,
norm 1) or by (e_y, e_y) (c_y and t_y, norm sqrt(2)): one record changes one class's correct and total counts by at
most 1 each, an L2 distance of at most sqrt(2), and no other coordinate. The model being evaluated is a released
(already noised) iterate, so it is public: the per-record vector is a fixed function of the record.

Composition. The held-out records are records of the same data subjects; one record is either a training record
or a held-out one, but the ledger composes every release against every record (a valid upper bound), so the run's
epsilon covers training and every node evaluation together. The plan (``mechanisms``) holds one evaluation
release per evaluation row of the run (``evaluations``: the start, every eval-every iterations and the end), each
at the noise multiplier that alone spends eval-epsilon at the run's delta (``eval_noise_multiplier``), or at
eval-noise-multiplier; calibration then fits training into what is left of the target.

Estimates. With accuracy a_k = c_k / t_k, the noisy ratio hat c_k / hat t_k has, by the delta method,
standard error se_k = sigma sqrt(1 + a_k^2) / t_k (independent N(0, sigma^2) errors on c_k and t_k); it is
computed from the noisy counts (post-processing). Overall accuracy sum c / sum t has se
sigma sqrt(K (1 + a^2)) / T. The worst class's se is that of the class that is worst in the noisy counts.
``expected_error`` gives the figure for planning (docs/explanation/privacy.md, table).
"""

from __future__ import annotations

import math

import numpy as np

from ..common.config import ConfigError
from ..common.eval_counts import EVAL_QUANTITY, EVAL_SENSITIVITY, evaluates_on_nodes  # noqa: F401 (re-exported)
from ..common.messages import Point, Query
from .ledger import Mechanism, calibrate, epsilon_of

EVAL_MECHANISM = EVAL_QUANTITY  # the ledger's name of a node evaluation release


def eval_version(iteration: int) -> int:
    """Model version id of the parameters evaluated at ``iteration``: -(iteration + 2), negative (the algorithms'
    ids are iterations >= 0) and new at every evaluation, so that a Flower node never reuses an earlier
    evaluation's parameters held under the same id, and its store (newest ids kept) drops them first."""
    return -(iteration + 2)

EVAL_DATA = ("auto", "server", "nodes")


def evaluations(iterations: int, eval_every: int) -> int:
    """Evaluation rows of a run of ``iterations`` iterations (server/engine.py's loop): one at the start, one every
    ``eval_every`` iterations and one at the end."""
    return 1 + iterations // eval_every + (1 if iterations % eval_every else 0)


def eval_noise_multiplier(eval_epsilon: float, delta: float, accountant: str = "pld") -> float:
    """The noise multiplier z at which one evaluation release (rate 1, Gaussian, sensitivity 1 in units of S)
    spends epsilon in [0.99 eval_epsilon, eval_epsilon] at ``delta`` (``ledger.calibrate``). ValueError for a
    non-positive or infinite eval_epsilon."""
    return calibrate({Mechanism(EVAL_MECHANISM, 1.0): 1}, eval_epsilon, delta, accountant)


def noise_multiplier_of(cfg, delta: float) -> float:
    """The run's evaluation noise multiplier: config key eval-noise-multiplier when > 0, else the one calibrated
    to eval-epsilon at ``delta`` (``eval_noise_multiplier``); 0 in a non-private run."""
    if not cfg.private:
        return 0.0
    if cfg.eval_noise_multiplier > 0:
        return float(cfg.eval_noise_multiplier)
    return eval_noise_multiplier(cfg.eval_epsilon, delta, cfg.accountant)


def mechanisms(cfg, delta: float) -> dict[Mechanism, int]:
    """The node evaluations of a run as plan entries (empty unless ``evaluates_on_nodes``): one fixed-noise
    mechanism, ``evaluations`` releases. Raises ConfigError (naming eval-epsilon, eval-noise-multiplier and
    eval-every) when they alone spend the run's epsilon, before any work."""
    if not evaluates_on_nodes(cfg):
        return {}
    count = evaluations(cfg.iterations, cfg.eval_every)
    if not cfg.private:
        return {Mechanism(EVAL_MECHANISM, 1.0, fixed_noise=0.0): count}
    z = noise_multiplier_of(cfg, delta)
    spent = epsilon_of({(1.0, z): count}, delta, cfg.accountant)
    if spent >= 0.9 * cfg.epsilon:
        raise ConfigError(
            f"config key 'eval-data': nodes: {count} node evaluations (1 + iterations/eval-every, eval-every = "
            f"{cfg.eval_every}) at noise multiplier {z:.4g} (eval-epsilon {cfg.eval_epsilon:g}, eval-noise-multiplier "
            f"{cfg.eval_noise_multiplier:g}) alone spend epsilon {spent:.4g}, over 0.9 x the run's epsilon "
            f"{cfg.epsilon:g}; allowed: evaluations spending less: raise eval-every, lower eval-epsilon (or raise "
            "eval-noise-multiplier), or raise epsilon")
    return {Mechanism(EVAL_MECHANISM, 1.0, fixed_noise=z): count}


def eval_query(iteration: int, num_classes: int, shift: np.ndarray | None) -> Query:
    """The query of one node evaluation at iteration ``iteration``: every held-out record (rate 1), clip sqrt(2)
    (the count vector's norm bound, never reached by scaling), dimension 2K, the public prediction shift (K,) in
    ``extra``; the evaluated parameters travel as version ``eval_version(iteration)``."""
    return Query(iteration, EVAL_MECHANISM, EVAL_QUANTITY, (Point(eval_version(iteration), 0.0),), 1.0,
                 EVAL_SENSITIVITY, 2 * num_classes, extra=tuple(float(v) for v in shift) if shift is not None else ())


def noisy_counts(counts: np.ndarray, noise_std: float, rng: np.random.Generator) -> np.ndarray:
    """counts (2K,) + N(0, noise_std^2 I): the Gaussian release itself, for tools outside a run (benchmarks, the
    audit); a run releases through ``Releaser`` (the same noise, charged)."""
    counts = np.asarray(counts, dtype=np.float64)
    return counts + rng.normal(0.0, noise_std, size=counts.shape) if noise_std > 0 else counts.copy()


def metrics_from_counts(noisy: np.ndarray, noise_std: float) -> dict:
    """Accuracy figures from released counts ``noisy`` (2K,) [correct, total] whose coordinates each carry
    N(0, noise_std^2) noise (0: exact counts). Each accuracy is clamped to [0, 1]; a class whose noisy total is
    below 1 has NaN accuracy (nothing to estimate). Returns test_accuracy, per_class_accuracy (list),
    worst_class_accuracy and their standard errors (module docstring): test_accuracy_se, per_class_accuracy_se,
    worst_class_accuracy_se, and the noisy per-class totals (eval_class_totals). ValueError for an odd length."""
    noisy = np.asarray(noisy, dtype=np.float64)
    if noisy.ndim != 1 or noisy.size % 2:
        raise ValueError(f"released counts must be a (2K,) vector [correct, total], got shape {noisy.shape}")
    k = noisy.size // 2
    correct, total = noisy[:k], noisy[k:]
    ok = total >= 1.0
    acc = np.full(k, np.nan)
    acc[ok] = np.clip(correct[ok] / total[ok], 0.0, 1.0)
    se = np.full(k, np.nan)
    se[ok] = noise_std * np.sqrt(1.0 + acc[ok] ** 2) / total[ok]
    big_t, big_c = float(total[ok].sum()), float(correct[ok].sum())
    overall = min(max(big_c / big_t, 0.0), 1.0) if big_t >= 1.0 else math.nan
    overall_se = noise_std * math.sqrt(int(ok.sum()) * (1.0 + overall**2)) / big_t if big_t >= 1.0 else math.nan
    worst = int(np.nanargmin(acc)) if ok.any() else None
    return {"test_accuracy": overall, "test_accuracy_se": overall_se,
            "worst_class_accuracy": float(acc[worst]) if worst is not None else math.nan,
            "worst_class_accuracy_se": float(se[worst]) if worst is not None else math.nan,
            "per_class_accuracy": [float(a) for a in acc], "per_class_accuracy_se": [float(s) for s in se],
            "eval_class_totals": [float(t) for t in total]}


def expected_error(epsilon: float, delta: float, records_per_class: int, accuracy: float = 0.9,
                   accountant: str = "pld") -> float:
    """Standard error a user should expect of one class's accuracy from one node evaluation at ``epsilon`` (its
    own, at ``delta``) over ``records_per_class`` held-out records of the class with true accuracy ``accuracy``:
    z sqrt(2) sqrt(1 + a^2) / t (module docstring; the float64 factor f is omitted, < 1e-6 here). About 95 % of
    draws fall within 1.96 times it."""
    if records_per_class < 1:
        raise ValueError(f"records_per_class must be at least 1, got {records_per_class}")
    z = eval_noise_multiplier(epsilon, delta, accountant)
    return z * EVAL_SENSITIVITY * math.sqrt(1.0 + accuracy**2) / records_per_class


def metrics_text(row: dict) -> str:
    """The accuracy figures of a node-evaluated row with their standard errors, e.g. 'accuracy 0.912 +- 0.004,
    worst-class accuracy 0.80 +- 0.01'."""
    return (f"accuracy {row['test_accuracy']:.4f} +- {row['test_accuracy_se']:.4f} (se)  worst-class accuracy "
            f"{row['worst_class_accuracy']:.4f} +- {row['worst_class_accuracy_se']:.4f} (se)")


def evaluate_on_nodes(releaser, iteration: int, flat: np.ndarray, num_classes: int,
                      shift: np.ndarray | None = None) -> dict:
    """One node evaluation of parameters ``flat`` (d,) at iteration ``iteration``: the nodes' count vectors are
    collected, charged and noised by ``releaser`` (server/releaser.py: the run's ledger, failure policy, noise mode
    and events.jsonl, like every release) and turned into metrics (``metrics_from_counts``) with eval_loss NaN (no
    loss is released) and eval_noise_std, the std of each released count. Raises PrivacyBudgetExceeded when the
    ledger refuses the release (nothing is released)."""
    q = eval_query(iteration, num_classes, shift)
    released = releaser.run([q], {q.points[0].version: np.asarray(flat, dtype=np.float64)})
    # the releaser hands back sum / expected count (rate n; p rate n with node sampling: releaser.expected)
    noisy = released[EVAL_MECHANISM] * releaser.expected(q)
    std = releaser.ledger.noise_multiplier(EVAL_MECHANISM) * releaser.noise_sensitivity(q)
    return {**metrics_from_counts(noisy, std), "eval_loss": math.nan, "eval_noise_std": std}


def evaluations_epsilon(ledger, delta: float) -> float:
    """Epsilon at ``delta`` that the node evaluations charged to ``ledger`` (a ``server.ledger.Ledger``) spend on
    their own: their part of the run's epsilon (checkpoint-select=private-best reports it as its selection's
    cost). 0 when none was made."""
    count = ledger.spent.get(EVAL_MECHANISM, 0)
    if not count:
        return 0.0
    return epsilon_of({(1.0, ledger.noise_multiplier(EVAL_MECHANISM)): count}, delta, ledger.accountant,
                      ledger.node_rate)
