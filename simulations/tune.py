"""Hyper-parameter search without test leakage, with Optuna: ``dpdro lab tune``.

    dpdro lab tune --dataset mnist-st --epsilon 4 [--trials 20] [--methods dp-sgd dp-sgd-la ...] [--jobs 2]
               [--confirm-top 3] [--confirm-seeds 3]

Equal effort for every method: each method gets its own Optuna study with the same number of finished
trials (complete or pruned), the same training length and the same levers (its step size, the refresh
batch, post-hoc and training logit adjustment, the stabiliser, plus its own problem's keys; the spaces are
declared with the algorithms in ``common/algorithm_specs.py``: AlgorithmSpec.space and .fixed). A trial is a
full private run at the target epsilon that trains on the training split minus a held-out validation split
(``validation-fraction`` of every class, seeded by ``split-seed``; CelebA uses its own validation split) and is
evaluated on that validation split only, every ``iterations / EVALS_PER_TRIAL`` iterations: the test split is
never looked at.

- Sampler: TPE (``optuna.samplers.TPESampler``), one per trial, seeded by ``--seed``, the method and the trial's
  index (a resumed search does not redraw its first points); the first ``TPE_STARTUP_TRIALS`` are random. With
  ``--jobs 1`` a search is reproducible point for point; with more jobs the points depend on which trial finishes
  first (Optuna's constant-liar TPE treats the running ones as pending).
- Workers: one pool of ``--jobs`` processes over every method's trials, in the methods' order, so that no worker
  idles at the end of one method's study while the next method still has trials to start.
- Pruner: ``optuna.pruners.MedianPruner`` on the intermediate validation scores (reported by the engine's
  ``Progress.on_eval`` hook at each evaluation): after ``PRUNE_STARTUP_TRIALS`` finished trials and from
  ``PRUNE_WARMUP_FRACTION`` of the iterations on (large steps leave DRO at chance for a while first), a trial
  below the median of the finished trials at the same iteration stops. A pruned trial counts towards the budget.
- Score: ``server.objective.validation_objective``: worst-class (CelebA: worst-group) accuracy, ties broken
  by the mean of the two lowest class accuracies, then by the validation accuracy.
- Warm start (``--warm-start``): each method's first trial is its shipped configuration (``shipped_point``: the
  hand-set file under ``configs/handset/`` when there is one, else its tuned file), enqueued before the sampler
  draws anything; it counts towards the same budget as every other trial, so every method gets the same number
  of trials and starts from its best known point.
- Confirmation: each method's ``--confirm-top`` best complete trials are trained again with seeds 1 ..
  ``--confirm-seeds`` - 1 (the trial itself is seed 0); the method's winner is the candidate with the best score
  of its mean terms over the seeds.
- Storage: Optuna's JournalStorage on the file ``<root>/<dataset>/eps<e>/optuna.journal`` (one study per method)
  and ``search.json`` (budget, seed, spaces) beside it. Rerunning the same command resumes: finished trials are
  kept, a trial that was running when the search was stopped is run again (same point, new number), confirmation
  runs with a summary.json are not run again. A second ``dpdro lab tune`` on the same search is refused.

The winners' keys are written as config files that train on the whole training split and are evaluated on the
test split:

    simulations/configs/tuned/<dataset>-eps<e>-<method>.toml     one per method
    simulations/configs/<dataset>-eps<e>-best.toml               the best method's (the overall winner)

and every trial's validation figures go to ``docs/research/TUNING.md`` (``dpdro lab tune --report`` writes both from the
storage and runs nothing).

``dpdro lab tune --dataset D --transfer-from S`` runs no trial: it writes D's tuned files from S's, keeping each
method's searched keys (batch sizes in units of the data set's 'batch-scale') and taking everything else from
D's trial keys. Nothing of D is then looked at to choose the hyper-parameters, so the choice costs D no privacy
at all; the files' first line and docs/research/RESULTS.md say where they came from.

Not privacy-accounted: the search reads noiseless validation metrics of private training records, so the
chosen hyper-parameters depend on the private data beyond the runs' epsilon (the standard practice the
results document states). The accounted search (Papernot & Steinke 2022) is ``dpdro lab tune --private``:
simulations/private_tune.py.
"""

from __future__ import annotations

import fcntl
import json
import logging
import multiprocessing
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from ..common.algorithm_specs import ALGORITHM_SPECS, FloatRange, IntRange, SearchDimension
from ..common.config import FIELD_BY_KEY, Config, ConfigError, toml_lines
from ..common.rng import derived_rng
from ..server.objective import evaluation_terms, mean_terms, pack_terms
from .tuned import SEARCH_MARK, TRANSFER_MARK, transferred_from, tuned_config_path, with_chosen_on_private

log = logging.getLogger(__name__)

# Keys shared by every trial of a data set (the training budget is the same for every method).
BASE = {"num-clients": 4, "threads": 1, "reproducible": False, "checkpoint-every": 0, "iterations": 500,
        "clip-x": 1.0, "clip-eta": 1.0, "noise-allocation": "variance"}
