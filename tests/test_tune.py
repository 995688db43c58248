"""dpdro lab tune (simulations/tune.py) with Optuna: seeded TPE, pruning, resumable storage, equal budgets,
confirmation on more seeds, the selection score. The trials are synthetic (``tune.train_trial`` replaced by a
function of the trial's keys): no training runs here."""

from __future__ import annotations

import json
import math
import tomllib
from pathlib import Path

import pytest

from dpdro.common.algorithm_specs import FloatRange
from dpdro.common.config import Config, ConfigError
from dpdro.server.objective import choose_by_objective, objective_terms, pack_terms, validation_objective
from dpdro.simulations import tune

DS, EPS = "mnist-st", 4.0


def _quality(cfg: Config) -> float:
    """A smooth synthetic validation quality of a trial's keys: best at lr-x = 4, posthoc-tau = 0.5."""
    return max(0.0, 0.9 - 0.25 * abs(math.log(cfg.lr_x / 4.0)) - 0.3 * abs(cfg.posthoc_tau - 0.5))


class FakeRunner:
    """Stands in for tune.train_trial: writes config.json / summary.json like a run, reports an evaluation row
    at each eval-every (quality growing towards its final value), records every call."""

    def __init__(self, interrupt_at: int | None = None, quality=_quality):
        self.calls: list[Config] = []
        self.reports: list[tuple[str, int]] = []
        self.interrupt_at = interrupt_at  # raise KeyboardInterrupt at this call (0-based), once
        self.quality = quality

    def __call__(self, cfg: Config, report) -> dict:
        if self.interrupt_at is not None and len(self.calls) == self.interrupt_at:
            self.interrupt_at = None
            self.calls.append(cfg)
            raise KeyboardInterrupt
        self.calls.append(cfg)
        out = Path(cfg.out_dir)
        out.mkdir(parents=True, exist_ok=False)  # a trial never reuses a run directory
        (out / "config.json").write_text(json.dumps(cfg.to_dict()))
        q = self.quality(cfg) + 0.001 * cfg.seed
        row = {}
        for t in range(0, cfg.iterations + 1, cfg.eval_every):
            f = q * t / cfg.iterations
            row = {"iteration": t, "test_accuracy": min(1.0, f + 0.05), "per_class_accuracy": [f, f + 0.02, 0.99]}
            if report is not None:
                self.reports.append((cfg.out_dir, t))
                report(row)
        summary = {**row, "epsilon_spent": cfg.epsilon, "wall_seconds": 1.0}
        (out / "summary.json").write_text(json.dumps(summary))
        return summary


@pytest.fixture
def fake(monkeypatch):
    runner = FakeRunner()
    monkeypatch.setattr(tune, "train_trial", runner)
    return runner


def _params(root: Path, method: str) -> list[dict]:
    study = tune.open_study(root, DS, EPS, method)
    return [t.params for t in study.get_trials(deepcopy=False)]


def test_validation_objective_breaks_ties_by_the_two_lowest_classes_then_accuracy():
    assert objective_terms([0.5, 0.2, float("nan"), 0.9], 0.7) == (0.2, 0.35, 0.7)
    assert objective_terms([0.4], 0.4) == (0.4, 0.4, 0.4)
    # worst decides, whatever the rest
    assert validation_objective([0.11, 0.11, 0.11], 0.11) > validation_objective([0.10, 1.0, 1.0], 1.0)
    # every worst class at 0: the second lowest class decides, not the accuracy on imbalanced data
    assert validation_objective([0.0, 0.30, 0.5], 0.60) > validation_objective([0.0, 0.10, 0.99], 0.95)
    # worst and two lowest tied: accuracy decides
    assert validation_objective([0.0, 0.2, 0.5], 0.61) > validation_objective([0.0, 0.2, 0.9], 0.60)
    # equal terms (to 4 decimals): equal scores; the score reads as the worst-class accuracy
    assert validation_objective([0.2, 0.3], 0.5) == validation_objective([0.20001, 0.3], 0.5)
    assert abs(validation_objective([0.25, 0.5, 0.75], 0.6) - 0.25) < 1e-4
    # the packing is exact at the extremes of the digits
    assert pack_terms((0.0, 1.0, 1.0)) < pack_terms((0.0001, 0.0001, 0.0)) < pack_terms((1.0, 1.0, 1.0)) < 1.0
    with pytest.raises(ValueError, match="per-class accuracies"):
        objective_terms([float("nan")], 0.5)
    with pytest.raises(ValueError, match="accuracy: got 1.5"):
        objective_terms([0.5], 1.5)


