"""Choosing a tuned file's post-hoc tau on a validation split: ``dpdro lab tune --choose-posthoc-tau``.

    dpdro lab tune --dataset fashion-mnist-st --epsilon 4 --methods dp-sgd-la dp-double-spider recursive-spider \\
               --choose-posthoc-tau [--tau-grid 0 0.1 ... 2] [--tau-seeds 1] [--min-accuracy A] [--jobs 2]

Post-hoc logit adjustment predicts argmax_k f_k(x) - tau log pi_k with the class priors pi the run released
(Menon et al. 2021, "Long-tail learning via logit adjustment", eq. 7). Tau changes no training step, only the
prediction, so it can be chosen after training on a model: every tau of the grid costs one argmax on the
validation split and no training. Applying a tau is post-processing of a released model and released priors;
choosing it by the validation metrics of private training records is not accounted (step 3 marks the file). A
search draws tau with the other keys; a file transferred from another data set (``--transfer-from``)
carries the source's tau, which need not fit the target's imbalance (Fashion-MNIST-ST's minority classes are not
MNIST-ST's). This step chooses it again, on the target's own validation split, by the search's score, the same
rule for every method:

1. For each method whose tuned file releases class priors (``Config.uses_priors``; dp-sgda at posthoc-tau 0
   does not, so it has only tau 0 and is skipped), train ``--tau-seeds`` models of the file exactly as it is,
   seeds 1, 2, ..., on the training split minus the validation split (``validation-fraction`` of every class, as in
   the search; a data set with its own validation split, CelebA, trains on the whole training split), evaluated on
   the validation split only. Resumable: a model with a summary.json is not trained again. They live in
   ``<root>/<dataset>/eps<e>/posthoc/<method>-<12 hex digits of the file's keys but posthoc-tau>-seed<s>``.
2. Evaluate every model at every tau of the grid (``server.prediction.predict_posthoc_taus``), take the mean of
   each term (worst class or group, the two lowest, accuracy) over the seeds (``objective.mean_terms``) and choose
   by ``objective.choose_by_terms`` among the taus whose mean accuracy is at least ``--min-accuracy``.
3. Rewrite the file's posthoc-tau, add 'posthoc-tau' to its key chosen-on-private-data (so that a run of the file
   lists the choice under not_accounted) and add a comment line that carries ``tuned.RECHOSEN_MARK``, the command,
   the models and the figures of the chosen and the previous tau (docs/research/RESULTS.md names such methods).

Not privacy-accounted, like the search itself: tau depends on noiseless validation metrics of private training
records. Applying a tau is post-processing of the released model and priors; choosing it on private records is not.
"""

from __future__ import annotations

import logging
import tomllib
from dataclasses import dataclass
from pathlib import Path

from ..common.config import Config
from ..server.objective import choose_by_terms, evaluation_terms, mean_terms
from .tuned import CHOSEN_KEY, RECHOSEN_MARK, leading_comments, tuned_config_path, with_chosen_on_private

log = logging.getLogger(__name__)

# 0.1 steps where the choices fell so far (0.3 .. 1.25 on MNIST-ST and Fashion-MNIST-ST), coarser above 1
TAU_GRID = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.25, 1.5, 2.0)
DEFAULT_VALIDATION_FRACTION = 0.2  # the search's (tune.PER_DATASET) for a data set without its own validation split
_OURS = "validation split by `dpdro tune"  # in the comment line this step writes (after RECHOSEN_MARK)
_NOTHING_CHOSEN = "Nothing of this data set chose these keys."  # line 2 of a transferred file (tune.transfer_tuned)


@dataclass(frozen=True)
class TauChoice:
    """The outcome for one method: ``previous`` and ``chosen`` tau with their mean validation terms (worst,
    two-lowest mean, accuracy), the validation models (run directories) and the rewritten file. ``chosen`` is
    None when no tau of the grid reached the accuracy floor (the file is then left as it was)."""

    method: str
    previous: float
    previous_terms: tuple[float, float, float]
    chosen: float | None
    chosen_terms: tuple[float, float, float] | None
    models: tuple[Path, ...]
    path: Path


