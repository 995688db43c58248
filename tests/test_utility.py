"""Utility mechanisms: class priors released privately, the logit-adjusted loss and post-hoc
adjustment, per-mechanism noise allocation, DRO weights that survive clipping, the SPIDER noise monitor,
the private eta initialisation, relative clip units of Algorithm 3, the validation split and the tuning
selection. Values are asserted against independent computations."""

from __future__ import annotations

import json
import math
from collections import Counter

import dp_accounting
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import PerRecordFromGrads
from dp_accounting.rdp import rdp_privacy_accountant
from hypothesis import given, settings
from hypothesis import strategies as st

from dpdro.common.config import Config, ConfigError
from dpdro.common.data import ArrayDataset, validation_split
from dpdro.common.messages import Point, Query, Reply
from dpdro.common.models import make_model
from dpdro.common.per_sample import FlatModel, clip_rows
from dpdro.common.psi import make_psi
from dpdro.common.quantities import QUANTITIES, Problem, dro_weight_bound, dual_x_weight_after_clip
from dpdro.common.transport import RoundResult
from dpdro.server import setup as setup_releases
from dpdro.server.algorithms import make_algorithm
from dpdro.server.allocation import NoiseProfile, allocate, proxy_variance, variance_rule
from dpdro.server.diagnostics import NoiseMonitor, planned_phase_ratio
from dpdro.server.engine import Releaser, plan_run
from dpdro.server.ledger import Ledger, Mechanism, calibrate, epsilon_of, plan_counts
from dpdro.server.rundir import RunDir

DELTA = 1e-5


class FixedTransport:
    """A transport whose clients always answer with the same totals (one reply per partition)."""

    def __init__(self, totals: list[np.ndarray], n: int) -> None:
        self.totals, self._n = totals, n

    @property
    def num_records(self) -> int:
        return self._n

    @property
    def num_clients(self) -> int:
        return len(self.totals)

    def run(self, queries, versions):
        return RoundResult({q.qid: [Reply(q.qid, pid, t.copy(), int(t.sum())) for pid, t in enumerate(self.totals)]
                            for q in queries})


# ---- class histogram and priors ----

def test_histogram_release_has_declared_std_and_charge(tmp_path):
    """The class histogram: each count gets N(0, z_h^2) (sensitivity 1), the ledger is charged one unsampled
    Gaussian with z_h, and the priors stay a valid distribution after noise."""
    cfg = Config.from_mapping({"algorithm": "dp-sgd-la", "epsilon": 1e4, "prior-noise-multiplier": 3.0,
                               "out-dir": str(tmp_path)})
    counts = np.array([5.0, 120, 130, 1000, 2000, 0, 7, 50, 3000, 400])
    shards = [counts * 0.25] * 4  # four clients, each a quarter of every class
    n = int(counts.sum())
    transport = FixedTransport(shards, n)
    plan = setup_releases.mechanisms(cfg)
    assert plan == {Mechanism("class-histogram", 1.0, fixed_noise=3.0): 1}
    ledger = Ledger({**plan, Mechanism("grad", 0.1): 1}, {"class-histogram": 3.0, "grad": 1.0}, cfg.epsilon, DELTA,
                    "rdp")
    rd = RunDir(tmp_path)
    rd.create()
    releaser = Releaser(cfg, transport, ledger, n, rd)
    [stage] = setup_releases.stages(cfg, 10)
    assert stage[0].rate == 1.0 and stage[0].clip == 1.0 and stage[0].quantity == "class-onehot"
    noise = []
    for _ in range(400):
        released = releaser.run(stage, {0: np.zeros(3)}, setup=True)["class-histogram"]
        noise.append(released * n - counts)
        priors = np.asarray(setup_releases.absorb(setup_releases.SetupResult(), {"class-histogram": released}, n,
                                                  cfg).priors)
        assert priors.min() > 0 and priors.sum() == pytest.approx(1.0, abs=1e-12)
    noise = np.asarray(noise).ravel()
    assert noise.std() == pytest.approx(3.0, rel=0.05)
    assert abs(noise.mean()) < 4 * 3.0 / math.sqrt(noise.size)
    # the first release was in the plan; its epsilon is the closed-form RDP of one Gaussian with z_h = 3
    one = Ledger({**plan, Mechanism("grad", 0.1): 1}, {"class-histogram": 3.0, "grad": 1.0}, cfg.epsilon, DELTA,
                 "rdp")
    one.charge("class-histogram", 1.0)
    orders = np.asarray(rdp_privacy_accountant.RdpAccountant()._orders, dtype=np.float64)
    eps_ref, _ = rdp_privacy_accountant.compute_epsilon(orders, orders / (2 * 3.0**2), DELTA)
    assert one.epsilon_spent() == pytest.approx(eps_ref, rel=1e-9)
    assert ledger.spent["class-histogram"] == 1 and sum(ledger.extra.values()) == 399
    events = [json.loads(line) for line in open(rd.events)]
    assert {e["phase"] for e in events} == {"setup"} and events[0]["noise_multiplier"] == 3.0