def test_choose_by_objective_takes_the_best_score_above_the_accuracy_floor():
    rows = [{"accuracy": 0.97, "per_class_accuracy": [0.6, 0.9]},   # 0: worst 0.6
            {"accuracy": 0.95, "per_class_accuracy": [0.88, 0.90]},  # 1: worst 0.88, two lowest 0.89
            {"accuracy": 0.96, "per_class_accuracy": [0.88, 0.92]},  # 2: worst 0.88, two lowest 0.90 -> best
            {"accuracy": 0.85, "per_class_accuracy": [0.95, 0.95]}]  # 3: best worst, below the floor
    assert choose_by_objective(rows, 0.88) == 2
    assert choose_by_objective(rows) == 3
    assert choose_by_objective(rows, 0.99) is None
    assert choose_by_objective(rows[1:3] + rows[1:3], 0.0) == 1  # the first of equal scores
    # groups count instead of the classes where they are given (CelebA), as in tuning
    grouped = [{"accuracy": 0.9, "per_class_accuracy": [0.9, 0.9], "per_group_accuracy": [0.2, 0.9]},
               {"accuracy": 0.9, "per_class_accuracy": [0.5, 0.9], "per_group_accuracy": [0.6, 0.9]}]
    assert choose_by_objective(grouped) == 1
    with pytest.raises(ValueError, match=r"min-accuracy: got 1.5; allowed: \[0, 1\]"):
        choose_by_objective(rows, 1.5)


def test_mean_terms_averages_each_term_and_choose_by_terms_honours_the_floor():
    from dpdro.server.objective import choose_by_terms, mean_terms

    assert mean_terms([(0.5, 0.6, 0.9), (0.25, 0.4, 0.8)]) == pytest.approx((0.375, 0.5, 0.85))
    terms = [(0.5, 0.6, 0.80), (0.4, 0.7, 0.90), (0.5, 0.6, 0.85)]
    assert choose_by_terms(terms) == 2  # same worst and two-lowest: the higher accuracy
    assert choose_by_terms(terms, 0.86) == 1
    assert choose_by_terms(terms, 0.95) is None
    with pytest.raises(ValueError, match="evaluations: got none"):
        mean_terms([])
    with pytest.raises(ValueError, match="min-accuracy: got -0.1"):
        choose_by_terms(terms, -0.1)


def test_tpe_search_is_seeded_and_reproducible(tmp_path, fake):
    trials = tune.TPE_STARTUP_TRIALS + 3  # past the random start: TPE's own proposals are compared too
    for root, seed, n in ((tmp_path / "a", 0, trials), (tmp_path / "b", 0, trials), (tmp_path / "c", 1, 2)):
        tune.run_search(DS, EPS, "dp-sgd", n, root, seed=seed, jobs=1)
    a, b, c = (_params(tmp_path / r, "dp-sgd") for r in "abc")
    assert len(a) == trials and a == b and a[:2] != c
    assert len({json.dumps(p, sort_keys=True) for p in a}) == trials
    assert set(a[0]) == set(tune.SPACES["dp-sgd"]) == {"lr-x", "refresh-batch", "posthoc-tau", "warmup-iterations"}


