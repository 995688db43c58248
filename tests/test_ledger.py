"""Privacy ledger and release (ALGORITHMS.md 5.2-5.3, 7): closed-form RDP of the Gaussian, mixed schedules
against an independent event-by-event composition, calibration, the guard, reply checks and noise."""

from __future__ import annotations

import math
from collections import Counter

import dp_accounting
import numpy as np
import pytest
import torch
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant
from scipy import optimize, special

from dpdro.common.config import Config, ConfigError
from dpdro.common.messages import Point, Query, Reply
from dpdro.server import ledger
from dpdro.server.ledger import Ledger, Mechanism, PrivacyBudgetExceeded
from dpdro.server.release import ReplyError, aggregate, check_reply, noisy_mean, split_valid

DELTA = 1e-5


# ---- (a) unsampled Gaussian against the closed-form RDP ----

@pytest.mark.parametrize("z,k", [(0.8, 1), (1.5, 10), (5.0, 100), (2.0, 1000)])
def test_unsampled_gaussian_equals_closed_form_rdp(z, k):
    orders = np.asarray(rdp_privacy_accountant.RdpAccountant()._orders, dtype=np.float64)
    rdp = k * orders / (2 * z**2)  # RDP of the Gaussian mechanism (Mironov 2017), k-fold composition
    eps_ref, _ = rdp_privacy_accountant.compute_epsilon(orders, rdp, DELTA)
    eps = ledger.epsilon_of({(1.0, z): k}, DELTA, "rdp")
    assert eps == pytest.approx(eps_ref, rel=1e-9)
    acc = rdp_privacy_accountant.RdpAccountant()
    acc.compose(ledger.release_event(1.0, z), k)
    assert acc.get_epsilon(DELTA) == pytest.approx(eps_ref, rel=1e-9)
    # the improved conversion is never worse than the classical one (Mironov 2017, Prop. 3)
    classical = float(np.min(rdp + math.log(1 / DELTA) / (orders - 1)))
    assert eps <= classical + 1e-12
    assert eps > 0.5 * classical


def test_epsilon_of_edge_cases():
    assert ledger.epsilon_of({}, DELTA) == 0.0
    assert ledger.epsilon_of({(0.1, 1.0): 0}, DELTA) == 0.0
    assert math.isinf(ledger.epsilon_of({(0.1, 0.0): 1}, DELTA))
    assert math.isinf(ledger.epsilon_of({(0.1, 1.0): 5, (0.2, 0.0): 1}, DELTA))
    # monotone in the number of releases and decreasing in the noise
    e1 = ledger.epsilon_of({(0.1, 1.0): 5}, DELTA)
    e2 = ledger.epsilon_of({(0.1, 1.0): 6}, DELTA)
    e3 = ledger.epsilon_of({(0.1, 1.2): 6}, DELTA)
    assert 0 < e1 < e2 and e3 < e2
    with pytest.raises(ValueError):
        ledger.make_accountant("moments")
    with pytest.raises(ValueError, match="allowed: pld, rdp"):
        ledger.epsilon_of({(0.1, 1.0): 5}, DELTA, "moments")


def test_release_event_structure():
    ev = ledger.release_event(0.25, 1.7)
    assert isinstance(ev, dp_accounting.PoissonSampledDpEvent)
    assert ev.sampling_probability == 0.25
    assert isinstance(ev.event, dp_accounting.GaussianDpEvent) and ev.event.noise_multiplier == 1.7


# ---- (b) mixed schedule against an independent computation ----

MIXED = {(0.1, 1.1): 6, (0.3, 2.5): 3, (0.05, 0.9): 2}