def test_priors_from_counts_clamps_and_normalises():
    pi = np.asarray(setup_releases.priors_from_counts(np.array([-3.0, 0.2, 1.0, 8.0])))
    np.testing.assert_allclose(pi, np.array([1, 1, 1, 8]) / 11.0, rtol=1e-15)
    result = setup_releases.SetupResult(tuple(pi), "private")
    np.testing.assert_allclose(result.offset(1.5), 1.5 * np.log(pi), rtol=1e-15)
    assert result.offset(0.0) == () and setup_releases.SetupResult().offset(1.0) == ()


def test_public_priors_are_declared_and_not_released():
    cfg = Config.from_mapping({"algorithm": "dp-sgd-la", "class-prior": "public",
                               "class-prior-values": "1,1,2,0,4,1,1,1,1,1"})
    assert setup_releases.mechanisms(cfg) == {} and setup_releases.stages(cfg, 10) == []
    res = setup_releases.initial(cfg, 10)
    assert res.prior_source == "public" and min(res.priors) > 0
    assert res.priors[4] == pytest.approx(4 / 13, rel=1e-9)
    with pytest.raises(ConfigError, match="class-prior-values"):
        Config.from_mapping({"algorithm": "dp-sgd-la", "class-prior": "public", "class-prior-values": "1,x"})
    with pytest.raises(ConfigError, match="exactly 10"):
        setup_releases.initial(cfg.with_updates({"class-prior-values": "1,2"}), 10)


def test_dp_sgd_la_refuses_tau_zero_and_defaults_to_one():
    assert Config.from_mapping({"algorithm": "dp-sgd-la"}).tau == 1.0
    assert Config.from_mapping({"algorithm": "dp-sgd"}).tau == 0.0
    with pytest.raises(ConfigError, match="logit-adjust-tau"):
        Config.from_mapping({"algorithm": "dp-sgd-la", "logit-adjust-tau": 0})


# ---- logit-adjusted loss ----

def test_logit_adjusted_gradients_equal_autograd_of_shifted_cross_entropy():
    fm = FlatModel(make_model("cnn", 10, 1, torch.float64))
    gen = torch.Generator().manual_seed(5)
    x = torch.rand(5, 1, 28, 28, generator=gen, dtype=torch.float64) * 2 - 1
    y = torch.tensor([0, 3, 3, 9, 5])
    pi = torch.tensor([0.004, 0.005, 0.004, 0.2, 0.2, 0.19, 0.1, 0.1, 0.1, 0.097], dtype=torch.float64)
    offset = 1.0 * torch.log(pi)
    flat = fm.initial()
    problem = Problem(make_psi("chi2", 0.1), 1.0, 1.0).with_offset(tuple(offset.tolist()), torch.float64,
                                                                   torch.device("cpu"))
    got = QUANTITIES["ce-grad"](fm, flat, 0.0, x, y, problem)
    for i in range(5):
        p = flat.clone().requires_grad_(True)
        loss = F.cross_entropy(fm.logits(p, x[i:i + 1]) + offset, y[i:i + 1])
        (g,) = torch.autograd.grad(loss, p)
        torch.testing.assert_close(got[i], g, rtol=1e-10, atol=1e-12)
    plain = QUANTITIES["ce-grad"](fm, flat, 0.0, x, y, Problem(make_psi("chi2", 0.1), 1.0, 1.0))
    assert not torch.allclose(plain, got)


def test_posthoc_adjustment_shifts_predictions():
    from dpdro.server.evaluate import evaluate

    fm = FlatModel(make_model("cnn", 10, 1, torch.float64))
    gen = torch.Generator().manual_seed(2)
    x = torch.rand(50, 1, 28, 28, generator=gen)
    data = ArrayDataset(x, torch.randint(0, 10, (50,), generator=gen), 10, "t")
    cfg = Config.from_mapping({})
    flat = fm.initial().numpy()
    shift = np.zeros(10)
    shift[4] = 100.0  # a huge shift for class 4: every prediction becomes 4
    out = evaluate(fm, flat, data, cfg, shift)
    assert out["per_class_accuracy"][4] == 1.0
    assert out["test_accuracy"] == pytest.approx(float((data.y == 4).double().mean()))
    base = evaluate(fm, flat, data, cfg)
    assert out["eval_loss"] == pytest.approx(base["eval_loss"], rel=1e-12)  # losses are unshifted


# ---- noise allocation ----

