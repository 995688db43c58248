"""A model you can use: every run writes model.pt + model.json (loadable into a fresh
model), MODEL_CARD.md and plots; ``dpdro predict`` on the test split repeats the run's reported accuracy
exactly; ``dpdro evaluate`` prints accuracy and worst-class accuracy and writes a confusion matrix; the Python
API ``dpdro.fit`` gives the same parameters as ``dpdro train`` for the same keys and seed.

The data are a small three-class set of overlapping 4x4 "images" registered here (no files), so that
accuracies are neither 0 nor 1 and a wrong prediction path shows."""

from __future__ import annotations

import csv
import json
import re
import shlex
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import dpdro
from dpdro.cli import main
from dpdro.common.data import DATASETS, DatasetSpec, register_dataset
from dpdro.common.models import MODELS, ModelError, register_model
from dpdro.server.model_files import load_model, read_model_spec

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _load_overlap(split, data_root, cache_dir, download, split_seed):
    """(uint8 (N, 4, 4), labels (N,), None): class k lights row k, plus heavy noise; class 0 rarest."""
    n = 600 if split == "train" else 300
    rng = np.random.default_rng({"train": 11, "test": 12}[split])
    labels = rng.choice(3, size=n, p=[0.2, 0.4, 0.4])
    images = rng.integers(0, 150, size=(n, 4, 4))
    images[np.arange(n), labels, :] += 70
    return torch.from_numpy(images.astype(np.uint8)), torch.from_numpy(labels.astype(np.int64)), None


class TinyMLP(nn.Module):
    """(B, 1, 4, 4) -> (B, K) logits through one tanh hidden layer of 8."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, num_classes))

    def forward(self, x):
        return self.net(x)


@pytest.fixture(scope="module")
def overlap():
    """Registers data set 'overlap-3' and model 'tiny-mlp' for this module's tests, removes them afterwards."""
    register_dataset("overlap-3", DatasetSpec(_load_overlap, 3, "tiny-mlp"))
    register_model("tiny-mlp")(TinyMLP)
    yield
    DATASETS.pop("overlap-3", None)
    MODELS.pop("tiny-mlp", None)


KEYS = {"dataset": "overlap-3", "algorithm": "dp-sgd", "epsilon": 4.0, "iterations": 8, "refresh-batch": 120,
        "lr-x": 2.0, "clip-x": 1.0, "num-clients": 2, "eval-every": 4, "checkpoint-every": 0, "reproducible": True,
        "reproducible-for-testing": True, "threads": 1, "seed": 5, "dtype": "float32", "posthoc-tau": 1.0}


def _set_args(keys: dict) -> list[str]:
    return ["--set"] + [f"{k}={v}" for k, v in keys.items()]


def _cli_train(keys: dict) -> dict:
    assert main(["train"] + _set_args(keys)) == 0
    return json.load(open(f"{keys['out-dir']}/summary.json"))


@pytest.fixture(scope="module")
def finished(overlap, tmp_path_factory):
    """(run directory, summary) of one finished `dpdro train` run of KEYS, shared by the tests that only read it."""
    run = tmp_path_factory.mktemp("finished") / "run"
    return run, _cli_train({**KEYS, "out-dir": run})


def test_api_and_cli_give_identical_parameters(overlap, tmp_path):
    cli_dir, api_dir = tmp_path / "cli", tmp_path / "api"
    summary = _cli_train({**KEYS, "out-dir": cli_dir})
    result = dpdro.fit({**KEYS, "out-dir": str(api_dir)})
    cli_params, api_params = np.load(cli_dir / "final_params.npy"), np.load(api_dir / "final_params.npy")
    assert cli_params.shape == (16 * 8 + 8 + 8 * 3 + 3,)
    assert np.array_equal(cli_params, api_params)
    assert result.summary["test_accuracy"] == summary["test_accuracy"]
    assert result.privacy["epsilon_spent"] == pytest.approx(summary["epsilon_spent"]) and 3.9 < summary[
        "epsilon_spent"] <= 4.0
    assert result.privacy["delta"] == pytest.approx(1 / 6000)  # auto: 1/(10 n), n = 600
    assert result.run_dir == api_dir
    # the returned module holds the trained weights, in the order of final_params.npy
    flat = torch.cat([p.detach().reshape(-1) for p in result.model.parameters()]).double().numpy()
    assert np.array_equal(flat, api_params.astype(np.float32).astype(np.float64))
    assert json.load(open(cli_dir / "config.json"))["n"] == json.load(open(api_dir / "config.json"))["n"] == 600