PER_DATASET = {
    "mnist-st": {"validation-fraction": 0.2},
    "fashion-mnist-st": {"validation-fraction": 0.2},
    # Tramer and Boneh's ScatterNet + linear head: the scattering features (computed once per record) and ghost
    # clipping of the linear head make an iteration cheaper than the end-to-end cnn32's (simulations/bench_features.py)
    "cifar10-st": {"validation-fraction": 0.2, "iterations": 200, "features": "scatternet", "model": "scatter-linear",
                   "per-record-engine": "ghost"},
    "celeba": {"iterations": 300, "batch-scale": 0.5},  # 8,000 training images: half the batch sizes
}
# Per data set, the keys of every method that declares them (AlgorithmSpec.keys): a data set judged on declared
# groups has the group-level DRO methods run over those groups (CelebA: worst-group accuracy over its 4 cells).
PER_DATASET_IF_USED = {
    "celeba": {"dro-groups": "attribute"},
}
# Per method: the searched keys and the keys every trial shares, declared with the algorithm
# (common/algorithm_specs.py: AlgorithmSpec.space and .fixed).
# Baselines first, then the DP-DRO methods (the order of the runs, the report and of ties between winners).
_ORDER = sorted(ALGORITHM_SPECS.values(), key=lambda s: s.dro)
SPACES: dict[str, dict[str, SearchDimension]] = {s.name: dict(s.space) for s in _ORDER if s.space}
FIXED: dict[str, dict] = {n: dict(s.fixed) for n, s in ALGORITHM_SPECS.items() if s.fixed}
METHODS = tuple(SPACES)
# Per data set, ranges that replace a method's own (for the keys the method searches): a linear head on normalised
# scattering features (cifar10-st) diverges at the CNNs' steps (lr-x 6 of the transferred files reached 0.40
# accuracy in a probe), so its step range is ~10x smaller.
SPACE_BY_DATASET: dict[str, dict[str, SearchDimension]] = {
    "cifar10-st": {"lr-x": FloatRange(0.05, 2.0, log=True)},
}


def space(method: str, dataset: str | None = None) -> dict[str, SearchDimension]:
    """The method's search space on ``dataset``: SPACES[method] with the data set's replacements
    (SPACE_BY_DATASET) of the keys the method searches. KeyError for an unknown method."""
    own = SPACES[method]
    return {**own, **{k: v for k, v in SPACE_BY_DATASET.get(dataset, {}).items() if k in own}}

EVALS_PER_TRIAL = 5  # validation evaluations per trial (the pruner's checkpoints), the last at the end
TPE_STARTUP_TRIALS = 8  # random trials before TPE models the space (Optuna's default is 10; budgets are ~20)
PRUNE_STARTUP_TRIALS = 5  # finished trials before the pruner may stop one
PRUNE_WARMUP_FRACTION = 0.4  # no pruning before this share of the iterations (DRO may sit at chance early)
TrialRunner = Callable[[Config, Callable[[dict], None] | None], dict]


def suggest(trial, method: str, dataset: str | None = None) -> dict:
    """The trial's point of the method's space on ``dataset`` (``space``; config key -> value), drawn by the
    study's sampler through Optuna's suggest_float / suggest_int / suggest_categorical. Raises ValueError for an
    unknown method."""
    if method not in SPACES:
        raise ValueError(f"unknown method {method!r}; allowed: {', '.join(SPACES)}")
    point = {}
    for key, dim in sorted(space(method, dataset).items()):
        if isinstance(dim, FloatRange):
            point[key] = trial.suggest_float(key, dim.low, dim.high, log=dim.log, step=dim.step)
        elif isinstance(dim, IntRange):
            point[key] = trial.suggest_int(key, dim.low, dim.high, log=dim.log, step=dim.step)
        else:
            point[key] = trial.suggest_categorical(key, list(dim.values))
    return point_keys(method, point, dataset)


def point_keys(method: str, params: dict, dataset: str | None = None) -> dict:
    """The config keys of a point of the method's space (Optuna's params): floats on a grid rounded to it
    (0.30000000000000004 -> 0.3), log-scale floats to 4 significant digits (readable tuned files; far below
    what a step size's effect can resolve)."""
    out = dict(params)
    for key, dim in space(method, dataset).items():
        if key in out and isinstance(dim, FloatRange):
            out[key] = round(out[key], 10) if not dim.log else float(f"{out[key]:.4g}")
    return out


def shipped_point(dataset: str, epsilon: float, method: str, configs: Path) -> tuple[dict, Path] | None:
    """The method's shipped configuration as a point of its space: (params, file), or None when nothing is
    shipped. The file is ``configs/handset/<dataset>-eps<e>-<method>*.toml`` (the first, sorted) when one exists,
    else ``configs/tuned/<dataset>-eps<e>-<method>.toml``. A searched key the file does not set takes its
    default; 'refresh-batch' is divided by the data set's 'batch-scale' (the space is in unscaled units).
    Raises ConfigError naming the file, the key, its value and the allowed range when a value lies outside the
    method's space (the enqueued point must be one the sampler could have drawn)."""
    import tomllib

    def read(path: Path) -> dict:
        with open(path, "rb") as f:
            return tomllib.load(f)

    handset = sorted((Path(configs) / "handset").glob(f"{dataset}-eps{epsilon:g}-{method}*.toml"))
    tuned = tuned_config_path(dataset, epsilon, method, Path(configs) / "tuned")
    # the name's prefix alone is ambiguous (dp-sgd-* matches dp-sgd-la's files): the file's algorithm decides
    found = [(p, v) for p, v in ((p, read(p)) for p in handset) if v.get("algorithm") == method]
    found += [(tuned, read(tuned))] if not found and tuned.exists() else []
    if not found:
        return None
    path, values = found[0]
    cfg = Config.from_mapping({k: v for k, v in values.items() if k in FIELD_BY_KEY})
    resolved = {**cfg.to_dict(), "logit-adjust-tau": cfg.tau}  # 'auto' as the run resolves it
    scale = PER_DATASET.get(dataset, {}).get("batch-scale", 1.0)
    point = {}
    for key, dim in space(method, dataset).items():
        value = resolved[key]
        if key == "refresh-batch":
            value = int(round(value / scale))
        if not _in_space(value, dim):
            raise ConfigError(f"{path}: {key} = {value!r} lies outside the search space of {method} ({dim!r}); "
                              "allowed: a point the sampler could draw")
        point[key] = value
    return point, path