def test_variance_rule_matches_closed_form_and_allocated_ledger_matches_independent_composition():
    rates = {"x-refresh": 0.04, "x-diff": 0.02, "eta-refresh": 0.04, "eta-diff": 0.02}
    prof = {"x-refresh": NoiseProfile(1000, 1.0, 5), "x-diff": NoiseProfile(1000, 0.2, 2.5),
            "eta-refresh": NoiseProfile(1, 1.0, 5), "eta-diff": NoiseProfile(1, 0.2, 2.5)}
    rel = variance_rule(rates, prof)
    raw = {k: rates[k] / (prof[k].weight * prof[k].dim * prof[k].clip**2) ** 0.25 for k in rates}
    for k in rates:
        assert rel[k] == pytest.approx(raw[k] / max(raw.values()), rel=1e-12)
    plan = {Mechanism(k, r): (20 if "refresh" in k else 80) for k, r in rates.items()}
    plan[Mechanism("class-histogram", 1.0, fixed_noise=10.0)] = 1
    allocated = allocate(plan, prof)
    scale = calibrate(allocated, 4.0, DELTA, "rdp")
    noise = {m.name: m.noise_at(scale) for m in allocated}
    assert noise["class-histogram"] == 10.0
    # independent: one event per release, composed one at a time with dp_accounting
    acc = rdp_privacy_accountant.RdpAccountant()
    for m, count in allocated.items():
        for _ in range(count):
            acc.compose(dp_accounting.PoissonSampledDpEvent(m.rate, dp_accounting.GaussianDpEvent(noise[m.name])))
    eps = acc.get_epsilon(DELTA)
    assert 0.99 * 4.0 <= eps <= 4.0
    assert epsilon_of(plan_counts(allocated, scale), DELTA, "rdp") == pytest.approx(eps, rel=1e-9)
    # the rule does what it claims: at equal privacy its proxy variance beats equal relative multipliers
    equal = {m: n for m, n in plan.items()}
    s_eq = calibrate(equal, 4.0, DELTA, "rdp")
    v_rule = proxy_variance(allocated, noise, prof, 10_000)
    v_eq = proxy_variance(equal, {m.name: m.noise_at(s_eq) for m in equal}, prof, 10_000)
    assert v_rule < v_eq


def test_engine_plan_lands_on_target_with_setup_releases():
    cfg = Config.from_mapping({"algorithm": "dp-double-spider", "logit-adjust-tau": 1.0, "epsilon": 2.0,
                               "eta-init-source": "private-mean-loss", "iterations": 60})
    algo = make_algorithm(cfg, 30_000, 26_010, 10)
    plan, noise, profiles = plan_run(cfg, algo, 30_000, 30_000**-1.1)
    assert noise["class-histogram"] == cfg.prior_noise_multiplier and noise["eta-init"] == 10.0
    counts = Counter()
    for m, k in plan.items():
        counts[(m.rate, noise[m.name])] += k
    eps = epsilon_of(counts, 30_000**-1.1)
    assert 0.99 * 2.0 <= eps <= 2.0
    assert noise["eta-refresh"] > noise["x-refresh"]  # a scalar: more noise per unit of privacy
    with pytest.raises(ValueError, match="alone spend"):
        calibrate({Mechanism("h", 1.0, fixed_noise=0.3): 1, Mechanism("g", 0.1): 10}, 1.0, DELTA)


# ---- DRO weights that survive clipping ----

@settings(max_examples=60, deadline=None)
@given(losses=st.lists(st.floats(0.0, 50.0), min_size=1, max_size=8),
       scale=st.floats(1e-3, 1e3), eta=st.floats(-5.0, 5.0), lam=st.floats(0.1, 5.0),
       clip=st.floats(0.05, 5.0), psi=st.sampled_from(["chi2", "kl", "smoothed-cvar", "cvar"]))
def test_weight_after_clip_never_exceeds_its_declared_sensitivity(losses, scale, eta, lam, clip, psi):
    """w~ clip_C(grad l) has norm <= C W for every record, W = psi*'((B - G eta) / lambda), B = 4."""

    class FakeModel(PerRecordFromGrads):
        def losses_and_grads(self, flat, x, y, offset=None):
            g = torch.randn(len(losses), 7, generator=torch.Generator().manual_seed(len(losses)), dtype=torch.float64)
            return torch.tensor(losses, dtype=torch.float64), g * scale


    problem = Problem(make_psi(psi, 0.3), lam, 1.0, loss_bound=4.0, clamp_weights=True)
    v = dual_x_weight_after_clip(FakeModel(), None, eta, None, None, problem, (clip,))
    bound = clip * dro_weight_bound(problem.psi, eta, lam, 1.0, 4.0)
    assert float(torch.linalg.vector_norm(v, dim=1).max()) <= bound * (1 + 1e-9) + 1e-12


def test_weight_after_clip_keeps_weights_that_the_product_clip_erases():
    """Two records with large gradients and different losses: after the product clip both have norm C; with
    weight-after-clip their norms keep the ratio of their DRO weights."""

    class FakeModel(PerRecordFromGrads):
        def losses_and_grads(self, flat, x, y, offset=None):
            return torch.tensor([0.5, 3.0], dtype=torch.float64), torch.full((2, 4), 10.0, dtype=torch.float64)


    problem = Problem(make_psi("chi2", 0.1), 1.0, 1.0, loss_bound=4.0, clamp_weights=True)
    wac = torch.linalg.vector_norm(dual_x_weight_after_clip(FakeModel(), None, 0.0, None, None, problem, (1.0,)),
                                   dim=1)
    np.testing.assert_allclose(wac.numpy(), [1.5, 4.0], rtol=1e-12)  # w = 1 + l - eta
    prod = torch.linalg.vector_norm(clip_rows(QUANTITIES["dual-x"](FakeModel(), None, 0.0, None, None,
                                                                   problem), 1.0), dim=1)
    np.testing.assert_allclose(prod.numpy(), [1.0, 1.0], rtol=1e-12)


