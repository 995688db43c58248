"""``dpdro predict`` / ``dpdro evaluate`` on records of your own: a CSV file without the label
column, a folder of images without class sub-folders, one image; the predictions on unlabelled records equal
those on the same records labelled (and those of the run's own test split); malformed input is refused naming the
file, the column or the folder and what was expected."""

from __future__ import annotations

import csv
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from test_user_data import CSV_KEYS, HEADER, IMAGE_KEYS, PRIVATE_RUN, easy_rows, write_csv, write_images

from dpdro.cli import main

RUN = {**PRIVATE_RUN, "iterations": 12, "eval-every": 12}


def _read(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _scores(rows: list[dict]) -> np.ndarray:
    return np.array([[float(v) for k, v in r.items() if k.startswith("score_")] for r in rows])


@pytest.fixture(scope="module")
def csv_run(tmp_path_factory):
    """(run directory, data folder, summary) of one private csv run (train.csv 400 rows, test.csv 200)."""
    root = tmp_path_factory.mktemp("csv")
    write_csv(root / "data" / "train.csv", easy_rows(400, 1), HEADER)
    write_csv(root / "data" / "test.csv", easy_rows(200, 2), HEADER)
    run = root / "run"
    keys = {**RUN, **CSV_KEYS, "data-root": root / "data", "out-dir": run}
    assert main(["train", "--set"] + [f"{k}={v}" for k, v in keys.items()]) == 0
    return run, root / "data", json.loads((run / "summary.json").read_text())


def test_predict_on_unlabelled_csv_rows_equals_the_predictions_on_the_same_rows_labelled(csv_run, tmp_path, capsys):
    run, data, summary = csv_run
    meta = json.loads((run / "model.json").read_text())
    assert meta["feature_names"] == ["f1", "f2"]
    assert "clipped to the declared public bounds (csv-bounds 0:10) and scaled to [-1, 1]" in meta["input_scaling"]
    assert main(["predict", "--run", str(run), "--data", "test", "--out", str(tmp_path / "split.csv")]) == 0
    # the same rows without the label column, the columns in another order (read by name, as in training)
    rows = easy_rows(200, 2)
    write_csv(tmp_path / "new.csv", [[r[3], r[1], r[0]] for r in rows], ["site", "f2", "f1"])
    capsys.readouterr()
    assert main(["predict", "--run", str(run), "--data", str(tmp_path / "new.csv")]) == 0
    assert "200 predictions" in capsys.readouterr().out
    split, new = _read(tmp_path / "split.csv"), _read(run / "predictions_new.csv")
    assert list(new[0])[:4] == ["index", "source", "predicted", "predicted_class"]  # no label column
    assert new[0]["source"] == "new.csv:2" and new[-1]["source"] == "new.csv:201"
    assert [r["predicted"] for r in new] == [r["predicted"] for r in split]
    assert np.array_equal(_scores(new), _scores(split))
    # the labelled file by path: every row, the run's reported accuracy (test.csv is the run's test split)
    assert main(["evaluate", "--run", str(run), "--data", str(data / "test.csv")]) == 0
    assert f"200 records, accuracy {summary['test_accuracy']:.4f}" in capsys.readouterr().out
    assert main(["evaluate", "--run", str(run), "--data", str(data / "test.csv"), "--format", "json"]) == 0
    m = json.loads(capsys.readouterr().out)
    assert m["records"] == 200 and m["accuracy"] == summary["test_accuracy"]
    assert m["worst_class_accuracy"] == min(m["per_class_accuracy"].values())
    assert sum(map(sum, m["confusion"])) == 200 and m["confusion_matrix_png"].endswith("confusion_test.png")
    by_path = _read(run / "predictions_new.csv")
    assert float(np.mean([r["predicted_class"] == row[2] for r, row in zip(by_path, rows, strict=True)])) == \
        summary["test_accuracy"]


def test_evaluate_refuses_unlabelled_rows(csv_run, tmp_path, capsys):
    run, _, _ = csv_run
    write_csv(tmp_path / "new.csv", [[1, 2]], ["f1", "f2"])
    assert main(["evaluate", "--run", str(run), "--data", str(tmp_path / "new.csv")]) == 2
    assert "evaluation needs labels and these records have none" in capsys.readouterr().err


@pytest.mark.parametrize(("rows", "header", "message"), [
    ([[1, 2]], ["f1", "x"], r"new\.csv: no feature column 'f2'; the model was trained on the columns f1, f2 and "
                            r"the header has: f1, x"),
    ([[1, 2], ["a", 3]], ["f1", "f2"], r"new\.csv, line 3, column 'f1': 'a' is not a number"),
    ([[1, 2, "maybe"]], ["f1", "f2", "label"], r"new\.csv, line 2: label 'maybe' is not one of the classes of the "
                                               r"model \(no, yes\)"),
    ([[1]], ["f1", "f2"], r"new\.csv, line 2: 1 cells; expected 2"),
    ([], ["f1", "f2"], r"new\.csv has a header but no records"),
])
def test_malformed_csv_for_prediction_is_refused_naming_file_line_and_column(csv_run, tmp_path, capsys, rows,
                                                                             header, message):
    run, _, _ = csv_run
    write_csv(tmp_path / "new.csv", rows, header)
    assert main(["predict", "--run", str(run), "--data", str(tmp_path / "new.csv"), "--out",
                 str(tmp_path / "out.csv")]) == 2
    err = capsys.readouterr().err
    assert re.search(message, err), err
    assert not (tmp_path / "out.csv").exists()


def test_a_missing_path_is_refused_saying_what_is_expected(csv_run, tmp_path, capsys):
    run, _, _ = csv_run
    assert main(["predict", "--run", str(run), "--data", str(tmp_path / "nowhere.csv")]) == 2
    assert "nowhere.csv not found; expected 'test', 'train', 'validation', a .csv file" in capsys.readouterr().err


@pytest.fixture(scope="module")
def image_run(tmp_path_factory):
    """(run directory, data folder) of one private image-folder run (8x8 grey, 2 classes, test 2 x 30)."""
    root = tmp_path_factory.mktemp("img")
    write_images(root / "images" / "train", 60, 1)
    write_images(root / "images" / "test", 30, 2)
    run = root / "run"
    keys = {**RUN, **IMAGE_KEYS, "data-root": root / "images", "out-dir": run}
    assert main(["train", "--set"] + [f"{k}={v}" for k, v in keys.items()]) == 0
    return run, root / "images"


def test_predict_on_a_flat_folder_of_images_equals_the_predictions_on_the_class_folders(image_run, tmp_path):
    run, images = image_run
    assert json.loads((run / "model.json").read_text())["input_scaling"] == (
        "images converted to grey, resized to 8x8 (bilinear), pixels p -> p / 255 * 2 - 1 (channels first, float)")
    assert main(["predict", "--run", str(run), "--data", "test", "--out", str(tmp_path / "split.csv")]) == 0
    flat = tmp_path / "flat"
    flat.mkdir()
    for f in sorted((images / "test").rglob("*.png")):  # bottom-000.png ...: the test split's order
        shutil.copy(f, flat / f"{f.parent.name}-{f.name}")
    assert main(["predict", "--run", str(run), "--data", str(flat)]) == 0
    split, new = _read(tmp_path / "split.csv"), _read(run / "predictions_flat.csv")
    assert len(new) == 60 and "label" not in new[0] and new[0]["source"] == "bottom-000.png"
    assert [r["predicted"] for r in new] == [r["predicted"] for r in split]
    assert np.array_equal(_scores(new), _scores(split))
    # class sub-folders: labelled, every image; one image file: one prediction
    assert main(["predict", "--run", str(run), "--data", str(images / "test")]) == 0
    labelled = _read(run / "predictions_test.csv")
    assert [r["label"] for r in labelled] == [r["label"] for r in split] and labelled[0]["source"] == \
        "bottom/000.png"
    assert main(["predict", "--run", str(run), "--data", str(flat / "top-005.png")]) == 0
    one = _read(run / "predictions_top-005.csv")
    assert [(r["source"], r["predicted"]) for r in one] == [("top-005.png", split[35]["predicted"])]


@pytest.mark.parametrize(("make", "message"), [
    (lambda d: (d / "sub").mkdir() or (d / "a.png").write_bytes(b"x"),
     r"holds both images \(a\.png, \.\.\.\) and sub-folders \(sub, \.\.\.\): expected either images only"),
    (lambda d: (d / "notes.txt").write_text("no image"), r"flat holds no images: expected files ending in \.jpg"),
    (lambda d: write_images(d, 1, 3, classes=("middle",)),
     r"class folder .*flat/middle is not one of the model's classes \(bottom, top\)"),
    (lambda d: (d / "broken.png").write_bytes(b"not a png"), r"cannot read image .*flat/broken\.png"),
])
def test_malformed_image_input_for_prediction_is_refused_naming_the_folder(image_run, tmp_path, capsys, make,
                                                                          message):
    run, _ = image_run
    (tmp_path / "flat").mkdir()
    make(tmp_path / "flat")
    assert main(["predict", "--run", str(run), "--data", str(tmp_path / "flat")]) == 2
    err = capsys.readouterr().err
    assert re.search(message, err), err


def test_the_cards_commands_work_from_the_run_folder_with_a_relative_data_root(tmp_path, monkeypatch, capsys):
    """A run started with a relative data-root (data-root=data, as the own-data guide does) and evaluated from
    inside its run folder, as its model card says: the relative root is read from config.json's data_read (the
    folder the run read, absolute), not from the current folder."""
    write_csv(tmp_path / "data" / "train.csv", easy_rows(300, 1), HEADER)
    write_csv(tmp_path / "data" / "test.csv", easy_rows(100, 2), HEADER)
    monkeypatch.chdir(tmp_path)
    keys = {**RUN, **CSV_KEYS, "iterations": 4, "eval-every": 4, "data-root": "data", "out-dir": "run"}
    assert main(["train", "--set"] + [f"{k}={v}" for k, v in keys.items()]) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert json.loads((tmp_path / "run" / "config.json").read_text())["data_read"] == str(tmp_path / "data")
    monkeypatch.chdir(tmp_path / "run")
    capsys.readouterr()
    assert main(["evaluate", "--run", ".", "--data", "test"]) == 0
    assert f"100 records, accuracy {summary['test_accuracy']:.4f}" in capsys.readouterr().out