def test_mixed_schedule_equals_event_by_event_composition():
    acc = rdp_privacy_accountant.RdpAccountant()
    # interleaved, one event at a time, built directly with dp_accounting
    order = []
    for (r, z), c in MIXED.items():
        order += [(r, z)] * c
    rng = np.random.default_rng(0)
    for j in rng.permutation(len(order)):
        r, z = order[j]
        acc.compose(dp_accounting.PoissonSampledDpEvent(r, dp_accounting.GaussianDpEvent(z)))
    eps_ref = acc.get_epsilon(DELTA)
    eps = ledger.epsilon_of(MIXED, DELTA, "rdp")
    assert eps == pytest.approx(eps_ref, rel=1e-9)
    # and the schedule is not dominated by a single mechanism (each one matters)
    for key in MIXED:
        fewer = {k: (c - 1 if k == key else c) for k, c in MIXED.items()}
        assert ledger.epsilon_of(fewer, DELTA, "rdp") < eps - 1e-6


def test_mixed_schedule_pld_close_to_rdp():
    """PLD is the tighter accountant: finite, never above RDP (+ a discretisation slack) and not wildly
    below it. (Measured PLD/RDP ratios are 0.8-0.92 for such schedules, so the brief's "within 10%" is
    not a property of the accountants; the bound used here is 25%.)"""
    eps_rdp = ledger.epsilon_of(MIXED, DELTA, "rdp")
    eps_pld = ledger.epsilon_of(MIXED, DELTA, "pld")
    assert math.isfinite(eps_pld) and eps_pld > 0
    assert eps_pld <= eps_rdp * (1 + 1e-3) + 1e-3
    assert eps_pld >= 0.75 * eps_rdp


# ---- (c) calibration ----

PLANS = [
    ({Mechanism("x-refresh", 0.02, 1.0): 40, Mechanism("x-diff", 0.01, 2.0): 360,
      Mechanism("eta-refresh", 0.02, 2.0): 40}, 1.0),
    ({Mechanism("x-refresh", 0.05, 1.0): 20, Mechanism("x-diff", 0.03, 1.5): 60}, 4.0),
    ({Mechanism("sgd", 0.01, 1.0): 500}, 8.0),
]


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
@pytest.mark.parametrize("plan,target", PLANS, ids=["eps1", "eps4", "eps8"])
def test_calibrate_lands_within_one_percent(plan, target, accountant):
    scale = ledger.calibrate(plan, target, DELTA, accountant)
    assert scale > 0 and math.isfinite(scale)
    eps = ledger.epsilon_of(ledger.plan_counts(plan, scale), DELTA, accountant)
    assert 0.99 * target <= eps <= target
    # a slightly smaller noise scale overspends (the scale is not needlessly large)
    assert ledger.epsilon_of(ledger.plan_counts(plan, scale * 0.98), DELTA, accountant) > target


def _main_job_plan():
    """The main job's plan (simulations/configs/main.toml, n = 30,018 MNIST-ST training records), built as the
    engine builds it."""
    import tomllib
    from pathlib import Path

    from dpdro.common.config import Config
    from dpdro.common.models import make_model, resolve_model
    from dpdro.common.per_sample import FlatModel
    from dpdro.server.algorithms import make_algorithm
    from dpdro.server.engine import plan_run

    with open(Path(__file__).resolve().parent.parent / "simulations" / "configs" / "main.toml", "rb") as f:
        cfg = Config.from_mapping(tomllib.load(f))
    n = 30_018
    dim = FlatModel(make_model(resolve_model(cfg.model, cfg.dataset), 10, 0)).dim
    return cfg, n, n**-1.1, plan_run(cfg, make_algorithm(cfg, n, dim, 10), n, n**-1.1)


def test_pld_calibration_on_the_main_job_plan_lands_and_needs_less_noise_than_rdp():
    cfg, n, delta, (plan, noise, _) = _main_job_plan()
    assert cfg.accountant == "pld"  # the default
    counts = Counter()
    for m, k in plan.items():
        counts[(m.rate, noise[m.name])] += k
    eps = ledger.epsilon_of(counts, delta, "pld")
    assert 0.99 * cfg.epsilon <= eps <= cfg.epsilon
    # PLD is the tighter bound: 0.90-0.95x the RDP noise at the same target (measured: 1.84 / 1.97 = 0.937),
    # and at RDP's noise it reports 3.67 where RDP says 4.00
    rdp_scale = ledger.calibrate(plan, cfg.epsilon, delta, "rdp")
    grad = next(m for m in plan if m.name == "grad")  # the model release of the main job's method
    assert 0.90 <= noise["grad"] / grad.noise_at(rdp_scale) <= 0.95
    at_rdp = ledger.plan_counts(plan, rdp_scale)
    assert ledger.epsilon_of(at_rdp, delta, "rdp") == pytest.approx(cfg.epsilon, rel=0.01)
    assert 0.85 * cfg.epsilon <= ledger.epsilon_of(at_rdp, delta, "pld") <= 0.95 * cfg.epsilon