def test_double_spider_weight_after_clip_queries_declare_c_times_w():
    cfg = Config.from_mapping({"dro-clip": "weight-after-clip", "loss-bound": 3.0, "lambda": 0.5, "clip-x": 0.7})
    algo = make_algorithm(cfg, 1000, 50, 10)
    state = algo.init_state(np.zeros(50))
    state.stage, state.eta_next = 1, 0.4
    [q] = algo.queries(state)
    assert q.quantity == "dual-x-wac" and q.extra == (0.7,)
    assert q.clip == pytest.approx(0.7 * (1 + (3.0 - 0.4) / 0.5), rel=1e-12)


# ---- SPIDER noise monitor ----

def test_noise_ratio_on_a_hand_checked_phase():
    """Refresh std 0.01; differences 0.004, 0.003, 0.012: ratios 0.4, 0.3, 1.2; the phase's accumulated ratio
    is sqrt(0.16 + 0.09 + 1.44) = 1.3 > 1 (noise-dominated); the next phase (one difference, 0.002 / 0.02)
    is 0.1."""
    mon = NoiseMonitor()
    seq = [("x-refresh", 0.01), ("x-diff", 0.004), ("x-diff", 0.003), ("x-diff", 0.012), ("x-refresh", 0.02),
           ("x-diff", 0.002)]
    ratios = []
    for mech, std in seq:
        ev = mon.observe({"mechanism": mech, "noise_std_of_mean": std, "clipped_fraction": 0.5})
        ratios.append(ev.get("noise_ratio_to_refresh"))
    assert ratios[0] is None and ratios[4] is None
    np.testing.assert_allclose(ratios[1:4] + ratios[5:], [0.4, 0.3, 1.2, 0.1], rtol=1e-12)
    mon.close()
    np.testing.assert_allclose(mon.phase_ratios, [1.3, 0.1], rtol=1e-12)
    assert mon.summary()["phases_noise_dominated"] == 1
    window = mon.take_window()
    assert window["noise_ratio_x-diff"] == pytest.approx((0.4 + 0.3 + 1.2 + 0.1) / 4)
    assert window["clipped_x-refresh"] == 0.5 and mon.take_window() == {}
    assert planned_phase_ratio(5, 1.0, 0.25, 512, 1.0, 1.0, 1024) == pytest.approx(2 * 0.25 * 2, rel=1e-12)


def test_clipped_fraction_coordinate_estimates_the_clipped_count(tmp_path):
    """The extra coordinate c * clip * (number clipped) makes the released value estimate the fraction."""
    from dpdro.client.worker import ShardWorker

    gen = torch.Generator().manual_seed(0)
    data = ArrayDataset(torch.rand(40, 1, 28, 28, generator=gen), torch.randint(0, 10, (40,), generator=gen), 10, "t")
    cfg = Config.from_mapping({"reproducible": True, "reproducible-for-testing": True, "dtype": "float64"})
    worker = ShardWorker(cfg, data, 0)
    q = Query(0, "grad", "ce-grad", (Point(0, 0.0),), 1.0, 0.05, worker.model.dim, count_scale=0.1)
    flat = worker.model.initial().numpy()
    reply = worker.answer(q, {0: flat})
    assert reply.total.shape == (q.out_dim,) == (worker.model.dim + 1,)
    grads = worker.model.losses_and_grads(torch.as_tensor(flat), worker.x, worker.y)[1]
    clipped = int((torch.linalg.vector_norm(grads, dim=1) > 0.05).sum())
    assert reply.total[-1] == pytest.approx(0.1 * 0.05 * clipped, rel=1e-12)
    assert q.sensitivity == pytest.approx(0.05 * math.sqrt(1.01), rel=1e-12)
    np.testing.assert_allclose(reply.total[:-1], clip_rows(grads, 0.05).sum(0).numpy(), rtol=1e-9, atol=1e-12)


# ---- Algorithm 3 in relative clip units ----

def test_relative_clip_units_scale_queries_and_undo_the_scale():
    cfg = Config.from_mapping({"algorithm": "recursive-spider", "rs-clip-units": "relative", "epsilon": "inf"})
    algo = make_algorithm(cfg, 1000, 4, 10)
    state = algo.init_state(np.zeros(4))
    state.lam, state.s = 2.0, 0.25
    vu, s_query = algo.queries(state)
    assert vu.extra == (8.0,) and s_query.extra == ()
    released = {"vu-refresh": 8.0 * np.array([1.0, 2.0, 3.0, 4.0, 0.5]), "s": np.array([0.3])}
    new = algo.apply(state, released)
    np.testing.assert_allclose(new.v, [1.0, 2.0, 3.0, 4.0], rtol=1e-15)
    assert new.u == pytest.approx(0.5 / cfg.u_scale)
    absolute = make_algorithm(cfg.with_updates({"rs-clip-units": "absolute"}), 1000, 4, 10)
    assert absolute.queries(state)[0].extra == ()