def validation_fraction(dataset: str) -> float:
    """The share of the training split held out for validation: 0 for a data set with its own validation split
    (CelebA), else the search's fraction (``tune.PER_DATASET``, default 0.2)."""
    from ..common.data import DATASETS
    from .tune import PER_DATASET

    if dataset in DATASETS and DATASETS[dataset].own_validation:
        return 0.0
    return float(PER_DATASET.get(dataset, {}).get("validation-fraction", DEFAULT_VALIDATION_FRACTION))


def model_dir(root: Path, dataset: str, epsilon: float, method: str, keys: dict, seed: int) -> Path:
    """Where the validation model of a tuned file's ``keys`` and ``seed`` lives (module docstring). Named by the
    keys without posthoc-tau (a tau changes no training step, so a model serves every tau) and without
    chosen-on-private-data (it computes nothing)."""
    from .tune import keys_tag, search_dir

    tag = keys_tag({k: v for k, v in keys.items() if k not in ("posthoc-tau", CHOSEN_KEY)})
    return search_dir(root, dataset, epsilon) / "posthoc" / f"{method}-{tag}-seed{seed}"


def validation_config(keys: dict, dataset: str, seed: int, out_dir: Path) -> Config:
    """The tuned file's ``keys`` trained on the training split minus its validation split and evaluated on the
    validation split only, with ``seed``. Raises ConfigError for a bad key, before any run."""
    return Config.from_mapping({**keys, "validation-fraction": validation_fraction(dataset),
                                "eval-split": "validation", "seed": seed, "out-dir": str(out_dir)})


def scan(models: list[Path], taus: list[float]) -> list[tuple[float, float, float]]:
    """Mean (worst, two-lowest mean, accuracy) over ``models`` at each tau, on their validation split."""
    from ..server.prediction import metrics, predict_posthoc_taus

    per_model = [[evaluation_terms(metrics(p), "accuracy") for p in predict_posthoc_taus(m, "validation", taus)]
                 for m in models]
    return [mean_terms([terms[i] for terms in per_model]) for i in range(len(taus))]


def scan_private(models: list[Path], taus: list[float], epsilon: float, delta: float
                 ) -> tuple[list[tuple[float, float, float]], float]:
    """``scan`` through noisy counts (server/private_selection.py): every (model, tau) pair's per-class correct and
    total counts on the validation split released with Gaussian noise, the len(models) x len(taus) releases
    spending ``epsilon`` at ``delta`` together; returns (mean noisy terms per tau, epsilon spent)."""
    from ..common.eval_counts import count_vector
    from ..common.rng import secret_rng
    from ..server.prediction import predict_posthoc_taus
    from ..server.private_selection import release_counts

    counts = []
    for m in models:
        for p in predict_posthoc_taus(m, "validation", taus):
            counts.append(count_vector(p.predicted, p.labels, p.scores.shape[1]))
    release = release_counts(counts, epsilon, delta, secret_rng())
    per_model = [release.metrics[i * len(taus):(i + 1) * len(taus)] for i in range(len(models))]
    return ([mean_terms([evaluation_terms(rows[i]) for rows in per_model]) for i in range(len(taus))],
            release.epsilon)


