"""``dpdro lab levers`` (simulations/levers.py): variants parse, every run trains on the training split minus the
validation split and is evaluated on the validation split, runs resume, and the table reports their figures."""

import json

import pytest

from dpdro.common.config import ConfigError
from dpdro.simulations import levers


def test_parse_variant_reads_toml_scalars_and_names_bad_text():
    v = levers.parse_variant("momentum 0.9: momentum=0.9 lr-x=0.25 dro-reference=prior")
    assert v.label == "momentum 0.9"
    assert v.changes == {"momentum": 0.9, "lr-x": 0.25, "dro-reference": "prior"}
    with pytest.raises(ConfigError, match="LABEL"):
        levers.parse_variant("momentum=0.9")
    with pytest.raises(ConfigError, match="'lr-x'"):
        levers.parse_variant("x: lr-x")


def test_variant_configs_hold_out_the_validation_split_and_refuse_a_bad_key_before_any_run(tmp_path):
    base = {"algorithm": "dp-sgd", "dataset": "mnist-st"}
    out = levers.variant_configs(base, [levers.Variant("a", {"lr-x": 0.5})], [0, 3], tmp_path)
    assert [(v.label, s, c.lr_x, c.seed, c.eval_split, c.validation_fraction) for v, s, c in out] == [
        ("a", 0, 0.5, 0, "validation", 0.2), ("a", 3, 0.5, 3, "validation", 0.2)]
    assert out[1][2].out_dir == str(tmp_path / "a-seed3")
    with pytest.raises(ConfigError, match="momentum"):
        levers.variant_configs(base, [levers.Variant("bad", {"momentum": 2.0})], [0], tmp_path)


def test_levers_train_once_and_tabulate_the_validation_figures(tmp_path):
    config = tmp_path / "base.toml"
    config.write_text('algorithm = "dp-sgd-la"\ndataset = "mnist-st"\niterations = 4\nrefresh-batch = 64\n'
                      'max-train-records = 600\nmax-test-records = 200\nepsilon = 4.0\nthreads = 1\n')
    variants = [levers.parse_variant("momentum: momentum=0.9")]
    levers.run_levers(config, variants, [0], tmp_path / "runs", jobs=1)
    summaries = {d.name: json.loads((d / "summary.json").read_text()) for d in (tmp_path / "runs").iterdir()}
    assert sorted(summaries) == ["file-seed0", "momentum-seed0"]
    assert {s["eval_split"] for s in summaries.values()} == {"validation"}
    stamp = (tmp_path / "runs" / "file-seed0" / "summary.json").stat().st_mtime_ns
    levers.run_levers(config, variants, [0], tmp_path / "runs", jobs=1)  # finished runs are not trained again
    assert (tmp_path / "runs" / "file-seed0" / "summary.json").stat().st_mtime_ns == stamp
    md = levers.write_levers(config, variants, [0], tmp_path / "runs", tmp_path / "docs", "t")
    text = md.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| momentum |"))
    assert f"{summaries['momentum-seed0']['worst_class_accuracy']:.3f}" in row
    assert "momentum=0.9" in row
    assert (tmp_path / "docs" / "levers-t.csv").read_text().count("\n") == 3  # header and two rows
    config.write_text(config.read_text().replace("iterations = 4", "iterations = 3"))  # the file changed
    assert levers.lever_rows(config, variants, [0], tmp_path / "runs")[0]["n"] == 0  # its old runs are not its rows
    levers.run_levers(config, variants, [0], tmp_path / "runs", jobs=1)  # so they are trained again
    assert json.loads((tmp_path / "runs" / "file-seed0" / "summary.json").read_text())["iterations"] == 3
    # a run with groups (CelebA's) is judged by its worst group, as the search judges it
    path = tmp_path / "runs" / "momentum-seed0" / "summary.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "per_group_accuracy": [0.9, 0.125]}))
    assert levers.lever_rows(config, variants, [0], tmp_path / "runs")[1]["worst"] == [0.125]


def test_each_variant_is_judged_against_the_file_by_the_reports_interval_rule():
    """A variant far above the file on worst class (3 seeds, small spread) is 'better'; one within the noise is
    'no clear difference'; one seed is too few for an interval."""
    rows = [{"label": "file", "worst": [0.10, 0.11, 0.12], "accuracy": [0.50, 0.51, 0.52]},
            {"label": "far", "worst": [0.30, 0.31, 0.32], "accuracy": [0.50, 0.52, 0.51]},
            {"label": "near", "worst": [0.09, 0.13, 0.11], "accuracy": [0.40, 0.41, 0.42]},
            {"label": "one", "worst": [0.2], "accuracy": [0.5]}]
    lines = levers.against_file(rows)
    assert lines[2].startswith("- far against the file: worst +0.200 (better, 95% interval [+0.")
    assert "accuracy +0.000 (no clear difference" in lines[2]
    assert "- near against the file: worst +0.000 (no clear difference" in lines[3]
    assert "accuracy -0.100 (worse, 95% interval [" in lines[3]
    assert "too few seeds for an interval" in lines[4]
    assert levers.against_file(rows[:1]) == []


def test_two_rows_that_would_share_a_run_folder_are_refused_before_any_run(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text('algorithm = "dp-sgd"\ndataset = "mnist-st"\n')
    with pytest.raises(ConfigError, match="'file'"):  # the file's own row is always there
        levers.planned_runs(config, [levers.parse_variant("file:")], [0], tmp_path)
    with pytest.raises(ConfigError, match="'lr 1'"):
        levers.planned_runs(config, [levers.parse_variant("lr 1: lr-x=1"), levers.parse_variant("LR 1: lr-x=2")],
                            [0], tmp_path)
    assert len(levers.planned_runs(config, [levers.parse_variant("lr 1: lr-x=1")], [0, 1], tmp_path)[2]) == 4


def test_variants_are_also_judged_against_a_named_row():
    """``--against LABEL``: every other row, the file's included, against that row; an unknown label is refused."""
    rows = [{"label": "file", "worst": [0.90, 0.91, 0.92], "accuracy": [0.95, 0.95, 0.96]},
            {"label": "eps1 q1", "worst": [0.70, 0.71, 0.72], "accuracy": [0.86, 0.87, 0.86]},
            {"label": "eps1 q4", "worst": [0.60, 0.61, 0.62], "accuracy": [0.90, 0.90, 0.91]}]
    lines = levers.against_file(rows, "eps1 q1")
    assert lines[0] == "At the file's tau, each variant against eps1 q1 (n seeds each):"
    assert lines[2].startswith("- file against eps1 q1: worst +0.200 (better")
    assert lines[3].startswith("- eps1 q4 against eps1 q1: worst -0.100 (worse")
    assert "accuracy +0.040 (better" in lines[3]
    with pytest.raises(ConfigError, match="'eps8'"):
        levers.against_file(rows, "eps8")