def test_pld_epsilon_equals_dp_accounting_pld_built_directly():
    """Ours (discretisation 1e-3, PLDs built and sized by the ledger) against dp-accounting's PLDAccountant at
    its finer default discretisation 1e-4, one event at a time: within 2e-3 (measured 2e-4)."""
    for counts, delta in (({(1.0, 10.0): 1, (0.0682, 1.97): 500}, 30_018**-1.1), (MIXED, DELTA)):
        acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
        for (r, z), c in counts.items():
            acc.compose(dp_accounting.PoissonSampledDpEvent(r, dp_accounting.GaussianDpEvent(z)), c)
        ref = acc.get_epsilon(delta)
        eps = ledger.epsilon_of(counts, delta, "pld")
        assert eps == pytest.approx(ref, abs=2e-3)
        assert eps < ledger.epsilon_of(counts, delta, "rdp")


# ---- (b') the unit: one record replaced with the null record, n fixed ----

def test_accountants_are_told_the_replace_with_null_relation(monkeypatch):
    """Every accountant the ledger builds (make_accountant, the RDP of epsilon_of, the PLDs of _pld) is given
    REPLACE_SPECIAL: one record replaced with the null record (zero vector), n fixed."""
    relation = dp_accounting.NeighboringRelation.REPLACE_SPECIAL
    assert ledger.NEIGHBOURING_RELATION == relation
    assert ledger.make_accountant("rdp").neighboring_relation == relation
    assert ledger.make_accountant("pld").neighboring_relation == relation
    seen = []
    real_pld, real_make = ledger.pld_lib.from_gaussian_mechanism, ledger.make_accountant
    monkeypatch.setattr(ledger.pld_lib, "from_gaussian_mechanism",
                        lambda **kw: seen.append(("pld", kw["neighboring_relation"])) or real_pld(**kw))
    monkeypatch.setattr(ledger, "make_accountant",
                        lambda kind: seen.append((kind, real_make(kind).neighboring_relation)) or real_make(kind))
    for accountant in ledger.ACCOUNTANTS:  # counts no other test uses: not answered from the cache
        ledger.epsilon_of({(0.0371, 1.113): 7, (0.0123, 2.17): 3}, DELTA, accountant)
    assert sorted(seen) == [("pld", relation), ("pld", relation), ("rdp", relation)]


