"""The private search's bound (server/private_tuning.py) against an independent computation of Papernot and
Steinke's statements (ICLR 2022, Theorems 2 and 6), and a small private search (simulations/private_tune.py) whose
events, summed from its trials' summaries, give the same epsilon_total."""

from __future__ import annotations

import argparse
import json
import math

import numpy as np
import pytest

from dpdro.common.config import ConfigError
from dpdro.server import private_tuning as ps
from dpdro.simulations import private_tune

DELTA = 1e-5


# ---- an independent implementation of the paper's statements (no dp-accounting) ----
def gaussian_rdp(orders, releases):
    """RDP of Gaussian mechanisms without sampling, noise multipliers ``releases`` (z, count): alpha sum c / (2 z^2)
    (Mironov 2017, Proposition 7, composed)."""
    return np.array([a * sum(c / (2 * z * z) for z, c in releases) for a in orders])


def rdp_to_epsilon(orders, rdp, delta):
    """eps = min_a rdp(a) + log(1 - 1/a) - log(delta a) / (a - 1) (Canonne, Kamath and Steinke 2020, Prop. 12 /
    Asoodeh et al. 2021), orders above 1.01."""
    return min(r + math.log(1 - 1 / a) - math.log(delta * a) / (a - 1) for a, r in zip(orders, rdp, strict=True)
               if a > 1.01)


def rdp_to_delta(orders, rdp, eps):
    """delta(eps) = min_a exp((a - 1)(rdp(a) - eps + log(1 - 1/a)) - log a) (the same conversion solved for delta),
    and TV <= sqrt(1 - exp(-D_a)) (Bretagnolle-Huber, D_a >= KL)."""
    log_best = 0.0
    for a, r in zip(orders, rdp, strict=True):
        log_best = min(log_best, 0.5 * math.log(-math.expm1(-r)))
        if a > 1.01:
            log_best = min(log_best, (a - 1) * (r - eps + math.log(1 - 1 / a)) - math.log(a))
    return math.exp(log_best)


def tnb_mean(eta, gamma, kmax=20000):
    """E[K] summed from the definition P[K = k] = (1 - gamma)^k prod_{l<k} (l + eta)/(l + 1) / (gamma^-eta - 1)."""
    total, weight, norm = 0.0, 1.0, 0.0
    for k in range(1, kmax):
        weight *= (k - 1 + eta) / k if eta != 0 or k > 1 else 1.0
        p = (1 - gamma) ** k * (weight if eta != 0 else 1 / k)
        total += k * p
        norm += p
    return total / norm


def theorem2_epsilon(orders, rdp, eta, gamma, delta):
    mean = tnb_mean(eta, gamma)
    hat = min((1 + eta) * (1 - 1 / b) * rb + (1 + eta) * math.log(1 / gamma) / b for b, rb in zip(orders, rdp,
                                                                                                   strict=True))
    sel = [r + hat + math.log(mean) / (a - 1) for a, r in zip(orders, rdp, strict=True)]
    return rdp_to_epsilon(orders, sel, delta)


def theorem6_epsilon(orders, rdp, mu, delta):
    sel = [r + mu * rdp_to_delta(orders, rdp, math.log(1 + 1 / (a - 1))) + math.log(mu) / (a - 1)
           for a, r in zip(orders, rdp, strict=True)]
    return rdp_to_epsilon(orders, sel, delta)


# ---- the bound ----
TRIAL = [(3.0, 10), (10.0, 1)]  # ten Gaussian releases at z 3 and the score at z 10, no sampling


@pytest.mark.parametrize("eta,gamma", [(1.0, 0.1), (0.0, 0.2), (-0.5, 0.05), (2.0, 0.3)])
def test_theorem2_matches_the_independent_closed_form(eta, gamma):
    counts = {(1.0, z): c for z, c in TRIAL}
    got = ps.search_epsilon(ps.TrialCount("tnb", eta=eta, gamma=gamma), counts, DELTA)
    want = theorem2_epsilon(ps.ORDERS, gaussian_rdp(ps.ORDERS, TRIAL), eta, gamma, DELTA)
    assert got["epsilon_total"] == pytest.approx(want, abs=1e-6)
    assert got["theorem"].endswith("Theorem 2")
    assert ps.TrialCount("tnb", eta=eta, gamma=gamma).expected() == pytest.approx(tnb_mean(eta, gamma), rel=1e-9)


@pytest.mark.parametrize("mu", [2.0, 10.0, 30.0])
def test_theorem6_matches_the_independent_closed_form(mu):
    counts = {(1.0, z): c for z, c in TRIAL}
    got = ps.search_epsilon(ps.TrialCount("poisson", mu=mu), counts, DELTA)
    want = theorem6_epsilon(ps.ORDERS, gaussian_rdp(ps.ORDERS, TRIAL), mu, DELTA)
    assert got["epsilon_total"] == pytest.approx(want, abs=1e-6)