def test_interrupted_search_resumes_without_rerunning_a_trial(tmp_path, monkeypatch):
    runner = FakeRunner(interrupt_at=2)
    monkeypatch.setattr(tune, "train_trial", runner)
    root = tmp_path / "runs"
    with pytest.raises(KeyboardInterrupt):
        tune.run_search(DS, EPS, "dp-sgd", 4, root, jobs=1)
    study = tune.open_study(root, DS, EPS, "dp-sgd")
    assert len(tune.finished_trials(study)) == 2
    interrupted = study.trials[2].params
    # a trial left running by a killed search (no exception reached Optuna)
    killed = study.ask()
    tune.suggest(killed, "dp-sgd")
    killed_params = killed.params
    done_dirs = [c.out_dir for c in runner.calls[:2]]
    tune.run_search(DS, EPS, "dp-sgd", 4, root, jobs=1)
    study = tune.open_study(root, DS, EPS, "dp-sgd")
    finished = tune.finished_trials(study)
    assert len(finished) == 4  # 2 before + the interrupted and the killed point again: the budget, no more
    assert [c.out_dir for c in runner.calls[3:]].count(done_dirs[0]) == 0  # finished trials not run again
    assert len(runner.calls) == 3 + 2
    assert [t.params for t in finished[2:]] == [interrupted, killed_params]
    assert sorted(t.user_attrs["retry_of"] for t in finished[2:]) == [2, 3]
    # resuming a finished search runs nothing; a larger budget goes on from there
    assert tune.run_search(DS, EPS, "dp-sgd", 4, root, jobs=1) == 0
    assert tune.run_search(DS, EPS, "dp-sgd", 5, root, jobs=1) == 1 and len(runner.calls) == 6