def null_record_delta(eps: float, q: float, z: float, k: int) -> float:
    """delta(eps) of k (1 or 2) Poisson-subsampled Gaussian releases (rate q, noise multiplier z) for a record
    of norm 1 against the null record, by direct integration (no dp-accounting): the larger hockey-stick
    divergence of the two orders of P = (1 - q) N(0, z^2) + q N(1, z^2) (the record, sampled with probability q)
    and Q = N(0, z^2) (the null record adds the zero vector), each composed k times. The privacy loss
    L(x) = log(P(x) / Q(x)) = log(1 - q + q exp((2x - 1) / (2 z^2))) is increasing in x, so one release's
    divergence is a difference of normal tails at the cut L(x) = t; two releases integrate it over the first
    release's loss (trapezoid, 40,001 points over +-30 z)."""
    z2 = z * z

    def loss(x):
        return np.log((1 - q) + q * np.exp((2 * x - 1) / (2 * z2)))

    def cut(t):  # the x with L(x) = t, -inf where L > t everywhere (e^t <= 1 - q)
        et = np.exp(t)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(et > 1 - q, z2 * np.log((et - (1 - q)) / q) + 0.5, -np.inf)

    def remove(t):  # E_P[(1 - e^(t - L))_+] = P(L > t) - e^t Q(L > t)
        x = cut(t)
        p = (1 - q) * special.ndtr(-x / z) + q * special.ndtr(-(x - 1) / z)
        return np.maximum(p - np.exp(t) * special.ndtr(-x / z), 0.0)

    def add(t):  # E_Q[(1 - e^(t + L))_+] = Q(L < -t) - e^t P(L < -t)
        x = cut(-t)
        p = (1 - q) * special.ndtr(x / z) + q * special.ndtr((x - 1) / z)
        return np.maximum(special.ndtr(x / z) - np.exp(t) * p, 0.0)

    if k == 1:
        return float(max(remove(np.float64(eps)), add(np.float64(eps))))
    x = np.linspace(-30 * z, 30 * z + 1, 40_001)
    q_pdf = np.exp(-x**2 / (2 * z2)) / (z * math.sqrt(2 * math.pi))
    p_pdf = (1 - q) * q_pdf + q * np.exp(-(x - 1) ** 2 / (2 * z2)) / (z * math.sqrt(2 * math.pi))
    return float(max(np.trapezoid(p_pdf * remove(eps - loss(x)), x), np.trapezoid(q_pdf * add(eps + loss(x)), x)))


@pytest.mark.parametrize(("rate", "z", "k"), [(0.05, 0.8, 1), (0.5, 1.5, 1), (0.2, 1.0, 2), (1.0, 2.0, 2)])
def test_epsilon_equals_the_direct_hockey_stick_divergence_against_the_null_record(rate, z, k):
    """The ledger's epsilon (PLD, discretisation 1e-3, pessimistic) against the direct integration of
    ``null_record_delta``: never below it, at most 2e-3 above (measured: within 2e-6); RDP is an upper bound."""
    if null_record_delta(0.0, rate, z, k) <= DELTA:
        exact = 0.0
    else:
        exact = optimize.brentq(lambda e: null_record_delta(e, rate, z, k) - DELTA, 0.0, 60.0, xtol=1e-9)
    assert exact > 1.0
    ours = ledger.epsilon_of({(rate, z): k}, DELTA, "pld")
    assert exact - 1e-6 <= ours <= exact + 2e-3
    assert ledger.epsilon_of({(rate, z): k}, DELTA, "rdp") >= exact


def _fake_epsilon(rule):
    """An epsilon_of replacement: rule(smallest noise multiplier of the releases) -> epsilon."""
    def fake(counts, delta, accountant="pld"):
        return rule(min(z for (_, z), c in counts.items() if c > 0))
    return fake


def test_calibrate_raises_rather_than_return_an_overspending_scale(monkeypatch):
    # an accountant by which every scale overspends: the old code stepped the scale up 200 times by 1.0005
    # and returned it anyway
    monkeypatch.setattr(ledger, "epsilon_of", _fake_epsilon(lambda z: 8.0))
    with pytest.raises(ledger.CalibrationError, match="no noise scale .* within epsilon 4"):
        ledger.calibrate({Mechanism("sgd", 0.01): 500}, 4.0, DELTA)


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_calibrate_raises_when_no_scale_lands_in_the_promised_range(monkeypatch, accountant):
    # epsilon jumps from 8 to 2 at z = 1.3: no scale spends [3.96, 4]; the old code returned one spending 2
    monkeypatch.setattr(ledger, "epsilon_of", _fake_epsilon(lambda z: 8.0 if z < 1.3 else 2.0))
    with pytest.raises(ledger.CalibrationError, match=r"could not land epsilon in \[3.96, 4\].*sgd"):
        ledger.calibrate({Mechanism("sgd", 0.01): 500}, 4.0, DELTA, accountant)


