"""The pictures and the model card of a finished run: ``plots/training_curves.png``
(test and worst-class accuracy, epsilon spent, against iterations), ``plots/per_class_accuracy.png`` and
``MODEL_CARD.md``; plus the confusion-matrix picture of ``dpdro evaluate``.

Everything here is drawn from what the run already reports (metrics.csv rows, summary.json, model.json):
post-processing of released values and of the public test split, no new release. matplotlib is imported
inside the functions (with its non-interactive Agg canvas), so importing this module stays cheap.
"""

from __future__ import annotations

import io
import math
from pathlib import Path

import numpy as np

from ..common.atomic import atomic_write_bytes
from ..common.noise_modes import noise_mode

TRAINING_CURVES = "plots/training_curves.png"
PER_CLASS = "plots/per_class_accuracy.png"
MODEL_CARD = "MODEL_CARD.md"


def _number(v) -> float:
    """A metric value as float: 'inf' strings (checkpointed rows) to inf, None to NaN."""
    if v is None:
        return math.nan
    return float(v)


def _save(fig, path: Path) -> None:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    atomic_write_bytes(path, buf.getvalue())


def plot_training_curves(rows: list[dict], path: Path, title: str, target: tuple[float, float] | None = None,
                         first_step: str = "") -> None:
    """Two panels against iteration from metric rows (each with iteration, test_accuracy, worst_class_accuracy,
    epsilon_spent, optionally worst_group_accuracy): accuracies, and epsilon spent (a note instead of a curve
    when epsilon is inf: not private). ``target``: (epsilon, delta) of the run, drawn as a dashed line and named
    in the panel's title; ``first_step``: what the epsilon spent before the first iteration paid for (the setup
    releases, e.g. the class histogram), written beside the iteration-0 point when that spend is above 0.
    Written atomically as PNG to ``path``."""
    from matplotlib.figure import Figure

    it = [int(r["iteration"]) for r in rows]
    fig = Figure(figsize=(9, 3.6))
    acc, eps = fig.subplots(1, 2)
    acc.plot(it, [_number(r["test_accuracy"]) for r in rows], marker="o", label="test accuracy")
    acc.plot(it, [_number(r["worst_class_accuracy"]) for r in rows], marker="s", label="worst-class accuracy")
    if any("worst_group_accuracy" in r for r in rows):
        acc.plot(it, [_number(r.get("worst_group_accuracy")) for r in rows], marker="^", label="worst-group accuracy")
    acc.set(xlabel="iteration", ylabel="accuracy", ylim=(0, 1.02), title="accuracy")
    acc.grid(alpha=0.3)
    acc.legend(loc="lower right", fontsize=8)
    spent = [_number(r["epsilon_spent"]) for r in rows]
    panel = "privacy spent"
    if all(math.isfinite(e) for e in spent):
        eps.plot(it, spent, marker="o", color="tab:red", label="epsilon spent")
        eps.set(ylabel="epsilon spent")
        if target is not None and math.isfinite(target[0]):
            eps.axhline(target[0], color="black", linestyle="--", linewidth=1,
                        label=f"target epsilon {target[0]:g}")
            panel = f"privacy spent (target epsilon {target[0]:g}, delta {target[1]:.3g})"
            eps.set_ylim(0, max(max(spent), target[0]) * 1.1 or 1.0)
        if first_step and spent and spent[0] > 0:  # the note sits in the empty lower right, an arrow to the point
            eps.annotate(f"epsilon {spent[0]:.3g} at iteration {it[0]}, before training:\n{first_step}",
                         (it[0], spent[0]), xytext=(0.97, 0.04), textcoords="axes fraction", ha="right",
                         va="bottom", fontsize=7, arrowprops={"arrowstyle": "->", "color": "gray"})
        eps.legend(loc="center right", fontsize=8)
    else:
        eps.text(0.5, 0.5, "epsilon = inf: not private", ha="center", va="center", transform=eps.transAxes)
    eps.set(xlabel="iteration")
    eps.set_title(panel, fontsize=9)
    eps.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    _save(fig, path)