def test_the_per_trial_curve_is_dp_accountings_gaussian_curve():
    assert ps.rdp_curve({(1.0, z): c for z, c in TRIAL}) == pytest.approx(gaussian_rdp(ps.ORDERS, TRIAL), rel=1e-12)


def test_selection_costs_more_than_one_trial_and_grows_with_the_trials():
    counts = {(0.05, 1.2): 200, (1.0, 10.0): 1}
    one = ps.epsilon_from_rdp(ps.ORDERS, ps.rdp_curve(counts), DELTA)[0]
    eps = [ps.search_epsilon(ps.TrialCount("tnb", gamma=g), counts, DELTA)["epsilon_total"] for g in (0.5, 0.1, 0.02)]
    assert one < eps[0] < eps[1] < eps[2]


def test_trial_count_pmf_mean_and_draws():
    for dist in (ps.TrialCount("tnb", 1.0, 0.1), ps.TrialCount("tnb", 0.0, 0.2), ps.TrialCount("tnb", -0.5, 0.1),
                 ps.TrialCount("poisson", mu=5.0)):
        ks = np.arange(0, 3000)
        pmf = np.array([dist.pmf(int(k)) for k in ks])
        assert pmf.sum() == pytest.approx(1.0, abs=1e-9)
        assert (ks * pmf).sum() == pytest.approx(dist.expected(), rel=1e-9)
        rng = np.random.default_rng(0)
        draws = [dist.draw(rng) for _ in range(20000)]
        assert np.mean(draws) == pytest.approx(dist.expected(), rel=0.05)
        assert min(draws) >= (0 if dist.kind == "poisson" else 1)


@pytest.mark.parametrize("kwargs,field", [({"kind": "geometric"}, "distribution"), ({"eta": -1.0}, "eta"),
                                          ({"gamma": 1.0}, "gamma"), ({"kind": "poisson", "mu": 0.0}, "mu")])
def test_bad_parameters_name_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        ps.TrialCount(**kwargs)
    with pytest.raises(ConfigError, match="score noise"):
        ps.score_counts(0.0)


def test_noisy_worst_class_is_the_gaussian_release_of_the_counts():
    correct, total, z = [90, 40, 70], [100, 50, 80], 2.0
    got = ps.noisy_worst_class(correct, total, z, np.random.default_rng(3))
    rng = np.random.default_rng(3)
    nc = np.array(correct) + rng.normal(0, z * math.sqrt(2), 3)
    nt = np.array(total) + rng.normal(0, z * math.sqrt(2), 3)
    assert got["per_class"] == pytest.approx(list(np.clip(nc / nt, 0, 1)))
    assert got["worst"] == pytest.approx(min(np.clip(nc / nt, 0, 1)))
    assert got["noise_std"] == pytest.approx(z * math.sqrt(2))


# ---- a small private search with synthetic trials ----
PLAN = [{"name": "grad", "count": 20, "sampling_rate": 1.0, "noise_multiplier": 8.0}]


def fake_plan(cfg):
    return {"releases": PLAN, "delta": DELTA}


def fake_train(cfg, report):
    """A trial's summary: releases as planned, class counts that depend on the trial's step size."""
    from dpdro.server.rundir import write_json

    quality = min(cfg.lr_x / 12.0, 1.0) if hasattr(cfg, "lr_x") else 0.5
    summary = {"releases": {"grad": 20}, "sampling_rates": {"grad": 1.0}, "noise_multipliers": {"grad": 8.0},
               "releases_beyond_plan": 0, "eval_class_total": [500, 500, 500],
               "eval_class_correct": [int(500 * quality), 450, 480]}
    out = cfg.out_dir if isinstance(cfg.out_dir, str) else str(cfg.out_dir)
    import pathlib

    pathlib.Path(out).mkdir(parents=True, exist_ok=True)
    write_json(pathlib.Path(out) / "summary.json", summary)
    (pathlib.Path(out) / "MODEL_CARD.md").write_text("# Model card\n")
    return summary