def test_pld_memory_cap_gives_a_clear_error_not_an_allocation(monkeypatch):
    # z = 1e-3 would need ~10^10 points per PMF (the issue's 5.89 TiB): refused before any allocation
    with pytest.raises(ledger.AccountingCostError, match=r"'accountant'.*noise multiplier 0.001.*GiB.*accountant=rdp"):
        ledger.epsilon_of({(0.5, 1e-3): 10}, DELTA, "pld")
    assert math.isfinite(ledger.epsilon_of({(0.5, 1e-3): 10}, DELTA, "rdp"))
    # a cap the main job's plan exceeds: calibration names the plan's releases and what to change
    monkeypatch.setattr(ledger, "PLD_MAX_POINTS", 500)
    ledger._epsilon_cached.cache_clear()
    plan = {Mechanism("class-histogram", 1.0, fixed_noise=10.0): 1, Mechanism("grad", 0.0682): 500}
    try:
        with pytest.raises(ledger.AccountingCostError, match=r"500 x grad \(rate 0.0682.*accountant=rdp"):
            ledger.calibrate(plan, 4.0, 30_018**-1.1, "pld")
    finally:
        ledger._epsilon_cached.cache_clear()


def test_pld_discretisation_coarsens_before_refusing(monkeypatch):
    # a PMF that does not fit the cap at 1e-3 is accounted at 1e-2 (a looser but valid bound)
    counts = {(0.0682, 1.97): 500}
    fine = ledger.epsilon_of(counts, DELTA, "pld")
    monkeypatch.setattr(ledger, "PLD_MAX_POINTS", 5000)
    ledger._epsilon_cached.cache_clear()
    try:
        coarse = ledger.epsilon_of(counts, DELTA, "pld")
    finally:
        ledger._epsilon_cached.cache_clear()
    assert fine < coarse <= fine + 0.05


def test_calibrate_rejects_bad_input():
    plan = {Mechanism("a", 0.1): 10}
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError):
            ledger.calibrate(plan, bad, DELTA)
    with pytest.raises(ValueError):
        ledger.calibrate({Mechanism("a", 0.1): 0}, 1.0, DELTA)


def test_plan_counts_merges_identical_releases():
    a, b = Mechanism("a", 0.1, 1.0), Mechanism("b", 0.1, 1.0)
    c = ledger.plan_counts({a: 3, b: 4, Mechanism("c", 0.2, 2.0): 1}, 1.5)
    assert c == {(0.1, 1.5): 7, (0.2, 3.0): 1}


# ---- (d) the guard ----

GUARD_PLAN = {Mechanism("refresh", 0.5, 1.0): 3, Mechanism("diff", 0.2, 2.0): 4}
GUARD_TARGET = 2.0


@pytest.fixture(scope="module")
def guard_noise():
    scale = ledger.calibrate(GUARD_PLAN, GUARD_TARGET, DELTA)
    return {m.name: m.relative_noise * scale for m in GUARD_PLAN}


def test_guard_accepts_the_plan_then_refuses(guard_noise):
    led = Ledger(GUARD_PLAN, guard_noise, GUARD_TARGET, DELTA)
    assert led.private
    assert led.epsilon_spent() == 0.0
    for _ in range(3):
        led.charge("refresh", 0.5)
        led.charge("diff", 0.2)
    led.charge("diff", 0.2)
    assert led.spent == {"refresh": 3, "diff": 4}
    spent_eps = led.epsilon_spent()
    assert 0.99 * GUARD_TARGET <= spent_eps <= GUARD_TARGET
    for name, rate in (("refresh", 0.5), ("diff", 0.2)):
        with pytest.raises(PrivacyBudgetExceeded, match="refused"):
            led.charge(name, rate)
        assert led.spent == {"refresh": 3, "diff": 4}
        assert not led.extra
        assert led.epsilon_spent() == pytest.approx(spent_eps, rel=1e-12)
    # an unknown mechanism has no noise: refused too
    with pytest.raises(PrivacyBudgetExceeded):
        led.charge("unplanned", 0.1)
    assert led.spent == {"refresh": 3, "diff": 4} and not led.extra