def _in_space(value, dim: SearchDimension) -> bool:
    if isinstance(dim, FloatRange | IntRange):
        on_grid = dim.step is None or abs((value - dim.low) / dim.step - round((value - dim.low) / dim.step)) < 1e-9
        return dim.low - 1e-12 <= value <= dim.high + 1e-12 and on_grid
    return value in dim.values


def trial_config(dataset: str, epsilon: float, method: str, keys: dict, out_dir: Path, seed: int = 0) -> Config:
    """The configuration of one trial: BASE, the data set's keys (PER_DATASET, and PER_DATASET_IF_USED where the
    method declares the key), the method's FIXED keys, the trial's
    searched keys; batch sizes scaled by the data set's 'batch-scale', SPIDER difference (and s) batches at
    half (and equal to) the refresh batch; evaluated on the validation split only, EVALS_PER_TRIAL times.
    ``seed``: the run's seed (0 for the search, 1.. for the confirmation runs)."""
    per = dict(PER_DATASET.get(dataset, {}))
    scale = per.pop("batch-scale", 1.0)
    per.update({k: v for k, v in PER_DATASET_IF_USED.get(dataset, {}).items() if k in ALGORITHM_SPECS[method].keys})
    values = {**BASE, **per, **FIXED.get(method, {}), **keys, "dataset": dataset, "algorithm": method,
              "epsilon": epsilon, "seed": seed, "eval-split": "validation", "out-dir": str(out_dir)}
    batch = int(values["refresh-batch"] * scale)
    batches = {"refresh-batch": batch, "diff-batch": batch // 2, "s-batch": batch}
    values.update({k: v for k, v in batches.items() if k == "refresh-batch" or k in ALGORITHM_SPECS[method].keys})
    values["eval-every"] = max(1, values["iterations"] // EVALS_PER_TRIAL)
    return Config.from_mapping(values)


def final_keys(cfg: Config) -> dict:
    """The keys of a tuned config file, with the validation split off and the test split evaluated: every key
    the search set (BASE, the method's FIXED and searched keys, the batches) and every other key that differs
    from its default, minus run-local keys (out-dir, seed, eval-every). Writing the searched keys even where
    they equal today's defaults keeps the file's meaning if a default changes."""
    default = Config.from_mapping({}).to_dict()
    values = cfg.with_updates({"validation-fraction": 0.0, "eval-split": "test"}).to_dict()
    reads = ALGORITHM_SPECS[cfg.algorithm].keys
    explicit = ({"algorithm", "dataset", "epsilon", "iterations", "refresh-batch"}
                | ({"diff-batch", "s-batch"} & set(reads))
                | set(BASE) | set(FIXED.get(cfg.algorithm, {})) | set(SPACES.get(cfg.algorithm, {})))
    drop = {"out-dir", "seed", "eval-every", "validation-fraction", "eval-split"}
    return {k: v for k, v in values.items() if k not in drop and (k in explicit or v != default[k])}


# ---- where a search lives ----
def search_dir(root: Path, dataset: str, epsilon: float) -> Path:
    """<root>/<dataset>/eps<e>: the search's storage, record and run directories."""
    return Path(root) / dataset / f"eps{epsilon:g}"


def search_file(root: Path, dataset: str, epsilon: float) -> Path:
    """The search's record: budget (trials per method), seed, confirmation settings, each method's space."""
    return search_dir(root, dataset, epsilon) / "search.json"


def journal_file(root: Path, dataset: str, epsilon: float) -> Path:
    """Optuna's journal (every study of the search, one per method)."""
    return search_dir(root, dataset, epsilon) / "optuna.journal"


def trial_dir(root: Path, dataset: str, epsilon: float, method: str, number: int) -> Path:
    """Run directory of trial ``number`` (Optuna's trial number): <search>/<method>/trial<nn>."""
    return search_dir(root, dataset, epsilon) / method / f"trial{number:02d}"


def confirm_dir(root: Path, dataset: str, epsilon: float, method: str, number: int, seed: int) -> Path:
    """Run directory of the confirmation of trial ``number`` with ``seed``: <search>/<method>/confirm/..."""
    return search_dir(root, dataset, epsilon) / method / "confirm" / f"trial{number:02d}-seed{seed}"


def searched_entries(root: Path, datasets) -> list[tuple[str, float]]:
    """(dataset, epsilon) of every search recorded under ``root`` for one of ``datasets``, sorted."""
    root = Path(root)
    found = {(p.parent.parent.name, float(p.parent.name[3:])) for p in root.glob("*/eps*/search.json")}
    return sorted(e for e in found if e[0] in datasets)


def _space_record(method: str, dataset: str | None = None) -> dict:
    return {k: repr(v) for k, v in sorted(space(method, dataset).items())}


def read_search(root: Path, dataset: str, epsilon: float) -> dict | None:
    """The search's record (``search_file``), or None when there is none. Raises RunFileError (via
    rundir.read_json) for a damaged file, ConfigError for the record of a search before Optuna."""
    from ..server.rundir import read_json

    path = search_file(root, dataset, epsilon)
    if not path.exists():
        return None
    record = read_json(path)
    if "spaces" not in record:  # written by the random search before Optuna: its trial folders would collide
        raise ConfigError(f"{path} records a random search of an earlier dpdro (no Optuna study): tune under "
                          "another --root")
    return record


def _record_search(root: Path, dataset: str, epsilon: float, methods: list[str], trials: int, seed: int,
                   confirm_top: int, confirm_seeds: int, warm_start: bool = False) -> dict:
    """Check the command against the stored record and store the updated one (atomic). The budget may grow
    (the search goes on to the larger count), not shrink; the seed and a method's space may not change.
    Raises ConfigError naming the field, the stored and the given value."""
    from ..server.rundir import write_json

    old = read_search(root, dataset, epsilon) or {}
    path = search_file(root, dataset, epsilon)
    if old and old["seed"] != seed:
        raise ConfigError(f"--seed: got {seed}; {path} records a search with seed {old['seed']}: use it or another "
                         "--root")
    if old and trials < old["trials"]:
        raise ConfigError(f"--trials: got {trials}; {path} records a search of {old['trials']} trials per method: "
                         "allowed: that many or more (the search then goes on)")
    spaces = dict(old.get("spaces", {}))
    for method in methods:
        if method in spaces and spaces[method] != _space_record(method, dataset):
            raise ConfigError(f"the search space of {method} changed since {path} was written (stored "
                             f"{spaces[method]}, now {_space_record(method, dataset)}); tune it under another --root")
        spaces[method] = _space_record(method, dataset)
    record = {"trials": trials, "seed": seed, "confirm-top": confirm_top, "confirm-seeds": confirm_seeds,
              "iterations": trial_iterations(dataset), "spaces": spaces,
              "warm-start": bool(old.get("warm-start", warm_start))}  # the first trials decide it
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, record)
    return record


def trial_iterations(dataset: str) -> int:
    """Iterations of every trial on the data set (BASE, or the data set's own)."""
    return int({**BASE, **PER_DATASET.get(dataset, {})}["iterations"])


@contextmanager
def _search_lock(root: Path, dataset: str, epsilon: float) -> Iterator[None]:
    """Hold the search's lock file for the duration; raises ConfigError when another process holds it (two
    tuners on one search would each take the other's running trials for interrupted ones)."""
    path = search_dir(root, dataset, epsilon) / ".tune.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(f"another dpdro lab tune is running on {path.parent} (it holds {path}); wait for it or "
                               "stop it first") from None
        yield


