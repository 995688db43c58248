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


def plot_training_curves(rows: list[dict], path: Path, title: str) -> None:
    """Two panels against iteration from metric rows (each with iteration, test_accuracy, worst_class_accuracy,
    epsilon_spent, optionally worst_group_accuracy): accuracies, and epsilon spent (a note instead of a curve
    when epsilon is inf: not private). Written atomically as PNG to ``path``."""
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
    if all(math.isfinite(e) for e in spent):
        eps.plot(it, spent, marker="o", color="tab:red")
        eps.set(ylabel="epsilon spent")
    else:
        eps.text(0.5, 0.5, "epsilon = inf: not private", ha="center", va="center", transform=eps.transAxes)
    eps.set(xlabel="iteration", title="privacy spent")
    eps.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    _save(fig, path)


def plot_per_class(per_class: list[float], classes: list[str], path: Path, title: str) -> None:
    """Bar chart of per-class accuracy (K,) (NaN, a class absent from the evaluation split, drawn as an empty
    slot), the worst class in red. Written atomically as PNG to ``path``."""
    from matplotlib.figure import Figure

    values = np.asarray(per_class, dtype=np.float64)
    fig = Figure(figsize=(max(4.0, 0.45 * len(values) + 2), 3.4))
    ax = fig.subplots()
    worst = int(np.nanargmin(values)) if np.isfinite(values).any() else -1
    colors = ["tab:red" if k == worst else "tab:blue" for k in range(len(values))]
    ax.bar(range(len(values)), np.nan_to_num(values, nan=0.0), color=colors)
    wide = len(values) > 12
    ax.set_xticks(range(len(values)), classes, rotation=45 if wide else 0, ha="right" if wide else "center",
                  fontsize=8)
    if worst >= 0:  # a worst class at 0 has no visible bar: name it
        title += f"\nworst: class {classes[worst]} ({values[worst]:.3f})"
    ax.set(ylim=(0, 1.02), xlabel="class", ylabel="accuracy", title=title)
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


def write_run_plots(run_dir: Path, rows: list[dict], summary: dict, classes: list[str]) -> list[str]:
    """Training curves and per-class accuracy of a finished run into ``run_dir``/plots/; returns the paths
    written, relative to ``run_dir``."""
    name = f"{summary['algorithm']} on {summary['dataset']}"
    plot_training_curves(rows, Path(run_dir) / TRAINING_CURVES, name)
    plot_per_class(summary["per_class_accuracy"], classes, Path(run_dir) / PER_CLASS,
                   f"per-class accuracy ({summary.get('eval_split', 'test')} split), {name}")
    return [TRAINING_CURVES, PER_CLASS]


def _fmt_eps(v) -> str:
    v = _number(v)
    return "inf" if math.isinf(v) else f"{v:.4g}"


# How the class priors of a run were obtained (summary.json class_prior), as the model card says it.
PRIOR_SOURCES = {"private": "released from the training records with noise and charged in the ledger",
                 "public": "declared public by the user (class-prior-values), not released from the data"}


