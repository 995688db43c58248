"""One-factor lever tables on a validation split: ``dpdro lab levers``.

    dpdro lab levers --config simulations/configs/tuned/cifar10-st-eps4-dp-sgd-la.toml \\
        --variant "momentum 0.9: momentum=0.9 lr-x=0.25" --variant "..." [--seeds 0 1] [--jobs 2] \\
        [--root runs/levers] [--docs DIR | --write-docs] [--name NAME]

Each variant is the configuration file with a few keys changed (a ``--variant`` is ``LABEL: KEY=VALUE ...``;
the file itself is always the first row, 'file'). Every variant is trained with every seed on the training split
minus its validation split (``validation-fraction`` of every class, the search's fraction; a data set with its own
validation split trains on the whole training split) and evaluated on the validation split only: the test split
is never touched, so a variant chosen from the table is chosen as the search chooses. Resumable: a run with a
summary.json of the same configuration (its fingerprint) is not trained again (``<root>/<name>/<label slug>-seed<s>``).

The table gives, per variant, the worst-class (worst-group) validation accuracy and the validation accuracy at the
file's post-hoc tau (mean +/- std over the seeds), and the same at the tau of ``TAU_GRID`` with the best mean
worst class ('best tau': chosen on the same validation split it is reported on, so an optimistic figure of
what a later private tau choice can reach; the column says so). The validation split of a long-tailed data set is
long-tailed too: its accuracy weighs the majority classes, unlike the balanced test split's.

Not privacy-accounted: a table of noiseless validation metrics of private training records (research, as the
non-private search).
"""

from __future__ import annotations

import csv
import io
import json
import re
import statistics
import tomllib
from dataclasses import dataclass
from pathlib import Path

from ..common.atomic import atomic_write_text
from ..common.config import Config, ConfigError

TAU_GRID = (0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 2.5, 3.0)


@dataclass(frozen=True)
class Variant:
    """A row of the table: ``label`` and the keys it changes (kebab-case key -> value as TOML would read it)."""

    label: str
    changes: dict


def parse_variant(text: str) -> Variant:
    """``'LABEL: KEY=VALUE KEY=VALUE'`` -> Variant (values parsed as TOML scalars, else kept as strings).
    Raises ConfigError naming the text when it has no label or a change is not KEY=VALUE."""
    label, sep, rest = text.partition(":")
    if not sep or not label.strip():
        raise ConfigError(f"--variant {text!r}: expected 'LABEL: KEY=VALUE ...'")
    changes = {}
    for item in rest.split():
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ConfigError(f"--variant {text!r}: {item!r} is not KEY=VALUE")
        try:
            changes[key] = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            changes[key] = value
    return Variant(label.strip(), changes)


def slug(label: str) -> str:
    """A folder name for a variant label: lower case, runs of other characters as '-'."""
    return re.sub(r"[^a-z0-9.]+", "-", label.lower()).strip("-") or "variant"


def variant_configs(base: dict, variants: list[Variant], seeds: list[int],
                    root: Path) -> list[tuple[Variant, int, Config]]:
    """(variant, seed, validated Config) of every run, trained on the training split minus the validation split and
    evaluated on the validation split; ``base`` the configuration file's keys. Raises ConfigError for any bad key
    of any variant, before any run."""
    from .posthoc_tau import validation_fraction

    out = []
    for v in variants:
        keys = {**base, **v.changes}
        for seed in seeds:
            run = root / f"{slug(v.label)}-seed{seed}"
            cfg = Config.from_mapping({**keys, "validation-fraction": validation_fraction(keys["dataset"]),
                                       "eval-split": "validation", "seed": seed, "out-dir": str(run),
                                       "overwrite": True})
            out.append((v, seed, cfg))
    return out


def current_runs(cfgs: list[Config]) -> set[str]:
    """The out-dirs of the runs of ``cfgs`` that finished under their own configuration: a summary.json, and a
    config.json of the same fingerprint (``sweep.changed_runs``), so a run left by an earlier version of the
    configuration file is trained again, not tabulated under the new one."""
    from .sweep import changed_runs

    stale = {run for run, _, _ in changed_runs(cfgs)}
    return {cfg.out_dir for cfg in cfgs
            if (Path(cfg.out_dir) / "summary.json").is_file() and str(Path(cfg.out_dir)) not in stale}


def planned_runs(config: Path, variants: list[Variant], seeds: list[int],
                 root: Path) -> tuple[dict, list[Variant], list[tuple[Variant, int, Config]]]:
    """The configuration file's keys, the table's rows (the file first, then ``variants``) and every run of them
    (``variant_configs``). Raises ConfigError when two rows' labels name the same folder (``slug``; 'file' is
    the file's own row), which would make two runs write one run directory."""
    base = tomllib.loads(config.read_text())
    rows = [Variant("file", {}), *variants]
    seen: dict[str, str] = {}
    for row in rows:
        folder = slug(row.label)
        if folder in seen:
            raise ConfigError(f"--variant {row.label!r}: its runs would share the folder {folder!r} with the row "
                              f"{seen[folder]!r}; give it another label (the file's own row, 'file', is always run)")
        seen[folder] = row.label
    return base, rows, variant_configs(base, rows, seeds, root)


def run_levers(config: Path, variants: list[Variant], seeds: list[int], root: Path, jobs: int) -> None:
    """Train every (variant, seed) run without a finished run of its configuration (``current_runs``), ``jobs`` at
    a time."""
    from .runner import run_many

    _, _, planned = planned_runs(config, variants, seeds, root)
    current = current_runs([cfg for _, _, cfg in planned])
    todo = [cfg for _, _, cfg in planned if cfg.out_dir not in current]
    for out_dir, missing in run_many(todo, jobs, "levers"):
        if missing:
            raise ConfigError(f"{out_dir}: {missing}")


