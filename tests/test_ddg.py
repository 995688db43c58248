"""The distributed discrete Gaussian core (common/ddg.py; Kairouz, Liu and Steinke, ICML 2021): the discrete
Gaussian sampler's law, the randomised Hadamard rotation, conditional randomised rounding, the epsilon (against an
independent computation: dp-accounting's Gaussian RDP where the two must agree), the modulus, an end-to-end
release of four clients' shares summed modulo 2^b, and the two dropout policies."""

from __future__ import annotations

import math

import numpy as np
import pytest
from dp_accounting import GaussianDpEvent, PoissonSampledDpEvent, SelfComposedDpEvent
from dp_accounting.rdp import RdpAccountant
from dp_accounting.rdp.rdp_privacy_accountant import _compute_rdp_poisson_subsampled_gaussian as exact_sgm_rdp

from dpdro.common import ddg

N = 100_000


def _uniform(seed: int = 0):
    return ddg.uniform_from(np.random.default_rng(seed))


@pytest.mark.parametrize("sigma", [0.8, 2.5, 40.0])
def test_discrete_gaussian_matches_its_pmf(sigma):
    """Seeded: the empirical frequencies of the values within 3 sigma match exp(-x^2 / (2 sigma^2)) / Z to within
    5 standard errors each; mean and variance (= sigma^2 up to e^{-2 pi^2 sigma^2}) too."""
    x = ddg.discrete_gaussian(sigma, N, _uniform())
    assert x.dtype == np.int64 and x.shape == (N,)
    support = np.arange(-int(12 * sigma) - 5, int(12 * sigma) + 6)
    pmf = np.exp(-support.astype(float) ** 2 / (2 * sigma**2))
    pmf /= pmf.sum()
    var = float(np.sum(pmf * support**2))
    assert abs(var / sigma**2 - 1) < 1e-3 or sigma < 1
    assert abs(x.mean()) < 5 * math.sqrt(var / N)
    assert abs(x.var() / var - 1) < 5 * math.sqrt(2 / N)
    inside = np.abs(support) <= 3 * sigma
    counts = np.array([np.count_nonzero(x == v) for v in support[inside]])
    expected = N * pmf[inside]
    assert np.all(np.abs(counts - expected) < 5 * np.sqrt(expected) + 1)
    with pytest.raises(ValueError, match="sigma must be finite and > 0, got 0"):
        ddg.discrete_gaussian(0.0, 3, _uniform())


def test_secure_discrete_gaussian_is_fresh():
    a, b = (ddg.discrete_gaussian(5.0, 50, ddg.uniform_from(None)) for _ in range(2))
    assert not np.array_equal(a, b)


def test_rotation_is_orthonormal_and_inverted():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(3, 1000))
    signs = ddg.rotation_signs(1000, rng)
    assert signs.shape == (1024,) and set(np.unique(signs)) == {-1.0, 1.0}
    y = ddg.rotate(x, signs)
    np.testing.assert_allclose(np.linalg.norm(y, axis=1), np.linalg.norm(x, axis=1), rtol=1e-12)
    np.testing.assert_allclose(ddg.unrotate(y, signs, 1000), x, atol=1e-12)
    np.testing.assert_allclose(ddg.hadamard(np.eye(4)) * 2, [[1, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1],
                                                             [1, -1, -1, 1]])
    # flattening: a basis vector spreads to +-1/sqrt(d') on every coordinate
    e = np.zeros(1000)
    e[7] = 1.0
    np.testing.assert_allclose(np.abs(ddg.rotate(e, signs)), 1 / math.sqrt(1024), rtol=1e-12)
    with pytest.raises(ValueError, match="power-of-two length, got 6"):
        ddg.hadamard(np.zeros(6))