def model_card(summary: dict, model: dict, plots: list[str], run_dir: str) -> str:
    """MODEL_CARD.md text of a finished run from its summary.json dict and model.json dict."""
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
             f"- Algorithm: {summary['algorithm']}, {summary['iterations']} iterations, "
             + _dro_keys(summary) + f"seed {summary['seed']}, transport {summary['transport']}",
             "", "## Privacy", ""]
    if seeded:
        lines.append("- **NOT PRIVATE**: reproducible=true for testing: the noise and samples derive from the seed "
                     "saved in summary.json; the figures below hold only for the same mechanism with secret seeds.")
    if private or seeded:
        lines += [f"- (epsilon, delta) = ({_fmt_eps(summary['epsilon_spent'])}, {summary['delta']:.3g}) spent "
                  f"of the target epsilon {_fmt_eps(summary['epsilon_target'])}, record-level (one record replaced "
                  f"with a null record, n fixed), accountant {summary['accountant']}",
                  f"- Noise mode: {summary['noise_mode']}. Trust model: {summary['trust_model']}"]
        if summary["noise_mode"] != "central" and summary.get("epsilon_against_server") is not None:
            lines.append(f"- Epsilon against the server itself: {_fmt_eps(summary['epsilon_against_server'])}")
    else:
        lines.append("- **NOT PRIVATE**: epsilon = inf, no clipping and no noise.")
    lines += ["- Not accounted:"] + [f"  - {item}" for item in summary["not_accounted"]]
    lines += ["", f"## Results on the {split} split", "",
              f"- Accuracy {summary['test_accuracy']:.4f}, worst-class accuracy {summary['worst_class_accuracy']:.4f}"
              + (f", worst-group accuracy {summary['worst_group_accuracy']:.4f}" if "worst_group_accuracy" in summary
                 else ""), "", "| class | accuracy |", "|---|---|"]
    lines += [f"| {c} | {'n/a' if a is None or (isinstance(a, float) and math.isnan(a)) else f'{a:.4f}'} |"
              for c, a in zip(classes, per_class, strict=True)]
    lines += ["", "## Plots", ""] + [f"![{Path(p).stem}]({p})" for p in plots]
    lines += ["", "## Use", ""] + use_section(summary["dataset"], model, str(run_dir))
    return "\n".join(lines)


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


def use_section(dataset: str, model: dict, run_dir: str) -> list[str]:
    """The card's commands that use the model, correct for how the run got its data: the dpdro commands for a
    data set that files hold (for user code by import path: with it importable), the Python API for records
    passed to ``dpdro.fit(data=...)`` (dataset 'python-data', which no file holds)."""
    from ..common.data import PYTHON_DATA

    module = "" if model.get("factory") else ", module=MyModel()"  # a module object: its class is rebuilt by you
    load = [f"model, spec = dpdro.load_model({run_dir!r}{module})   # nn.Module in eval mode, model.json"]
    if module:
        load.insert(0, f"# the run trained a module object ({model.get('module_class')}): pass an untrained one "
                       "of that architecture as module=")
    if dataset == PYTHON_DATA or module:
        k = model["num_classes"]
        why = "on records passed from Python (dpdro.fit(data=...))" if dataset == PYTHON_DATA else \
            "a module object passed to dpdro.fit"
        return [f"The run trained {why}; use it from Python:", "",
                "```python", "import dpdro", *load,
                f"test = dpdro.records(x_test, y_test, {k})   # your held-out records: float x, labels in [0, {k})",
                f"print(dpdro.evaluate({run_dir!r}, test{module}))   # accuracy, worst class, confusion matrix",
                f"p = dpdro.predict({run_dir!r}, test{module})   # p.predicted (N,), p.scores (N, {k})", "```", ""]
    lines = []
    if ":" in dataset:
        lines += [f"The data come from `{dataset}`: its module must be importable (PYTHONPATH) for these.", ""]
    return lines + ["```",
                    f"dpdro predict --run {run_dir} --data test      # predictions_test.csv",
                    f"dpdro evaluate --run {run_dir} --data test     # accuracy, worst class, confusion matrix",
                    f"dpdro predict --run {run_dir} --data PATH      # new records (README: using the trained model)",
                    "```", "", "```python", "import dpdro", *load, "```", ""]


def write_model_card(run_dir: Path, summary: dict, model: dict, plots: list[str]) -> None:
    """Atomically write ``run_dir``/MODEL_CARD.md (``model_card``)."""
    atomic_write_bytes(Path(run_dir) / MODEL_CARD, model_card(summary, model, plots, str(run_dir)).encode())


def _dro_keys(summary: dict) -> str:
    """'psi P, lambda L, ' for an algorithm that reads them (its AlgorithmSpec), '' otherwise: a card should not
    list settings the run never used."""
    from ..common.algorithm_specs import ALGORITHM_SPECS

    keys = ALGORITHM_SPECS[summary["algorithm"]].keys if summary["algorithm"] in ALGORITHM_SPECS else ()
    return "".join(f"{k} {summary[k]}, " for k in ("psi", "lambda") if k in keys and k in summary)