def _mean_std(values: list[float]) -> str:
    if not values:
        return "not run"
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.fmean(values):.3f} +/- {statistics.stdev(values):.3f}"


def lever_rows(config: Path, variants: list[Variant], seeds: list[int], root: Path) -> list[dict]:
    """One dict per variant: label, changes, n (finished seeds), worst and accuracy at the file's tau (lists over
    seeds), and the best tau of ``TAU_GRID`` by mean worst with its mean worst and accuracy (``_worst``)."""
    from .posthoc_tau import scan

    base, table, planned = planned_runs(config, variants, seeds, root)
    current = current_runs([cfg for _, _, cfg in planned])
    rows = []
    for v in table:
        done = [Path(cfg.out_dir) for w, _, cfg in planned if w is v and cfg.out_dir in current]
        sums = [json.loads((r / "summary.json").read_text()) for r in done]
        row = {"label": v.label, "changes": v.changes, "n": len(done),
               "worst": [_worst(s) for s in sums], "accuracy": [s["test_accuracy"] for s in sums]}
        if done and {**base, **v.changes}.get("algorithm") != "dp-sgda":
            terms = scan(done, list(TAU_GRID))
            best = max(range(len(TAU_GRID)), key=lambda i: (terms[i][0], terms[i][2]))
            row.update(best_tau=TAU_GRID[best], best_worst=terms[best][0], best_accuracy=terms[best][2])
        rows.append(row)
    return rows


def _worst(summary: dict) -> float:
    """The search's worst of a run's summary.json: its worst group's accuracy when it has groups (CelebA's,
    ``server.objective.evaluation_terms``), else its worst class's."""
    from ..server.objective import evaluation_terms

    if summary.get("per_group_accuracy") is not None:
        return evaluation_terms(summary)[0]
    return summary["worst_class_accuracy"]


def check_against(labels, against) -> None:
    """Raises ConfigError naming the first label of ``against`` (``--against``) that no row of ``labels`` has."""
    for base in against:
        if base not in labels:
            raise ConfigError(f"--against {base!r}: no row has that label; the rows are {sorted(labels)}")


def against_file(rows: list[dict], base: str = "file") -> list[str]:
    """Each other variant's difference from the row labelled ``base`` (default the file's own row) in mean worst
    class and mean accuracy (at the file's tau), with the report's decision rule (``tables.verdict``: 'better' /
    'worse' only where the Welch 95 % interval of the difference excludes 0). Raises ConfigError when no row has
    that label."""
    from .tables import verdict

    by_label = {r["label"]: r for r in rows}
    check_against(by_label, [base])
    ref, out = by_label[base], []
    name = "the file" if base == "file" else base
    for r in rows:
        if r is not ref and r["worst"] and ref["worst"]:
            dw = statistics.mean(r["worst"]) - statistics.mean(ref["worst"])
            da = statistics.mean(r["accuracy"]) - statistics.mean(ref["accuracy"])
            out.append(f"- {r['label']} against {name}: worst {dw:+.3f} ({verdict(r['worst'], ref['worst'])}), "
                       f"accuracy {da:+.3f} ({verdict(r['accuracy'], ref['accuracy'])}).")
    return [f"At the file's tau, each variant against {name} (n seeds each):", "", *out] if out else []


def write_levers(config: Path, variants: list[Variant], seeds: list[int], root: Path, docs: Path, name: str,
                 against: tuple[str, ...] = ()) -> Path:
    """``<docs>/levers-<name>.md`` and ``.csv`` from the finished runs; returns the markdown path. Every variant is
    compared with the file's row, and also with each row labelled in ``against`` (``--against``: e.g. a variant at
    another epsilon that the rows beside it change one key of)."""
    rows = lever_rows(config, variants, seeds, root)
    check_against({r["label"] for r in rows}, against)  # an unknown label fails before anything is written
    lines = [f"# Levers: {name}", "",
             f"Generated by `dpdro lab levers --config {config}` (seeds {' '.join(map(str, seeds))}). Every row is "
             "trained on the training split minus its validation split and evaluated on the validation split "
             "(simulations/levers.py); the test split is not used. 'best tau' is chosen on the same split it is "
             "reported on (optimistic). Not privacy-accounted (noiseless validation metrics).", "",
             "| variant | keys changed | n | worst (file's tau) | accuracy (file's tau) | best tau | worst at best tau "
             "| accuracy at best tau |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        keys = " ".join(f"{k}={v}" for k, v in r["changes"].items()) or "(the file)"
        best = (f"{r['best_tau']:g} | {r['best_worst']:.3f} | {r['best_accuracy']:.3f}" if "best_tau" in r
                else "- | - | -")
        lines.append(f"| {r['label']} | {keys} | {r['n']} | {_mean_std(r['worst'])} | {_mean_std(r['accuracy'])} "
                     f"| {best} |")
    lines += ["", *against_file(rows)]
    for base in against:
        lines += ["", *against_file(rows, base)]
    docs.mkdir(parents=True, exist_ok=True)
    md = docs / f"levers-{name}.md"
    atomic_write_text(md, "\n".join(lines) + "\n")
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=["label", "changes", "n", "worst", "accuracy", "best_tau", "best_worst",
                                             "best_accuracy"], extrasaction="ignore")
    writer.writeheader()
    for r in rows:
        writer.writerow({**r, "changes": " ".join(f"{k}={v}" for k, v in r["changes"].items()),
                         "worst": " ".join(f"{w:.4f}" for w in r["worst"]),
                         "accuracy": " ".join(f"{a:.4f}" for a in r["accuracy"])})
    atomic_write_text(docs / f"levers-{name}.csv", buf.getvalue())
    return md