def test_pruner_stops_a_clearly_bad_trial(tmp_path, monkeypatch):
    runner = FakeRunner(quality=lambda cfg: 0.05 if cfg.lr_x > 11.0 else 0.8)
    monkeypatch.setattr(tune, "train_trial", runner)
    root = tmp_path / "runs"
    study = tune.open_study(root, DS, EPS, "dp-sgd")
    for lr in (2.0, 3.0, 4.0, 5.0, 6.0):
        study.enqueue_trial({"lr-x": lr, "refresh-batch": 1024, "posthoc-tau": 0.5})
    study.enqueue_trial({"lr-x": 11.5, "refresh-batch": 1024, "posthoc-tau": 0.5})
    tune.run_search(DS, EPS, "dp-sgd", 6, root, jobs=1)
    trials = tune.open_study(root, DS, EPS, "dp-sgd").trials
    from optuna.trial import TrialState

    assert [t.state for t in trials] == [TrialState.COMPLETE] * 5 + [TrialState.PRUNED]
    iterations, warmup = tune.trial_iterations(DS), int(tune.PRUNE_WARMUP_FRACTION * tune.trial_iterations(DS))
    first_check = min(t for t in range(0, iterations + 1, iterations // tune.EVALS_PER_TRIAL) if t >= warmup and t > 0)
    assert trials[-1].user_attrs["pruned_at"] == first_check < iterations
    assert max(t for d, t in runner.reports if d == runner.calls[-1].out_dir) == first_check  # it stopped there
    assert len(tune.finished_trials(tune.open_study(root, DS, EPS, "dp-sgd"))) == 6  # a pruned trial counts


def test_every_method_gets_the_same_budget_and_the_tuned_files_hold_the_winners_keys(tmp_path, fake):
    root, configs, docs = tmp_path / "runs", tmp_path / "configs", tmp_path / "docs"
    methods = ["dp-sgd", "dp-sgd-la", "dp-double-spider"]
    winners = tune.run_tune(DS, EPS, methods, 4, root, configs, jobs=1, confirm_top=2, confirm_seeds=3)
    for method in methods:
        study = tune.open_study(root, DS, EPS, method)
        assert len(tune.finished_trials(study)) == 4
        # the top 2 complete trials ran again on seeds 1 and 2, nothing else
        top = [t.number for t in tune.top_trials(study, 2)]
        assert sorted(p.name for p in (tune.search_dir(root, DS, EPS) / method / "confirm").iterdir()) == sorted(
            f"trial{n:02d}-seed{s}" for n in top for s in (1, 2))
        win = winners[method]
        assert win["seeds"] == 3 and win["trial"] in top
        assert win == tune.select_winner(tune.candidates(DS, EPS, method, root, study, 2, 3), 3)
        with open(configs / "tuned" / f"{DS}-eps4-{method}.toml", "rb") as f:
            written = tomllib.load(f)
        params = tune.point_keys(method, study.trials[win["trial"]].params)
        assert {k: written[k] for k in params} == params == win["keys"]  # the winner's searched keys, exactly
        cfg = Config.from_mapping(written)
        assert cfg.eval_split == "test" and cfg.validation_fraction == 0.0 and cfg.algorithm == method
        # what the search chose on the validation split: a run of the file lists it as not accounted
        assert cfg.chosen_on_private == ("hyper-parameters", "posthoc-tau")
    assert sum(c.seed == 0 for c in fake.calls) == 12 and sum(c.seed > 0 for c in fake.calls) == 3 * 2 * 2
    best = max(winners.items(), key=lambda kv: kv[1]["score"])[0]
    with open(configs / f"{DS}-eps4-best.toml", "rb") as f:
        best_keys = tomllib.load(f)
    assert best_keys["algorithm"] == best  # the method, too, was chosen on the validation split
    assert best_keys["chosen-on-private-data"] == "hyper-parameters,model,posthoc-tau"
    # --report: nothing runs, the same files and the trials' document come out
    n_calls = len(fake.calls)
    assert tune.write_tuned(DS, EPS, methods, root, configs) == winners and len(fake.calls) == n_calls
    text = tune.tuning_report(tune.searched_entries(root, [DS]), methods, root, docs).read_text()
    assert "(per method: 4 TPE trials of at most 500 iterations, top 2 confirmed on 3 seeds)" in text
    assert text.count("**(selected)**") == 3 and "### dp-double-spider (4 of 4 trials" in text
    # a second run of the finished search trains nothing
    tune.run_tune(DS, EPS, methods, 4, root, configs, jobs=1, confirm_top=2, confirm_seeds=3)
    assert len(fake.calls) == n_calls


def test_winner_must_hold_on_all_confirmation_seeds():
    recs = [{"trial": 0, "seeds": 3, "score": 0.4}, {"trial": 1, "seeds": 2, "score": 0.9},
            {"trial": 2, "seeds": 3, "score": 0.4}]
    assert tune.select_winner(recs, 3)["trial"] == 0  # trial 1 is not confirmed yet; tie: lower number
    assert tune.select_winner(recs, 2)["trial"] == 1 and tune.select_winner(recs[1:2], 3) is None


def test_search_record_refuses_a_changed_seed_or_a_smaller_budget(tmp_path, fake):
    root, configs = tmp_path / "runs", tmp_path / "configs"
    tune.run_tune(DS, EPS, ["dp-sgd"], 2, root, configs, jobs=1, confirm_seeds=1)
    with pytest.raises(ConfigError, match="--seed: got 1"):
        tune.run_tune(DS, EPS, ["dp-sgd"], 2, root, configs, seed=1, jobs=1)
    with pytest.raises(ConfigError, match="--trials: got 1"):
        tune.run_tune(DS, EPS, ["dp-sgd"], 1, root, configs, jobs=1)
    with pytest.raises(ConfigError, match="--confirm-seeds: got 0"):
        tune.run_tune(DS, EPS, ["dp-sgd"], 2, root, configs, jobs=1, confirm_seeds=0)
    record = tune.read_search(root, DS, EPS)
    tune.search_file(root, DS, EPS).write_text(json.dumps({"trials": 8, "seed": 0}))  # a random search's record
    with pytest.raises(ConfigError, match="random search of an earlier dpdro"):
        tune.run_tune(DS, EPS, ["dp-sgd"], 2, root, configs, jobs=1)
    record["spaces"]["dp-sgd"]["lr-x"] = "FloatRange(low=1.0, high=2.0)"
    tune.search_file(root, DS, EPS).write_text(json.dumps(record))
    with pytest.raises(ConfigError, match="search space of dp-sgd changed"):
        tune.run_tune(DS, EPS, ["dp-sgd"], 2, root, configs, jobs=1)


def test_every_method_searches_the_same_levers():
    levers = {"lr-x", "refresh-batch", "posthoc-tau", "warmup-iterations"}
    for method, space in tune.SPACES.items():
        assert levers <= set(space), method
        assert ("logit-adjust-tau" in space) == (method != "dp-sgd"), method  # dp-sgd with tau > 0 is dp-sgd-la
    # every point of the space is a valid trial configuration
    for method, space in tune.SPACES.items():
        for end in ("low", "high"):
            point = {k: (d.values[0] if end == "low" else d.values[-1]) if hasattr(d, "values") else getattr(d, end)
                     for k, d in space.items()}
            cfg = tune.trial_config(DS, EPS, method, point, Path("unused"))
            assert cfg.eval_every * tune.EVALS_PER_TRIAL == cfg.iterations and cfg.eval_split == "validation"


def test_point_keys_round_grid_and_log_floats_for_readable_files():
    keys = tune.point_keys("dp-double-spider", {"posthoc-tau": 0.30000000000000004, "lr-x": 4.594176194078786,
                                                "q": 5, "dro-clip": "product"})
    assert keys == {"posthoc-tau": 0.3, "lr-x": 4.594, "q": 5, "dro-clip": "product"}


def test_trial_config_trains_without_the_validation_split_and_final_keys_evaluate_on_test(tmp_path):
    keys = {"lr-x": 2.0, "refresh-batch": 1024, "posthoc-tau": 0.5, "logit-adjust-tau": 1.0, "q": 5,
            "lambda": 1.0, "lr-eta": 0.1, "dro-clip": "product"}
    cfg = tune.trial_config(DS, EPS, "dp-double-spider", keys, tmp_path / "t")
    assert cfg.eval_split == "validation" and cfg.validation_fraction == 0.2 and cfg.seed == 0
    assert cfg.diff_batch == cfg.refresh_batch // 2
    final = tune.final_keys(cfg)
    assert "validation-fraction" not in final and "eval-split" not in final and "out-dir" not in final
    assert Config.from_mapping(final).eval_split == "test"
    assert tune.trial_config(DS, EPS, "dp-double-spider", keys, tmp_path / "t", seed=2).seed == 2


def test_a_second_tuner_on_the_same_search_is_refused(tmp_path, fake):
    root, configs = tmp_path / "runs", tmp_path / "configs"
    with tune._search_lock(root, DS, EPS):
        with pytest.raises(ConfigError, match="another dpdro lab tune is running"):
            tune.run_tune(DS, EPS, ["dp-sgd"], 1, root, configs, jobs=1, confirm_seeds=1)
    assert fake.calls == []
    tune.run_tune(DS, EPS, ["dp-sgd"], 1, root, configs, jobs=1, confirm_seeds=1)  # released: runs
    assert len(fake.calls) == 1


def test_a_worker_whose_tuner_has_gone_stops_like_ctrl_c(monkeypatch):
    import os

    monkeypatch.setattr(tune, "_PARENT_PID", os.getppid())
    tune._stop_if_orphaned(1)  # its tuner is alive: goes on
    monkeypatch.setattr(tune, "_PARENT_PID", os.getppid() + 10**7)
    with pytest.raises(KeyboardInterrupt, match="has gone"):
        tune._stop_if_orphaned(1)


def test_real_trial_reports_each_evaluation_and_stops_when_pruned(tmp_path):
    """The real trial runner (a tiny MNIST-ST run): the engine's evaluation hook reaches the reporter with the
    validation figures, and a TrialPruned raised there stops the run before its end (no summary.json)."""
    import optuna

    keys = {"lr-x": 2.0, "refresh-batch": 64, "posthoc-tau": 0.0}
    cfg = tune.trial_config(DS, EPS, "dp-sgd", keys, tmp_path / "t").with_updates(
        {"iterations": 6, "eval-every": 2, "max-train-records": 600, "max-test-records": 200})
    seen = []

    def report(row):
        seen.append((row["iteration"], len(row["per_class_accuracy"])))
        if row["iteration"] == 4:
            raise optuna.TrialPruned("test")

    with pytest.raises(optuna.TrialPruned):
        tune.train_trial(cfg, report)
    assert seen == [(0, 10), (2, 10), (4, 10)]
    assert (tmp_path / "t" / "metrics.csv").exists() and not (tmp_path / "t" / "summary.json").exists()


def test_report_without_a_search_leaves_the_document(tmp_path):
    from dpdro.cli import main

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "TUNING.md").write_text("an earlier search")
    assert main(["lab", "tune", "--report", "--root", str(tmp_path / "none"), "--docs", str(docs),
                 "--configs", str(tmp_path / "configs")]) == 0
    assert (docs / "TUNING.md").read_text() == "an earlier search"


def test_command_line_runs_the_search_with_its_budget(tmp_path, fake):
    from dpdro.cli import main

    root, configs, docs = tmp_path / "runs", tmp_path / "configs", tmp_path / "docs"
    args = ["lab", "tune", "--dataset", DS, "--trials", "2", "--methods", "dp-sgd", "dp-sgda", "--jobs", "1",
            "--confirm-top", "1", "--confirm-seeds", "2", "--root", str(root), "--configs", str(configs),
            "--docs", str(docs)]
    assert main(args) == 0
    assert len(fake.calls) == 2 * (2 + 1)
    assert (configs / "tuned" / f"{DS}-eps4-dp-sgda.toml").exists() and (configs / f"{DS}-eps4-best.toml").exists()
    assert "(per method: 2 TPE trials of at most 500 iterations, top 1 confirmed on 2 seeds)" in (
        docs / "TUNING.md").read_text()
    assert main([*args[:4], "--trials", "1", *args[6:]]) == 2  # a smaller budget: a clear error, exit status 2


def test_probe_runs_one_point_with_the_trial_protocol_outside_the_search(tmp_path, monkeypatch, capsys):
    """dpdro lab tune --probe: the trial's protocol (validation split, trial length, the method's fixed keys) with the
    given keys on top, in probes/ under the search folder, resumed rather than rerun, and no study written."""
    from dpdro.cli import main
    from dpdro.simulations import runner

    calls = []

    def fake_run_one(values, progress=None):
        calls.append(values)
        out = Path(values["out-dir"])
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").write_text(json.dumps({
            "eval_split": values["eval-split"], "seed": values["seed"], "test_accuracy": 0.9,
            "worst_class_accuracy": 0.5, "per_class_accuracy": [0.5, 1.0]}))
        return str(out), None

    monkeypatch.setattr(runner, "run_one", fake_run_one)
    args = ["lab", "tune", "--dataset", DS, "--methods", "dp-double-spider", "--root", str(tmp_path), "--probe",
            "dro-reference=uniform", "lambda=0.5", "q=1"]
    assert main(args) == 0
    (values,) = calls
    assert values["eval-split"] == "validation" and values["iterations"] == tune.trial_iterations(DS)
    assert values["dro-level"] == "group" and values["eta-clip-rule"] == "weight-bound"  # the method's fixed keys
    assert values["dro-reference"] == "uniform" and values["lambda"] == 0.5 and values["q"] == 1
    assert Path(values["out-dir"]).parent == tune.search_dir(tmp_path, DS, 4.0) / "probes"
    assert "accuracy 0.9000, worst 0.5000; per class 0.500, 1.000" in capsys.readouterr().out
    assert main(args) == 0 and len(calls) == 1  # finished: not run again
    assert not (tune.search_dir(tmp_path, DS, 4.0) / "optuna.journal").exists()
    assert main([*args[:-1], "q=7.5"]) == 2 and len(calls) == 1  # a bad value: refused before any run
    assert main(["lab", "tune", "--methods", "dp-sgd", "dp-sgda", "--root", str(tmp_path), "--probe", "q=1"]) == 2
    # the batch as the CLI gives it (text): the protocol scales it and halves it for the difference batch
    assert main([*args, "refresh-batch=1024"]) == 0 and len(calls) == 2
    assert (calls[-1]["refresh-batch"], calls[-1]["diff-batch"], calls[-1]["s-batch"]) == (1024, 512, 1024)
    # another seed of the same point is another run, in its own folder (a confirmation), then resumed as well
    assert main([*args, "--seed", "2"]) == 0 and len(calls) == 3 and calls[-1]["seed"] == 2
    assert Path(calls[-1]["out-dir"]).name == Path(values["out-dir"]).name + "-seed2"
    assert main([*args, "--seed", "2"]) == 0 and len(calls) == 3
    assert main([*args, "refresh-batchh=1024"]) == 2 and len(calls) == 3  # an unknown key: refused


