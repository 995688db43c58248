"""psi-divergences (ALGORITHMS.md 1.3): psi* and psi*' against the closed forms, against a numerical
sup_t (s t - psi(t)) on a fine grid, and psi*' against finite differences of psi*."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dpdro.common.psi import KL, KL_S_MAX, Chi2, CVaR, SmoothedCVaR, make_psi

CASES = [
    ("chi2", 0.1),
    ("kl", 0.1),
    ("cvar", 0.1),
    ("cvar", 0.3),
    ("smoothed-cvar", 0.1),
    ("smoothed-cvar", 0.5),
]
IDS = [f"{n}-{a}" if "cvar" in n else n for n, a in CASES]


# ---- closed forms of the table in ALGORITHMS.md 1.3, written independently in numpy (float64) ----

def psi_ref(name: str, a: float, t: np.ndarray) -> np.ndarray:
    t = np.asarray(t, dtype=np.float64)
    out = np.full_like(t, np.inf)
    if name == "chi2":
        ok = t >= 0
        out[ok] = (t[ok] - 1) ** 2 / 2
    elif name == "kl":
        ok = t >= 0
        tt = t[ok]
        with np.errstate(divide="ignore", invalid="ignore"):
            out[ok] = np.where(tt > 0, tt * np.log(np.where(tt > 0, tt, 1.0)) - tt + 1, 1.0)
    elif name == "cvar":
        ok = (t >= 0) & (t <= 1 / a)
        out[ok] = 0.0
    elif name == "smoothed-cvar":
        ok = (t >= 0) & (t < 1 / a)
        tt = t[ok]
        first = np.where(tt > 0, tt * np.log(np.where(tt > 0, tt, 1.0)), 0.0)
        out[ok] = first + ((1 - a * tt) / a) * np.log((1 - a * tt) / (1 - a))
    else:
        raise AssertionError(name)
    return out


def conj_ref(name: str, a: float, s: np.ndarray) -> np.ndarray:
    s = np.asarray(s, dtype=np.float64)
    if name == "chi2":
        return np.maximum(s + 1, 0) ** 2 / 2 - 0.5
    if name == "kl":
        return np.exp(s) - 1
    if name == "cvar":
        return np.maximum(s, 0) / a
    if name == "smoothed-cvar":
        return np.log(1 - a + a * np.exp(s)) / a
    raise AssertionError(name)


def weight_ref(name: str, a: float, s: np.ndarray) -> np.ndarray:
    s = np.asarray(s, dtype=np.float64)
    if name == "chi2":
        return np.maximum(s + 1, 0)
    if name == "kl":
        return np.exp(s)
    if name == "cvar":
        return (s > 0).astype(np.float64) / a
    if name == "smoothed-cvar":
        return np.exp(s) / (1 - a + a * np.exp(s))
    raise AssertionError(name)


def t64(x) -> torch.Tensor:
    return torch.as_tensor(np.asarray(x, dtype=np.float64))


S_GRID = np.linspace(-3.0, 3.0, 61)


def test_make_psi_types_and_unknown():
    assert isinstance(make_psi("chi2"), Chi2)
    assert isinstance(make_psi("kl"), KL)
    c = make_psi("cvar", 0.3)
    assert isinstance(c, CVaR) and c.alpha == 0.3
    sc = make_psi("smoothed-cvar", 0.5)
    assert isinstance(sc, SmoothedCVaR) and sc.alpha == 0.5
    with pytest.raises(ValueError, match="allowed"):
        make_psi("tv")


@pytest.mark.parametrize("name,alpha", CASES, ids=IDS)
def test_psi_matches_table(name, alpha):
    p = make_psi(name, alpha)
    hi = 1 / alpha if "cvar" in name else 30.0
    t = np.concatenate([[0.0], np.logspace(-8, math.log10(hi * 0.999), 200), np.linspace(0, hi * 0.999, 200)])
    got = p.psi(t64(t)).numpy()
    np.testing.assert_allclose(got, psi_ref(name, alpha, t), rtol=1e-12, atol=1e-12)
    # outside the domain psi is +inf
    outside = [-1e-9, -1.0] + ([1 / alpha + 1e-6, 2 / alpha] if "cvar" in name else [])
    assert np.all(np.isposinf(p.psi(t64(outside)).numpy()))


@pytest.mark.parametrize("name,alpha", CASES, ids=IDS)
def test_conj_and_weight_match_closed_forms(name, alpha):
    p = make_psi(name, alpha)
    s = np.concatenate([S_GRID, [-20.0, -7.5, 7.5, 20.0]])
    np.testing.assert_allclose(p.conj(t64(s)).numpy(), conj_ref(name, alpha, s), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(p.weight(t64(s)).numpy(), weight_ref(name, alpha, s), rtol=1e-12, atol=1e-12)


def sup_numeric(psi_fn, s: np.ndarray, t_max: float, n: int = 50_001, n_fine: int = 2_001) -> np.ndarray:
    """sup_{0 <= t <= t_max} (s t - psi(t)) for each s, on a uniform grid of t, then again on a fine uniform
    grid between the neighbours of the grid argmax (s t - psi(t) is concave in t, so the sup lies there)."""
    s = np.asarray(s, dtype=np.float64)[:, None]
    t = np.linspace(0.0, t_max, n)
    vals = s * t[None, :] - psi_fn(t)[None, :]
    i = np.argmax(vals, axis=1)
    lo, hi = t[np.maximum(i - 1, 0)], t[np.minimum(i + 1, n - 1)]
    t2 = lo[:, None] + (hi - lo)[:, None] * np.linspace(0.0, 1.0, n_fine)[None, :]
    vals2 = s * t2 - psi_fn(t2.ravel()).reshape(t2.shape)
    return np.maximum(vals.max(axis=1), vals2.max(axis=1))


@pytest.mark.parametrize("name,alpha", CASES, ids=IDS)
def test_conj_equals_numerical_sup(name, alpha):
    p = make_psi(name, alpha)
    # t range: the closed domain [0, 1/alpha] for (smoothed) cvar (beyond it psi = +inf, see
    # test_psi_matches_table; for smoothed-cvar psi(1/alpha) = +inf and the maximiser is interior);
    # for chi2 / kl far beyond the maximiser (s + 1 <= 4, e^s <= e^3 ~ 20).
    t_max = {"chi2": 50.0, "kl": 100.0}.get(name, 1 / alpha)

    def lib_psi(t):
        return p.psi(t64(t)).numpy()

    def ref_psi(t):
        return psi_ref(name, alpha, t)

    got = p.conj(t64(S_GRID)).numpy()
    for psi_fn in (lib_psi, ref_psi):
        num = sup_numeric(psi_fn, S_GRID, t_max)
        np.testing.assert_allclose(got, num, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name,alpha", [c for c in CASES if c[0] != "cvar"],
                         ids=[i for i in IDS if not i.startswith("cvar")])
def test_weight_is_argmax_of_sup(name, alpha):
    """psi*'(s) is the maximiser t*(s) of s t - psi(t) (Danskin), checked where the maximiser is unique."""
    p = make_psi(name, alpha)
    t_max = {"chi2": 50.0, "kl": 100.0}.get(name, 1 / alpha * (1 - 1e-9))
    for s in [-2.0, -0.5, 0.3, 1.7, 2.9]:
        t = np.linspace(0.0, t_max, 400_001)
        vals = s * t - psi_ref(name, alpha, t)
        t_star = t[int(np.argmax(vals))]
        w = float(p.weight(t64([s]))[0])
        assert abs(w - t_star) <= 2 * (t[1] - t[0]) + 1e-3 * abs(w), (s, w, t_star)