# ---- Optuna ----
def open_study(root: Path, dataset: str, epsilon: float, method: str, sampler=None, pruner=None):
    """The method's study in the search's journal (created when missing), maximising the score."""
    import optuna
    from optuna.storages.journal import JournalFileBackend, JournalStorage

    journal = journal_file(root, dataset, epsilon)
    journal.parent.mkdir(parents=True, exist_ok=True)
    storage = JournalStorage(JournalFileBackend(str(journal)))
    return optuna.create_study(storage=storage, study_name=method, direction="maximize", sampler=sampler,
                               pruner=pruner, load_if_exists=True)


def make_sampler(seed: int, method: str, worker: int, finished: int):
    """TPE seeded by (seed, method, worker, the trial's index among the method's trials): two trials never draw
    the same random start, and a resumed search does not redraw the points it began with."""
    from optuna.samplers import TPESampler

    s = int(derived_rng(seed, "tune", method, worker, finished).integers(2**31))
    return TPESampler(seed=s, n_startup_trials=TPE_STARTUP_TRIALS, multivariate=True, constant_liar=True)


def make_pruner(iterations: int):
    """Median pruner: PRUNE_STARTUP_TRIALS finished trials first, none before PRUNE_WARMUP_FRACTION of the
    iterations."""
    from optuna.pruners import MedianPruner

    return MedianPruner(n_startup_trials=PRUNE_STARTUP_TRIALS,
                        n_warmup_steps=int(PRUNE_WARMUP_FRACTION * iterations))


def finished_trials(study) -> list:
    """The trials that count towards the budget: complete or pruned (Optuna FrozenTrials, by number)."""
    from optuna.trial import TrialState

    return study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED))


def retry_interrupted(study) -> list[int]:
    """Mark the trials a stopped search left running as failed and enqueue each interrupted trial's point once
    more (user attribute retry_of = its number), so that the point is still evaluated; returns the numbers
    retried. Only call it while holding the search's lock (no trial of this search is running then)."""
    from optuna.trial import TrialState

    retried = {t.user_attrs.get("retry_of") for t in study.get_trials(deepcopy=False)}
    out = []
    for t in study.get_trials(deepcopy=False):
        interrupted = t.state == TrialState.RUNNING or (t.state == TrialState.FAIL and t.user_attrs.get("interrupted"))
        if t.state == TrialState.RUNNING:
            study.tell(t.number, state=TrialState.FAIL)
        if interrupted and t.number not in retried:
            study.enqueue_trial(dict(t.params), user_attrs={"retry_of": t.number})
            out.append(t.number)
    return out


def train_trial(cfg: Config, report: Callable[[dict], None] | None) -> dict:
    """Train ``cfg`` in this process, calling ``report(row)`` after each evaluation (it may raise
    optuna.TrialPruned to stop the run); returns the run's summary.json. Raises DataError when the data set is
    missing. Tests replace this function by a synthetic one."""
    from ..common.data import DataError
    from ..server.engine import Progress
    from ..server.rundir import read_json
    from .runner import run_one

    progress = Progress(on_step=_stop_if_orphaned, on_eval=report or (lambda row: None))
    out, missing = run_one(cfg.to_dict(), progress=progress)
    if missing:
        raise DataError(missing)
    return read_json(Path(out) / "summary.json")


_PARENT_PID: int | None = None  # set in a worker process: the tuner that started it


def _stop_if_orphaned(t: int) -> None:
    """In a worker process whose tuner has gone (killed, e.g. by SIGTERM, which the workers do not get), stop
    like Ctrl-C: the trial is marked interrupted and runs again when the search resumes, instead of going on
    unsupervised next to a resumed search."""
    if _PARENT_PID is not None and os.getppid() != _PARENT_PID:
        raise KeyboardInterrupt(f"the tuner (pid {_PARENT_PID}) has gone")