# ---- private eta initialisation, end to end on real data ----

@pytest.mark.data
def test_private_eta_init_and_priors_end_to_end(small_config):
    from dpdro.client.local_transport import LocalTransport
    from dpdro.common.data import load_from_config
    from dpdro.server.engine import train

    cfg = small_config(eta_init_source="private-mean-loss", logit_adjust_tau=1.0, posthoc_tau=0.5,
                       eta_init_noise_multiplier=10.0, prior_noise_multiplier=5.0)
    train_set = load_from_config(cfg, True)
    res = train(cfg, LocalTransport(cfg, train_set), load_from_config(cfg, False))
    s = res.summary
    counts = np.bincount(train_set.y.numpy(), minlength=10)
    n = len(train_set)
    assert s["class_prior"] == "private" and abs(sum(s["priors"]) - 1) < 1e-12
    assert np.all(np.abs(np.asarray(s["priors"]) * n - counts) < 5 * 5.0 + 2)  # within 5 noise stds (+ clamp)
    # eta0: the mean of min(l, B) at the initial model on the logit-adjusted loss, within 5 stds of 10 B / n
    model = FlatModel(make_model("cnn", 10, cfg.seed, torch.float64))
    offset = torch.log(torch.as_tensor(s["priors"], dtype=torch.float64))
    with torch.no_grad():
        mean = float(torch.clamp(model.losses(model.initial(), train_set.x.double(), train_set.y, offset),
                                 max=cfg.loss_bound).mean())
    assert abs(s["eta0"] - mean) < 5 * 10.0 * cfg.loss_bound / n
    events = [json.loads(line) for line in open(f"{cfg.out_dir}/events.jsonl")]
    assert [e["mechanism"] for e in events[:2]] == ["class-histogram", "eta-init"]
    assert all(e.get("phase") == "setup" for e in events[:2]) and 0.99 * 4 <= s["epsilon_spent"] <= 4
    assert s["noise_multipliers"]["class-histogram"] == 5.0 and s["noise_allocation"]["rule"] == "variance"


# ---- validation split and the tuning selection ----

def test_validation_split_is_stratified_disjoint_and_seeded():
    labels = np.repeat(np.arange(4), [10, 20, 100, 7])
    tr, va = validation_split(labels, 0.2, 3)
    assert len(np.intersect1d(tr, va)) == 0 and len(tr) + len(va) == len(labels)
    np.testing.assert_array_equal(np.bincount(labels[va]), [2, 4, 20, 1])
    tr2, va2 = validation_split(labels, 0.2, 3)
    assert np.array_equal(va, va2) and not np.array_equal(va, validation_split(labels, 0.2, 4)[1])


def test_eval_split_validation_needs_a_validation_part():
    with pytest.raises(ConfigError, match="eval-split"):
        Config.from_mapping({"eval-split": "validation"})
    with pytest.raises(ConfigError, match="validation-fraction"):
        Config.from_mapping({"dataset": "celeba", "validation-fraction": 0.1})
    Config.from_mapping({"dataset": "celeba", "eval-split": "validation"})


def test_tuned_report_compares_against_the_strongest_baseline_and_checks_the_goal(tmp_path):
    from dpdro.simulations.sweep import PROFILES, run_dir, write_report
    from dpdro.simulations.tune import write_toml

    root, docs, configs = tmp_path / "runs", tmp_path / "docs", tmp_path / "configs"
    figures = {"dp-sgd": (0.80, 0.20), "dp-sgd-la": (0.88, 0.64), "dp-double-spider": (0.86, 0.50),
               "recursive-spider": (0.87, 0.66)}
    for algo, (acc, worst) in figures.items():
        for seed, jitter in enumerate((-0.01, 0.0, 0.01)):
            out = run_dir(root, "tuned", "mnist-st", algo, 4.0, seed)
            out.mkdir(parents=True)
            (out / "summary.json").write_text(json.dumps(
                {"dataset": "mnist-st", "algorithm": algo, "epsilon_target": 4.0, "seed": seed,
                 "test_accuracy": acc + jitter, "worst_class_accuracy": worst + jitter, "epsilon_spent": 3.99,
                 "wall_seconds": 1.0}))
    out = run_dir(root, "tuned", "mnist-st", "dp-sgd", 8.0, 0)  # one seed only at epsilon 8
    out.mkdir(parents=True)
    (out / "summary.json").write_text(json.dumps(
        {"dataset": "mnist-st", "algorithm": "dp-sgd", "epsilon_target": 8.0, "seed": 0, "test_accuracy": 0.9,
         "worst_class_accuracy": 0.3, "epsilon_spent": 7.99, "wall_seconds": 1.0}))
    write_toml(configs / "mnist-st-eps4-best.toml", {"algorithm": "dp-sgd-la"})
    write_toml(configs / "tuned" / "mnist-st-eps4-dp-double-spider.toml", {"algorithm": "dp-double-spider", "q": 1})
    write_toml(configs / "tuned" / "mnist-st-eps4-recursive-spider.toml", {"algorithm": "recursive-spider", "q": 5})
    text = write_report(root, "tuned", docs, configs).read_text()
    # only the SPIDER-type method tuned to q = 1 is named as running without differences
    assert "no SPIDER difference releases): dp-double-spider; these rows" in text
    assert "| 0.900 +/- 0.000 (n=1) | 0.300 +/- 0.000 (n=1) |" in text
    assert "**dp-sgd-la**" in text and "reaches test accuracy 0.880 +/- 0.010" in text and "goal **reached**" in text
    assert "strongest simple baseline **dp-sgd-la** (worst 0.640 +/- 0.010)" in text
    # decisions on the Welch 95 % interval of the difference (n = 3 each, std 0.010): -0.140 excludes 0, +0.020 not
    assert "dp-double-spider -0.140 (worse, 95% interval [" in text
    assert "recursive-spider +0.020 (no clear difference, 95% interval [-0.003, +0.043])" in text
    assert "| dp-sgd (n=3) | " in text and "## fashion-mnist-st" in text
    assert "Not run: not tuned yet (`dpdro lab tune --dataset fashion-mnist-st`" in text
    assert PROFILES["tuned"].epsilons == (1.0, 4.0, 8.0) and len(PROFILES["tuned"].seeds) >= 3