def test_warm_start_enqueues_each_methods_shipped_point_within_the_same_budget(tmp_path, fake):
    root, configs, docs = tmp_path / "runs", tmp_path / "configs", tmp_path / "docs"
    (configs / "tuned").mkdir(parents=True)
    (configs / "handset").mkdir()
    (configs / "tuned" / f"{DS}-eps4-dp-sgd.toml").write_text('algorithm = "dp-sgd"\nlr-x = 3.0\n')
    (configs / "tuned" / f"{DS}-eps4-dp-sgd-la.toml").write_text('algorithm = "dp-sgd-la"\nlr-x = 5.0\n')
    # a hand-set file wins over the tuned one; keys it leaves out take their defaults ('auto' resolved)
    (configs / "handset" / f"{DS}-eps4-dp-sgd-la-x.toml").write_text(
        'algorithm = "dp-sgd-la"\nlr-x = 2.0\nposthoc-tau = 0.35\nrefresh-batch = 1024\n')
    tune.run_tune(DS, EPS, ["dp-sgd", "dp-sgd-la"], 3, root, configs, jobs=1, confirm_seeds=1, warm_start=True)
    first = {c.algorithm: c for c in fake.calls if c.out_dir.endswith("trial00")}
    batch = Config.from_mapping({}).refresh_batch
    assert (first["dp-sgd"].lr_x, first["dp-sgd"].refresh_batch, first["dp-sgd"].posthoc_tau) == (3.0, batch, 0.0)
    assert (first["dp-sgd-la"].lr_x, first["dp-sgd-la"].posthoc_tau, first["dp-sgd-la"].tau) == (2.0, 0.35, 1.0)
    for method in ("dp-sgd", "dp-sgd-la"):
        study = tune.open_study(root, DS, EPS, method)
        assert len(tune.finished_trials(study)) == 3  # the shipped point is one of the 3, not a fourth
        assert [("shipped" in t.user_attrs) for t in study.trials] == [True, False, False]
    text = tune.tuning_report(tune.searched_entries(root, [DS]), ["dp-sgd", "dp-sgd-la"], root, docs).read_text()
    assert "the first the method's shipped configuration" in text
    assert "Not in this search: dp-double-spider, recursive-spider, dp-sgda, dp-sgd-dual, dp-spiderboost" in text
    assert f"complete (shipped: {DS}-eps4-dp-sgd-la-x.toml)" in text
    # a resumed search enqueues nothing again
    tune.run_tune(DS, EPS, ["dp-sgd"], 4, root, configs, jobs=1, confirm_seeds=1, warm_start=True)
    assert sum("shipped" in t.user_attrs for t in tune.open_study(root, DS, EPS, "dp-sgd").trials) == 1