def test_predict_on_the_test_split_reproduces_the_reported_accuracy_exactly(finished, capsys):
    run, summary = finished
    spec = read_model_spec(run)
    assert spec.priors is not None and spec.posthoc_tau == 1.0  # the prediction shift is in play
    assert 0.3 < summary["test_accuracy"] < 1.0
    capsys.readouterr()
    assert main(["predict", "--run", str(run), "--data", "test"]) == 0
    rows = list(csv.DictReader(open(run / "predictions_test.csv")))
    assert len(rows) == 300
    assert list(rows[0]) == ["index", "label", "predicted", "predicted_class", "score_0", "score_1", "score_2"]
    accuracy = float(np.mean([r["label"] == r["predicted"] for r in rows]))
    assert accuracy == summary["test_accuracy"]
    per_class = [float(np.mean([r["label"] == r["predicted"] for r in rows if r["label"] == str(k)]))
                 for k in range(3)]
    assert per_class == summary["per_class_accuracy"]
    capsys.readouterr()
    assert main(["evaluate", "--run", str(run), "--data", "test"]) == 0
    out = capsys.readouterr().out
    assert (f"300 records, accuracy {summary['test_accuracy']:.4f}, worst-class accuracy "
            f"{summary['worst_class_accuracy']:.4f}") in out
    assert (run / "plots" / "confusion_test.png").read_bytes()[:8] == PNG_MAGIC


def test_evaluate_with_another_posthoc_tau_predicts_with_the_released_priors(finished, capsys):
    """--posthoc-tau T: argmax(logits - T log pi) on the run's released priors, computed here from the raw
    logits; T 0 is the plain argmax; the run's own tau reproduces its report; a negative T is refused."""
    from dpdro.common.config import ConfigError
    from dpdro.server.prediction import load_data, predict

    run, summary = finished
    model, spec = load_model(run)
    records = load_data(run, "test", None, spec)
    with torch.no_grad():
        logits = model(records.x.float()).double().numpy()
    log_pi = np.log(np.asarray(spec.priors))
    for tau in (0.0, 0.5, 2.0):
        expected = np.argmax(logits - tau * log_pi, axis=1)
        assert np.array_equal(predict(run, "test", posthoc_tau=tau).predicted, expected)
    assert np.mean(predict(run, "test", posthoc_tau=1.0).predicted == records.labels) == summary["test_accuracy"]
    capsys.readouterr()
    assert main(["evaluate", "--run", str(run), "--data", "test", "--posthoc-tau", "0"]) == 0
    plain = float(np.mean(np.argmax(logits, axis=1) == records.labels))
    assert f"data test (post-hoc tau 0): 300 records, accuracy {plain:.4f}" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="--posthoc-tau: got -1.0; allowed: >= 0"):
        predict(run, "test", posthoc_tau=-1.0)
    import dataclasses

    from dpdro.server.prediction import with_posthoc_tau

    without = dataclasses.replace(spec, priors=None)  # a run that released no priors
    assert with_posthoc_tau(without, 0.0).prediction_shift is None
    with pytest.raises(ConfigError, match="released no class priors"):
        with_posthoc_tau(without, 0.5)


