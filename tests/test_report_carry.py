"""Results that outlive their run directories (simulations/sweep.py): each results CSV row carries the
fingerprint of its run's configuration, and a report on a machine without those run directories keeps exactly
the rows whose configuration is still the planned one. Also: a tuned sweep runs the config files it is given."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from dpdro.common.config import FIELD_BY_KEY, Config, ConfigError
from dpdro.simulations import sweep
from dpdro.simulations.tune import write_toml

PROFILE = sweep.Profile("carry", ("mnist-st",), ("dp-sgd", "dp-sgd-la"), (4.0,), (0, 1),
                        base={"eval-every": 100}, tuned_at=4.0)


@pytest.fixture
def profile(monkeypatch):
    monkeypatch.setitem(sweep.PROFILES, "carry", PROFILE)
    return PROFILE


def _tuned(configs: Path, la_lr: float = 6.0) -> Path:
    tuned = configs / "tuned"
    write_toml(tuned / "mnist-st-eps4-dp-sgd.toml", {"algorithm": "dp-sgd", "lr-x": 4.0})
    write_toml(tuned / "mnist-st-eps4-dp-sgd-la.toml", {"algorithm": "dp-sgd-la", "lr-x": la_lr})
    return tuned


def _finish(cfg: Config, accuracy: float) -> None:
    """A finished run directory of ``cfg`` as the engine leaves it (config.json, summary.json)."""
    out = Path(cfg.out_dir)
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(cfg.to_dict()))
    (out / "metrics.csv").write_text("iteration,test_accuracy,worst_class_accuracy\n0,0.1,0.0\n"
                                     f"{cfg.iterations},{accuracy},{accuracy / 2}\n")
    (out / "summary.json").write_text(json.dumps(
        {"dataset": cfg.dataset, "algorithm": cfg.algorithm, "epsilon_target": cfg.epsilon, "seed": cfg.seed,
         "test_accuracy": accuracy, "worst_class_accuracy": accuracy / 2, "epsilon_spent": 3.99,
         "wall_seconds": 10.0}))


def _rows(docs: Path) -> dict[tuple, dict]:
    with open(docs / "results-carry.csv", newline="") as f:
        return {(r["algorithm"], int(r["seed"])): r for r in csv.DictReader(f)}


def test_fingerprint_ignores_runtime_keys_and_paths_but_not_what_a_run_computes():
    base = Config.from_mapping({"algorithm": "dp-sgd", "lr-x": 4.0, "seed": 0})
    same = base.with_updates({"out-dir": "elsewhere", "threads": 2, "eval-every": 7, "data-root": "/data"})
    assert sweep.config_fingerprint(base) == sweep.config_fingerprint(same)
    for change in ({"lr-x": 4.5}, {"seed": 1}, {"epsilon": 8.0}, {"delta": 1e-6}):
        assert sweep.config_fingerprint(base) != sweep.config_fingerprint(base.with_updates(change)), change
    # 'auto' is compared by what it means: tau auto of dp-sgd-la is 1; delta auto under another rule is another run
    la = Config.from_mapping({"algorithm": "dp-sgd-la"})
    assert sweep.config_fingerprint(la) == sweep.config_fingerprint(la.with_updates({"logit-adjust-tau": 1.0}))
    assert sweep.config_fingerprint(la) != sweep.config_fingerprint(la.with_updates({"logit-adjust-tau": 0.5}))
    assert sweep.config_fingerprint(base) != sweep.config_fingerprint(base, legacy=True)


def test_rows_of_an_unchanged_configuration_survive_the_loss_of_their_run_directories(tmp_path, profile):
    root, docs, configs = tmp_path / "runs", tmp_path / "docs", tmp_path / "configs"
    planned = sweep.plan_runs(profile, root, tuned_folder=_tuned(configs))
    for i, cfg in enumerate(planned):
        _finish(cfg, 0.5 + 0.1 * i)
    sweep.write_report(root, "carry", docs, configs)
    first = _rows(docs)
    assert len(first) == 4 and {r["source"] for r in first.values()} == {"run"}
    assert all(r["config_sha"] == sweep.config_fingerprint(c) for r, c in zip(first.values(), planned, strict=True))
    text = (docs / "RESULTS-carry.md").read_text()
    curves = (docs / "curves-carry.csv").read_text()
    assert len(curves.splitlines()) == 1 + 2 * 2  # seed 0 of both methods, two evaluations each
    png = docs / "plots" / "carry_mnist-st_training_curves.png"
    assert "carry_mnist-st_training_curves" in text and png.stat().st_size > 1000
    png.unlink()

    # the machine is wiped: no run directory left, the same rows and the same tables come back from the CSV
    for cfg in planned:
        for f in Path(cfg.out_dir).iterdir():
            f.unlink()
        Path(cfg.out_dir).rmdir()
    sweep.write_report(root, "carry", docs, configs)
    carried = _rows(docs)
    assert {r["source"] for r in carried.values()} == {"carried"}
    assert {k: r["test_accuracy"] for k, r in carried.items()} == {k: r["test_accuracy"] for k, r in first.items()}
    again = (docs / "RESULTS-carry.md").read_text()
    assert "4 of the 4 runs are carried from the previous results CSV" in again and "carried" not in text
    assert again.replace(sweep.carried_sentence(list(carried.values())), "") == text  # the same tables
    assert (docs / "curves-carry.csv").read_text() == curves and png.stat().st_size > 1000  # and curves

    # a run directory here replaces the carried row of its cell
    _finish(planned[0], 0.95)
    sweep.write_report(root, "carry", docs, configs)
    rows = _rows(docs)
    assert rows[("dp-sgd", 0)]["source"] == "run" and float(rows[("dp-sgd", 0)]["test_accuracy"]) == 0.95

    # dp-sgd-la tuned again: its old rows are another experiment and drop out; dp-sgd's stay
    _tuned(configs, la_lr=8.0)
    sweep.write_report(root, "carry", docs, configs)
    assert sorted(_rows(docs)) == [("dp-sgd", 0), ("dp-sgd", 1)]
    assert "dp-sgd-la" not in (docs / "curves-carry.csv").read_text()

    # --no-carry: only what is on this machine
    sweep.write_report(root, "carry", docs, configs, carry=False)
    assert sorted(_rows(docs)) == [("dp-sgd", 0)]


def test_a_row_without_fingerprint_is_not_carried(tmp_path, profile):
    root, docs, configs = tmp_path / "runs", tmp_path / "docs", tmp_path / "configs"
    sweep.plan_runs(profile, root, tuned_folder=_tuned(configs))
    docs.mkdir()
    (docs / "results-carry.csv").write_text(
        "dataset,algorithm,epsilon_target,seed,test_accuracy,worst_accuracy,epsilon_spent,wall_seconds,transport\n"
        "mnist-st,dp-sgd,4.0,0,0.9,0.5,3.99,10.0,local\n")
    sweep.write_report(root, "carry", docs, configs)
    assert _rows(docs) == {}


def test_tuned_sweep_runs_the_config_files_it_is_given(tmp_path, profile, monkeypatch):
    """`dpdro lab sweep --configs F` ran the checkout's tuned files instead of F's (found running a transfer)."""
    from dpdro.simulations import runner

    started = []
    monkeypatch.setattr(sweep, "data_missing", lambda cfg: None)
    monkeypatch.setattr(runner, "run_many", lambda cfgs, jobs, label: started.extend(cfgs) or cfgs)
    tuned = _tuned(tmp_path / "configs", la_lr=7.5)
    counts = sweep.run_sweep("carry", tmp_path / "runs", tuned_folder=tuned)
    assert counts["done"] == 4
    assert sorted((c.algorithm, c.lr_x) for c in started) == [("dp-sgd", 4.0)] * 2 + [("dp-sgd-la", 7.5)] * 2


def test_runs_under_the_old_delta_rule_are_carried_marked_until_replaced(tmp_path, profile):
    root, docs, configs = tmp_path / "runs", tmp_path / "docs", tmp_path / "configs"
    planned = sweep.plan_runs(profile, root, tuned_folder=_tuned(configs))
    docs.mkdir()
    header = ("dataset,algorithm,epsilon_target,seed,test_accuracy,worst_accuracy,epsilon_spent,wall_seconds,delta,"
              "config_sha\n")
    lines = [f"mnist-st,{c.algorithm},4.0,{c.seed},0.8,0.4,3.99,10.0,n^-1.1,"
             f"{sweep.config_fingerprint(c, legacy=True)}\n" for c in planned]
    (docs / "results-carry.csv").write_text(header + "".join(lines))
    text = sweep.write_report(root, "carry", docs, configs).read_text()
    assert len(_rows(docs)) == 4 and "0.800 +/- 0.000†" in text
    _finish(planned[0], 0.9)  # a run under today's rule replaces its cell's old row
    sweep.write_report(root, "carry", docs, configs)
    rows = _rows(docs)
    assert rows[("dp-sgd", 0)]["source"] == "run" and rows[("dp-sgd", 1)]["delta"] == "n^-1.1"
    # a row claiming another configuration under the old rule is not carried
    (docs / "results-carry.csv").write_text(header + lines[1][:-2] + "x\n")  # the last digit of its sha changed
    sweep.write_report(root, "carry", docs, configs)
    assert sorted(_rows(docs)) == [("dp-sgd", 0)]


def _figure_rows(dataset, method, eps, figures):
    return [{"dataset": dataset, "algorithm": method, "epsilon_target": eps, "seed": i, "test_accuracy": a,
             "worst_accuracy": w, "delta": "1/(10 n)"} for i, (a, w) in enumerate(figures)]


def test_the_paper_methods_are_judged_against_the_best_other_method_and_their_goal():
    """RESULTS.md's issue-22 lines: the best paper method (by mean worst) against the best of every other method,
    DP-SGDA included, and the goal figure with its gap; a method missing from a cell is left out."""
    from collections import defaultdict

    from dpdro.simulations.tables import paper_goal_lines, paper_lines

    rows = (_figure_rows("mnist-st", "dp-double-spider", 4.0, [(0.92, 0.80), (0.92, 0.78)])
            + _figure_rows("mnist-st", "recursive-spider", 4.0, [(0.95, 0.60), (0.93, 0.70)])
            + _figure_rows("mnist-st", "dp-sgda", 4.0, [(0.86, 0.82), (0.87, 0.81)])
            + _figure_rows("mnist-st", "dp-sgd-la", 4.0, [(0.90, 0.70), (0.90, 0.70)])
            + _figure_rows("mnist-st", "dp-sgd-la", 1.0, [(0.60, 0.10)]))
    groups = defaultdict(list)
    for r in rows:
        groups[(r["dataset"], r["algorithm"], r["epsilon_target"])].append(r)
    lines = paper_lines(groups, "mnist-st", (1.0, 4.0))
    assert len(lines) == 1  # epsilon 1 has no paper method
    assert "best paper method **dp-double-spider** (worst 0.790 +/- 0.014" in lines[0]
    assert "best other method **dp-sgda** (worst 0.815 +/- 0.007" in lines[0]
    # Welch's 95 % interval of -0.025 with two seeds a side is wide (t with ~1.6 degrees of freedom): no decision
    assert "worst -0.025 (no clear difference, 95% interval [" in lines[0]
    assert "accuracy +0.055" in lines[0]
    (goal,) = paper_goal_lines(groups)
    assert "**dp-double-spider** reaches worst 0.790" in goal
    assert "goal **not reached** (worst -0.060 from the goal)" in goal
    assert "against dp-sgda (worst 0.815): -0.025" in goal
    groups[("mnist-st", "recursive-spider", 4.0)] = _figure_rows("mnist-st", "recursive-spider", 4.0, [(0.9, 0.86)])
    assert "**recursive-spider** reaches worst 0.860" in paper_goal_lines(groups)[0]
    assert "one seed, no interval: goal **not reached**" in paper_goal_lines(groups)[0]  # the mean alone is not enough
    tight = [(0.9, w) for w in (0.86, 0.87, 0.86, 0.85, 0.86)]  # sd 0.00707: 0.86 +/- 2.776 sd / sqrt(5)
    groups[("mnist-st", "recursive-spider", 4.0)] = _figure_rows("mnist-st", "recursive-spider", 4.0, tight)
    assert "interval of its mean worst class [0.851, 0.869]: goal **reached**" in paper_goal_lines(groups)[0]
    wide = [(0.9, w) for w in (0.95, 0.75, 0.95, 0.75, 0.90)]  # mean 0.86, lower end below 0.82
    groups[("mnist-st", "recursive-spider", 4.0)] = _figure_rows("mnist-st", "recursive-spider", 4.0, wide)
    assert "goal **not reached**" in paper_goal_lines(groups)[0]


def test_difference_interval_is_welchs_and_decides_only_when_it_excludes_zero():
    import math

    from dpdro.simulations.tables import difference_interval, verdict

    a, b = [0.80, 0.82, 0.84], [0.70, 0.71, 0.75]
    ma, mb = sum(a) / 3, sum(b) / 3
    va = sum((x - ma) ** 2 for x in a) / 2 / 3
    vb = sum((x - mb) ** 2 for x in b) / 2 / 3
    df = (va + vb) ** 2 / (va**2 / 2 + vb**2 / 2)  # Welch-Satterthwaite
    from scipy.stats import t

    half = t.ppf(0.975, df) * math.sqrt(va + vb)
    lo, hi = difference_interval(a, b)
    assert lo == pytest.approx(ma - mb - half) and hi == pytest.approx(ma - mb + half)
    assert verdict(a, b).startswith("better") and verdict(b, a).startswith("worse")
    assert verdict([0.8, 0.7], [0.75, 0.76]).startswith("no clear difference")
    assert verdict([0.8], [0.7, 0.6]) == "too few seeds for an interval"
    assert difference_interval([0.5, 0.5], [0.4, 0.4]) == pytest.approx((0.1, 0.1))


def test_a_finished_run_of_an_older_configuration_is_neither_skipped_nor_reported(tmp_path, profile, monkeypatch):
    """A method tuned again after its runs finished: the sweep skipped the finished directories (summary.json
    exists) and the report showed the old experiment under the new configuration's name."""
    from dpdro.simulations import runner

    root, docs, configs = tmp_path / "runs", tmp_path / "docs", tmp_path / "configs"
    planned = sweep.plan_runs(profile, root, tuned_folder=_tuned(configs))
    for cfg in planned:
        _finish(cfg, 0.8)
    _tuned(configs, la_lr=7.5)  # dp-sgd-la tuned again
    assert sorted(Path(d).name for d, _, _ in sweep.changed_runs(
        sweep.plan_runs(profile, root, tuned_folder=configs / "tuned"))) == ["seed0", "seed1"]
    started = []
    monkeypatch.setattr(sweep, "data_missing", lambda cfg: None)
    monkeypatch.setattr(runner, "run_many", lambda cfgs, jobs, label: started.extend(cfgs) or cfgs)
    with pytest.raises(ConfigError, match=r"2 finished run directories were made with another configuration"):
        sweep.run_sweep("carry", root, tuned_folder=configs / "tuned")
    assert started == []  # refused before any work
    sweep.write_report(root, "carry", docs, configs)
    assert sorted(_rows(docs)) == [("dp-sgd", 0), ("dp-sgd", 1)]
    for d, _, _ in sweep.changed_runs(sweep.plan_runs(profile, root, tuned_folder=configs / "tuned")):
        Path(d).rename(d + ".old")  # what the error tells the user to do
    assert sweep.run_sweep("carry", root, tuned_folder=configs / "tuned")["done"] == 2
    assert sorted((c.algorithm, c.lr_x) for c in started) == [("dp-sgd-la", 7.5)] * 2


REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("published, configs, at_least", [
    ("docs/research/results.csv", "simulations/configs/tuned", 100),
    ("docs/research/scatter/results.csv", "simulations/configs/scatter/tuned", 30)])
def test_every_published_result_keeps_the_fingerprint_of_its_checked_in_configuration(tmp_path, published, configs,
                                                                                       at_least):
    """A published results.csv is only as good as its fingerprints: every row must be carried by a report on a
    machine without run directories (here: none at all), i.e. its config_sha is the fingerprint of what the
    checked-in tuned files (the main table's, or the scattering-feature table's) plan for its cell. Adding a
    configuration key without KEYS_ADDED_LATER, or changing a tuned file without new runs, breaks this."""
    with open(REPO / published, newline="") as f:
        cells = {sweep._cell(r) for r in csv.DictReader(f)}
    planned = sweep.plan_runs(sweep.PROFILES["tuned"], tmp_path, tuned_folder=REPO / configs)
    carried = {sweep._cell(r) for r in sweep.carried_rows(REPO / published, planned, [])}
    assert len(cells) >= at_least and carried == cells, sorted(cells - carried)[:5]


def test_every_data_set_with_tuned_files_has_published_rows():
    """A data set whose tuned files are checked in has rows in docs/research/results.csv at the epsilon it was
    tuned at (made by the sweep: source 'run' or 'carried', never another), so no data set drops out of the
    tables silently when a report does not carry its rows."""
    from dpdro.simulations.tuned import TUNED_CONFIGS

    tuned = {p.name.split("-eps")[0] for p in TUNED_CONFIGS.glob("*-eps4-*.toml")}
    with open(Path(__file__).resolve().parent.parent / "docs" / "research" / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    published = {r["dataset"] for r in rows if float(r["epsilon_target"]) == 4.0}
    assert {"mnist-st", "cifar10-st"} <= tuned and tuned <= published, sorted(tuned - published)
    assert {r["source"] for r in rows} <= {"run", "carried"}


# A value other than the old behaviour for each key added later without a list of choices.
OTHER_VALUES = {"init-weights": "public.pt", "trainable": "head", "eval-data": "nodes", "eval-epsilon": 0.5,
                "eval-noise-multiplier": 2.0, "x-storm-a": 0.5, "clip-diff-quantile": 0.9, "clip-diff-quantile-lr": 0.5,
                "clip-diff-quantile-noise-ratio": 2.0, "node-sampling-rate": 0.5, "momentum": 0.9, "ema-decay": 0.9,
                "ddg-bits": 20, "ddg-wrap-probability": 1e-6, "local-epochs": 1, "local-lr": 0.1, "local-batch": 8,
                "feature-norm-clip": 2.0, "feature-norm-noise-multiplier": 4.0, "num-sites": 2}
# Keys whose other value needs another key changed with it (features=scatternet needs a scatter model); the
# fingerprint is compared against the configuration with those companions alone where it is valid without the key.
WITH = {"features": {"model": "scatter-linear"}, "privacy-unit": {"num-clients": 10},
        "local-epochs": {"privacy-unit": "node", "num-clients": 10, "q": 1},
        "feature-norm": {"features": "scatternet", "model": "scatter-linear"},
        "checkpoint-select": {"eval-split": "validation", "validation-fraction": 0.1}}


def test_a_key_added_later_counts_only_away_from_its_old_behaviour():
    base = Config.from_mapping({"algorithm": "dp-double-spider"})
    for key, before in sweep.KEYS_ADDED_LATER.items():
        assert base.to_dict()[key] == before  # the default is the old behaviour
        other = next(v for v in FIELD_BY_KEY[key].choices if v != before) if FIELD_BY_KEY[key].choices else \
            OTHER_VALUES.get(key, True)
        companions = base
        if key in WITH:
            try:
                companions = base.with_updates(WITH[key])  # where the companions are valid without the key
            except ConfigError:
                pass
        assert sweep.config_fingerprint(companions) != sweep.config_fingerprint(
            companions.with_updates({key: other, **WITH.get(key, {})}))


def test_a_statement_key_never_changes_the_fingerprint():
    """chosen-on-private-data changes only what a run states (its summary's not_accounted), not what it computes:
    marking the shipped tuned files with it keeps every published row carried."""
    base = Config.from_mapping({"algorithm": "dp-sgd-la"})
    marked = base.with_updates({"chosen-on-private-data": "hyper-parameters,posthoc-tau"})
    assert marked.chosen_on_private == ("hyper-parameters", "posthoc-tau")
    assert sweep.config_fingerprint(marked) == sweep.config_fingerprint(base)
    assert sweep.config_fingerprint(marked, legacy=True) == sweep.config_fingerprint(base, legacy=True)


def test_decisive_cells_plan_more_seeds_and_the_table_counts_them(tmp_path, monkeypatch):
    """A decisive cell (the methods that decide a table) plans profile.seeds + decisive_seeds, the other cells
    profile.seeds; a decisive cell with only its first seeds finished says its own n in the table."""
    decisive = sweep.Profile("tuned", ("mnist-st",), ("dp-sgd", "dp-sgd-la"), (1.0, 4.0), (0, 1),
                             base={"eval-every": 100}, tuned_at=4.0,
                             decisive={("mnist-st", 4.0): ("dp-sgd-la",)}, decisive_seeds=(1, 2, 3))
    monkeypatch.setitem(sweep.PROFILES, "tuned", decisive)  # the tuned profile's report marks a cell's own n
    root, docs, configs = tmp_path / "runs", tmp_path / "docs", tmp_path / "configs"
    planned = sweep.plan_runs(decisive, root, tuned_folder=_tuned(configs))
    seeds: dict[tuple, list[int]] = {}
    for c in planned:
        seeds.setdefault((c.algorithm, c.epsilon), []).append(c.seed)
    assert seeds == {("dp-sgd", 1.0): [0, 1], ("dp-sgd", 4.0): [0, 1], ("dp-sgd-la", 1.0): [0, 1],
                     ("dp-sgd-la", 4.0): [0, 1, 2, 3]}
    for cfg in planned:
        if cfg.seed < 2:
            _finish(cfg, 0.6)
    sweep.write_report(root, "tuned", docs, configs)
    text = (docs / "RESULTS.md").read_text()
    assert "and also 1, 2, 3 in the cells that decide a table (mnist-st epsilon 4: dp-sgd-la;" in text
    row = next(line for line in text.splitlines() if line.startswith("| dp-sgd-la"))
    # the label, then eps 4's two cells (2 of its 4 seeds); eps 1 has all of its 2 and says nothing
    assert row.startswith("| dp-sgd-la (n=2) | 0.600 +/- 0.000 | 0.300 +/- 0.000 | 0.600 +/- 0.000 (n=2) |")
    assert next(line for line in text.splitlines() if line.startswith("| dp-sgd (")).count("(n=2)") == 1


def test_a_report_writes_rows_of_older_csvs_beside_rows_with_newer_columns(tmp_path, profile):
    """Carried rows from a CSV written before a column existed (worst_records) and new rows with it share one
    CSV: the column is the union, empty where a row has no value; a run's worst-group records are reported."""
    root, docs, configs = tmp_path / "runs", tmp_path / "docs", tmp_path / "configs"
    planned = sweep.plan_runs(profile, root, tuned_folder=_tuned(configs))
    for cfg in planned:
        _finish(cfg, 0.5)
    sweep.write_report(root, "carry", docs, configs)
    summary = Path(planned[0].out_dir) / "summary.json"
    for cfg in planned[1:]:
        for f in Path(cfg.out_dir).iterdir():
            f.unlink()
    s = json.loads(summary.read_text())
    summary.write_text(json.dumps({**s, "worst_group_accuracy": 0.25, "worst_group_records": 8}))
    sweep.write_report(root, "carry", docs, configs)
    rows = _rows(docs)
    assert rows[("dp-sgd", 0)]["worst_records"] == "8" and rows[("dp-sgd", 0)]["source"] == "run"
    assert rows[("dp-sgd-la", 1)]["worst_records"] == "" and rows[("dp-sgd-la", 1)]["source"] == "carried"


def test_the_worst_group_record_line_lists_each_run_that_records_its_count():
    from dpdro.simulations.tables import worst_records_line

    groups = {("celeba", "dp-sgd-la", 4.0): [{"worst_records": 8}, {"worst_records": 9}, {"worst_records": ""}],
              ("celeba", "dp-sgd", 4.0): [{"worst_records": ""}]}
    line = worst_records_line(groups, "celeba", (4.0,), ["dp-sgd", "dp-sgd-la"])
    assert "dp-sgd-la eps 4: 8, 9." in line and "dp-sgd eps" not in line
    assert worst_records_line(groups, "celeba", (1.0,), ["dp-sgd-la"]) == ""


def test_a_tuned_report_of_other_config_files_names_them_and_the_main_one_does_not(tmp_path):
    """`dpdro lab report --configs F` (e.g. simulations/configs/scatter) ran F's files: the report says so instead of
    naming the main table's folder as the source of its rows."""
    from dpdro.simulations import tables
    from dpdro.simulations.tuned import TUNED_CONFIGS

    tuned = sweep.PROFILES["tuned"]
    other = tables.write_tuned_report([], tuned, tmp_path / "a", _tuned(tmp_path / "mine").parent, []).read_text()
    assert f"These rows run the files of `{tmp_path / 'mine'}/tuned/`" in other
    assert f"each method (`{tmp_path / 'mine'}/tuned/`)" in other
    main = tables.write_tuned_report([], tuned, tmp_path / "b", TUNED_CONFIGS.parent, []).read_text()
    assert "These rows run" not in main and "each method (`simulations/configs/tuned/`)" in main
    research = REPO / "docs" / "research"
    assert tables._research_link(research / "scatter", "NODES.md") == "../NODES.md"  # mkdocs --strict checks it
    assert tables._research_link(research, "NODES.md") == tables._research_link(tmp_path, "NODES.md") == "NODES.md"