def plot_per_class(per_class: list[float], classes: list[str], path: Path, title: str,
                   minority: tuple[list[int], str] | None = None) -> None:
    """Bar chart of per-class accuracy (K,) (NaN, a class absent from the evaluation split, drawn as an empty
    slot), the worst class in red, each bar's value printed on it. ``minority``: (class indices, where the
    classes' training counts come from, as ``minority_classes`` gives them): their bars are hatched and their
    labels marked '*', with a note saying why. Written atomically as PNG to ``path``."""
    from matplotlib.figure import Figure

    values = np.asarray(per_class, dtype=np.float64)
    marked = set(minority[0]) if minority else set()
    fig = Figure(figsize=(max(4.0, 0.55 * len(values) + 2), 3.8))
    ax = fig.subplots()
    worst = int(np.nanargmin(values)) if np.isfinite(values).any() else -1
    colors = ["tab:red" if k == worst else "tab:blue" for k in range(len(values))]
    bars = ax.bar(range(len(values)), np.nan_to_num(values, nan=0.0), color=colors,
                  hatch=[("//" if k in marked else "") for k in range(len(values))], edgecolor="white")
    ax.bar_label(bars, labels=["n/a" if math.isnan(v) else f"{v:.2f}" for v in values], fontsize=7, padding=1)
    wide = len(values) > 12
    labels = [f"{c}*" if k in marked else c for k, c in enumerate(classes)]
    ax.set_xticks(range(len(values)), labels, rotation=45 if wide else 0, ha="right" if wide else "center",
                  fontsize=8)
    if worst >= 0:  # a worst class at 0 has no visible bar: name it
        title += f"\nworst: class {classes[worst]} ({values[worst]:.3f})"
    if minority and minority[0]:
        short = minority[1].split(";")[0].split(" (")[0].split(":")[0]  # the card has the whole sentence
        ax.set_xlabel(f"class (* hatched: minority in training, {short})", fontsize=8)
    else:
        ax.set_xlabel("class")
    ax.set(ylim=(0, 1.12), ylabel="accuracy", title=title)
    ax.grid(axis="y", alpha=0.3)
    _save(fig, path)


def confusion_matrix(labels: np.ndarray, pred: np.ndarray, num_classes: int) -> np.ndarray:
    """Counts (K, K) int64: entry [i, j] = records of true class i predicted as j."""
    m = np.zeros((num_classes, num_classes), dtype=np.int64)
    np.add.at(m, (np.asarray(labels, dtype=np.int64), np.asarray(pred, dtype=np.int64)), 1)
    return m


def plot_confusion(matrix: np.ndarray, classes: list[str], path: Path, title: str) -> None:
    """Confusion matrix (K, K) counts as a picture, rows normalised to the fraction of each true class (the
    counts written in the cells for K <= 20). Written atomically as PNG to ``path``."""
    from matplotlib.figure import Figure

    k = len(classes)
    rows = matrix.sum(1, keepdims=True)
    frac = np.divide(matrix, rows, out=np.zeros(matrix.shape, dtype=np.float64), where=rows > 0)
    fig = Figure(figsize=(max(4.0, 0.5 * k + 2.5), max(3.5, 0.5 * k + 2)))
    ax = fig.subplots()
    im = ax.imshow(frac, vmin=0, vmax=1, cmap="Blues")
    fig.colorbar(im, ax=ax, label="fraction of the true class")
    ax.set_xticks(range(k), classes, rotation=45 if k > 12 else 0, fontsize=8)
    ax.set_yticks(range(k), classes, fontsize=8)
    ax.set(xlabel="predicted", ylabel="true", title=title)
    if k <= 20:
        for i in range(k):
            for j in range(k):
                ax.text(j, i, str(matrix[i, j]), ha="center", va="center", fontsize=7,
                        color="white" if frac[i, j] > 0.5 else "black")
    _save(fig, path)


# The setup releases (server/setup.py) as the training-curves panel names them.
SETUP_RELEASES = {"class-histogram": "the class histogram", "group-histogram": "the group histogram",
                  "eta-init": "the eta initialisation (mean loss)"}