def test_guard_allows_off_plan_release_only_within_target(guard_noise):
    led = Ledger(GUARD_PLAN, guard_noise, GUARD_TARGET, DELTA)
    led.charge("refresh", 0.5)
    # off-plan rate: exact check, accepted while the budget allows it, recorded as extra
    led.charge("refresh", 0.01)
    assert led.spent == {"refresh": 1} and led.extra == {(0.01, guard_noise["refresh"]): 1}
    expected = ledger.epsilon_of({(0.5, guard_noise["refresh"]): 1, (0.01, guard_noise["refresh"]): 1}, DELTA)
    assert led.epsilon_spent() == pytest.approx(expected, rel=1e-12)
    # state round trip
    other = Ledger(GUARD_PLAN, guard_noise, GUARD_TARGET, DELTA)
    other.load_state(led.state())
    assert other.spent == led.spent and other.extra == led.extra
    assert other.epsilon_spent() == pytest.approx(led.epsilon_spent(), rel=1e-12)


def test_planned_releases_are_checked_once_releases_beyond_the_plan_were_charged(guard_noise):
    """A release beyond the plan (off-plan rate, or one lost to a crash and charged on resume) used to leave the
    guard admitting every planned release unchecked, so plan + extras could end above the target. Planned
    releases are now admitted unchecked only while the rest of the plan still fits with the extras."""
    led = Ledger(GUARD_PLAN, guard_noise, GUARD_TARGET, DELTA)
    led.record(0.5, guard_noise["refresh"])  # a refresh lost to a crash, charged on resume
    assert led.epsilon_if_completed() > GUARD_TARGET
    charged = 0
    with pytest.raises(PrivacyBudgetExceeded, match="refused"):
        for _ in range(3):
            led.charge("refresh", 0.5)
            charged += 1
            led.charge("diff", 0.2)
            charged += 1
        led.charge("diff", 0.2)
        charged += 1
    assert charged < 7  # the plan's last release(s) no longer fit
    assert led.epsilon_spent() <= GUARD_TARGET
    # with room to spare (a tiny extra), the plan still fits and is admitted as before
    roomy = Ledger(GUARD_PLAN, guard_noise, GUARD_TARGET * 1.5, DELTA)
    roomy.record(0.5, guard_noise["refresh"])
    for _ in range(3):
        roomy.charge("refresh", 0.5)
        roomy.charge("diff", 0.2)
    roomy.charge("diff", 0.2)
    assert roomy.spent == {"refresh": 3, "diff": 4} and roomy.extra == {(0.5, guard_noise["refresh"]): 1}
    assert roomy.epsilon_spent() == pytest.approx(roomy.epsilon_if_completed(), rel=1e-12)


def test_non_private_ledger_never_refuses():
    led = Ledger(GUARD_PLAN, {"refresh": 0.0, "diff": 0.0}, math.inf, DELTA)
    assert not led.private
    for _ in range(1000):
        led.charge("refresh", 0.5)
    led.charge("whatever", 1.0)
    assert led.spent["refresh"] == 1000 and led.spent["whatever"] == 1
    assert math.isinf(led.epsilon_spent())


# ---- (e) release ----

def make_query(dim=3, clip=1.0, rate=0.1):
    return Query(iteration=7, mechanism="x-refresh", quantity="dual-x", points=(Point(0, 0.0),),
                 rate=rate, clip=clip, dim=dim)


def test_check_reply_accepts_valid():
    q = make_query()
    check_reply(q, Reply("7:x-refresh", 0, np.array([0.6, 0.8, 1.0]), 2), "float32")  # norm 1.41 <= 1 x 2
    check_reply(q, Reply("7:x-refresh", 1, np.zeros(3), 0), "float32")  # empty sample
    check_reply(make_query(clip=math.inf), Reply("7:x-refresh", 0, np.array([1e6, 0.0, 0.0]), 1), "float64")