def choose_posthoc_tau(dataset: str, epsilon: float, methods: list[str], root: Path, configs: Path,
                       grid: tuple[float, ...] = TAU_GRID, seeds: int = 1, jobs: int = 2,
                       min_accuracy: float = 0.0, selection_epsilon: float | None = None) -> dict[str, TauChoice]:
    """Choose each method's post-hoc tau on the validation split and rewrite its tuned file (module docstring).

    grid: taus >= 0 (the file's own tau is evaluated too); seeds >= 1 validation models per method; min_accuracy
    in [0, 1]. ``selection_epsilon``: choose from noisy counts (``scan_private``) spending this epsilon per method at
    delta 1/(10 n_val) of its validation split, and mark the file 'posthoc-tau-noisy' instead of 'posthoc-tau'
    (the choice is differentially private by itself; not_accounted says it composes with the run's epsilon).
    Returns method -> TauChoice for the methods whose file releases priors; methods without a tuned
    file or without priors are logged and skipped. Raises ConfigError (a ValueError) for a bad argument or a bad
    key in a file, before any training."""
    from ..common.config import ConfigError
    from .tune import run_unfinished

    if not grid or min(grid) < 0:
        raise ConfigError(f"--tau-grid: got {list(grid)}; allowed: one or more taus >= 0")
    if seeds < 1:
        raise ConfigError(f"--tau-seeds: got {seeds}; allowed: >= 1")
    if not 0.0 <= min_accuracy <= 1.0:
        raise ConfigError(f"--min-accuracy: got {min_accuracy}; allowed: [0, 1]")
    plans: dict[str, tuple[Path, dict, list[Config]]] = {}
    for method in methods:
        path = tuned_config_path(dataset, epsilon, method, configs / "tuned")
        if not path.exists():
            log.warning("no tuned file %s: %s skipped", path, method)
            continue
        keys = tomllib.loads(path.read_text())
        cfgs = [validation_config(keys, dataset, s, model_dir(root, dataset, epsilon, method, keys, s))
                for s in range(1, seeds + 1)]
        if not cfgs[0].uses_priors:
            log.warning("%s releases no class priors (posthoc-tau and logit-adjust-tau 0): only tau 0, skipped",
                        path.name)
            continue
        plans[method] = (path, keys, cfgs)
    run_unfinished([c for _, _, cfgs in plans.values() for c in cfgs], jobs)
    choices = {}
    for method, (path, keys, cfgs) in plans.items():
        previous = float(keys.get("posthoc-tau", 0.0))
        taus = sorted({*map(float, grid), previous})
        models = tuple(Path(c.out_dir) for c in cfgs)
        if selection_epsilon is not None:
            from ..common.data import load_from_config

            delta = 0.1 / len(load_from_config(cfgs[0], train=False))  # the validation split (eval-split)
            terms, spent = scan_private(list(models), taus, selection_epsilon, delta)
            log.info("%s: tau chosen from noisy counts, epsilon %.4g at delta %.3g", method, spent, delta)
        else:
            terms = scan(list(models), taus)
        best = choose_by_terms(terms, min_accuracy)
        choice = TauChoice(method, previous, terms[taus.index(previous)], None if best is None else taus[best],
                           None if best is None else terms[best], models, path)
        # a second call that keeps the tau leaves the file (and its line with the first call's figures) alone
        if best is not None and (choice.chosen != previous or _OURS not in path.read_text()):
            rewrite(path, choice, dataset, epsilon, grid, min_accuracy, selection_epsilon)
        choices[method] = choice
    return choices


def _fmt_terms(terms: tuple[float, float, float]) -> str:
    return f"validation worst {terms[0]:.3f}, two lowest {terms[1]:.3f}, accuracy {terms[2]:.3f}"


def rewrite(path: Path, choice: TauChoice, dataset: str, epsilon: float, grid, min_accuracy: float,
            selection_epsilon: float | None = None) -> None:
    """Set ``choice.chosen`` as the file's posthoc-tau (atomic) and add the comment line that says how it was
    chosen (an earlier such line of this step is replaced); the other keys and their order stay."""
    from .tune import write_toml

    text = path.read_text()
    item = "posthoc-tau" if selection_epsilon is None else "posthoc-tau-noisy"
    keys = with_chosen_on_private({**tomllib.loads(text), "posthoc-tau": choice.chosen}, item)
    ours = f"# {RECHOSEN_MARK} on {dataset}'s {_OURS}"
    header = [line.replace(_NOTHING_CHOSEN, "Nothing of this data set chose these keys but posthoc-tau (below).")
              for line in leading_comments(text) if not line.startswith(ours)]
    floor = f", among accuracy >= {min_accuracy:g}" if min_accuracy > 0 else ""
    fraction = validation_fraction(dataset)
    split = (f"trained with validation-fraction {fraction:g}" if fraction > 0 else
             "trained on the whole training split (the data set has its own validation split)")
    header.append(
        f"{ours} --dataset {dataset} --epsilon {epsilon:g} --choose-posthoc-tau`: the search's score (worst, then "
        f"the two lowest, then accuracy{floor}), mean over {len(choice.models)} model(s) of this file {split} "
        f"(seeds 1..{len(choice.models)}), over the taus "
        f"{', '.join(f'{t:g}' for t in grid)}: {choice.chosen:g} ({_fmt_terms(choice.chosen_terms)}) instead of "
        f"{choice.previous:g} ({_fmt_terms(choice.previous_terms)})"
        + (f", from noisy counts at selection epsilon {selection_epsilon:g}." if selection_epsilon is not None
           else "."))
    write_toml(path, keys, "\n".join(header))