def first_step(summary: dict) -> str:
    """What the epsilon spent at iteration 0 paid for: the setup releases the run made (summary.json releases),
    e.g. 'the class histogram release (noise multiplier 10)'; '' when it made none."""
    made = [m for m in SETUP_RELEASES if summary.get("releases", {}).get(m)]
    noise = summary.get("noise_multipliers", {})
    return " and ".join(f"{SETUP_RELEASES[m]} release (noise multiplier {_number(noise.get(m)):.3g})" for m in made)


def write_run_plots(run_dir: Path, rows: list[dict], summary: dict, classes: list[str],
                    minority: tuple[list[int], str] | None = None) -> list[str]:
    """Training curves and per-class accuracy of a finished run into ``run_dir``/plots/; returns the paths
    written, relative to ``run_dir``. ``minority`` as ``plot_per_class`` takes it."""
    name = f"{summary['algorithm']} on {summary['dataset']}"
    target = (_number(summary["epsilon_target"]), float(summary["delta"]))
    plot_training_curves(rows, Path(run_dir) / TRAINING_CURVES, name, target, first_step(summary))
    plot_per_class(summary["per_class_accuracy"], classes, Path(run_dir) / PER_CLASS,
                   f"per-class accuracy ({summary.get('eval_split', 'test')} split), {name}", minority)
    return [TRAINING_CURVES, PER_CLASS]


# A class (or group) is a minority in training when its count is below this share of the mean count per class.
MINORITY_SHARE = 0.5


def minority_classes(summary: dict, construction: tuple[list[int], str] | None = None
                     ) -> tuple[list[int], str] | None:
    """(minority class indices, where the counts come from) of a finished run, without any new release: from the
    class histogram the run released (summary.json class_counts: noisy, charged in the ledger; exact without
    privacy), else from declared public priors (n pi_k), else ``construction`` (a built-in long-tailed data set's
    public rule, ``long_tailed_construction``); None when the run knows no class counts. A class is a minority
    when its count is below MINORITY_SHARE of the mean count per class."""
    counts, source = summary.get("class_counts"), None
    rule = f"a minority has fewer than {MINORITY_SHARE:g} x the mean count per class"
    if counts is not None:
        z = _number(summary.get("noise_multipliers", {}).get("class-histogram", 0.0))
        source = (f"noisy counts of the class histogram release (Gaussian noise of std {z:.3g} records per class, "
                  f"charged in the ledger); {rule}" if summary.get("private") and z > 0
                  else f"exact counts of the class histogram (not private); {rule}")
    elif summary.get("class_prior") == "public" and summary.get("priors"):
        counts = [p * summary["n"] for p in summary["priors"]]
        source = f"n x the class priors declared public (class-prior-values), not counted from the data; {rule}"
    if counts is None:
        return construction
    mean = sum(max(c, 0.0) for c in counts) / len(counts)
    return [k for k, c in enumerate(counts) if c < MINORITY_SHARE * mean], source