def _terms_attrs(terms) -> dict:
    return dict(zip(("val_worst", "val_two_lowest", "val_accuracy"), terms, strict=True))


def _objective(trial, dataset: str, epsilon: float, method: str, root: Path) -> float:
    """One trial: train the sampled point, reporting every evaluation's score to the pruner; returns the final
    validation score. The figures go to the trial's user attributes (the report reads them)."""
    import optuna

    cfg = trial_config(dataset, epsilon, method, suggest(trial, method, dataset),
                       trial_dir(root, dataset, epsilon, method, trial.number))
    trial.set_user_attr("out_dir", cfg.out_dir)

    def report(row: dict) -> None:
        step = int(row["iteration"])
        terms = evaluation_terms(row)
        trial.report(pack_terms(terms), step)
        if 0 < step < cfg.iterations and trial.should_prune():
            for k, v in {**_terms_attrs(terms), "pruned_at": step}.items():
                trial.set_user_attr(k, v)
            raise optuna.TrialPruned(f"validation score below the median at iteration {step}")

    try:
        summary = train_trial(cfg, report)
    except KeyboardInterrupt:  # a stopped search: the point is run again when the search resumes
        trial.set_user_attr("interrupted", True)
        raise
    terms = evaluation_terms(summary)
    for k, v in {**_terms_attrs(terms), "epsilon_spent": summary["epsilon_spent"],
                 "wall_seconds": summary["wall_seconds"]}.items():
        trial.set_user_attr(k, v)
    return pack_terms(terms)


def _optimize(root: str, dataset: str, epsilon: float, method: str, seed: int, finished: int, quota: int,
              parent: int | None = None) -> None:
    """Run ``quota`` trials of the method's study (in a worker process of its own when jobs > 1, then ``parent``
    is the tuner's pid); ``finished`` seeds the sampler (``make_sampler``)."""
    global _PARENT_PID
    _PARENT_PID = parent
    logging.getLogger("absl").setLevel(logging.ERROR)
    root_path = Path(root)
    study = open_study(root_path, dataset, epsilon, method, make_sampler(seed, method, 0, finished),
                       make_pruner(trial_iterations(dataset)))
    study.optimize(lambda trial: _objective(trial, dataset, epsilon, method, root_path), n_trials=quota)


def _train_values(values: dict, parent: int) -> None:
    """train_trial of a config given as its keys, in a worker process of the tuner ``parent``."""
    global _PARENT_PID
    _PARENT_PID = parent
    train_trial(Config.from_mapping(values), None)


def _prepare_study(dataset: str, epsilon: float, method: str, trials: int, root: Path,
                   shipped: tuple[dict, Path] | None) -> tuple[int, int]:
    """Open the method's study, re-enqueue interrupted trials and, with ``shipped`` (``shipped_point``'s (params,
    file)) on a study without any trial, enqueue that point (user attribute shipped = its file). Returns (finished
    trials, trials still to run for ``trials``)."""
    study = open_study(root, dataset, epsilon, method)
    if shipped is not None and not study.get_trials(deepcopy=False):
        study.enqueue_trial(shipped[0], user_attrs={"shipped": str(shipped[1])})
        log.info("%s: trial 0 is the shipped configuration %s", method, shipped[1])
    retried = retry_interrupted(study)
    if retried:
        log.info("%s: trials %s were interrupted; their points run again", method, retried)
    finished = len(finished_trials(study))
    remaining = max(0, trials - finished)
    if remaining:
        log.info("%s: %d of %d trials finished, %d to run", method, finished, trials, remaining)
    return finished, remaining