@pytest.mark.parametrize("total,count,qid,why", [
    (np.zeros(4), 1, "7:x-refresh", "shape"),
    (np.zeros((3, 1)), 1, "7:x-refresh", "shape"),
    (np.array([0.0, np.nan, 0.0]), 1, "7:x-refresh", "NaN"),
    (np.array([0.0, np.inf, 0.0]), 1, "7:x-refresh", "Inf"),
    (np.zeros(3), 1, "8:x-refresh", "answers"),
    (np.zeros(3), 1, "7:x-diff", "answers"),
    (np.array([2.0, 0.5, 0.0]), 2, "7:x-refresh", "exceeds"),
    (np.array([0.1, 0.0, 0.0]), 0, "7:x-refresh", "exceeds"),
    (np.zeros(3), -1, "7:x-refresh", "negative"),
    (np.zeros(3, dtype=np.int64), 1, "7:x-refresh", "dtype"),
    (np.zeros(3, dtype=np.float16), 1, "7:x-refresh", "dtype float16, expected float64"),
    (np.zeros(3, dtype=np.float32), 1, "7:x-refresh", "dtype float32, expected float64"),
])
def test_check_reply_rejects(total, count, qid, why):
    with pytest.raises(ReplyError, match=why):
        check_reply(make_query(), Reply(qid, 3, total, count), "float32")


def test_aggregate_sums_in_partition_order():
    q = make_query(dim=2, clip=10.0)
    replies = [Reply("7:x-refresh", p, np.array([0.1 * p, 1.0]), 1) for p in (2, 0, 1)]
    np.testing.assert_allclose(aggregate(q, replies), [0.3, 3.0], rtol=1e-15)
    bad = Reply("7:x-refresh", 3, np.array([np.nan, 0.0]), 1)
    valid, rejected = split_valid(q, replies + [bad], "float64")
    assert sorted(r.partition for r in valid) == [0, 1, 2]
    assert list(rejected) == [3] and "NaN" in rejected[3]


def test_noisy_mean_without_noise_is_total_over_expected_batch():
    q = make_query(dim=3, clip=1.0, rate=0.25)
    total = np.array([1.0, -2.0, 0.5])
    out = noisy_mean(q, total, 0.0, 40, np.random.default_rng(0))
    np.testing.assert_allclose(out, total / (0.25 * 40), rtol=1e-15)
    assert out is not total and total[1] == -2.0  # input not modified


def test_noisy_mean_has_declared_std():
    clip, z, rate, n = 0.7, 1.3, 0.1, 50
    q = make_query(dim=1, clip=clip, rate=rate)
    rng = np.random.default_rng(12345)
    total = np.array([2.0])
    draws = np.array([noisy_mean(q, total, z * q.sensitivity, n, rng)[0] for _ in range(20000)])
    noise = draws * (rate * n) - total[0]
    assert noise.std() == pytest.approx(z * clip, rel=0.03)
    assert abs(noise.mean()) < 5 * z * clip / math.sqrt(20000)
    # seeded: reproducible
    a = noisy_mean(q, total, z * clip, n, np.random.default_rng(7))
    b = noisy_mean(q, total, z * clip, n, np.random.default_rng(7))
    assert np.array_equal(a, b)


# ---- (f) delta against n ----

@pytest.mark.parametrize("delta,n,given", [(0.5, 20, 0.5), (0.05, 20, 0.05), (1.0, 1, "auto"), (0.01, 100, 0.01)])
def test_check_delta_refuses_delta_of_one_over_n_or_more(delta, n, given):
    with pytest.raises(ConfigError, match=rf"config key 'delta': got {given!r}.*n = {n} training.*1/n = "):
        ledger.check_delta(delta, n, given)


def test_check_delta_warns_above_a_tenth_of_one_over_n():
    warning = ledger.check_delta(20**-1.1, 20, "auto")  # the issue's n = 20: delta 0.037 > 1/200
    assert warning is not None and "0.0371" in warning and "1/(10 n) = 0.005" in warning and "n = 20" in warning
    assert ledger.check_delta(0.004, 20, 0.004) is None
    assert ledger.check_delta(1e-6, 30_018, 1e-6) is None