@pytest.mark.parametrize("name,alpha", CASES, ids=IDS)
def test_weight_equals_finite_difference_of_conj(name, alpha):
    p = make_psi(name, alpha)
    kinks = {"chi2": [-1.0], "cvar": [0.0]}.get(name, [])
    s = np.linspace(-4.0, 4.0, 161)
    s = s[np.all([np.abs(s - k) > 1e-2 for k in kinks], axis=0)] if kinks else s
    s = s + 1e-3  # off the grid of round numbers, away from kinks
    h = 1e-5
    fd = (p.conj(t64(s + h)).numpy() - p.conj(t64(s - h)).numpy()) / (2 * h)
    np.testing.assert_allclose(p.weight(t64(s)).numpy(), fd, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name,alpha", CASES, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_weights_nonnegative_finite_and_shape(name, alpha, dtype):
    p = make_psi(name, alpha)
    s = torch.cat([torch.linspace(-1000, 1000, 2001, dtype=dtype), torch.tensor([-1e30, 1e30], dtype=dtype)])
    w = p.weight(s)
    c = p.conj(s[:2001].reshape(3, 667))
    assert w.dtype == dtype and w.shape == s.shape
    assert c.dtype == dtype and c.shape == (3, 667)
    assert torch.all(w >= 0)
    assert torch.all(torch.isfinite(w))
    if "cvar" in name:
        assert torch.all(w <= 1 / alpha * (1 + 1e-6))


def test_smoothness_constants():
    assert Chi2().smoothness == 1.0
    assert math.isinf(KL().smoothness)
    assert math.isinf(CVaR(alpha=0.3).smoothness)
    for a in (0.1, 0.5):
        sc = SmoothedCVaR(alpha=a)
        assert sc.smoothness == pytest.approx(1 / (4 * a))
        # M = sup psi*'' numerically
        s = np.linspace(-15, 15, 300_001)
        h = 1e-5
        second = (sc.weight(t64(s + h)).numpy() - sc.weight(t64(s - h)).numpy()) / (2 * h)
        assert second.max() == pytest.approx(1 / (4 * a), rel=1e-6)
        assert second.min() >= -1e-9
    # chi2: psi*'' = 1 right of the kink
    c = Chi2()
    s = np.array([-0.5, 0.0, 2.0])
    h = 1e-5
    np.testing.assert_allclose((c.weight(t64(s + h)) - c.weight(t64(s - h))).numpy() / (2 * h), 1.0, rtol=1e-8)


@pytest.mark.parametrize("a", [0.1, 0.5])
def test_smoothed_cvar_stable_at_extremes(a):
    p = SmoothedCVaR(alpha=a)
    s = t64([800.0, -800.0])
    c = p.conj(s).numpy()
    w = p.weight(s).numpy()
    # psi*(s) ~ (s + log a) / a for s -> inf (the naive formula overflows); -> log(1 - a) / a for s -> -inf
    assert c[0] == pytest.approx((800.0 + math.log(a)) / a, rel=1e-12)
    assert c[1] == pytest.approx(math.log1p(-a) / a, rel=1e-12)
    assert w[0] == pytest.approx(1 / a, rel=1e-12)
    assert 0 <= w[1] < 1e-300


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_kl_clamp_large_s(dtype):
    p = KL()
    s = torch.tensor([KL_S_MAX - 1, KL_S_MAX, 100.0, 1e6, 1e30, math.inf], dtype=dtype)
    c = p.conj(s)
    w = p.weight(s)
    assert torch.all(torch.isfinite(c)) and torch.all(torch.isfinite(w))
    # below the clamp: exact
    assert float(w[0]) == pytest.approx(math.exp(KL_S_MAX - 1), rel=1e-6)
    assert float(c[0]) == pytest.approx(math.expm1(KL_S_MAX - 1), rel=1e-6)
    # at and beyond the clamp: the value at KL_S_MAX
    cap_w = torch.exp(torch.tensor(KL_S_MAX, dtype=dtype))
    cap_c = torch.expm1(torch.tensor(KL_S_MAX, dtype=dtype))
    assert torch.all(w[1:] == cap_w)
    assert torch.all(c[1:] == cap_c)
    # monotone (non-decreasing) across the clamp
    assert torch.all(torch.diff(w) >= 0)
    # far below: no underflow problem, conj -> -1
    assert float(p.conj(torch.tensor(-1e4, dtype=dtype))) == -1.0
    assert float(p.weight(torch.tensor(-1e4, dtype=dtype))) == 0.0