def test_a_small_private_search_sums_its_events_to_the_closed_form(tmp_path):
    dist = ps.TrialCount("tnb", eta=1.0, gamma=0.25)
    out = private_tune.run_private_search("mnist-st", 2.0, "dp-sgd", dist, tmp_path, fake_plan, seed=0,
                                          score_noise=10.0, rng=np.random.default_rng(7), train_fn=fake_train)
    record = json.loads(open(out["record"]).read())
    ran = [t for t in record["trials"] if "out_dir" in t]
    assert record["trials_drawn"] == len(record["trials"]) >= 1 and ran
    for t in ran:  # each trial's events, summed from its summary plus its score, equal the declared trial
        summary = json.loads(open(f"{t['out_dir']}/summary.json").read())
        events = private_tune.summary_counts(summary) + ps.score_counts(10.0)
        assert dict(events) == {(1.0, 8.0): 20, (1.0, 10.0): 1}
        assert t["keys"]["refresh-batch"] == private_tune.fixed_plan_keys("dp-sgd")["refresh-batch"]
    want = theorem2_epsilon(ps.ORDERS, gaussian_rdp(ps.ORDERS, [(8.0, 20), (10.0, 1)]), 1.0, 0.25, DELTA)
    assert out["epsilon_total"] == pytest.approx(want, abs=1e-6)
    best = max(ran, key=lambda t: t["noisy_worst"])
    assert out["best"]["out_dir"] == best["out_dir"]
    released = json.loads((tmp_path / "mnist-st" / "eps2" / "private" / "dp-sgd" / "released.json").read_text())
    assert "trials" not in released and "trials_drawn" not in released  # K and the others' scores stay private
    summary = json.loads(open(f"{best['out_dir']}/summary.json").read())
    assert summary["private_search"]["epsilon_total"] == pytest.approx(out["epsilon_total"])
    card = open(f"{best['out_dir']}/MODEL_CARD.md").read()
    assert f"epsilon_total = {out['epsilon_total']:.4f}" in card
    with pytest.raises(ConfigError, match="private search already"):  # a second search would spend again
        private_tune.run_private_search("mnist-st", 2.0, "dp-sgd", dist, tmp_path, fake_plan,
                                        rng=np.random.default_rng(7), train_fn=fake_train)


def test_a_trial_whose_plan_exceeds_the_declared_curve_is_not_run(tmp_path):
    calls = []

    def plan(cfg):  # the reference plans are the first calls; every later trial plans more releases
        calls.append(cfg.out_dir)
        count = 20 if len(calls) <= private_tune.REFERENCE_POINTS else 40
        return {"releases": [{**PLAN[0], "count": count}], "delta": DELTA}

    trained = []
    out = private_tune.run_private_search("mnist-st", 2.0, "dp-sgd", ps.TrialCount("poisson", mu=3.0), tmp_path,
                                          plan, rng=np.random.default_rng(1),
                                          train_fn=lambda cfg, r: trained.append(cfg) or fake_train(cfg, r))
    record = json.loads(open(out["record"]).read())
    assert record["trials_drawn"] >= 1 and not trained and out["best"] is None
    assert all(t["skipped"].startswith("plan above") for t in record["trials"])


def test_a_trial_that_releases_other_than_its_plan_stops_the_search(tmp_path):
    def train(cfg, report):
        return {**fake_train(cfg, report), "releases": {"grad": 21}}

    with pytest.raises(ConfigError, match="other than its plan"):
        private_tune.run_private_search("mnist-st", 2.0, "dp-sgd", ps.TrialCount("tnb", gamma=0.5), tmp_path,
                                        fake_plan, rng=np.random.default_rng(0), train_fn=train)


def test_random_points_are_seeded_and_inside_the_space():
    from dpdro.simulations import tune

    a = private_tune.random_point("dp-sgd", "mnist-st", 0, 3)
    assert a == private_tune.random_point("dp-sgd", "mnist-st", 0, 3) != private_tune.random_point("dp-sgd",
                                                                                                   "mnist-st", 0, 4)
    for key, dim in tune.space("dp-sgd", "mnist-st").items():
        assert tune._in_space(a[key], dim), (key, a[key])


def test_plan_prints_the_search_epsilon():
    from dpdro.cli.plan import search_plan

    plan = {"releases": PLAN, "delta": DELTA, "planned_epsilon": {"rdp": 1.0}}
    got = search_plan(plan, "poisson", 1.0, 0.1, 10.0, 10.0)
    want = theorem6_epsilon(ps.ORDERS, gaussian_rdp(ps.ORDERS, [(8.0, 20), (10.0, 1)]), 10.0, DELTA)
    assert got["epsilon_total"] == pytest.approx(want, abs=1e-6)
    with pytest.raises(ConfigError, match="not private"):
        search_plan({**plan, "planned_epsilon": None}, "tnb", 1.0, 0.1, 10.0, 10.0)


def test_tune_private_takes_one_method():
    from dpdro.cli.lab import tune as cli_tune

    args = argparse.Namespace(methods=["dp-sgd", "dp-sgd-la"], private=True)
    with pytest.raises(ConfigError, match="exactly one"):
        cli_tune._private(args)