def _engine_cfg(tmp_path, **values):
    return Config.from_mapping({"algorithm": "dp-sgd", "epsilon": 4.0, "iterations": 1, "refresh-batch": 4,
                                "s-batch": 4, "diff-batch": 4, "num-clients": 2, "out-dir": str(tmp_path / "run"),
                                **values})


def test_engine_refuses_delta_at_least_one_over_n_before_any_work(tmp_path):
    from dpdro.client.local_transport import LocalTransport
    from dpdro.common.data import ArrayDataset
    from dpdro.server.engine import train

    g = torch.Generator().manual_seed(0)
    data = ArrayDataset(torch.rand(20, 1, 28, 28, generator=g) * 2 - 1, torch.arange(20) % 10, 10, "tiny")
    cfg = _engine_cfg(tmp_path, delta=0.5)
    with pytest.raises(ConfigError, match=r"'delta': got 0.5 for n = 20 .*1/n = 0.05"):
        train(cfg, LocalTransport(cfg, data), data)
    assert not (tmp_path / "run").exists()  # nothing calibrated, created or written


def test_engine_warns_for_a_weak_delta_but_never_for_auto(tmp_path, caplog):
    from dpdro.server.engine import resolve_delta

    with caplog.at_level("WARNING", logger="dpdro.server.engine"):
        assert resolve_delta(_engine_cfg(tmp_path, delta=20**-1.1), 20) == pytest.approx(20**-1.1)
    assert any("exceeds 1/(10 n)" in r.getMessage() and r.levelname == "WARNING" for r in caplog.records)
    caplog.clear()
    with caplog.at_level("WARNING", logger="dpdro.server.engine"):
        # 'auto' is 1/(10 n): the default never triggers the product's own weak-delta warning, whatever n
        for n in (1, 20, 30_018, 10**9):
            assert resolve_delta(_engine_cfg(tmp_path), n) == pytest.approx(0.1 / n)
        resolve_delta(_engine_cfg(tmp_path, delta=1e-6), 20)
        resolve_delta(_engine_cfg(tmp_path, epsilon="inf", delta=0.5), 20)  # not private: delta unused
    assert not caplog.records


def test_auto_delta_is_a_tenth_of_one_over_n():
    assert ledger.auto_delta(1) == pytest.approx(0.1)
    assert ledger.auto_delta(30_018) == pytest.approx(3.331e-6, rel=1e-3)
    assert ledger.check_delta(ledger.auto_delta(20), 20, "auto") is None
    with pytest.raises(ValueError, match="at least 1"):
        ledger.auto_delta(0)


def test_a_release_within_the_plan_is_refused_when_seen_releases_beyond_it_leave_no_room():
    """A ledger of what the server has seen: releases protected by at least the planned multiplier count as
    planned ones; a partial sum seen at a smaller multiplier goes beyond the plan, and then the next planned
    release is admitted only if the exact epsilon with it stays within the target (the plan alone no longer
    proves it); ``check_spent`` refuses once what was seen passes the target."""
    a = Mechanism("a", 0.1)
    plan = {a: 20}
    z = ledger.calibrate(plan, 1.0, 1e-5)
    seen = Ledger(plan, {"a": z}, 1.0, 1e-5)
    for _ in range(17):
        seen.record_seen("a", 0.1, z * 1.2)  # more noise than planned: bounded by the planned event
    seen.check_spent("against the server")
    assert seen.spent["a"] == 17 and not seen.extra
    seen.record_seen("a", 0.1, z * math.sqrt(2 / 3))  # a discarded partial sum: beyond the plan
    assert seen.extra == Counter({(0.1, z * math.sqrt(2 / 3)): 1})
    assert seen.epsilon_spent() <= 1.0  # 18 releases so far, within the target
    with pytest.raises(PrivacyBudgetExceeded, match="release 'a' .* would spend epsilon 1.0"):
        seen.check("a", 0.1)  # the 18th planned release would pass it
    seen.record_seen("a", 0.1, z)
    with pytest.raises(PrivacyBudgetExceeded, match="the releases against the server spend epsilon 1.0.* > target 1"):
        seen.check_spent("against the server")
