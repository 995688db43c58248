"""`dpdro plan` prints the run plan (server/run_plan.py ``describe_plan``): the model, the problem, every release
with its count, sampling rate and calibrated noise multiplier, delta and the planned epsilon, as text and as JSON.
The noise multiplier is checked against dp-accounting directly, not against the ledger that calibrated it."""

from __future__ import annotations

import json

import numpy as np
import pytest

# TabularMLP on 2 features and 2 classes: 2 -> 64 -> 64 -> 2, weights and biases
MLP_PARAMETERS = (2 * 64 + 64) + (64 * 64 + 64) + (64 * 2 + 2)


def _csv(path, n: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    rows = ["f1,f2,label,site"]
    for i in range(n):
        f1, f2 = rng.uniform(0, 10, 2)
        rows.append(f"{f1:.3f},{f2:.3f},{'yes' if f1 > f2 else 'no'},{'ab'[i % 2]}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(rows) + "\n")


@pytest.fixture
def keys(tmp_path) -> list[str]:
    _csv(tmp_path / "data" / "train.csv", 200, 1)
    _csv(tmp_path / "data" / "test.csv", 50, 2)
    return ["dataset=csv", "csv-bounds=0:10", "csv-group=site", f"data-root={tmp_path / 'data'}", "algorithm=dp-sgd",
            "iterations=5", "refresh-batch=40", "clip-x=0.5", "epsilon=2"]


def test_plan_prints_model_problem_releases_and_calibrated_noise(keys, capsys):
    import dp_accounting
    from dp_accounting.pld import pld_privacy_accountant
    from dp_accounting.rdp import rdp_privacy_accountant

    from dpdro.cli import main

    assert main(["plan", "--format", "json", "--set", *keys]) == 0
    p = json.loads(capsys.readouterr().out)
    assert (p["algorithm"], p["dataset"], p["n"], p["iterations"], p["fitted"]) == ("dp-sgd", "csv", 200, 5, [])
    assert p["delta"] == pytest.approx(1 / (10 * 200)) and p["epsilon_target"] == 2.0 and p["accountant"] == "pld"
    assert p["model"] == {"factory": "mlp", "module_class": "dpdro.common.models:TabularMLP", "dtype": "float32",
                          "init_weights": None, "trainable": "all", "trainable_parameters": MLP_PARAMETERS,
                          "parameters": MLP_PARAMETERS}
    assert p["problem"] == {"num_classes": 2, "num_groups": 2, "dro": False,
                            "keys": {"refresh-batch": 40, "clip-x": 0.5, "lr-x": 1.0}}
    [r] = p["releases"]
    assert (r["name"], r["count"], r["sampling_rate"]) == ("grad", 5, 40 / 200)
    z = r["noise_multiplier"]
    assert 0.3 < z < 3.0

    def epsilon(accountant) -> float:  # 5 Poisson-sampled Gaussian releases at rate 0.2 and noise multiplier z
        event = dp_accounting.PoissonSampledDpEvent(0.2, dp_accounting.GaussianDpEvent(z))
        return accountant.compose(dp_accounting.SelfComposedDpEvent(event, 5)).get_epsilon(p["delta"])

    pld = epsilon(pld_privacy_accountant.PLDAccountant())
    assert 0.98 * 2.0 <= pld <= 2.02 and p["planned_epsilon"]["pld"] == pytest.approx(pld, rel=0.02)
    assert p["planned_epsilon"]["rdp"] == pytest.approx(epsilon(rdp_privacy_accountant.RdpAccountant()), rel=0.02)
    assert p["planned_epsilon"]["rdp"] > p["planned_epsilon"]["pld"]  # RDP's bound is looser

    assert main(["plan", "--set", *keys]) == 0
    out = capsys.readouterr().out
    assert (f"model: mlp (dpdro.common.models:TabularMLP, float32), {MLP_PARAMETERS} trainable of {MLP_PARAMETERS} "
            "parameters") in out
    assert "problem: 2 classes, 2 groups, average loss; refresh-batch=40, clip-x=0.5, lr-x=1.0" in out
    assert f"{'grad':<16}{5:>7}{0.2:>15.4g}{z:>18.4f}" in out
    assert f"planned epsilon: pld {p['planned_epsilon']['pld']:.4f}, rdp {p['planned_epsilon']['rdp']:.4f}" in out


def test_plan_of_a_non_private_run_has_no_noise_and_no_epsilon(keys, capsys):
    from dpdro.cli import main

    assert main(["plan", "--format", "json", "--set", *keys, "epsilon=inf"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert p["planned_epsilon"] is None and [r["noise_multiplier"] for r in p["releases"]] == [0.0]
    assert p["epsilon_target"] == "inf"  # strict JSON: non-finite floats as strings
