"""Dual DRO loss and the exact objective (ALGORITHMS.md 1.1-1.3): min over eta of the mean dual loss equals
the primal maximum over the simplex (solved independently with scipy), KL's closed form, and the eta
derivative against autograd."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.optimize import minimize, minimize_scalar

from dpdro.common.dro import dro_objective, dro_weight, dual_eta_grad, dual_loss
from dpdro.common.psi import make_psi


def random_losses(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.gamma(2.0, 1.0, size=n)  # non-negative, spread out, a few large ones


# ---- primal, independently: max_{p in simplex} sum p_i l_i - lambda (1/n) sum psi(n p_i) ----

def _psi_and_grad(name: str, a: float, t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    if name == "chi2":
        return (t - 1) ** 2 / 2, t - 1
    if name == "kl":
        return t * np.log(t) - t + 1, np.log(t)
    if name == "smoothed-cvar":
        r = 1 - a * t
        val = t * np.log(t) + (r / a) * np.log(r / (1 - a))
        grad = np.log(t) + 1 - np.log(r / (1 - a)) - 1
        return val, grad
    raise AssertionError(name)


def primal_max(losses: np.ndarray, name: str, lam: float, a: float = 0.1) -> tuple[float, np.ndarray]:
    n = len(losses)

    def neg(p):
        v, g = _psi_and_grad(name, a, n * p)
        return -(p @ losses - lam * v.mean()), -(losses - lam * g)

    lo = 0.0 if name == "chi2" else 1e-12
    hi = 1.0 if name != "smoothed-cvar" else 1 / (n * a) - 1e-12
    p0 = np.full(n, 1.0 / n)
    res = minimize(neg, p0, jac=True, method="SLSQP", bounds=[(lo, hi)] * n,
                   constraints=[{"type": "eq", "fun": lambda p: p.sum() - 1.0, "jac": lambda p: np.ones_like(p)}],
                   options={"ftol": 1e-15, "maxiter": 2000})
    assert res.success, res.message
    return -float(res.fun), res.x


PRIMAL_CASES = [(name, lam, n, seed)
                for name in ("chi2", "kl")
                for lam, n, seed in [(0.1, 8, 0), (0.5, 12, 1), (1.0, 20, 2), (3.0, 15, 3), (10.0, 10, 4)]]


@pytest.mark.parametrize("name,lam,n,seed", PRIMAL_CASES)
def test_dual_min_equals_primal_max(name, lam, n, seed):
    losses = random_losses(n, seed)
    psi = make_psi(name)
    dual_val, eta = dro_objective(losses, psi, lam)
    primal_val, p = primal_max(losses, name, lam)
    assert dual_val == pytest.approx(primal_val, rel=1e-6, abs=1e-9)
    # the optimal distribution is p_i = psi*'((l_i - eta*)/lambda) / n (first-order conditions)
    w = dro_weight(torch.as_tensor(losses), eta, psi, lam).numpy()
    assert w.mean() == pytest.approx(1.0, abs=1e-7)
    np.testing.assert_allclose(p, w / n, atol=2e-4)


@pytest.mark.parametrize("lam,n,seed", [(0.3, 10, 5), (1.0, 16, 6)])
@pytest.mark.parametrize("alpha", [0.1, 0.5])
def test_dual_min_equals_primal_max_smoothed_cvar(alpha, lam, n, seed):
    losses = random_losses(n, seed)
    dual_val, _ = dro_objective(losses, make_psi("smoothed-cvar", alpha), lam)
    primal_val, _ = primal_max(losses, "smoothed-cvar", lam, alpha)
    assert dual_val == pytest.approx(primal_val, rel=1e-6, abs=1e-9)


@pytest.mark.parametrize("name", ["chi2", "kl", "smoothed-cvar", "cvar"])
@pytest.mark.parametrize("lam", [0.2, 1.0, 4.0])
def test_bisection_value_is_the_minimum_over_eta(name, lam):
    """dro_objective's value is min_eta of the mean dual loss (independent 1-D minimiser)."""
    losses = random_losses(17, 11)
    psi = make_psi(name, 0.3)
    value, eta = dro_objective(losses, psi, lam)
    ls = torch.as_tensor(losses)

    def mean_dual(e):
        return float(dual_loss(ls, e, psi, lam).mean())

    res = minimize_scalar(mean_dual, bracket=(losses.min() - lam - 1, losses.max() + 1),
                          options={"xtol": 1e-12})
    assert value == pytest.approx(res.fun, rel=1e-7, abs=1e-10)
    assert mean_dual(eta) == pytest.approx(value, rel=1e-7, abs=1e-10)
    # no eta on a grid does better
    grid = np.linspace(losses.min() - lam - 5, losses.max() + 5, 2001)
    assert min(mean_dual(e) for e in grid) >= value - 1e-9


