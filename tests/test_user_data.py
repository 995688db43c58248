"""Your own data (docs/how-to/own-data.md): dataset=csv, dataset=image-folder and dataset='package.module:function'
read files the test writes, train end to end with a private run, and refuse malformed files before training with
a message naming the file, the line or folder, and what was expected (one test per error)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from dpdro.common.config import Config, ConfigError
from dpdro.common.data import DataError, load_from_config

# A private run small enough for a test: dp-sgd, epsilon 4, 40 iterations of ~100 records.
PRIVATE_RUN = {"algorithm": "dp-sgd", "epsilon": 4.0, "iterations": 40, "refresh-batch": 100, "diff-batch": 50,
               "lr-x": 1.0, "clip-x": 1.0, "num-clients": 2, "eval-every": 40, "checkpoint-every": 0,
               "reproducible": True, "reproducible-for-testing": True, "threads": 1, "seed": 1}


def write_csv(path: Path, rows: list[list], header: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(",".join(str(c) for c in r) for r in [header, *rows]) + "\n")
    return path


def easy_rows(n: int, seed: int) -> list[list]:
    """Two features in [0, 10] (the public bounds); label 'yes' when f1 > f2 + 1, 'no' when f1 < f2 - 1 (a margin
    of 1 around the diagonal); group 'a'/'b' alternating."""
    rng = np.random.default_rng(seed)
    rows = []
    while len(rows) < n:
        f1, f2 = rng.uniform(0, 10, 2)
        if abs(f1 - f2) > 1:
            rows.append([round(f1, 3), round(f2, 3), "yes" if f1 > f2 else "no", "ab"[len(rows) % 2]])
    return rows


HEADER = ["f1", "f2", "label", "site"]
CSV_KEYS = {"dataset": "csv", "csv-bounds": "0:10", "csv-group": "site"}


@pytest.fixture
def csv_root(tmp_path) -> Path:
    write_csv(tmp_path / "data" / "train.csv", easy_rows(400, 1), HEADER)
    write_csv(tmp_path / "data" / "test.csv", easy_rows(200, 2), HEADER)
    return tmp_path / "data"


def test_csv_splits_classes_groups_and_public_scaling(csv_root):
    cfg = Config.from_mapping({**CSV_KEYS, "data-root": str(csv_root)})
    train, test = load_from_config(cfg, True), load_from_config(cfg, False)
    assert (len(train), len(test), train.num_classes, test.num_groups) == (400, 200, 2, 2)
    assert train.x.shape == (400, 2) and train.x.dtype == torch.float32
    rows = easy_rows(400, 1)
    # features scaled by the declared bounds [0, 10] to [-1, 1]; labels by the sorted class names (no, yes)
    assert train.x[0].tolist() == pytest.approx([rows[0][0] / 5 - 1, rows[0][1] / 5 - 1], abs=1e-6)
    assert train.y.tolist() == [int(r[2] == "yes") for r in rows]
    assert train.groups.tolist() == [int(r[3] == "b") for r in rows]
    # a value beyond the declared bounds is clipped to them, not rescaled by the data
    write_csv(csv_root / "test.csv", [[-5, 25, "yes", "a"], [5, 5, "no", "b"]], HEADER)
    assert load_from_config(cfg, False).x.tolist() == [[-1.0, 1.0], [0.0, 0.0]]


def test_csv_without_test_file_takes_a_seeded_stratified_split(tmp_path):
    path = write_csv(tmp_path / "all.csv", easy_rows(100, 3), HEADER)
    cfg = Config.from_mapping({**CSV_KEYS, "data-root": str(path), "split-seed": 5})
    train, test = load_from_config(cfg, True), load_from_config(cfg, False)
    labels = np.array([r[2] == "yes" for r in easy_rows(100, 3)])
    assert len(train) + len(test) == 100
    # 20% of each class, rounded, goes to test
    assert int(test.y.sum()) == round(0.2 * labels.sum()) and len(test) == round(0.2 * labels.sum()) + round(
        0.2 * (~labels).sum())
    again = load_from_config(cfg, False)
    assert torch.equal(again.x, test.x)
    other = load_from_config(cfg.with_updates({"split-seed": 6}), False)
    assert not torch.equal(other.x, test.x)


def test_csv_trains_privately_to_a_stated_accuracy(csv_root, tmp_path):
    from dpdro.simulations.runner import run_one

    out = tmp_path / "run"
    assert run_one({**PRIVATE_RUN, **CSV_KEYS, "data-root": str(csv_root), "out-dir": str(out)}) == (str(out), None)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dataset"] == "csv" and 0 < summary["epsilon_spent"] <= 4.0 + 1e-9
    assert math.isfinite(summary["noise_multipliers"]["grad"])
    # a margin-separated two-class task: the private MLP (the csv default model) is far above chance (0.5)
    assert summary["test_accuracy"] >= 0.9
    assert summary["worst_group_accuracy"] >= 0.85


@pytest.mark.parametrize(("rows", "keys", "message"), [
    ([[1, 2, "no", "a"]], {"csv-label": "target"},
     r"train\.csv: no column 'target' \(config key 'csv-label'\); the header has: f1, f2, label, site"),
    ([[1, 2, "no", "a"], [1, "x7", "yes", "b"]], {},
     r"train\.csv, line 3, column 'f2': 'x7' is not a number; feature columns must be numeric"),
    ([[1, 2, "no", "a"], [1, 2, "yes"]], {}, r"train\.csv, line 3: 3 cells; expected 4"),
    ([[1, 2, "no", "a"]], {"csv-features": "f1,f3"}, r"train\.csv: no column 'f3' \(config key 'csv-features'\)"),
    ([[1, 2, "no", "a"], [1, "red", "yes", "b"]], {"csv-bounds": "f1=0:3"},  # a text column: encode it, not bound it
     r"train\.csv, line 3, column 'f2': 'red' is not a number; feature columns must be numeric"),
], ids=["missing-label-column", "non-numeric-cell", "short-row", "missing-feature-column", "text-column-unbounded"])
def test_malformed_csv_is_refused_naming_file_and_line(tmp_path, rows, keys, message):
    write_csv(tmp_path / "train.csv", rows, HEADER)
    write_csv(tmp_path / "test.csv", rows[:1], HEADER)
    cfg = Config.from_mapping({**CSV_KEYS, "data-root": str(tmp_path), **keys})
    with pytest.raises(DataError, match=message):
        load_from_config(cfg, True)


def test_csv_test_file_with_a_class_the_training_file_lacks_is_refused(tmp_path):
    write_csv(tmp_path / "train.csv", [[1, 2, "no", "a"], [2, 1, "yes", "a"]], HEADER)
    write_csv(tmp_path / "test.csv", [[1, 2, "no", "a"], [3, 3, "maybe", "a"]], HEADER)
    cfg = Config.from_mapping({**CSV_KEYS, "data-root": str(tmp_path)})
    with pytest.raises(DataError, match=r"test\.csv, line 3: label 'maybe' is not one of the classes of the "
                                        r"training file train\.csv \(no, yes\)"):
        load_from_config(cfg, False)
    # declared classes fix the label order for every node and admit a class the training file lacks
    declared = load_from_config(cfg.with_updates({"classes": "yes,no,maybe"}), False)
    assert declared.y.tolist() == [1, 2] and declared.num_classes == 3


def test_csv_keys_are_checked_before_any_file_is_read():
    with pytest.raises(ConfigError, match="config key 'csv-bounds': required for dataset=csv"):
        Config.from_mapping({"dataset": "csv"})
    with pytest.raises(ConfigError, match="config key 'csv-bounds': got '3:1'; allowed: finite lo < hi"):
        Config.from_mapping({"dataset": "csv", "csv-bounds": "3:1"})
    with pytest.raises(ConfigError, match="config key 'classes': got 'a,,b'"):
        Config.from_mapping({"dataset": "csv", "csv-bounds": "0:1", "classes": "a,,b"})


def test_csv_bounds_must_cover_every_feature(tmp_path):
    write_csv(tmp_path / "train.csv", [[1, 2, "no", "a"]], HEADER)
    cfg = Config.from_mapping({**CSV_KEYS, "data-root": str(tmp_path), "csv-bounds": "f1=0:10"})
    with pytest.raises(DataError, match=r"config key 'csv-bounds': no range for feature column\(s\) f2"):
        load_from_config(cfg, True)
    per_column = cfg.with_updates({"csv-bounds": "f1=0:10,f2=0:2"})
    assert load_from_config(per_column, True).x.tolist()[0] == pytest.approx([-0.8, 1.0])


@pytest.mark.parametrize(("column", "key"), [(2, "label"), (3, "site")], ids=["empty-label", "empty-group"])
def test_csv_empty_label_or_group_cell_is_refused_naming_file_line_and_column(tmp_path, column, key):
    """A training record without a label (or group) is an error naming the file, the line as an editor numbers it
    (header = line 1) and the column, whichever split is loaded first (before, the label '' became a class)."""
    rows = easy_rows(6, 1)
    rows[2][column] = " "  # the third record: line 4
    write_csv(tmp_path / "train.csv", rows, HEADER)
    write_csv(tmp_path / "test.csv", easy_rows(4, 2), HEADER)
    cfg = Config.from_mapping({**CSV_KEYS, "data-root": str(tmp_path)})
    what = "label" if key == "label" else "group"
    message = rf"train\.csv, line 4, column '{key}': empty {what} cell; every record needs a {what}"
    for split in (True, False):
        with pytest.raises(DataError, match=message):
            load_from_config(cfg, split)
    # the same in the test file
    write_csv(tmp_path / "train.csv", easy_rows(6, 1), HEADER)
    write_csv(tmp_path / "test.csv", rows, HEADER)
    with pytest.raises(DataError, match=message.replace("train", "test")):
        load_from_config(cfg, False)


def test_csv_header_only_file_is_an_empty_split_refused_naming_file_and_split(tmp_path):
    """A test.csv (or train.csv) with a header and no record is refused when its split is loaded (before, the
    test split loaded empty and evaluation crashed in torch.cat)."""
    write_csv(tmp_path / "train.csv", easy_rows(20, 1), HEADER)
    write_csv(tmp_path / "test.csv", [], HEADER)
    cfg = Config.from_mapping({**CSV_KEYS, "data-root": str(tmp_path)})
    assert len(load_from_config(cfg, True)) == 20
    with pytest.raises(DataError, match=r"test\.csv has a header but no records \(the test split would be empty\)"):
        load_from_config(cfg, False)
    write_csv(tmp_path / "train.csv", [], HEADER)
    with pytest.raises(DataError, match=r"train\.csv has a header but no records \(the train split would be empty\)"):
        load_from_config(cfg, True)


def test_an_empty_split_carved_from_the_training_data_is_refused_naming_it(tmp_path):
    """A split that rounds to no record (the 20% test split of one record per class; a validation fraction too
    small for the classes) is an error naming the split and the data root, not an empty evaluation."""
    path = write_csv(tmp_path / "two.csv", [[1, 5, "no", "a"], [5, 1, "yes", "b"]], HEADER)
    cfg = Config.from_mapping({**CSV_KEYS, "data-root": str(path)})
    assert len(load_from_config(cfg, True)) == 2
    with pytest.raises(DataError, match=r"the test split of dataset 'csv' \(data-root .*two\.csv\) holds no record"):
        load_from_config(cfg, False)
    write_csv(tmp_path / "d" / "train.csv", easy_rows(20, 1), HEADER)
    write_csv(tmp_path / "d" / "test.csv", easy_rows(4, 2), HEADER)
    val = Config.from_mapping({**CSV_KEYS, "data-root": str(tmp_path / "d"), "validation-fraction": 0.01,
                               "eval-split": "validation"})
    with pytest.raises(DataError, match=r"the validation split of dataset 'csv' .* holds no record"):
        load_from_config(val, False)


@pytest.mark.parametrize("rows", [1, 9])
def test_a_private_run_on_too_few_records_is_refused_before_any_work(tmp_path, rows):
    """A private run needs n >= 10 training records (server.engine.MIN_PRIVATE_RECORDS): the error names n, the
    minimum and why, before any release or run file (before, n = 1 trained at delta 0.1 without a word)."""
    from dpdro.simulations.runner import run_one

    write_csv(tmp_path / "data" / "train.csv", easy_rows(rows, 1), HEADER)
    write_csv(tmp_path / "data" / "test.csv", easy_rows(4, 2), HEADER)
    out = tmp_path / "run"
    keys = {**PRIVATE_RUN, **CSV_KEYS, "data-root": str(tmp_path / "data"), "out-dir": str(out), "num-clients": 1,
            "refresh-batch": 1, "diff-batch": 1, "classes": "no,yes", "csv-group": "", "csv-features": "f1,f2"}
    with pytest.raises(ConfigError, match=rf"n = {rows} training records: a private run needs at least 10\. With "
                                          rf"fewer, the default delta = 1/\(10 n\) = {0.1 / rows:.3g} is above 0\.01"):
        run_one(keys)
    assert not out.exists()
    from dpdro.server.engine import MIN_PRIVATE_RECORDS, check_records

    assert MIN_PRIVATE_RECORDS == 10
    check_records(Config.from_mapping({**keys, "epsilon": 4.0}), 10)  # the minimum itself is accepted
    check_records(Config.from_mapping({**keys, "epsilon": "inf"}), 1)  # no noise, no minimum


# ---- dataset=image-folder ----
IMAGE_KEYS = {"dataset": "image-folder", "image-size": 8, "image-channels": 1}


def write_images(folder: Path, per_class: int, seed: int, classes=("bottom", "top")) -> None:
    """8x8 grey PNGs: class 'top' has a bright upper half, 'bottom' a bright lower half, plus noise."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    for name in classes:
        (folder / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            a = rng.integers(0, 60, size=(8, 8))
            if name == "top":
                a[:4] += 180
            else:
                a[4:] += 180
            Image.fromarray(a.astype(np.uint8), mode="L").save(folder / name / f"{i:03d}.png")


@pytest.fixture
def image_root(tmp_path) -> Path:
    write_images(tmp_path / "images" / "train", 100, 1)
    write_images(tmp_path / "images" / "test", 30, 2)
    return tmp_path / "images"


def test_image_folder_reads_classes_sizes_and_the_fixed_scaling(image_root):
    cfg = Config.from_mapping({**IMAGE_KEYS, "data-root": str(image_root)})
    train, test = load_from_config(cfg, True), load_from_config(cfg, False)
    assert (len(train), len(test), train.num_classes) == (200, 60, 2)
    assert train.x.shape == (200, 1, 8, 8) and float(train.x.min()) >= -1 and float(train.x.max()) <= 1
    # sorted class folders: bottom = 0, top = 1; 'top' records are brighter in the upper half
    assert train.y.tolist() == [0] * 100 + [1] * 100
    upper = train.x[:, 0, :4].mean(dim=(1, 2)) - train.x[:, 0, 4:].mean(dim=(1, 2))
    assert bool((upper[100:] > 0).all()) and bool((upper[:100] < 0).all())
    # resized RGB and declared public normalisation
    rgb = load_from_config(cfg.with_updates({"image-size": 4, "image-channels": 3, "image-mean": "0.5,0.5,0.5",
                                             "image-std": "0.25,0.25,0.25"}), False)
    assert rgb.x.shape == (60, 3, 4, 4) and float(rgb.x.max()) > 1  # (x - 0.5) / 0.25 reaches 2


def test_image_folder_without_test_folder_takes_a_seeded_stratified_split(tmp_path):
    write_images(tmp_path / "flat", 10, 3)
    cfg = Config.from_mapping({**IMAGE_KEYS, "data-root": str(tmp_path / "flat")})
    train, test = load_from_config(cfg, True), load_from_config(cfg, False)
    assert (len(train), len(test)) == (16, 4) and test.y.tolist() == [0, 0, 1, 1]


def test_image_folder_trains_privately_to_a_stated_accuracy(image_root, tmp_path):
    from dpdro.simulations.runner import run_one

    out = tmp_path / "run"
    keys = {**PRIVATE_RUN, **IMAGE_KEYS, "data-root": str(image_root), "out-dir": str(out)}
    assert run_one(keys) == (str(out), None)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dataset"] == "image-folder" and 0 < summary["epsilon_spent"] <= 4.0 + 1e-9
    # two classes with bright upper or lower halves: the private convnet (the default) is far above chance
    assert summary["test_accuracy"] >= 0.9


def test_image_folder_class_folder_without_images_is_refused(image_root):
    (image_root / "train" / "empty").mkdir()
    (image_root / "train" / "empty" / "notes.txt").write_text("no image here")
    cfg = Config.from_mapping({**IMAGE_KEYS, "data-root": str(image_root)})
    with pytest.raises(DataError, match=r"class folder .*train/empty has no images: expected files ending in .jpg"):
        load_from_config(cfg, True)


def test_image_folder_test_class_the_training_folder_lacks_is_refused(image_root):
    write_images(image_root / "test", 2, 4, classes=("middle",))
    cfg = Config.from_mapping({**IMAGE_KEYS, "data-root": str(image_root)})
    with pytest.raises(DataError, match=r"test class folder .*test/middle is not one of the class folders of "
                                        r".*train \(bottom, top\): more classes in test than in training"):
        load_from_config(cfg, False)


def test_image_folder_unreadable_image_is_refused_naming_it(image_root):
    (image_root / "train" / "top" / "999.png").write_bytes(b"not a png")
    cfg = Config.from_mapping({**IMAGE_KEYS, "data-root": str(image_root)})
    with pytest.raises(DataError, match=r"cannot read image .*train/top/999\.png"):
        load_from_config(cfg, True)


def test_image_folder_mixed_sizes_need_image_size(image_root):
    from PIL import Image

    Image.new("L", (5, 7)).save(image_root / "train" / "top" / "odd.png")
    cfg = Config.from_mapping({**IMAGE_KEYS, "data-root": str(image_root), "image-size": 0})
    with pytest.raises(DataError, match=r"image .*train/top/odd\.png is 5x7, the first image 8x8: with image-size=0"):
        load_from_config(cfg, True)


def test_image_folder_missing_folder_and_bad_keys_are_refused(tmp_path):
    cfg = Config.from_mapping({**IMAGE_KEYS, "data-root": str(tmp_path / "nowhere")})
    with pytest.raises(DataError, match=r"nowhere not found: dataset=image-folder expects data-root to be a folder"):
        load_from_config(cfg, True)
    with pytest.raises(ConfigError, match="config keys 'image-mean', 'image-std': got '0.5', ''"):
        Config.from_mapping({**IMAGE_KEYS, "image-mean": "0.5"})
    with pytest.raises(ConfigError, match="config key 'image-mean': got '0.5'; allowed: 3 comma-separated"):
        Config.from_mapping({**IMAGE_KEYS, "image-channels": 3, "image-mean": "0.5", "image-std": "1,1,1"})
    with pytest.raises(ConfigError, match="config key 'image-channels': got 2"):
        Config.from_mapping({**IMAGE_KEYS, "image-channels": 2})


def test_image_folder_reads_nested_sub_folders_as_torchvision_image_folder(image_root):
    """Images in sub-folders of a class folder, at any depth, belong to the class, in ImageFolder's order
    (before, only the files directly in the class folder were read)."""
    from torchvision.datasets import ImageFolder
    from torchvision.datasets.folder import IMG_EXTENSIONS

    from dpdro.common.image_folder import IMAGE_EXTENSIONS

    write_images(image_root / "train" / "top" / "2024" / "march", 7, 5, classes=("",))
    write_images(image_root / "train" / "bottom" / "extra", 3, 6, classes=("",))
    (image_root / "train" / "top" / "2024" / "UPPER.PNG").write_bytes((image_root / "train" / "top" / "000.png")
                                                                    .read_bytes())
    cfg = Config.from_mapping({**IMAGE_KEYS, "data-root": str(image_root)})
    train = load_from_config(cfg, True)
    reference = ImageFolder(str(image_root / "train"))
    assert len(train) == len(reference) == 100 + 3 + 100 + 7 + 1
    assert train.y.tolist() == reference.targets == [0] * 103 + [1] * 108
    assert IMAGE_EXTENSIONS == IMG_EXTENSIONS
    # the same pixels in the same order: the nested 'extra' images come after bottom's own files
    first_nested = np.asarray(reference.loader(reference.samples[100][0]).convert("L"), dtype=np.float32)
    assert train.x[100, 0].numpy() == pytest.approx(first_nested / 255 * 2 - 1, abs=1e-6)


def test_image_folder_skipped_files_are_counted_in_the_log_and_the_summary(image_root, tmp_path, caplog):
    """Files that are not images (other extensions, hidden files, files beside the class folders) are skipped,
    counted over the training and test folders, logged once as a warning and reported as summary.json's
    skipped_files (before, they were skipped without a count)."""
    from dpdro.simulations.runner import run_one

    (image_root / "train" / "top" / "notes.txt").write_text("not an image")
    (image_root / "train" / "bottom" / "deep").mkdir()
    (image_root / "train" / "bottom" / "deep" / ".DS_Store").write_bytes(b"\0")
    (image_root / "train" / "README.md").write_text("beside the class folders")
    (image_root / "test" / "top" / "labels.csv").write_text("a,b")
    cfg = Config.from_mapping({**IMAGE_KEYS, "data-root": str(image_root)})
    with caplog.at_level("WARNING", logger="dpdro.common.image_folder"):
        train, test = load_from_config(cfg, True), load_from_config(cfg, False)
    assert (len(train), len(test), train.skipped_files, test.skipped_files) == (200, 60, 4, 4)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2  # one per folder, not one per load
    assert any("train: skipped 3 file(s) that are not images" in w and "top/notes.txt" in w for w in warnings)
    out = tmp_path / "run"
    keys = {**PRIVATE_RUN, **IMAGE_KEYS, "data-root": str(image_root), "out-dir": str(out), "iterations": 2,
            "eval-every": 2}
    assert run_one(keys) == (str(out), None)
    assert json.loads((out / "summary.json").read_text())["skipped_files"] == 4


# ---- user code by import path: model=module:factory, dataset=module:function ----
PLUGINS = Path(__file__).parent / "plugins"


@pytest.fixture
def user_code(monkeypatch):
    """tests/plugins/ on sys.path, as a user's PYTHONPATH would hold their own module."""
    monkeypatch.syspath_prepend(str(PLUGINS))


def test_entry_point_data_set_and_user_model_train_privately(user_code, tmp_path):
    from dpdro.simulations.runner import run_one

    out = tmp_path / "run"
    keys = {**PRIVATE_RUN, "dataset": "user_code:blobs", "model": "user_code:tiny_mlp", "out-dir": str(out)}
    assert run_one(keys) == (str(out), None)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dataset"] == "user_code:blobs" and 0 < summary["epsilon_spent"] <= 4.0 + 1e-9
    # three separated blobs: far above chance (1/3)
    assert summary["test_accuracy"] >= 0.9 and summary["worst_group_accuracy"] >= 0.85


def test_entry_point_data_set_as_a_torch_dataset(user_code):
    cfg = Config.from_mapping({"dataset": "user_code:blobs_dataset"})
    train, test = load_from_config(cfg, True), load_from_config(cfg, False)
    assert (len(train), len(test), train.num_classes, train.groups) == (300, 150, 3, None)
    from user_code import blobs

    assert torch.equal(train.x, torch.from_numpy(blobs("train", None)[0]))  # float records used as they are
    assert load_from_config(cfg.with_updates({"classes": "a,b,c,d"}), False).num_classes == 4


def test_entry_point_test_split_with_a_class_training_lacks_is_refused(user_code):
    cfg = Config.from_mapping({"dataset": "user_code:blobs_with_extra_test_class"})
    with pytest.raises(DataError, match="the test split has label 3, beyond the training split's labels "
                                        r"\(0 \.\. 2\): more classes than in training"):
        load_from_config(cfg, False)


def test_import_paths_that_do_not_import_are_refused_by_config(user_code):
    with pytest.raises(ConfigError, match="config key 'model': model 'no_such_module:net': cannot import module "
                                          "'no_such_module'"):
        Config.from_mapping({"model": "no_such_module:net"})
    with pytest.raises(ConfigError, match="config key 'dataset': dataset 'user_code:nothing': module 'user_code' "
                                          "has no attribute 'nothing'"):
        Config.from_mapping({"dataset": "user_code:nothing"})
    with pytest.raises(ConfigError, match="config key 'model': model 'user_code:NOT_A_FACTORY' is a int"):
        Config.from_mapping({"model": "user_code:NOT_A_FACTORY"})
    with pytest.raises(ConfigError, match=r"config key 'model': got 'not a path'; allowed: one of 'auto'.* or an "
                                          "import path 'package.module:name'"):
        Config.from_mapping({"model": "not a path"})


@pytest.mark.parametrize(("factory", "message"), [
    ("BatchNormNet", "layer 'net.2' is BatchNorm1d: batch normalisation mixes records, so per-record clipping "
                     "bounds nothing. Set config key model-fix=groupnorm"),
    ("CentringNet", "a record's output changes with the other records of its batch"),
    ("NumpyNet", "torch.func cannot compute per-record gradients of model 'user_code:NumpyNet'"),
    ("needs_weights", r"model 'user_code:needs_weights': factory\(num_classes=3, input_shape=\(2,\)\) failed "
                      r"\(FileNotFoundError: weights.pt not found\)"),
    ("no_parameters", "model 'user_code:no_parameters' has no trainable parameters"),
])
def test_user_models_that_cannot_be_trained_per_record_are_refused_before_training(user_code, tmp_path, factory,
                                                                                   message):
    from dpdro.common.models import ModelError
    from dpdro.simulations.runner import run_one

    out = tmp_path / "run"
    keys = {**PRIVATE_RUN, "dataset": "user_code:blobs", "model": f"user_code:{factory}", "out-dir": str(out)}
    with pytest.raises(ModelError, match=message):
        run_one(keys)
    assert not (out / "summary.json").exists() and not (out / "ledger.json").exists()


def test_flower_shard_cache_follows_changes_of_user_files(csv_root, tmp_path, user_code):
    """A Flower node caches its shard under a hash of the data keys: for user files the hash also covers their
    sizes and modification times (an edited CSV is read again), and user code keeps no cache at all."""
    import os

    from dpdro.client.flower.app import _load_shard, shard_cache_path

    cfg = Config.from_mapping({**CSV_KEYS, "data-root": str(csv_root), "cache-dir": str(tmp_path / "cache"),
                               "num-clients": 2})
    first = _load_shard(cfg, 0)
    path = shard_cache_path(cfg, 0)
    assert path.is_file() and len(first) == 200
    write_csv(csv_root / "train.csv", easy_rows(100, 5), HEADER)
    os.utime(csv_root / "train.csv", ns=(1, 1))  # a different modification time even within the clock's tick
    assert shard_cache_path(cfg, 0) != path and len(_load_shard(cfg, 0)) == 50
    assert shard_cache_path(Config.from_mapping({"dataset": "user_code:blobs"}), 0) is None
    assert len(_load_shard(Config.from_mapping({"dataset": "user_code:blobs", "num-clients": 3}), 1)) == 100


def test_plan_of_group_attribute_runs_on_groups_and_refuses_a_data_set_without(csv_root, capsys):
    """dpdro plan at dro-level=group, dro-groups=attribute: with the CSV's group column it plans the group
    histogram and the K-vector releases over its 2 groups; without a group column it answers with the same
    one-line ConfigError as training (before, plan crashed on a 0-dimensional release)."""
    from dpdro.cli import main

    keys = [f"{k}={v}" for k, v in CSV_KEYS.items()] + [
        f"data-root={csv_root}", "algorithm=dp-double-spider", "dro-level=group", "dro-groups=attribute",
        "iterations=4", "q=2", "epsilon=4"]
    assert main(["plan", "--set", *keys]) == 0
    out = capsys.readouterr().out
    assert "group-histogram" in out and "group-refresh" in out and "group-diff" in out
    # --format json: the same plan as one object (releases in the text's order, the same figures)
    import json

    assert main(["plan", "--format", "json", "--set", *keys]) == 0
    plan = json.loads(capsys.readouterr().out)
    table = out.split("noise multiplier\n", 1)[1].split("planned epsilon")[0]  # the rows under the header line
    names = [ln.split()[0] for ln in table.splitlines() if ln]
    assert [r["name"] for r in plan["releases"]] == names and "group-histogram" in names
    assert plan["iterations"] == 4 and plan["epsilon_target"] == 4.0 and plan["accountant"] == "pld"
    assert f"pld {plan['planned_epsilon']['pld']:.4f}, rdp {plan['planned_epsilon']['rdp']:.4f}" in out
    for r in plan["releases"]:
        assert f"{r['name']:<16}{r['count']:>7}{r['sampling_rate']:>15.4g}{r['noise_multiplier']:>18.4f}" in out
    no_groups = [k for k in keys if not k.startswith("csv-group")] + ["csv-features=f1,f2"]
    assert main(["plan", "--set", *no_groups]) == 2
    assert "config key 'dro-groups': got 'attribute'; data set 'csv' declares no group attribute" in (
        capsys.readouterr().err)


def test_walkthrough_data_script_writes_the_readme_files(tmp_path):
    """examples/make_walkthrough_data.py writes what the own-data tutorial reads: 3 class folders of
    120 / 30 PNGs, 12 unlabelled images, the risk table (1,500 / 500 rows) and 20 unlabelled rows, which load as
    the csv and image-folder data sets."""
    import runpy
    import sys as _sys

    script = Path(__file__).resolve().parents[1] / "examples" / "make_walkthrough_data.py"
    argv = _sys.argv
    try:
        _sys.argv = [str(script), str(tmp_path)]
        with pytest.raises(SystemExit) as done:
            runpy.run_path(str(script), run_name="__main__")
    finally:
        _sys.argv = argv
    assert done.value.code == 0
    for split, count in (("train", 120), ("test", 30)):
        assert sorted(p.name for p in (tmp_path / "images" / split).iterdir()) == ["one", "seven", "zero"]
        assert all(len(list((tmp_path / "images" / split / c).glob("*.png"))) == count
                   for c in ("one", "seven", "zero"))
    assert len(list((tmp_path / "new-images").glob("*.png"))) == 12
    assert len((tmp_path / "table" / "train.csv").read_text().splitlines()) == 1501
    assert (tmp_path / "new-rows.csv").read_text().splitlines()[0] == "age,income,score,sex"
    cfg = Config.from_mapping({"dataset": "csv", "data-root": str(tmp_path / "table"), "csv-label": "risk",
                               "csv-group": "sex", "csv-bounds": "age=18:90,income=0:200000,score=0:1"})
    train = load_from_config(cfg, True)
    assert (len(train), train.num_classes, train.num_groups) == (1500, 2, 2)