def test_conditional_rounding_is_unbiased_and_bounded():
    rng = np.random.default_rng(2)
    d, c = 256, 30.0
    x = rng.normal(size=d)
    x *= c / np.linalg.norm(x)
    bound = ddg.rounded_l2_bound(c, d, math.exp(-0.5))
    rows = ddg.conditional_round(np.tile(x, (4000, 1)), bound, _uniform(3))
    assert rows.dtype == np.int64
    assert np.all(np.linalg.norm(rows, axis=1) <= bound)
    assert np.all(np.abs(rows - x) < 1)
    # unbiased up to the rare conditioning: the mean error per coordinate is within 5 standard errors (<= 0.5/sqrt n)
    assert np.max(np.abs(rows.mean(axis=0) - x)) < 5 * 0.5 / math.sqrt(4000)
    with pytest.raises(RuntimeError, match="still above the bound"):
        ddg.conditional_round(x[None] * 2, bound, _uniform(), max_tries=3)


def test_rounded_bounds():
    assert ddg.rounded_l2_bound(10.0, 100, 0.0) == 20.0
    c, d, beta = 1000.0, 32768, math.exp(-0.5)
    assert ddg.rounded_l2_bound(c, d, beta) == pytest.approx(math.sqrt(c * c + d / 4 + 1.0 * (c + math.sqrt(d) / 2)))
    assert ddg.rounded_l1_bound(3.0, 100) == 9.0 and ddg.rounded_l1_bound(30.0, 100) == 300.0
    with pytest.raises(ValueError, match="0 <= beta < 1"):
        ddg.rounded_l2_bound(1.0, 4, 1.0)


def test_epsilon_equals_the_gaussian_one_without_inflation():
    """One share (tau = 0): the DDG's RDP is the Gaussian mechanism's, so its epsilon over 100 full-batch releases
    equals dp-accounting's RdpAccountant for GaussianDpEvent(z) composed 100 times, on the same orders."""
    z, steps, delta, l2 = 1.1, 100, 1e-5, 1000.0
    acc = RdpAccountant(list(ddg.RDP_ORDERS))
    acc.compose(SelfComposedDpEvent(GaussianDpEvent(z), steps))
    rdp = [steps * ddg.ddg_rdp(a, l2, l2 * l2, z * l2, 1, 1) for a in ddg.RDP_ORDERS]
    from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon

    assert compute_epsilon(list(ddg.RDP_ORDERS), rdp, delta)[0] == pytest.approx(acc.get_epsilon(delta), rel=1e-9)
    assert ddg.tau(z * l2, 1) == 0.0


@pytest.mark.parametrize("q", [0.001, 0.01, 0.1])
def test_subsampled_bound_is_above_the_exact_gaussian_and_close(q):
    """Zhu and Wang's general bound, applied to the Gaussian's RDP curve, is an upper bound on the exact Poisson-
    subsampled Gaussian RDP (dp-accounting), within a factor 2.5 at these orders (its price for holding for any
    mechanism)."""
    z = 1.0
    for order in (2, 4, 8, 16, 32):
        exact = float(exact_sgm_rdp(q, z, [order])[0])
        bound = ddg.subsampled_rdp(order, q, lambda a: a / (2 * z * z))
        assert exact <= bound * (1 + 1e-9) and bound <= 2.5 * exact + 1e-12
    assert ddg.subsampled_rdp(5, 1.0, lambda a: 7.0) == 7.0
    with pytest.raises(ValueError, match="integer order >= 2"):
        ddg.subsampled_rdp(2.5, q, lambda a: 1.0)


def test_ddg_epsilon_grows_with_dropouts_and_inflation():
    base = dict(q=0.01, c_over_gamma=1000.0, sigma=600.0, dim=32768, count=500)
    full = ddg.ddg_epsilon([ddg.DdgRelease(shares=4, **base)], 1e-5)
    fewer = ddg.ddg_epsilon([ddg.DdgRelease(shares=3, **base)], 1e-5)
    assert 0 < full < fewer
    # the same central noise as a Gaussian of z = 2 sigma / Delta_2 (4 shares), in RDP with the same subsampling
    # bound: the DDG's epsilon is within 1 % (tau is negligible at sigma = 600 grid steps)
    z = 2 * 600.0 / ddg.rounded_l2_bound(1000.0, 32768, math.exp(-0.5))
    gauss = ddg.ddg_epsilon([ddg.DdgRelease(q=0.01, c_over_gamma=1e9, sigma=z * 1e9, shares=1, dim=1, beta=0.0,
                                            count=500)], 1e-5)
    assert full == pytest.approx(gauss, rel=0.01)
    acc = RdpAccountant(list(ddg.RDP_ORDERS))
    acc.compose(SelfComposedDpEvent(PoissonSampledDpEvent(0.01, GaussianDpEvent(z)), 500))
    assert acc.get_epsilon(1e-5) <= full <= 1.2 * acc.get_epsilon(1e-5)