def test_evaluate_several_posthoc_taus_prints_each_and_chooses_by_the_tuning_score(finished, capsys):
    """--posthoc-tau T1 T2 ...: the model runs once, each tau's figures equal a single-tau evaluation, and the
    chosen tau is the best tuning score among those reaching --min-accuracy."""
    from dpdro.server.objective import objective_terms
    from dpdro.server.prediction import metrics, predict

    run, _ = finished
    taus = [0.0, 1.0, 3.0]
    singles = [metrics(predict(run, "test", posthoc_tau=t)) for t in taus]
    terms = [objective_terms(m["per_class_accuracy"], m["accuracy"]) for m in singles]
    capsys.readouterr()
    png = run / "chosen.png"
    assert main(["evaluate", "--run", str(run), "--posthoc-tau", "0", "1", "3", "--out", str(png)]) == 0
    out = capsys.readouterr().out
    for tau, (worst, two_lowest, acc) in zip(taus, terms, strict=True):
        assert (f"tau {tau:g}: accuracy {acc:.4f}, worst-class accuracy {worst:.4f}, two lowest "
                f"{two_lowest:.4f}") in out
    best = max(range(3), key=lambda i: (round(terms[i][0], 4), round(terms[i][1], 4), round(terms[i][2], 4), -i))
    assert f"chosen: tau {taus[best]:g} " in out and png.read_bytes()[:8] == PNG_MAGIC
    assert "this is the test split: choose on validation" in out
    # --format json: the same figures and choice as one object
    assert main(["evaluate", "--run", str(run), "--posthoc-tau", "0", "1", "3", "--format", "json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert [t["tau"] for t in got["taus"]] == taus and got["chosen_tau"] == taus[best]
    figures = [x for t in got["taus"] for x in (t["worst_class_accuracy"], t["two_lowest"], t["accuracy"])]
    assert figures == pytest.approx([x for t in terms for x in t])
    # a floor above every tau's accuracy: nothing is chosen, exit status 1
    floor = max(t[2] for t in terms) + 1e-3
    if floor <= 1.0:
        assert main(["evaluate", "--run", str(run), "--posthoc-tau", "0", "1", "--min-accuracy", str(floor),
                     "--out", str(png)]) == 1
        assert "chosen: none" in capsys.readouterr().out
    assert main(["evaluate", "--run", str(run), "--posthoc-tau", "0", "1", "--min-accuracy", "2"]) == 2
    assert "--min-accuracy: got 2.0; allowed: [0, 1]" in capsys.readouterr().err


def test_evaluate_posthoc_taus_over_several_runs_prints_the_mean_terms_and_chooses_one_tau(finished, tmp_path,
                                                                                         capsys):
    """--run R1 R2 --posthoc-tau ...: each tau's line is the term-wise mean of the runs' single evaluations (the
    mean of the worst classes, as tune scores seeds) and one tau is chosen on those means; several runs refuse
    --out and a single tau."""
    import shutil

    from dpdro.server.objective import choose_by_terms, mean_terms, objective_terms
    from dpdro.server.prediction import metrics, predict

    run, _ = finished
    other = tmp_path / "other"
    shutil.copytree(run, other)
    meta = json.loads((other / "model.json").read_text())
    meta["priors"] = [0.6, 0.3, 0.1]  # another model's released priors: the same logits, other adjustments
    (other / "model.json").write_text(json.dumps(meta))
    taus = [0.0, 1.0, 3.0]
    per_run = [[objective_terms(m["per_class_accuracy"], m["accuracy"])
                for m in (metrics(predict(r, "test", posthoc_tau=t)) for t in taus)] for r in (run, other)]
    assert per_run[0][1] != per_run[1][1] or per_run[0][2] != per_run[1][2]  # the copy is a different model
    means = [mean_terms([per_run[0][i], per_run[1][i]]) for i in range(3)]
    capsys.readouterr()
    assert main(["evaluate", "--run", str(run), str(other), "--posthoc-tau", "0", "1", "3"]) == 0
    out = capsys.readouterr().out
    assert "mean over 2 runs" in out
    for tau, (worst, two_lowest, acc) in zip(taus, means, strict=True):
        assert f"tau {tau:g}: accuracy {acc:.4f}, worst-class accuracy {worst:.4f}, two lowest {two_lowest:.4f}" in out
    assert f"chosen: tau {taus[choose_by_terms(means)]:g} " in out
    assert (other / "plots" / "confusion_test.png").read_bytes()[:8] == PNG_MAGIC
    assert main(["evaluate", "--run", str(run), str(other), "--posthoc-tau", "0", "1", "--out", "x.png"]) == 2
    assert "--out: got 'x.png' with 2 runs" in capsys.readouterr().err
    assert main(["evaluate", "--run", str(run), str(other), "--posthoc-tau", "1"]) == 2
    assert "--run: got 2 run directories" in capsys.readouterr().err


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_predict_and_evaluate_on_private_splits_say_not_private_and_write_only_to_out(finished, tmp_path, capsys):
    """On 'train' (the run's private training records) both commands print "not private (reads private records)",
    return it, and leave the run directory byte for byte as it was unless --out names a file (written there, the
    statement in it); on 'test' they stay post-processing. --out naming a folder is refused, naming the flag."""
    run, summary = finished
    before = _files(run)
    capsys.readouterr()
    assert main(["predict", "--run", str(run), "--data", "train"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^600 predictions \(train, accuracy 0\.\d{4} against its labels\): not private \(reads private "
                     r"records\); nothing written", out, re.M), out
    assert main(["evaluate", "--run", str(run), "--data", "train"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^data train: 600 records, accuracy 0\.\d{4}, .*; not private \(reads private records\)$", out,
                     re.M), out
    assert "confusion matrix: not written (derived from private records" in out
    assert main(["evaluate", "--run", str(run), "--data", "train", "--posthoc-tau", "0", "1"]) == 0
    out = capsys.readouterr().out
    assert "600 records; post-hoc tau on the run's released priors (not private (reads private records))" in out
    assert "chosen on private records: not accounted" in out and "confusion matrix: not written" in out
    assert _files(run) == before  # nothing derived from private records in the run directory
    # asked for: written where --out says, the statement with it
    csv_out, png_out = tmp_path / "train.csv", tmp_path / "train.png"
    assert main(["predict", "--run", str(run), "--data", "train", "--out", str(csv_out)]) == 0
    assert f"written to {csv_out}; not private (reads private records)" in capsys.readouterr().out
    rows = list(csv.DictReader(open(csv_out)))
    assert len(rows) == 600 and list(rows[0])[-1] == "privacy"
    assert {r["privacy"] for r in rows} == {"not private (reads private records)"}
    assert main(["evaluate", "--run", str(run), "--data", "train", "--out", str(png_out)]) == 0
    assert f"confusion matrix: {png_out}" in capsys.readouterr().out and png_out.read_bytes()[:8] == PNG_MAGIC
    assert _files(run) == before
    # the Python API returns the statement; the public test split stays post-processing
    train, test = dpdro.evaluate(run, "train"), dpdro.evaluate(run, "test")
    assert train["privacy"] == "not private (reads private records)" and train["records"] == 600
    assert test["privacy"] == "post-processing of the released model: no privacy cost"
    assert test["accuracy"] == summary["test_accuracy"]
    assert dpdro.predict(run, "train").privacy == "not private (reads private records)"
    from dpdro.server.prediction import reads_private_records

    assert [reads_private_records(d) for d in ("train", "validation", "test", "rows.csv")] == [True, True, False,
                                                                                              False]
    assert main(["predict", "--run", str(run), "--data", "train", "--out", str(tmp_path)]) == 2
    assert f"--out {tmp_path}: is a folder; allowed: the path of the file to write" in capsys.readouterr().err
    assert main(["evaluate", "--run", str(run), "--data", "validation"]) == 2  # it held none out
    assert ("--data validation: the run held out no validation split (its validation-fraction is 0 and overlap-3 "
            "has none of its own)") in capsys.readouterr().err


def test_a_run_whose_posthoc_tau_was_chosen_on_private_data_lists_it_as_not_accounted(overlap, tmp_path):
    """Config key chosen-on-private-data (which dpdro lab tune writes into its files): each item becomes a line of the
    summary's not_accounted and of the model card; without it neither line appears; an unknown item is refused."""
    from dpdro.common.config import Config, ConfigError

    tau_line = ("post-hoc tau chosen on a validation split of the private training records: not accounted (applying "
                "a tau is post-processing; choosing it on private records is not)")
    marked = _cli_train({**KEYS, "chosen-on-private-data": "posthoc-tau,hyper-parameters", "out-dir": tmp_path / "m"})
    assert tau_line in marked["not_accounted"]
    assert any(s.startswith("hyper-parameters chosen on a validation split of the private training records")
               for s in marked["not_accounted"])
    assert tau_line in (tmp_path / "m" / "MODEL_CARD.md").read_text()
    plain = _cli_train({**KEYS, "out-dir": tmp_path / "p"})
    assert not any("validation split of the private" in s for s in plain["not_accounted"])
    assert marked["epsilon_spent"] == plain["epsilon_spent"] and marked["test_accuracy"] == plain["test_accuracy"]
    with pytest.raises(ConfigError, match=r"config key 'chosen-on-private-data': got 'posthoc_tau' \(unknown "
                                          r"'posthoc_tau'\); allowed: '' or comma-separated items of"):
        Config.from_mapping({"chosen-on-private-data": "posthoc_tau"})


def test_model_pt_loads_into_a_fresh_model_built_from_model_json(finished):
    run, _ = finished
    meta = json.load(open(run / "model.json"))
    assert (meta["factory"], meta["num_classes"], meta["classes"], meta["input_shape"], meta["dtype"]) == (
        "tiny-mlp", 3, ["0", "1", "2"], [1, 4, 4], "float32")
    assert len(meta["priors"]) == 3 and abs(sum(meta["priors"]) - 1) < 1e-12
    assert meta["prediction_shift"] == pytest.approx([-np.log(p) for p in meta["priors"]])
    model, _ = load_model(run)
    assert isinstance(model, TinyMLP) and not model.training
    state = torch.load(run / "model.pt", weights_only=True)
    assert set(state) == {"net.1.weight", "net.1.bias", "net.3.weight", "net.3.bias"}
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
    assert flat.dtype == np.float32 and np.array_equal(flat, np.load(run / "final_params.npy").astype(np.float32))
    fresh = TinyMLP(3)  # an untrained module of the same architecture, loaded by the user
    fresh.load_state_dict(state)
    x = torch.randn(5, 1, 4, 4)
    assert torch.equal(fresh(x), model(x))


def test_every_run_writes_a_model_card_and_plots(finished):
    run, summary = finished
    card = (run / "MODEL_CARD.md").read_text()
    acc, worst = summary["test_accuracy"], summary["worst_class_accuracy"]
    assert f"Accuracy {acc:.4f}, worst-class accuracy {worst:.4f}" in card
    assert f"({summary['epsilon_spent']:.4g}, {summary['delta']:.3g}) spent of the target epsilon 4" in card
    assert summary["trust_model"] in card and all(item in card for item in summary["not_accounted"])
    assert f"- Algorithm: dp-sgd, 8 iterations, seed {summary['seed']}," in card  # dp-sgd: no psi, lambda
    for k, a in enumerate(summary["per_class_accuracy"]):
        assert f"| {k} | {a:.4f} |" in card
    for name in ("training_curves.png", "per_class_accuracy.png"):
        assert (run / "plots" / name).read_bytes()[:8] == PNG_MAGIC
        assert f"(plots/{name})" in card


def test_the_summary_has_the_class_counts_and_a_released_models_card_states_epsilon_total(finished):
    from dpdro.server.run_report import model_card

    run, summary = finished
    correct, total = summary["eval_class_correct"], summary["eval_class_total"]
    assert [c / t for c, t in zip(correct, total, strict=True)] == pytest.approx(summary["per_class_accuracy"])
    model = json.load(open(run / "model.json"))
    block = {"epsilon_total": 3.51, "delta": 1e-5, "theorem": "Papernot & Steinke 2022, Theorem 2"}
    card = model_card({**summary, "private_search": block}, model, [])
    assert "private hyper-parameter search (Papernot & Steinke 2022, Theorem 2): epsilon_total = 3.51 at delta 1e-05" \
        in card
    assert "private hyper-parameter search" not in model_card(summary, model, [])


def test_a_rerun_with_overwrite_replaces_the_model_files(overlap, tmp_path):
    run = tmp_path / "run"
    _cli_train({**KEYS, "out-dir": run})
    first = (run / "model.pt").read_bytes()
    _cli_train({**KEYS, "out-dir": run, "seed": 6, "overwrite": True})
    assert (run / "model.pt").read_bytes() != first
    flat = torch.cat([p.detach().reshape(-1) for p in load_model(run)[0].parameters()]).double().numpy()
    assert np.array_equal(flat, np.load(run / "final_params.npy").astype(np.float32))


def test_fit_trains_a_module_object_and_a_factory_on_python_records(tmp_path):
    rng = np.random.default_rng(0)
    y = torch.as_tensor(rng.integers(0, 2, 400))
    x = torch.as_tensor(rng.normal(size=(400, 1, 4, 4)), dtype=torch.float32) + y.view(-1, 1, 1, 1) * 1.5
    data = (dpdro.records(x[:300], y[:300], 2), dpdro.records(x[300:], y[300:], 2, name="held-out"))
    keys = {k: v for k, v in KEYS.items() if k != "dataset"} | {"posthoc-tau": 0.0, "refresh-batch": 100,
                                                                 "diff-batch": 100}
    module = TinyMLP(2)
    by_object = dpdro.fit({**keys, "out-dir": str(tmp_path / "obj")}, data=data, model=module)
    assert by_object.model is module  # the user's module now holds the trained weights
    flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()]).double().numpy()
    assert np.array_equal(flat, np.load(tmp_path / "obj" / "final_params.npy").astype(np.float32))
    assert by_object.summary["test_accuracy"] > 0.7
    meta = json.load(open(tmp_path / "obj" / "model.json"))
    assert meta["factory"] is None and meta["module_class"].endswith(":TinyMLP") and meta["data"] == "held-out"
    with pytest.raises(ValueError, match="pass it as module="):
        load_model(tmp_path / "obj")
    # an importable factory becomes config key model (as on the command line); a lambda is built in fit with
    # torch seeded by key seed, as make_model builds: both start from, and end at, the same parameters
    by_factory = dpdro.fit({**keys, "out-dir": str(tmp_path / "fac")}, data=data, model=TinyMLP)
    by_lambda = dpdro.fit({**keys, "out-dir": str(tmp_path / "lam")}, data=data, model=lambda k: TinyMLP(k))
    assert json.load(open(tmp_path / "fac" / "model.json"))["factory"] == "test_model_files:TinyMLP"
    assert json.load(open(tmp_path / "lam" / "model.json"))["factory"] is None
    assert np.array_equal(np.load(tmp_path / "fac" / "final_params.npy"),
                          np.load(tmp_path / "lam" / "final_params.npy"))
    assert by_factory.summary["test_accuracy"] == by_lambda.summary["test_accuracy"]
    assert isinstance(load_model(tmp_path / "fac")[0], TinyMLP)  # rebuilt from the import path in model.json


def test_fit_refuses_bad_arguments_before_training(tmp_path):
    data = (dpdro.records(torch.zeros(10, 1, 4, 4), torch.zeros(10, dtype=torch.long), 2),) * 2
    with pytest.raises(ValueError, match="with data= name a model"):
        dpdro.fit({"out-dir": str(tmp_path / "a")}, data=data)
    bn = nn.Sequential(nn.Flatten(), nn.Linear(16, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    with pytest.raises(ModelError, match="BatchNorm1d.*GroupNorm"):
        dpdro.fit({"out-dir": str(tmp_path / "b"), "refresh-batch": 5, "diff-batch": 5}, data=data, model=bn)
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 2\); got values in \[0, 2\]"):
        dpdro.records(torch.zeros(3, 2), torch.tensor([0, 1, 2]), 2)
    with pytest.raises(dpdro.api.ConfigError, match="config key 'epsilon'"):
        dpdro.fit({"epsilon": -1, "out-dir": str(tmp_path / "c")})
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists() and not (tmp_path / "c").exists()


def test_a_csv_run_names_its_classes_and_evaluate_reports_the_worst_group(tmp_path, capsys):
    from test_user_data import CSV_KEYS, HEADER, easy_rows, write_csv

    write_csv(tmp_path / "data" / "train.csv", easy_rows(400, 1), HEADER)
    write_csv(tmp_path / "data" / "test.csv", easy_rows(200, 2), HEADER)
    run = tmp_path / "run"
    keys = {**CSV_KEYS, "data-root": tmp_path / "data", "algorithm": "dp-sgd", "epsilon": 4.0, "iterations": 20,
            "refresh-batch": 100, "diff-batch": 100, "num-clients": 2, "eval-every": 20, "checkpoint-every": 0,
            "reproducible": True, "reproducible-for-testing": True, "threads": 1, "seed": 1, "out-dir": run}
    summary = _cli_train(keys)
    meta = json.load(open(run / "model.json"))
    assert (meta["factory"], meta["classes"], meta["input_shape"]) == ("mlp", ["no", "yes"], [2])
    # what scoring new rows by hand needs: the declared columns and public bounds, as the run used them
    assert (meta["preprocessing"]["csv-bounds"], meta["preprocessing"]["csv-group"]) == ("0:10", "site")
    assert isinstance(load_model(run)[0], nn.Module)
    capsys.readouterr()
    assert main(["predict", "--run", str(run)]) == 0
    rows = list(csv.DictReader(open(run / "predictions_test.csv")))
    assert {r["predicted_class"] for r in rows} <= {"no", "yes"} and list(rows[0])[-2:] == ["score_no", "score_yes"]
    assert float(np.mean([r["label"] == r["predicted"] for r in rows])) == summary["test_accuracy"]
    assert main(["evaluate", "--run", str(run)]) == 0
    out = capsys.readouterr().out
    assert f"worst-group accuracy {summary['worst_group_accuracy']:.4f}" in out
    assert "| no | " in (run / "MODEL_CARD.md").read_text()


def _card_block(card: str, lang: str) -> str:
    """The first fenced block of ``lang`` ('' for a plain one) in a model card."""
    m = re.search(rf"^```{lang}\n(.*?)^```", card, re.S | re.M)
    assert m, card
    return m.group(1)


def _card_evaluate_args(run) -> list[str]:
    """The card's `dpdro evaluate ...` command as CLI arguments (its comment dropped)."""
    line = next(ln for ln in _card_block((run / "MODEL_CARD.md").read_text(), "").splitlines()
                if ln.startswith("dpdro evaluate"))
    return shlex.split(line.split("#")[0])[1:]


def test_the_card_evaluate_command_of_a_data_set_run_repeats_its_accuracy(finished, capsys, monkeypatch, tmp_path):
    run, summary = finished
    card = (run / "MODEL_CARD.md").read_text()
    assert str(run) not in card and "--run ." in card  # paths relative to the run folder: a copy keeps a right card
    copied = tmp_path / "copied-run"
    shutil.copytree(run, copied)
    monkeypatch.chdir(copied)  # the card's commands run from the (copied) run folder
    capsys.readouterr()
    assert main(_card_evaluate_args(copied)) == 0
    assert f"accuracy {summary['test_accuracy']:.4f}" in capsys.readouterr().out


def test_the_card_evaluate_command_of_an_entry_point_run_repeats_its_accuracy(tmp_path, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent / "plugins"))
    run = tmp_path / "run"
    summary = _cli_train({**KEYS, "dataset": "user_code:blobs", "model": "user_code:tiny_mlp", "posthoc-tau": 0.0,
                          "refresh-batch": 60, "diff-batch": 60, "out-dir": run})
    assert json.load(open(run / "config.json"))["dataset"] == "user_code:blobs"
    assert "`user_code:blobs`: its module must be importable" in (run / "MODEL_CARD.md").read_text()
    monkeypatch.chdir(run)
    capsys.readouterr()
    assert main(_card_evaluate_args(run)) == 0
    assert f"accuracy {summary['test_accuracy']:.4f}" in capsys.readouterr().out


def test_a_fit_on_python_records_records_python_data_and_its_card_snippet_runs(tmp_path, capsys):
    rng = np.random.default_rng(1)
    y = torch.as_tensor(rng.integers(0, 2, 400))
    x = torch.as_tensor(rng.normal(size=(400, 1, 4, 4)), dtype=torch.float32) + y.view(-1, 1, 1, 1) * 1.5
    keys = {k: v for k, v in KEYS.items() if k != "dataset"} | {"posthoc-tau": 0.0, "refresh-batch": 100,
                                                                 "diff-batch": 100, "out-dir": str(tmp_path / "run")}
    result = dpdro.fit(keys, data=(dpdro.records(x[:300], y[:300], 2), dpdro.records(x[300:], y[300:], 2)),
                       model=TinyMLP)
    run = result.run_dir
    # recorded as what it is, not the default of key dataset (mnist-st), in every file
    assert json.load(open(run / "config.json"))["dataset"] == "python-data" == result.summary["dataset"]
    card = (run / "MODEL_CARD.md").read_text()
    assert "dpdro evaluate --run" not in card and "records passed from Python" in card
    # the card's Python snippet runs as written, given the user's held-out records, and repeats the accuracy
    capsys.readouterr()
    with pytest.MonkeyPatch.context() as m:
        m.chdir(run)  # the card's code runs from the run folder
        exec(_card_block(card, "python"), {"x_test": x[300:], "y_test": y[300:]})  # noqa: S102 - the card's own code
    printed = capsys.readouterr().out
    assert f"'accuracy': {result.summary['test_accuracy']}" in printed
    # the same held-out records as a torch Dataset of (input, label) items give the same evaluation
    from_dataset = dpdro.records(torch.utils.data.TensorDataset(x[300:], y[300:]), num_classes=2)
    assert torch.equal(from_dataset.x, x[300:]) and torch.equal(from_dataset.y, y[300:])
    assert dpdro.evaluate(run, from_dataset)["accuracy"] == result.summary["test_accuracy"]
    with pytest.raises(ValueError, match="num_classes must be declared"):
        dpdro.records(torch.utils.data.TensorDataset(x, y))
    # the command line says how to evaluate such a run instead of loading mnist-st
    assert main(["evaluate", "--run", str(run)]) == 2
    assert "trained on records passed to dpdro.fit(data=...) from Python" in capsys.readouterr().err


def test_choose_posthoc_tau_trains_validation_models_and_rewrites_the_tuned_file(overlap, tmp_path, capsys):
    """dpdro lab tune --choose-posthoc-tau: the tuned file's tau becomes the one the search's score chooses from the
    validation models' mean terms over the grid, the other keys stay, a comment line says how; a file that
    releases no priors is skipped; a second call trains nothing and replaces its line instead of adding one."""
    import tomllib

    from dpdro.server.objective import choose_by_terms
    from dpdro.simulations.posthoc_tau import choose_posthoc_tau, scan
    from dpdro.simulations.tuned import RECHOSEN_MARK, tuned_config_path

    configs = tmp_path / "configs"
    (configs / "tuned").mkdir(parents=True)
    keys = {**{k: v for k, v in KEYS.items() if k not in ("seed", "eval-every")}, "diff-batch": 60}
    path = tuned_config_path("overlap-3", 4.0, "dp-sgd", configs / "tuned")
    path.write_text("# Transferred by a test. Nothing of this data set chose these keys.\n"
                    + "".join(f"{k} = {json.dumps(v)}\n" for k, v in keys.items()))
    no_priors = tuned_config_path("overlap-3", 4.0, "dp-sgd-dual", configs / "tuned")
    no_priors.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in {**keys, "algorithm": "dp-sgd-dual",
                                                                        "posthoc-tau": 0.0}.items()))
    before_no_priors = no_priors.read_text()
    grid = (0.0, 0.5, 3.0)
    choices = choose_posthoc_tau("overlap-3", 4.0, ["dp-sgd", "dp-sgd-dual", "dp-sgda"], tmp_path / "root",
                                 configs, grid, seeds=2, jobs=1)
    assert set(choices) == {"dp-sgd"} and no_priors.read_text() == before_no_priors
    c = choices["dp-sgd"]
    assert [m.name[-6:] for m in c.models] == ["-seed1", "-seed2"]
    for m in c.models:
        s = json.loads((m / "summary.json").read_text())
        assert s["eval_split"] == "validation" and s["n"] == 480  # 600 training records minus 20% validation
    taus = [0.0, 0.5, 1.0, 3.0]  # the grid and the file's own tau
    terms = scan(list(c.models), taus)
    assert c.chosen == taus[choose_by_terms(terms)] and c.chosen_terms == terms[taus.index(c.chosen)]
    assert c.previous == 1.0 and c.previous_terms == terms[2]
    written = tomllib.loads(path.read_text())  # the choice is marked: a run of the file lists it as not accounted
    assert written == {**keys, "posthoc-tau": c.chosen, "chosen-on-private-data": "posthoc-tau"}
    lines = path.read_text().splitlines()
    assert lines[0] == "# Transferred by a test. Nothing of this data set chose these keys but posthoc-tau (below)."
    assert lines[1].startswith(f"# {RECHOSEN_MARK} on overlap-3's validation split by `dpdro tune")
    assert f": {c.chosen:g} (validation worst {c.chosen_terms[0]:.3f}" in lines[1] and "0, 0.5, 3:" in lines[1]
    # again, with an accuracy floor no tau reaches: nothing trains, the file stays as it is
    stamps = [(m / "summary.json").stat().st_mtime_ns for m in c.models]
    text = path.read_text()
    again = choose_posthoc_tau("overlap-3", 4.0, ["dp-sgd"], tmp_path / "root", configs, grid, seeds=2, jobs=1,
                               min_accuracy=1.0)
    assert again["dp-sgd"].chosen is None and path.read_text() == text
    assert [(m / "summary.json").stat().st_mtime_ns for m in c.models] == stamps
    # once more without the floor: the same tau, so the file keeps the first call's line (its previous tau)
    choose_posthoc_tau("overlap-3", 4.0, ["dp-sgd"], tmp_path / "root", configs, grid, seeds=2, jobs=1)
    assert path.read_text() == text
    # a file whose tau was changed by hand: chosen again, one line of this step (replaced, not added)
    path.write_text(text.replace(f"posthoc-tau = {c.chosen}", "posthoc-tau = 0.25"))
    choose_posthoc_tau("overlap-3", 4.0, ["dp-sgd"], tmp_path / "root", configs, grid, seeds=2, jobs=1)
    assert sum(RECHOSEN_MARK in line for line in path.read_text().splitlines()) == 1
    taus = [0.0, 0.25, 0.5, 3.0]  # the grid and the file's tau now
    assert "instead of 0.25 (" in path.read_text()
    assert tomllib.loads(path.read_text())["posthoc-tau"] == taus[choose_by_terms(scan(list(c.models), taus))]
    assert [(m / "summary.json").stat().st_mtime_ns for m in c.models] == stamps
    with pytest.raises(ValueError, match="--tau-seeds: got 0"):
        choose_posthoc_tau("overlap-3", 4.0, ["dp-sgd"], tmp_path / "root", configs, grid, seeds=0)
    with pytest.raises(ValueError, match="--tau-grid: got"):
        choose_posthoc_tau("overlap-3", 4.0, ["dp-sgd"], tmp_path / "root", configs, (-1.0,))
