"""The membership-inference metrics of the privacy audit on hand-made and synthetic scores."""

from __future__ import annotations

import numpy as np
import pytest

from dpdro.simulations.audit import lira_scores, roc_auc, tpr_at_fpr


def test_roc_auc_on_hand_made_scores():
    assert roc_auc(np.array([3.0, 4.0]), np.array([1.0, 2.0])) == 1.0
    assert roc_auc(np.array([1.0, 2.0]), np.array([3.0, 4.0])) == 0.0
    assert roc_auc(np.array([1.0, 3.0]), np.array([2.0, 2.0])) == 0.5
    assert roc_auc(np.array([2.0]), np.array([2.0])) == 0.5  # a tie counts one half


def test_roc_auc_matches_pairwise_definition():
    rng = np.random.default_rng(0)
    a, b = rng.normal(0.3, 1, 200).round(1), rng.normal(0, 1, 150).round(1)
    pairs = (a[:, None] > b[None, :]).mean() + 0.5 * (a[:, None] == b[None, :]).mean()
    assert roc_auc(a, b) == pytest.approx(pairs, abs=1e-12)


def test_tpr_at_fpr():
    nonmember = np.arange(100, dtype=float)  # threshold at the 99% quantile: 99
    member = np.array([50.0, 99.5, 120.0, 98.0])
    assert tpr_at_fpr(member, nonmember, 0.01) == 0.5
    assert tpr_at_fpr(nonmember, nonmember, 0.01) == 0.0


def test_lira_separates_members_when_shadows_show_a_gap():
    rng = np.random.default_rng(1)
    s, n = 8, 200
    shadow_in = rng.random((s, n)) < 0.5
    shadow_phi = np.where(shadow_in, 2.0, 0.0) + rng.normal(0, 0.3, (s, n))
    member = rng.random(n) < 0.5
    target = np.where(member, 2.0, 0.0) + rng.normal(0, 0.3, n)
    scores = lira_scores(target, shadow_phi, shadow_in)
    assert roc_auc(scores[member], scores[~member]) > 0.97  # a few records lack IN or OUT shadows (score 0)
    # no information: same distribution in and out gives an AUC near one half
    flat = lira_scores(rng.normal(0, 1, n), rng.normal(0, 1, (s, n)), shadow_in)
    assert abs(roc_auc(flat[member], flat[~member]) - 0.5) < 0.12
