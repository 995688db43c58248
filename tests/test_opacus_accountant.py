"""DP-SGD's epsilon from our ledger (dp-accounting) against Opacus' RDP and PRV accountants (test-only
dependency): RDP against RDP, and our default PLD against Opacus' PRV accountant (Gopi et al. 2021), an
independent numerical composition of the same privacy loss."""

from __future__ import annotations

import pytest
from opacus.accountants import PRVAccountant, RDPAccountant

from dpdro.server.ledger import Ledger, Mechanism, calibrate, epsilon_of


@pytest.mark.parametrize(("rate", "z", "steps"), [(0.01, 1.0, 1000), (0.034, 0.8, 300), (0.1, 2.0, 50)])
def test_dp_sgd_epsilon_matches_opacus(rate, z, steps):
    delta = 1e-5
    ours = epsilon_of({(rate, z): steps}, delta, "rdp")
    acc = RDPAccountant()
    acc.history = [(z, rate, steps)]
    theirs = acc.get_epsilon(delta)
    # Both are RDP bounds of the same Poisson-subsampled Gaussian; they differ only in the order grid and
    # the RDP-to-(epsilon, delta) conversion, and ours is never the looser one by more than 1%.
    assert ours == pytest.approx(theirs, rel=0.05)
    assert ours <= theirs * 1.01


def test_calibrated_dp_sgd_plan_spends_target_by_opacus_too():
    plan = {Mechanism("grad", 0.02): 500}
    scale = calibrate(plan, 4.0, 1e-5, "rdp")
    ledger = Ledger(plan, {"grad": scale}, 4.0, 1e-5, "rdp")
    for _ in range(500):
        ledger.charge("grad", 0.02)
    acc = RDPAccountant()
    acc.history = [(scale, 0.02, 500)]
    assert ledger.epsilon_spent() == pytest.approx(4.0, rel=0.01)
    assert acc.get_epsilon(1e-5) == pytest.approx(ledger.epsilon_spent(), rel=0.05)


PRV_ERROR = 0.01  # Opacus' eps_error: its upper bound is within about 2 x this of the true epsilon


@pytest.mark.parametrize(("history", "delta"), [
    ([(10.0, 1.0, 1), (1.9652, 0.06823, 500)], 30_018**-1.1),  # the main job's plan at RDP's epsilon-4 noise
    ([(1.0, 0.01, 1000)], 1e-5),
    ([(0.8, 0.034, 300), (2.0, 0.1, 50)], 1e-5),
])
def test_pld_epsilon_matches_opacus_prv(history, delta):
    ours = epsilon_of({(rate, z): steps for z, rate, steps in history}, delta, "pld")
    acc = PRVAccountant()
    acc.history = list(history)
    theirs = acc.get_epsilon(delta, eps_error=PRV_ERROR)  # PRV's upper bound
    # both are numerical upper bounds of the same privacy loss: agree to 2 x eps_error (measured: <= 0.011)
    assert ours == pytest.approx(theirs, abs=2 * PRV_ERROR)
    assert ours < epsilon_of({(rate, z): steps for z, rate, steps in history}, delta, "rdp")


def test_calibrated_pld_plan_spends_target_by_opacus_prv_too():
    plan = {Mechanism("grad", 0.02): 500}
    scale = calibrate(plan, 4.0, 1e-5)  # the default accountant: PLD
    acc = PRVAccountant()
    acc.history = [(scale, 0.02, 500)]
    assert 0.99 * 4.0 <= epsilon_of({(0.02, scale): 500}, 1e-5) <= 4.0
    assert acc.get_epsilon(1e-5, eps_error=PRV_ERROR) == pytest.approx(4.0, abs=2 * PRV_ERROR)