def test_hazard_variants_change_one_key_of_the_tuned_configs(tmp_path):
    from dpdro.simulations.hazards import TOGGLES, variants
    from dpdro.simulations.tune import write_toml

    write_toml(tmp_path / "mnist-st-eps4-dp-double-spider.toml",
               {"algorithm": "dp-double-spider", "dro-clip": "product", "lr-x": 4.0, "q": 5})
    write_toml(tmp_path / "mnist-st-eps4-recursive-spider.toml", {"algorithm": "recursive-spider", "lr-x": 2.0})
    vs = variants(tmp_path)
    labels = [v[0] for v in vs]
    assert labels[0] == "dp-double-spider (tuned)" and "dp-double-spider, dro-clip=product" not in labels
    assert "dp-double-spider, dro-clip=weight-after-clip" in labels and "dp-double-spider, q=1" in labels
    for _, algo, keys in vs:
        base = dict(vs[[v[0] for v in vs].index(f"{algo} (tuned)")][2])
        changed = {k for k in set(keys) | set(base) if keys.get(k) != base.get(k)}
        assert len(changed) <= 1 and Config.from_mapping(keys).algorithm == algo
    # equal to the tuned configs, hence left out: product, q = 5, tau = 0 ('auto'), eta-init config, eta-clip-rule
    # fixed; rs: absolute, q = 5 (the default), tau = 0
    assert len(vs) == 2 + sum(len(t) for t in TOGGLES.values()) - 8
    assert "dp-double-spider, eta-clip-rule=weight-bound" in labels
    assert "dp-double-spider, logit-adjust-tau=1.0" in labels and "dp-double-spider, logit-adjust-tau=0.0" not in labels
    # a q = 1 configuration has no differences: its difference cap is compared at q = 5
    write_toml(tmp_path / "mnist-st-eps4-recursive-spider.toml", {"algorithm": "recursive-spider", "q": 1})
    rs = {v[0]: v[2] for v in variants(tmp_path) if v[1] == "recursive-spider"}
    assert rs["recursive-spider, q=5, clip-diff-max=1.0"] == {"algorithm": "recursive-spider", "q": 5,
                                                               "clip-diff-max": 1.0}


def test_celeba_trials_run_the_group_level_methods_over_its_declared_groups(tmp_path):
    """CelebA is judged on its 4 (Blond_Hair, Male) cells: the methods that declare dro-groups (the group-level paper
    methods and dp-sgda) run over them, in a trial and in a file transferred to CelebA; methods without the key are
    untouched."""
    from dpdro.simulations import tune

    for method in ("dp-double-spider", "recursive-spider", "dp-sgda"):
        cfg = tune.trial_config("celeba", 4.0, method, {"refresh-batch": 1024}, tmp_path / method)
        assert cfg.dro_groups == "attribute" and cfg.attribute_groups
        assert tune.trial_config("mnist-st", 4.0, method, {"refresh-batch": 1024}, tmp_path).dro_groups == "class"
    baseline = tune.trial_config("celeba", 4.0, "dp-sgd-la", {"refresh-batch": 1024}, tmp_path / "s")
    assert "dro-groups" not in tune.final_keys(baseline)
    src = tune.final_keys(tune.trial_config("mnist-st", 4.0, "dp-double-spider",
                                            {"lr-x": 3.0, "refresh-batch": 1024}, tmp_path))
    tune.write_toml(tmp_path / "configs" / "tuned" / "mnist-st-eps4-dp-double-spider.toml", src, "# Tuned.\n")
    written = tune.transfer_tuned("celeba", "mnist-st", 4.0, ["dp-double-spider"], tmp_path / "configs")
    got = Config.from_mapping(tomllib_load(written["dp-double-spider"]))
    assert (got.dro_groups, got.lr_x, got.dataset) == ("attribute", 3.0, "celeba")


def tomllib_load(path):
    import tomllib

    with open(path, "rb") as f:
        return tomllib.load(f)