def test_modulus_bits():
    assert ddg.modulus_bits(32768, 256, 1000.0, 500.0, 4, 1e-9) <= 20
    # doubling every scale adds one bit
    assert ddg.modulus_bits(32768, 256, 2000.0, 1000.0, 4, 1e-9) - ddg.modulus_bits(32768, 256, 1000.0, 500.0, 4,
                                                                                        1e-9) in (0, 1, 2)
    with pytest.raises(ValueError, match="wrap probability must be in"):
        ddg.modulus_bits(8, 1, 1.0, 1.0, 1, 0.0)


def test_a_release_of_four_clients_decodes_to_the_noised_sum():
    """Four clients' records (unit norm) encoded and summed modulo 2^b decode to the exact sum plus noise of std
    2 sigma gamma per coordinate (the discrete Gaussian shares, rotated back), within 5 %; no coordinate wrapped."""
    rng = np.random.default_rng(4)
    d, clients, records = 300, 4, 20
    gamma, sigma = 1 / 50, 100.0
    dim = ddg.padded_dim(d)
    signs = ddg.rotation_signs(d, np.random.default_rng(9))
    bound = ddg.rounded_l2_bound(1 / gamma, dim, math.exp(-0.5))
    bits = ddg.modulus_bits(dim, records, 1 / gamma, sigma, clients, 1e-9)
    errors = []
    for trial in range(30):
        rows = [rng.normal(size=(records, d)) for _ in range(clients)]
        rows = [r / np.linalg.norm(r, axis=1, keepdims=True) for r in rows]
        exact = sum(r.sum(axis=0) for r in rows)
        shares = [ddg.encode(r, 1 / gamma, signs, bound, sigma, bits, _uniform(100 * trial + i))
                  for i, r in enumerate(rows)]
        assert all(s.dtype == np.uint64 and s.max() < 2**bits for s in shares)
        released = ddg.decode(ddg.modular_sum(shares, bits), 1 / gamma, signs, d, bits)
        errors.append(released - exact)
    err = np.concatenate(errors)
    assert abs(err.std() / (2 * sigma * gamma) - 1) < 0.05
    assert abs(err.mean()) < 5 * 2 * sigma * gamma / math.sqrt(err.size)


def test_dropout_policies():
    assert ddg.check_shares(4, 4, "refuse") == 4 and ddg.check_shares(4, 3, "charge") == 3
    with pytest.raises(ddg.ShareShortfall, match="only 3 of 4 noise shares"):
        ddg.check_shares(4, 3, "refuse")
    with pytest.raises(ddg.ShareShortfall):
        ddg.check_shares(4, 0, "charge")
    with pytest.raises(ValueError, match="'refuse' or 'charge'"):
        ddg.check_shares(4, 3, "ignore")


def test_plan_grid_shows_the_general_bound_costs_least_at_small_rates():
    """simulations/ddg_cost.py --grid: one row per plan; the DDG never needs less noise than the central Gaussian
    (PLD) at the same plan, is within 25 % of it at a small rate and loosest at the largest rate (Zhu and Wang's
    general subsampling bound is nearly tight only where q is small)."""
    from dpdro.simulations.ddg_cost import plan_grid
    rows = plan_grid(30_018, [256, 4096], [100], 4.0, 3.3e-6, 26_106, 4)
    assert len(rows) == 2 + 2 and rows[0].startswith("| releases |")
    ratios = [float(r.split("|")[6]) for r in rows[2:]]
    assert all(r >= 1.0 for r in ratios)
    assert ratios[0] <= 1.25 and ratios[1] > 1.5 * ratios[0]