def run_searches(dataset: str, epsilon: float, methods: list[str], trials: int, root: Path, seed: int = 0,
                 jobs: int = 1, shipped: dict[str, tuple[dict, Path] | None] | None = None) -> dict[str, int]:
    """Bring every method's study to ``trials`` finished trials with one pool of ``jobs`` worker processes over all
    the methods' trials, in the methods' order (a worker never idles while a method still has a trial to start; in
    this process when jobs <= 1). Each trial draws from its own TPE sampler seeded by (seed, method, its index among
    the method's trials), so with jobs 1 a search is reproducible point for point. ``shipped``: method -> its
    shipped point (``shipped_point``) to start an empty study with. Call it holding the search's lock (``run_tune``
    does). Returns method -> trials run now."""
    tasks = []
    for method in methods:
        finished, remaining = _prepare_study(dataset, epsilon, method, trials, root, (shipped or {}).get(method))
        tasks += [(method, finished + i) for i in range(remaining)]
    if jobs <= 1 or len(tasks) <= 1:
        for method, index in tasks:
            _optimize(str(root), dataset, epsilon, method, seed, index, 1)
    else:  # spawn, not fork: see runner.run_many
        with ProcessPoolExecutor(max_workers=min(jobs, len(tasks)),
                                 mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = [pool.submit(_optimize, str(root), dataset, epsilon, method, seed, index, 1, os.getpid())
                       for method, index in tasks]
            for f in futures:
                f.result()
    return {m: sum(t[0] == m for t in tasks) for m in methods}


def run_search(dataset: str, epsilon: float, method: str, trials: int, root: Path, seed: int = 0,
               jobs: int = 1) -> int:
    """``run_searches`` of one method; returns the number of trials run now."""
    return run_searches(dataset, epsilon, [method], trials, root, seed, jobs)[method]


# ---- confirmation and selection ----
def top_trials(study, k: int) -> list:
    """The k complete trials with the highest score (ties: the lower number first)."""
    from optuna.trial import TrialState

    done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    return sorted(done, key=lambda t: (-t.value, t.number))[:k]


def confirm_configs(dataset: str, epsilon: float, method: str, root: Path, study, top: int,
                    seeds: int) -> list[Config]:
    """The confirmation runs of the method's ``top`` best trials, seeds 1 .. seeds-1 (seed 0 is the trial)."""
    return [trial_config(dataset, epsilon, method, point_keys(method, t.params, dataset),
                         confirm_dir(root, dataset, epsilon, method, t.number, s), seed=s)
            for t in top_trials(study, top) for s in range(1, seeds)]


def run_unfinished(configs: list[Config], jobs: int) -> None:
    """Run the unfinished runs of ``configs`` (confirmation runs, the validation models of
    ``posthoc_tau``), ``jobs`` at a time: a summary.json marks a finished one; a partial one is resumed from its
    checkpoint or started again (``rundir.continue_keys``)."""
    from ..server.rundir import continue_keys

    plans = [c.with_updates(continue_keys(c.out_dir)) for c in configs
             if not (Path(c.out_dir) / "summary.json").exists()]
    if not plans:
        return
    log.info("%d runs to run", len(plans))
    if jobs <= 1:
        for c in plans:
            train_trial(c, None)
        return
    with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        for f in [pool.submit(_train_values, c.to_dict(), os.getpid()) for c in plans]:
            f.result()


def candidates(dataset: str, epsilon: float, method: str, root: Path, study, top: int, seeds: int) -> list[dict]:
    """The method's top trials with their figures over the seeds run so far: trial (number), keys, seeds (how
    many evaluations), val_worst / val_two_lowest / val_accuracy (means over the seeds), score (pack_terms of
    the means), out_dir (the trial's run directory)."""
    from ..server.rundir import read_json

    out = []
    for t in top_trials(study, top):
        runs = [tuple(t.user_attrs[k] for k in ("val_worst", "val_two_lowest", "val_accuracy"))]
        for s in range(1, seeds):
            path = confirm_dir(root, dataset, epsilon, method, t.number, s) / "summary.json"
            if path.exists():
                runs.append(evaluation_terms(read_json(path)))
        means = mean_terms(runs)
        out.append({"trial": t.number, "keys": point_keys(method, t.params, dataset), "seeds": len(runs),
                    **_terms_attrs(means), "score": pack_terms(means), "out_dir": t.user_attrs["out_dir"]})
    return out


def select_winner(records: list[dict], seeds: int) -> dict | None:
    """The candidate with the highest score among those evaluated on all ``seeds`` (ties: lower trial number);
    None when none is."""
    full = [r for r in records if r["seeds"] >= max(1, seeds)]
    return max(full, key=lambda r: (r["score"], -r["trial"])) if full else None


def keys_tag(keys: dict) -> str:
    """12 hex digits of the SHA-256 of ``keys`` (sorted JSON): the folder name of a point's run outside the study."""
    import hashlib

    return hashlib.sha256(json.dumps(keys, sort_keys=True, default=str).encode()).hexdigest()[:12]


def run_probe(dataset: str, epsilon: float, method: str, keys: dict, root: Path, seed: int = 0) -> dict:
    """Train one hand-set point of ``method`` with a trial's protocol (``trial_config``: the validation split, the
    trial length, the method's FIXED keys; ``keys`` override the rest) *outside* the search: it is not recorded in
    the study, does not count towards any budget and chooses nothing. For diagnostics (e.g. a method at another
    method's setting). Runs in <root>/<dataset>/eps<e>/probes/<method>-<12 hex digits of the keys>[-seed<s> for a
    seed other than 0] (resumed if unfinished) and returns its summary.json. Raises ConfigError for an unknown key
    or bad value, before any work."""
    from .runner import run_one

    # typed values (the CLI gives text): the trial protocol computes with some of them (refresh-batch * scale);
    # an unknown key stays as it is for trial_config's Config to refuse, before any run
    keys = {k: FIELD_BY_KEY[k].parse(v) if k in FIELD_BY_KEY else v for k, v in keys.items()}
    tag = keys_tag(keys)
    # seed 0 keeps the folder it always had; another seed (a confirmation of the point) gets its own
    out = search_dir(root, dataset, epsilon) / "probes" / f"{method}-{tag}{f'-seed{seed}' if seed else ''}"
    default_batch = Config.from_mapping({}).refresh_batch  # a trial always draws one; a probe may leave it out
    cfg = trial_config(dataset, epsilon, method, {"refresh-batch": default_batch, **keys}, out, seed)
    if not (out / "summary.json").exists():
        from ..server.rundir import continue_keys

        run_one({**cfg.to_dict(), **continue_keys(out)})
    return json.loads((out / "summary.json").read_text())


def run_tune(dataset: str, epsilon: float, methods: list[str], trials: int, root: Path, configs: Path,
             seed: int = 0, jobs: int = 2, confirm_top: int = 3, confirm_seeds: int = 3,
             warm_start: bool = False) -> dict[str, dict]:
    """Bring every method's study to ``trials`` finished trials, confirm each method's ``confirm_top`` best on
    ``confirm_seeds`` seeds, then write the tuned config files. ``warm_start``: every method's first trial is its
    shipped configuration under ``configs`` (``shipped_point``), read before any run (a file outside the space is
    refused then). Resumable (module docstring). Returns method ->
    the winner's record (``candidates``). Raises ConfigError (a ValueError) for arguments out of range or
    contradicting the stored search, or when another tuner holds the search."""
    for name, value, low in (("--trials", trials, 1), ("--confirm-top", confirm_top, 1),
                             ("--confirm-seeds", confirm_seeds, 1), ("--jobs", jobs, 1)):
        if value < low:
            raise ConfigError(f"{name}: got {value}; allowed: >= {low}")
    unknown = [m for m in methods if m not in SPACES]
    if unknown:
        raise ConfigError(f"--methods: got {unknown}; allowed: {', '.join(SPACES)}")
    # every shipped file read and checked before the first trial runs
    shipped = {m: shipped_point(dataset, epsilon, m, configs) for m in methods} if warm_start else None
    with _search_lock(root, dataset, epsilon):
        _record_search(root, dataset, epsilon, methods, trials, seed, confirm_top, confirm_seeds, warm_start)
        run_searches(dataset, epsilon, methods, trials, root, seed, jobs, shipped)
        plans = [c for m in methods for c in confirm_configs(dataset, epsilon, m, root, open_study(
            root, dataset, epsilon, m), confirm_top, confirm_seeds)]
        run_unfinished(plans, jobs)
    return write_tuned(dataset, epsilon, methods, root, configs)


def write_tuned(dataset: str, epsilon: float, methods: list[str], root: Path, configs: Path) -> dict[str, dict]:
    """Write the tuned config files from the stored search (its record says the budget and the confirmation);
    returns method -> winning record (``candidates``). Methods without a confirmed winner are skipped."""
    from ..server.engine import load_run_config

    record = read_search(root, dataset, epsilon)
    if record is None:
        return {}
    winners = {}
    (configs / "tuned").mkdir(parents=True, exist_ok=True)
    for method in [m for m in methods if m in record["spaces"]]:
        win = select_winner(candidates(dataset, epsilon, method, root, open_study(root, dataset, epsilon, method),
                                       record["confirm-top"], record["confirm-seeds"]), record["confirm-seeds"])
        if win is None:
            log.warning("%s: no trial confirmed on %d seeds yet: no tuned file", method, record["confirm-seeds"])
            continue
        winners[method] = win
        keys = with_chosen_on_private(final_keys(load_run_config(win["out_dir"])), *_searched_choices(method))
        header = (f"{SEARCH_MARK} {dataset} --epsilon {epsilon:g} --trials {record['trials']}`: "
                  f"trial {win['trial']} of {method} ({budget_line(record)}), mean over {win['seeds']} seed(s): "
                  f"validation worst {win['val_worst']:.4f}, two lowest {win['val_two_lowest']:.4f}, accuracy "
                  f"{win['val_accuracy']:.4f}.\n# Trains on the whole training split, evaluates on the test split. "
                  "The search itself is not privacy-accounted (docs/research/TUNING.md).\n")
        write_toml(tuned_config_path(dataset, epsilon, method, configs / "tuned"), keys, header)
    if winners:
        method, win = max(winners.items(), key=lambda kv: kv[1]["score"])  # ties: the first (baselines first)
        keys = {**with_chosen_on_private(final_keys(load_run_config(win["out_dir"])), *_searched_choices(method),
                                         "model"), "out-dir": f"runs/{dataset}-eps{epsilon:g}-best"}
        header = (f"# Best configuration for {dataset} at epsilon {epsilon:g} over {', '.join(winners)} "
                  f"({budget_line(record)} each, selected on the validation score): {method}, trial "
                  f"{win['trial']}.\n# Run: dpdro train --config <this file>. The search is not "
                  "privacy-accounted (docs/research/TUNING.md).\n")
        write_toml(configs / f"{dataset}-eps{epsilon:g}-best.toml", keys, header)
    return winners


def _searched_choices(method: str) -> tuple[str, ...]:
    """What a search of ``method`` chose on the validation split (items of key chosen-on-private-data): its
    hyper-parameters, and the post-hoc tau when the method's space draws it."""
    return ("hyper-parameters", *(("posthoc-tau",) if "posthoc-tau" in SPACES[method] else ()))


def budget_line(record: dict) -> str:
    """The per-method budget of a search, in words."""
    extra = (f", top {record['confirm-top']} confirmed on {record['confirm-seeds']} seeds"
             if record["confirm-seeds"] > 1 else "")
    start = ", the first the method's shipped configuration" if record.get("warm-start") else ""
    return f"{record['trials']} TPE trials of at most {record['iterations']} iterations{start}{extra}"


def transfer_tuned(target: str, source: str, epsilon: float, methods: list[str], configs: Path) -> dict[str, Path]:
    """Write ``configs/tuned/<target>-eps<e>-<method>.toml`` from the source data set's tuned file of each method:
    the method's searched keys (SPACES) of the source file, 'refresh-batch' divided by the source's and multiplied
    by the target's 'batch-scale', every other key from the target's trial keys (``trial_config``), evaluated on
    the test split. Methods without a source file are skipped. No run, no look at the target's data.

    Returns method -> written path. Raises ValueError when target == source or when no source file exists."""
    import tomllib

    if target == source:
        raise ValueError(f"--transfer-from: source {source!r} is the target data set; pick another data set")
    written = {}
    src_scale = PER_DATASET.get(source, {}).get("batch-scale", 1.0)
    for method in methods:
        path = tuned_config_path(source, epsilon, method, configs / "tuned")
        if not path.exists():
            log.warning("no tuned config %s: %s is not transferred", path, method)
            continue
        text = path.read_text()
        src = tomllib.loads(text)
        keys = {k: src[k] for k in SPACES[method] if k in src}
        keys["refresh-batch"] = int(round(src["refresh-batch"] / src_scale))
        cfg = trial_config(target, epsilon, method, keys, configs / "unused")
        origin = text.splitlines()[0].lstrip("# ").rstrip(".")
        header = (f"{TRANSFER_MARK} by `dpdro tune --dataset {target} --epsilon {epsilon:g} --transfer-from {source}`: "
                  f"the searched keys of {path.name} ({origin}); no trial on {target}.\n# Trains on the whole "
                  "training split, evaluates on the test split. Nothing of this data set chose these keys.\n")
        out = tuned_config_path(target, epsilon, method, configs / "tuned")
        write_toml(out, final_keys(cfg), header)
        written[method] = out
    if not written:
        raise ValueError(f"--transfer-from {source}: no tuned config {source}-eps{epsilon:g}-<method>.toml under "
                         f"{configs / 'tuned'}; run `dpdro lab tune --dataset {source}` first")
    return written




def write_toml(path: Path, keys: dict, header: str = "") -> None:
    """A flat TOML file of configuration keys (atomic)."""
    from ..common.atomic import atomic_write_bytes

    lines = [header.rstrip("\n")] if header else []
    atomic_write_bytes(path, ("\n".join([*lines, toml_lines(keys)]) + "\n").encode())


def _fmt(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def tuning_report(entries: list[tuple[str, float]], methods: list[str], root: Path, docs: Path) -> Path:
    """docs/research/TUNING.md: per (dataset, epsilon) the budget, every trial's state, searched keys and validation
    figures, and the confirmation of each method's top trials (atomic write)."""
    from optuna.trial import TrialState

    from ..common.atomic import atomic_write_bytes

    lines = ["# Hyper-parameter search (generated by `dpdro lab tune --report`)", "",
             "Optuna, one study per method with the same budget: TPE sampler (seeded; the first "
             f"{TPE_STARTUP_TRIALS} trials random), median pruner on the validation score at each of the "
             f"{EVALS_PER_TRIAL} evaluations of a trial (after {PRUNE_STARTUP_TRIALS} finished trials, from "
             f"{PRUNE_WARMUP_FRACTION:.0%} of the iterations on); a pruned trial counts towards the budget. Each "
             "trial is a full private run at the target epsilon, trained without the validation split and "
             "evaluated on it. Score (`server/objective.py`): validation worst-class (CelebA: worst-group) "
             "accuracy, ties broken by the mean of the two lowest class accuracies, then by the validation "
             "accuracy. Each method's best complete trials are trained again on more seeds and the best mean "
             "score wins. The test split is never used here. **The search is not privacy-accounted**: it reads "
             "noiseless validation metrics of private training records (the accounted search is `dpdro lab tune "
             "--private`, docs/explanation/ALGORITHMS.md 5.7). Levers of every method: step size, "
             "refresh batch, post-hoc and training logit adjustment (dp-sgd: training tau 0), and its own keys "
             "(`common/algorithm_specs.py`). Shared keys: "
             + ", ".join(f"{k}={v}" for k, v in sorted(BASE.items())) + "; per data set: "
             + "; ".join(f"{d}: " + ", ".join(f"{k}={v}" for k, v in kv.items()) for d, kv in PER_DATASET.items())
             + ". SPIDER difference batches are half the refresh batch.", ""]
    for dataset, epsilon in entries:
        record = read_search(root, dataset, epsilon)
        if record is None:
            continue
        lines += [f"## {dataset}, epsilon {epsilon:g} (per method: {budget_line(record)})", ""]
        unsearched = [m for m in SPACES if not finished_trials(open_study(root, dataset, epsilon, m))]
        if unsearched:
            lines += [f"Not in this search: {', '.join(unsearched)} (no finished trial); their tuned files, if any, "
                      "come from an earlier search (their first line says which).", ""]
        for method in methods:
            if method not in record["spaces"]:
                continue
            study = open_study(root, dataset, epsilon, method)
            trials = [t for t in study.get_trials(deepcopy=False)
                      if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
            if not trials:
                continue
            cands = candidates(dataset, epsilon, method, root, study, record["confirm-top"],
                               record["confirm-seeds"])
            win = select_winner(cands, record["confirm-seeds"])
            iters = sum(t.user_attrs.get("pruned_at", record["iterations"]) for t in trials)
            lines += [f"### {method} ({len(trials)} of {record['trials']} trials, "
                      f"{sum(t.state == TrialState.PRUNED for t in trials)} pruned, {iters} iterations trained; "
                      f"winner: {'trial ' + str(win['trial']) if win else 'none confirmed yet'})", "",
                      "| trial | state | val worst | val two lowest | val accuracy | keys |",
                      "|---|---|---|---|---|---|"]
            for t in trials:
                state = "complete" if t.state == TrialState.COMPLETE else f"pruned at {t.user_attrs.get('pruned_at')}"
                if "shipped" in t.user_attrs:
                    state += f" (shipped: {Path(t.user_attrs['shipped']).name})"
                keys = ", ".join(f"{k}={_fmt(v)}" for k, v in sorted(t.params.items()))
                figs = " | ".join(f"{t.user_attrs[k]:.3f}" if k in t.user_attrs else "-"
                                  for k in ("val_worst", "val_two_lowest", "val_accuracy"))
                lines.append(f"| {t.number} | {state} | {figs} | {keys} |")
            lines += ["", "Confirmation (means over the seeds):", "",
                      "| trial | seeds | val worst | val two lowest | val accuracy |", "|---|---|---|---|---|"]
            for c in cands:
                mark = " **(selected)**" if win is not None and c["trial"] == win["trial"] else ""
                lines.append(f"| {c['trial']}{mark} | {c['seeds']} of {record['confirm-seeds']} | {c['val_worst']:.3f} "
                             f"| {c['val_two_lowest']:.3f} | {c['val_accuracy']:.3f} |")
            lines.append("")
    out = Path(docs) / "TUNING.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out, "\n".join(lines).encode())
    return out


__all__ = ["run_tune", "run_search", "run_searches", "transfer_tuned", "transferred_from", "select_winner",
           "write_tuned", "tuning_report", "searched_entries", "METHODS", "SPACES"]