@pytest.mark.parametrize("lam", [0.05, 0.5, 2.0, 50.0])
def test_kl_closed_form(lam):
    losses = random_losses(13, 21) * 3
    value, eta = dro_objective(losses, make_psi("kl"), lam)
    closed = lam * math.log(np.mean(np.exp(losses / lam)))
    assert value == pytest.approx(closed, rel=1e-10)
    assert eta == pytest.approx(closed, rel=1e-7, abs=1e-9)  # eta* = lambda log mean e^{l/lambda} = F


def test_kl_closed_form_large_losses_stable():
    """lambda small relative to the losses: e^{l/lambda} overflows naively; the value stays exact."""
    losses = np.array([0.0, 10.0, 50.0, 200.0])
    value, _ = dro_objective(losses, make_psi("kl"), 0.1)
    m = losses.max()
    assert math.isfinite(value)
    assert value == pytest.approx(m + 0.1 * math.log(np.mean(np.exp((losses - m) / 0.1))), rel=1e-12)


def test_cvar_is_mean_of_top_fraction():
    """Rockafellar-Uryasev: with n alpha an integer, F = mean of the n alpha largest losses (any lambda)."""
    losses = random_losses(20, 31)
    for alpha, lam in [(0.1, 1.0), (0.25, 0.3), (0.5, 7.0)]:
        value, _ = dro_objective(losses, make_psi("cvar", alpha), lam)
        k = round(20 * alpha)
        assert value == pytest.approx(np.sort(losses)[-k:].mean(), rel=1e-9)


def test_objective_limits():
    losses = random_losses(10, 41)
    # lambda -> inf: the penalty forces p uniform, F -> mean loss; lambda -> 0 (KL): F -> max loss
    for name in ("chi2", "kl"):
        v, _ = dro_objective(losses, make_psi(name), 1e5)
        assert v == pytest.approx(losses.mean(), rel=1e-4)
    v, _ = dro_objective(losses, make_psi("kl"), 1e-3)
    assert v == pytest.approx(losses.max(), rel=1e-3)
    # F >= mean loss always (p uniform is feasible with zero penalty)
    for name in ("chi2", "kl", "cvar", "smoothed-cvar"):
        v, _ = dro_objective(losses, make_psi(name, 0.2), 0.7)
        assert v >= losses.mean() - 1e-9


def test_dro_objective_rejects_empty():
    with pytest.raises(ValueError):
        dro_objective(np.zeros(0), make_psi("chi2"), 1.0)


@pytest.mark.parametrize("name", ["chi2", "kl", "cvar", "smoothed-cvar"])
@pytest.mark.parametrize("eta_scale", [1.0, 2.5])
def test_dual_eta_grad_equals_autograd(name, eta_scale):
    psi = make_psi(name, 0.2)
    lam = 0.7
    losses = torch.as_tensor(random_losses(12, 51))
    for eta0 in (-0.4, 0.3, 1.1):
        eta = torch.tensor(eta0, dtype=torch.float64, requires_grad=True)
        vals = dual_loss(losses, eta, psi, lam, eta_scale)
        auto = torch.stack([torch.autograd.grad(v, eta, retain_graph=True)[0] for v in vals])
        formula = dual_eta_grad(losses, eta0, psi, lam, eta_scale)
        assert formula.shape == (12,)
        torch.testing.assert_close(formula, auto, rtol=1e-12, atol=1e-12)
        # d/deta L = G (1 - w)
        w = dro_weight(losses, eta0, psi, lam, eta_scale)
        torch.testing.assert_close(formula, eta_scale * (1 - w), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ["chi2", "kl", "smoothed-cvar"])
def test_dual_loss_value_and_loss_derivative(name):
    """L = lambda psi*((l - G eta)/lambda) + G eta, and dL/dl = w (the DRO weight)."""
    psi = make_psi(name, 0.2)
    lam, g, eta = 0.7, 2.0, 0.4
    losses = torch.as_tensor(random_losses(9, 61)).requires_grad_(True)
    vals = dual_loss(losses, eta, psi, lam, g)
    ref = lam * psi.conj((losses.detach() - g * eta) / lam) + g * eta
    torch.testing.assert_close(vals.detach(), ref, rtol=1e-14, atol=1e-14)
    (grad,) = torch.autograd.grad(vals.sum(), losses)
    torch.testing.assert_close(grad, dro_weight(losses.detach(), eta, psi, lam, g), rtol=1e-12, atol=1e-12)