def test_warm_start_refuses_a_shipped_point_outside_the_space_before_any_run(tmp_path, fake):
    configs = tmp_path / "configs"
    (configs / "tuned").mkdir(parents=True)
    (configs / "tuned" / f"{DS}-eps4-dp-sgd.toml").write_text('algorithm = "dp-sgd"\nlr-x = 30.0\n')
    with pytest.raises(ConfigError, match=r"lr-x = 30.0 lies outside the search space of dp-sgd"):
        tune.run_tune(DS, EPS, ["dp-sgd"], 2, tmp_path / "runs", configs, jobs=1, warm_start=True)
    (configs / "tuned" / f"{DS}-eps4-dp-sgd.toml").write_text('algorithm = "dp-sgd"\nposthoc-tau = 0.33\n')
    with pytest.raises(ConfigError, match=r"posthoc-tau = 0.33 lies outside"):  # off the 0.05 grid
        tune.run_tune(DS, EPS, ["dp-sgd"], 2, tmp_path / "runs", configs, jobs=1, warm_start=True)
    assert fake.calls == []


def test_a_data_set_may_replace_a_methods_range():
    """cifar10-st trains a linear head on scattering features: its step range replaces every method's own (the
    CNNs' steps diverge there), the other data sets keep the methods' ranges, and its trials train scatter-linear
    with the ghost engine."""
    for method in tune.SPACES:
        assert tune.space(method, "cifar10-st")["lr-x"] == FloatRange(0.05, 2.0, log=True)
        assert tune.space(method, "mnist-st") == tune.SPACES[method]
        rest = {k: v for k, v in tune.space(method, "cifar10-st").items() if k != "lr-x"}
        assert rest == {k: v for k, v in tune.SPACES[method].items() if k != "lr-x"}
    point = {"lr-x": 0.3, "refresh-batch": 1024, "posthoc-tau": 0.5, "warmup-iterations": 0,
             "logit-adjust-tau": 1.0}
    cfg = tune.trial_config("cifar10-st", EPS, "dp-sgd-la", point, Path("unused"))
    assert (cfg.features, cfg.model, cfg.per_record_engine, cfg.lr_x) == ("scatternet", "scatter-linear", "ghost", 0.3)
    assert tune.final_keys(cfg)["per-record-engine"] == "ghost"