def test_transfer_keeps_the_searched_keys_and_takes_the_rest_from_the_target(tmp_path):
    """--transfer-from: each method's searched keys come from the source file (batches rescaled by the target's
    batch-scale), everything else from the target's trial keys; the report says where they came from."""
    import tomllib

    from dpdro.simulations import tune
    from dpdro.simulations.tables import _origin_line

    configs = tmp_path / "configs"
    src = tune.final_keys(tune.trial_config("mnist-st", 4.0, "dp-sgda", {"lr-x": 8.0, "refresh-batch": 2048,
                                                                         "lr-p": 0.2, "lambda": 0.1,
                                                                         "logit-adjust-tau": 1.0}, tmp_path))
    tune.write_toml(configs / "tuned" / "mnist-st-eps4-dp-sgda.toml", src, "# Tuned by a test.\n")
    written = tune.transfer_tuned("celeba", "mnist-st", 4.0, ["dp-sgda", "dp-sgd"], configs)
    assert list(written) == ["dp-sgda"]  # dp-sgd has no source file: skipped
    with open(written["dp-sgda"], "rb") as f:
        got = tomllib.load(f)
    cfg = Config.from_mapping(got)
    assert (cfg.dataset, cfg.lr_x, cfg.lr_p, cfg.lambda_, cfg.logit_adjust_tau) == ("celeba", 8.0, 0.2, 0.1, 1.0)
    assert (cfg.refresh_batch, cfg.diff_batch, cfg.iterations) == (1024, 512, 300)  # celeba: batch-scale 0.5
    assert cfg.eval_split == "test" and cfg.validation_fraction == 0.0
    assert written["dp-sgda"].read_text().startswith("# Transferred by `dpdro tune --dataset celeba --epsilon 4 "
                                                     "--transfer-from mnist-st`")
    assert tune.transferred_from("celeba", 4.0, configs) == "mnist-st"
    assert tune.transferred_from("mnist-st", 4.0, configs) is None  # searched
    assert tune.transferred_from("fashion-mnist-st", 4.0, configs) is None  # no file
    assert "searched on mnist-st" in _origin_line("mnist-st", 4.0, configs)
    # a posthoc-tau chosen after the search is named with its value, in the source and in what was transferred
    from dpdro.simulations.tables import rechosen_tau_line
    from dpdro.simulations.tuned import RECHOSEN_MARK

    assert rechosen_tau_line("mnist-st", 4.0, configs, ["dp-sgda"]) is None
    tune.write_toml(configs / "tuned" / "mnist-st-eps4-dp-sgda.toml", {**src, "posthoc-tau": 1.25},
                    f"# Tuned by a test; {RECHOSEN_MARK} on validation: 1.25.\n")
    tune.transfer_tuned("fashion-mnist-st", "mnist-st", 4.0, ["dp-sgda"], configs)
    for ds in ("mnist-st", "fashion-mnist-st"):
        assert rechosen_tau_line(ds, 4.0, configs, ["dp-sgd", "dp-sgda"]).endswith(": dp-sgda (1.25).")
    # the mark in a later comment line at the top (dpdro lab tune --choose-posthoc-tau adds one) counts too
    tune.write_toml(configs / "tuned" / "fashion-mnist-st-eps4-dp-sgda.toml", {**src, "posthoc-tau": 0.5},
                    "# Transferred by `dpdro tune --dataset fashion-mnist-st --epsilon 4 --transfer-from mnist-st`.\n"
                    f"# {RECHOSEN_MARK} on fashion-mnist-st's validation split: 0.5.\n")
    assert rechosen_tau_line("fashion-mnist-st", 4.0, configs, ["dp-sgda"]).endswith(": dp-sgda (0.5).")
    assert "only its validation split chose a key" in _origin_line("fashion-mnist-st", 4.0, configs)
    assert "none of its data chose anything" in _origin_line("celeba", 4.0, configs)
    # keys a lever table chose on the data set's validation split after the transfer are named, method by method
    from dpdro.simulations.tuned import LEVERS_MARK

    tune.write_toml(configs / "tuned" / "celeba-eps4-dp-sgd.toml", {**src, "algorithm": "dp-sgd", "dataset": "celeba"},
                    "# Transferred by `dpdro tune --dataset celeba --epsilon 4 --transfer-from mnist-st`.\n"
                    f"# rho {LEVERS_MARK} on celeba's validation split: 0.2.\n")
    line = _origin_line("celeba", 4.0, configs)
    assert ("no trial ran on celeba, so none of its data chose anything but the keys of dp-sgd that one-factor "
            "lever tables on its validation split chose (`dpdro lab levers`;") in line
    assert line.endswith("(unequal tuning effort: dp-sgd had more on celeba than the other methods).")
    (configs / "tuned" / "celeba-eps4-dp-sgd.toml").unlink()
    (configs / "tuned" / "fashion-mnist-st-eps4-dp-sgda.toml").unlink()
    assert "**transferred from mnist-st**" in _origin_line("celeba", 4.0, configs)
    with pytest.raises(ValueError, match="no tuned config fashion-mnist-st-eps4"):
        tune.transfer_tuned("celeba", "fashion-mnist-st", 4.0, ["dp-sgda"], configs)
    with pytest.raises(ValueError, match="is the target"):
        tune.transfer_tuned("celeba", "celeba", 4.0, ["dp-sgda"], configs)
    # the command line: no trial runs, so the trials' document is left as it is
    from dpdro.cli import main

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "TUNING.md").write_text("trials of a search")
    assert main(["lab", "tune", "--dataset", "fashion-mnist-st", "--transfer-from", "mnist-st", "--methods", "dp-sgda",
                 "--configs", str(configs), "--docs", str(docs), "--root", str(tmp_path / "none")]) == 0
    assert (docs / "TUNING.md").read_text() == "trials of a search"
    assert tune.transferred_from("fashion-mnist-st", 4.0, configs) == "mnist-st"


