"""DP-SGD's epsilon from our ledger (dp-accounting) against Opacus' RDP accountant (test-only dependency)."""

from __future__ import annotations

import pytest
from opacus.accountants import RDPAccountant

from dpdro.server.ledger import Ledger, Mechanism, calibrate, epsilon_of


@pytest.mark.parametrize(("rate", "z", "steps"), [(0.01, 1.0, 1000), (0.034, 0.8, 300), (0.1, 2.0, 50)])
def test_dp_sgd_epsilon_matches_opacus(rate, z, steps):
    delta = 1e-5
    ours = epsilon_of({(rate, z): steps}, delta)
    acc = RDPAccountant()
    acc.history = [(z, rate, steps)]
    theirs = acc.get_epsilon(delta)
    # Both are RDP bounds of the same Poisson-subsampled Gaussian; they differ only in the order grid and
    # the RDP-to-(epsilon, delta) conversion, and ours is never the looser one by more than 1%.
    assert ours == pytest.approx(theirs, rel=0.05)
    assert ours <= theirs * 1.01


def test_calibrated_dp_sgd_plan_spends_target_by_opacus_too():
    plan = {Mechanism("grad", 0.02): 500}
    scale = calibrate(plan, 4.0, 1e-5)
    ledger = Ledger(plan, {"grad": scale}, 4.0, 1e-5)
    for _ in range(500):
        ledger.charge("grad", 0.02)
    acc = RDPAccountant()
    acc.history = [(scale, 0.02, 500)]
    assert ledger.epsilon_spent() == pytest.approx(4.0, rel=0.01)
    assert acc.get_epsilon(1e-5) == pytest.approx(ledger.epsilon_spent(), rel=0.05)