def long_tailed_construction(dataset: str, num_classes: int, ratio: float, long_tailed: bool
                             ) -> tuple[list[int], str] | None:
    """The minority classes that a built-in '-st' data set's public rule makes (common/data.py: the first half of
    the classes keep ``ratio`` of their records), with the rule as the source; None for other data sets."""
    if not long_tailed:
        return None
    return list(range(num_classes // 2)), (f"by {dataset}'s public construction: the first half of the classes "
                                           f"keep {ratio:g} of their records (imbalance-ratio); counts not released")


def _fmt_eps(v) -> str:
    v = _number(v)
    return "inf" if math.isinf(v) else f"{v:.4g}"


# How the class priors of a run were obtained (summary.json class_prior), as the model card says it.
PRIOR_SOURCES = {"private": "released from the training records with noise and charged in the ledger",
                 "public": "declared public by the user (class-prior-values), not released from the data"}


def _returned_lines(summary: dict) -> list[str]:
    """The model card's line on which evaluated iterate the run returned (summary.json's checkpoint_returned,
    server/checkpoint_selection.py); none for a summary written before it existed."""
    r = summary.get("checkpoint_returned")
    if not r:
        return []
    if r["rule"] != "private-best":
        return [f"- Returned: the last iterate (iteration {r['iteration']}; checkpoint-select={r['rule']})"]
    return [f"- Returned: the iterate of iteration {r['iteration']} of {summary['iterations']}, chosen among "
            f"{r['candidates']} evaluations by the best noisy worst-class accuracy on the validation split "
            f"(checkpoint-select=private-best; noisy worst-class accuracy {r['noisy_worst_class_accuracy']:.4f}, "
            "biased upwards as the best of several noisy scores). Accounted: every evaluation is a charged "
            f"release (together epsilon {_fmt_eps(r['evaluations_epsilon'])} on their own, composed into the "
            "epsilon above) and the choice is post-processing of their noisy counts"]


def model_card(summary: dict, model: dict, plots: list[str], minority: tuple[list[int], str] | None = None) -> str:
    """MODEL_CARD.md text of a finished run from its summary.json dict and model.json dict; ``minority`` as
    ``minority_classes`` gives it. Every path in it is relative to the run folder (the card's own), so a copied
    or shared run folder keeps a correct card."""
    from .evaluate import worst_group_words

    per_class = summary["per_class_accuracy"]
    classes = model["classes"]
    private = summary["private"]
    seeded = not private and not math.isinf(_number(summary["epsilon_target"]))  # noise from the saved seed
    split = summary.get("eval_split", "test")
    lines = [f"# Model card: {summary['algorithm']} on {model.get('data', summary['dataset'])}", "",
             "Written by dpdro when the run finished. Every figure comes from the run's own files (summary.json, "
             "metrics.csv, model.json).", "",
             "## Model", "",
             f"- Architecture: `{model['factory'] or model.get('module_class')}` "
             + ("with every BatchNorm replaced by GroupNorm (model-fix=groupnorm) "
                if model.get("model_fix", "none") == "groupnorm" else "") +
             f"({model['parameters']} parameters, dtype {model['dtype']}), {model['num_classes']} classes: "
             f"{', '.join(classes)}",
             *_initial_lines(model),
             f"- Input: one record of shape {tuple(model['input_shape'])}; {model['input_scaling']}",
             "- Files: `model.pt` (state_dict), `model.json` (how to build the model and predict), "
             "`final_params.npy` (the same " + ("trainable " if _frozen(model) else "") + "weights as one flat "
             "vector)",
             "- Prediction: argmax of the logits" + (
                 f" minus {model['posthoc_tau']:g} log(class priors) (post-hoc logit adjustment; the priors are in "
                 f"model.json: {PRIOR_SOURCES.get(summary.get('class_prior'), summary.get('class_prior'))})"
                 if model.get("prediction_shift") is not None
                 else ""),
             "", "## Data and training", "",
             f"- Data set: {model.get('data', summary['dataset'])}; n = {summary['n']} training records over "
             f"{summary['num_clients']} client(s)",
             *_minority_lines(summary, classes, minority),
             f"- Algorithm: {summary['algorithm']}, {summary['iterations']} iterations, "
             + _dro_keys(summary) + f"seed {summary['seed']}, transport {summary['transport']}",
             "", "## Privacy", ""]
    if seeded:
        lines.append("- **NOT PRIVATE**: reproducible=true for testing: the noise and samples derive from the seed "
                     "saved in summary.json; the figures below hold only for the same mechanism with secret seeds.")
    if private or seeded:
        lines += [f"- (epsilon, delta) = ({_fmt_eps(summary['epsilon_spent'])}, {summary['delta']:.3g}) spent "
                  f"of the target epsilon {_fmt_eps(summary['epsilon_target'])}, {_unit_text(summary)}, accountant "
                  f"{summary['accountant']}",
                  f"- Noise mode: {summary['noise_mode']}. Trust model: {summary['trust_model']}"]
        trusted = noise_mode(summary["noise_mode"]).trusts_server
        if not trusted and summary.get("epsilon_against_server") is not None:
            lines.append(f"- Epsilon against the server itself: {_fmt_eps(summary['epsilon_against_server'])}")
        if summary.get("ddg"):
            d = summary["ddg"]
            bits = ", ".join(f"{m} {b}" for m, b in sorted(d["bits_per_coordinate"].items()))
            lines.append(f"- Distributed discrete Gaussian: bits per coordinate {bits or '-'}; modular wrap-around "
                         f"probability at most {d['wrap_probability']:g} per release; shares calibrated for "
                         f"{d['shares']} clients, shortfall policy '{d['shortfall_policy']}'; {d['accounting']}")
    else:
        lines.append("- **NOT PRIVATE**: epsilon = inf, no clipping and no noise.")
    search = summary.get("private_search")
    if search:  # the model was released by a private hyper-parameter search (simulations/private_tune.py)
        lines.append(f"- Released by a private hyper-parameter search ({search['theorem']}): epsilon_total = "
                     f"{_fmt_eps(search['epsilon_total'])} at delta {search['delta']:.3g} covers the whole search "
                     "(every trial's training and noisy score, and the choice of this model)")
    lines += _returned_lines(summary)
    lines += ["- Not accounted:"] + [f"  - {item}" for item in summary["not_accounted"]]
    lines += ["", f"## Results on the {split} split", "",
              f"- Accuracy {summary['test_accuracy']:.4f}, worst-class accuracy {summary['worst_class_accuracy']:.4f}"
              + worst_group_words(summary),
              *([f"- Evaluated on the nodes' held-out records (eval-data=nodes): figures from noisy per-class counts "
                 f"charged to the run's epsilon; standard errors: accuracy {summary['test_accuracy_se']:.4f}, "
                 f"worst-class accuracy {summary['worst_class_accuracy_se']:.4f}"]
                if "test_accuracy_se" in summary else []),
              *([f"- Still rising: {summary['worst_still_rising']}"] if summary.get("worst_still_rising") else []),
              "", "| class | accuracy |", "|---|---|"]
    lines += [f"| {c} | {'n/a' if a is None or (isinstance(a, float) and math.isnan(a)) else f'{a:.4f}'} |"
              for c, a in zip(classes, per_class, strict=True)]
    lines += ["", "## Plots", ""] + [f"![{Path(p).stem}]({p})" for p in plots]
    lines += ["", "## Use", ""] + use_section(summary["dataset"], model)
    return "\n".join(lines)


def _minority_lines(summary: dict, classes: list[str], minority: tuple[list[int], str] | None) -> list[str]:
    """The card's line naming the minority classes in training with their counts and where the counts come from
    (``minority_classes``), or saying why the run cannot name them without a release its epsilon does not cover;
    plus the group counts when the run released a group histogram."""
    counts = summary.get("class_counts")
    if minority is None:
        lines = ["- Minority classes in training: not known to this run: it released no class histogram (its "
                 "algorithm and keys need none), and counting the training records' classes would be a release "
                 "its epsilon does not cover"]
    elif not minority[0]:
        lines = [f"- Minority classes in training: none ({minority[1]})"]
    else:
        shown = counts if counts is not None else (
            [p * summary["n"] for p in summary["priors"]] if summary.get("class_prior") == "public" else None)
        named = ", ".join(f"{classes[k]}" + (f" ({shown[k]:.0f})" if shown is not None else "") for k in minority[0])
        lines = [f"- Minority classes in training: {named} ({minority[1]})"]
    if summary.get("group_counts") is not None:
        groups = ", ".join(f"group {g}: {c:.0f}" for g, c in enumerate(summary["group_counts"]))
        how = "released with noise, charged in the ledger" if summary.get("private") else "exact (not private)"
        lines.append(f"- Group counts in training ({how}): {groups}")
    return lines


def _frozen(model: dict) -> bool:
    """Whether the run froze some parameters (model.json's trainable_parameters below its parameters)."""
    return model.get("trainable_parameters", model["parameters"]) < model["parameters"]


def _initial_lines(model: dict) -> list[str]:
    """The card's lines on where training started (the init-weights file and its sha256) and what trained
    (config key trainable), from model.json; none for a run from the seed's initialisation with every parameter
    trained."""
    lines = []
    loaded = model.get("init_weights")
    if loaded:
        lines.append(f"- Initial weights: `{loaded['path']}` (sha256 {loaded['sha256']}), declared trained on "
                     "public data (no privacy cost; not from the private records)")
    if _frozen(model):
        lines.append(f"- Trainable: {model['trainable']} ({model['trainable_parameters']} of {model['parameters']} "
                     "parameters); the others frozen at their initial values, saved in model.pt")
    return lines


def use_section(dataset: str, model: dict) -> list[str]:
    """The card's commands that use the model, correct for how the run got its data: the dpdro commands for a
    data set that files hold (for user code by import path: with it importable), the Python API for records
    passed to ``dpdro.fit(data=...)`` (dataset 'python-data', which no file holds). They name the run folder as
    '.' and are run from it, so they stay right when the folder is copied or moved."""
    from ..common.data import PYTHON_DATA

    run_dir = "."
    module = "" if model.get("factory") else ", module=MyModel()"  # a module object: its class is rebuilt by you
    load = [f"model, spec = dpdro.load_model({run_dir!r}{module})   # nn.Module in eval mode, model.json"]
    if module:
        load.insert(0, f"# the run trained a module object ({model.get('module_class')}): pass an untrained one "
                       "of that architecture as module=")
    if dataset == PYTHON_DATA or module:
        k = model["num_classes"]
        why = "on records passed from Python (dpdro.fit(data=...))" if dataset == PYTHON_DATA else \
            "a module object passed to dpdro.fit"
        return [f"The run trained {why}; use it from Python, started in this folder:", "",
                "```python", "import dpdro", *load,
                f"test = dpdro.records(x_test, y_test, {k})   # your held-out records: float x, labels in [0, {k})",
                f"print(dpdro.evaluate({run_dir!r}, test{module}))   # accuracy, worst class, confusion matrix",
                f"p = dpdro.predict({run_dir!r}, test{module})   # p.predicted (N,), p.scores (N, {k})", "```", ""]
    lines = []
    if ":" in dataset:
        lines += [f"The data come from `{dataset}`: its module must be importable (PYTHONPATH) for these.", ""]
    return lines + ["Run these from this folder (the one that holds this card), with dpdro on your PATH (in a clone "
                    "set up by `make`: `source <clone>/.venv/bin/activate`):", "", "```",
                    f"dpdro predict --run {run_dir} --data test      # predictions_test.csv",
                    f"dpdro evaluate --run {run_dir} --data test     # accuracy, worst class, confusion matrix",
                    f"dpdro predict --run {run_dir} --data PATH      # new records (docs/how-to/use-the-model.md)",
                    "```", "", "```python", "import dpdro", *load, "```", ""]


def write_model_card(run_dir: Path, summary: dict, model: dict, plots: list[str],
                     minority: tuple[list[int], str] | None = None) -> None:
    """Atomically write ``run_dir``/MODEL_CARD.md (``model_card``)."""
    atomic_write_bytes(Path(run_dir) / MODEL_CARD, model_card(summary, model, plots, minority).encode())


def _dro_keys(summary: dict) -> str:
    """'psi P, lambda L, ' for an algorithm that reads them (its AlgorithmSpec), '' otherwise: a card should not
    list settings the run never used."""
    from ..common.algorithm_specs import ALGORITHM_SPECS

    keys = ALGORITHM_SPECS[summary["algorithm"]].keys if summary["algorithm"] in ALGORITHM_SPECS else ()
    return "".join(f"{k} {summary[k]}, " for k in ("psi", "lambda") if k in keys and k in summary)


def _unit_text(summary: dict) -> str:
    """The privacy unit in words, with the node-sampling rate (summary.json of an older run has neither: record)."""
    p = summary.get("node_sampling_rate", 1.0)
    sampled = f"; nodes Poisson-sampled at rate {p:g} per release" if p < 1 else ""
    if summary.get("privacy_unit", "record") == "node":
        return f"node-level (one node's whole data replaced with a null node, the number of nodes fixed{sampled})"
    return f"record-level (one record replaced with a null record, n fixed{sampled})"