def test_main_job_is_the_tuned_best_configuration():
    """`make run` trains exactly the configuration `dpdro lab tune` selected for MNIST-ST at epsilon 4 (only the
    run directory, the evaluation and checkpoint cadence differ), so the quick start shows the goal-figure setting."""
    import tomllib
    from pathlib import Path

    configs = Path(__file__).resolve().parents[1] / "simulations" / "configs"
    with open(configs / "main.toml", "rb") as f:
        main = tomllib.load(f)
    with open(configs / "mnist-st-eps4-best.toml", "rb") as f:
        best = tomllib.load(f)
    local = {"out-dir", "eval-every", "checkpoint-every"}
    assert {k: v for k, v in main.items() if k not in local} == {k: v for k, v in best.items() if k not in local}
    assert main["out-dir"] == "runs/main" and best["dataset"] == "mnist-st" and best["epsilon"] == 4.0
    import warnings

    from dpdro.common.config import IgnoredKeyWarning
    with warnings.catch_warnings():
        warnings.simplefilter("error", IgnoredKeyWarning)  # the quick start prints no warning
        Config.from_mapping(main)  # valid, and every key it sets is read


def test_hazard_variants_of_a_group_level_config_toggle_the_group_levers(tmp_path):
    from dpdro.simulations.hazards import GROUP_TOGGLES, variants
    from dpdro.simulations.tune import write_toml

    write_toml(tmp_path / "mnist-st-eps4-dp-double-spider.toml",
               {"algorithm": "dp-double-spider", "dro-level": "group", "dro-reference": "uniform", "psi": "kl",
                "beta": 0.3, "q": 1, "dro-clip": "product"})
    write_toml(tmp_path / "mnist-st-eps4-recursive-spider.toml", {"algorithm": "recursive-spider", "q": 1})
    vs = variants(tmp_path)
    dss = [label for label, algo, _ in vs if algo == "dp-double-spider"]
    # equal to the tuned config, hence left out: uniform, q = 1, tau 0 (the default), product, kl
    assert len(dss) == 1 + len(GROUP_TOGGLES["dp-double-spider"]) - 5
    assert "dp-double-spider, dro-reference=prior" in dss and "dp-double-spider, dro-level=record" in dss
    assert "dp-double-spider, eta-clip-rule=fixed" not in dss  # a record-level lever, inert at the group level
    # the record-level recursive-spider config keeps the record toggles
    assert "recursive-spider, rs-clip-units=relative" in [label for label, _, _ in vs]


def test_baseline_variants_carry_the_baseline_setting_into_double_spider(tmp_path):
    from dpdro.simulations.hazards import baseline_variants
    from dpdro.simulations.tune import write_toml

    dss = {"algorithm": "dp-double-spider", "dro-clip": "product", "lr-x": 2.0, "q": 1, "lambda": 1.0,
           "refresh-batch": 1024, "diff-batch": 512}
    write_toml(tmp_path / "mnist-st-eps4-dp-double-spider.toml", dss)
    write_toml(tmp_path / "mnist-st-eps4-dp-sgd-la.toml", {"algorithm": "dp-sgd-la", "lr-x": 6.0,
               "refresh-batch": 2048, "diff-batch": 1024, "posthoc-tau": 0.5})
    vs = baseline_variants(tmp_path)
    assert [v[2]["dro-clip"] for v in vs] == ["product", "weight-after-clip"]
    for _, algo, keys in vs:
        cfg = Config.from_mapping(keys)
        assert algo == cfg.algorithm == "dp-double-spider" and cfg.lr_x == 6.0 and cfg.refresh_batch == 2048
        assert cfg.posthoc_tau == 0.5 and cfg.tau == 1.0 and cfg.q == 1 and cfg.lambda_ == 1.0


def test_hazards_header_states_the_runs_own_delta_and_accountant():
    from dpdro.simulations.hazards import _privacy_words

    assert _privacy_words([]) == "no finished runs"
    summaries = [{"delta": 3.3313e-06, "accountant": "pld"}, {"delta": 1.19e-05}, {"delta": 1.19e-05}]
    # a summary without an accountant field predates the PLD default: RDP
    assert _privacy_words(summaries) == "delta 1.19e-05, RDP accountant; delta 3.33e-06, PLD accountant"
