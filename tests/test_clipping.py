"""Clipping is exact to the bound in the working dtype, and the server's reply check accepts every honest
reply: a float32 record clipped to norm 1.0000012 > 1 used to be rejected as malformed, so
whether a reply passed depended on which records were sampled."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dpdro.common.messages import Point, Query, Reply
from dpdro.common.per_sample import (
    RowBlocks,
    _clip_factors,
    clip_margin,
    clip_rows,
    clip_scales,
    clipped_sum_and_count,
    norm_upper_bound,
)
from dpdro.server.release import ReplyError, check_reply, gamma, reply_tolerance, sum_rounding_factor

DTYPES = {"float32": torch.float32, "float64": torch.float64}


def exact_norms(v: torch.Tensor) -> np.ndarray:
    """Row norms of v computed in float64 (exact to ~1e-15 relative for float32 data)."""
    return np.linalg.norm(v.detach().cpu().numpy().astype(np.float64), axis=1)


@st.composite
def batches(draw):
    """(dtype name, rows (B, D), bound): heavy-tailed entries over many magnitudes, bounds near the norms."""
    dtype = draw(st.sampled_from(sorted(DTYPES)))
    rows, dim = draw(st.integers(1, 6)), draw(st.integers(1, 5000))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    v = torch.randn(rows, dim, generator=gen, dtype=torch.float64)
    v = v * torch.exp(draw(st.floats(0.0, 3.0)) * torch.randn(rows, dim, generator=gen, dtype=torch.float64))
    v = (v * 10.0 ** draw(st.floats(-6, 6))).to(DTYPES[dtype])
    # bounds at, just below and far below a row's norm: the rounding cases that used to overshoot
    norm = float(exact_norms(v)[0])
    bound = draw(st.sampled_from([norm, norm * (1 - 1e-7), norm * 0.999, norm * 1e-3]))
    return dtype, v, max(bound, 1e-30)


@settings(max_examples=300, deadline=None)
@given(batches())
def test_clipped_rows_never_exceed_the_bound(case):
    """Every clipped row's exact norm is <= the bound (no rounding overshoot), in float32 and float64."""
    dtype, v, bound = case
    out = clip_rows(v, bound)
    assert out.dtype == v.dtype
    assert np.all(exact_norms(out) <= bound), (exact_norms(out) / bound - 1, dtype)
    # rows that had to be clipped still land on the bound (up to the safety margin), with their direction
    big = exact_norms(v) > bound * (1 + 4 * clip_margin(v.dtype))
    assert np.all(exact_norms(out)[big] >= bound * (1 - 4 * clip_margin(v.dtype)) - 1e-300)
    # one record's sum is exactly within the bound too (the case the server used to reject)
    one, clipped = clipped_sum_and_count(v[:1], bound)
    assert float(np.linalg.norm(one.double().numpy())) <= bound
    if big[0]:
        assert clipped == 1
    if exact_norms(v)[0] < bound * (1 - 4 * clip_margin(v.dtype)):
        assert clipped == 0 and torch.equal(out[0], v[0])  # rows inside the bound are left alone


@settings(max_examples=200, deadline=None)
@given(batches(), st.sampled_from([0.0, 0.1, 1.0]))
def test_honest_replies_always_pass_the_servers_check(case, count_scale):
    """A reply built as a client builds it (clipped sum in the working dtype, float64 total, clipped-count
    coordinate) is accepted for every sample: no rejection depends on the records."""
    dtype, v, bound = case
    total, clipped = clipped_sum_and_count(v, bound)
    out = total.to(torch.float64).numpy()
    dim = out.shape[0]
    if count_scale > 0:
        out = np.append(out, count_scale * bound * clipped)
    q = Query(1, "x-refresh", "dual-x", (Point(0, 0.0),), 0.1, bound, dim, count_scale=count_scale)
    check_reply(q, Reply(q.qid, 0, out, int(v.shape[0])), dtype)


@settings(max_examples=200, deadline=None)
@given(batches(), st.integers(1, 4), st.sampled_from(["none", "uniform", "spread"]))
def test_row_blocks_clip_and_sum_as_their_dense_rows(case, parts, factor_kind):
    """RowBlocks (column blocks times a per-record factor, never formed): the clipped sum equals that of the dense
    rows to rounding, the clipped count is the same away from the bound, and one record's clipped sum has exact
    norm <= the bound (the factor joins the clip factor without overshoot)."""
    dtype, v, bound = case
    rows, dim = v.shape
    cuts = sorted({0, dim, *(dim * i // parts for i in range(1, parts))})
    blocks = [v[:, a:b].clone() for a, b in zip(cuts, cuts[1:], strict=False) if b > a]
    factor = {"none": None, "uniform": torch.full((rows,), 0.5, dtype=v.dtype),
              "spread": torch.logspace(-3, 3, rows, dtype=torch.float64).to(v.dtype)}[factor_kind]
    rb = RowBlocks(blocks, factor)
    dense = rb.dense()
    assert rb.shape == tuple(dense.shape) == (rows, dim)
    total, clipped = clipped_sum_and_count(rb, bound)
    ref, ref_clipped = clipped_sum_and_count(dense, bound)
    scale = float(ref.abs().max()) + float(bound)
    tol = 64 * rows * torch.finfo(v.dtype).eps * scale
    assert float((total - ref).abs().max()) <= tol
    far = np.abs(exact_norms(dense) / bound - 1) > 8 * clip_margin(v.dtype)
    if far.all():
        assert clipped == ref_clipped
    one, _ = clipped_sum_and_count(RowBlocks([b[:1] for b in blocks], None if factor is None else factor[:1]), bound)
    assert float(np.linalg.norm(one.double().numpy())) <= bound


def test_row_blocks_with_nan_or_inf_rows_contribute_nothing():
    rb = RowBlocks([torch.tensor([[3.0], [math.nan], [0.3]]), torch.tensor([[4.0], [1.0], [0.4]])],
                   torch.tensor([1.0, 1.0, 1.5]))
    total, clipped = clipped_sum_and_count(rb, 1.0)
    np.testing.assert_allclose(total.numpy(), [0.6 + 0.45, 0.8 + 0.6], rtol=1e-5)
    assert clipped == 2
    total, _ = clipped_sum_and_count(RowBlocks(rb.blocks, torch.tensor([math.inf, 1.0, 1.0])), 1.0)
    np.testing.assert_allclose(total.numpy(), [0.3, 0.4], rtol=1e-5)  # an infinite factor zeroes its row
    np.testing.assert_allclose(clipped_sum_and_count(RowBlocks([torch.ones(2, 3)], torch.tensor([2.0, 3.0])),
                                                     math.inf)[0].numpy(), [5.0, 5.0, 5.0])
    with pytest.raises(ValueError, match="equal rows"):
        RowBlocks([torch.ones(2, 3), torch.ones(3, 1)])


def test_one_float32_record_on_the_bound_is_not_rejected():
    """The reported case: a float32 record clipped to 1 with the clipped-count coordinate (sensitivity
    1.00499) had norm 1.0000012 x that and was rejected; now its norm is <= 1 and it passes."""
    gen = torch.Generator().manual_seed(3)
    worst = 0.0
    for _ in range(200):
        v = torch.randn(1, 26106, generator=gen, dtype=torch.float32) * 0.37
        total, clipped = clipped_sum_and_count(v, 1.0)
        worst = max(worst, float(np.linalg.norm(total.double().numpy())))
        out = np.append(total.double().numpy(), 0.1 * 1.0 * clipped)
        q = Query(6, "x-refresh", "dual-x", (Point(0, 0.0),), 0.1, 1.0, 26106, count_scale=0.1)
        check_reply(q, Reply(q.qid, 8, out, 1), "float32")
    assert 1.0 - 1e-4 < worst <= 1.0


def test_norm_upper_bound_is_an_upper_bound_within_the_margin():
    gen = torch.Generator().manual_seed(0)
    for dtype in DTYPES.values():
        for dim in (1, 63, 64, 65, 1000, 100_003):
            v = (torch.randn(8, dim, generator=gen, dtype=torch.float64)
                 * torch.exp(3 * torch.randn(8, dim, generator=gen, dtype=torch.float64))).to(dtype)
            ratio = norm_upper_bound(v).numpy() / exact_norms(v)
            assert np.all(ratio >= 1.0) and np.all(ratio <= 1 + 3 * clip_margin(dtype)), (dtype, dim, ratio)


def test_rows_with_nan_or_inf_contribute_nothing_and_count_as_clipped():
    v = torch.tensor([[3.0, 4.0], [math.nan, 1.0], [math.inf, 0.0], [0.3, 0.4]], dtype=torch.float32)
    total, clipped = clipped_sum_and_count(v, 1.0)
    assert torch.all(torch.isfinite(total)) and clipped == 3
    np.testing.assert_allclose(total.numpy(), [0.6 + 0.3, 0.8 + 0.4], rtol=1e-5)
    out = clip_rows(v, 1.0)
    assert torch.equal(out[1], torch.zeros(2)) and torch.equal(out[2], torch.zeros(2))
    scale, scaled = clip_scales(v, 1.0)
    assert scale[3] == 1.0 and scaled.tolist() == [True, True, True, False]


def test_reply_tolerance_is_dtype_aware_and_grows_with_the_count():
    t32, t64 = reply_tolerance("float32", 1, 100), reply_tolerance("float64", 1, 100)
    assert 5e-8 < t32 < 7e-8 and t64 < 1e-13
    assert reply_tolerance("float32", 1000, 100) == pytest.approx(1000 * 2**-24, rel=1e-3)
    q = Query(1, "x-refresh", "dual-x", (Point(0, 0.0),), 0.1, 1.0, 2)
    over = np.array([1.0 + 3e-7, 0.0])  # float32 slack for one record is 6e-8: this is not rounding
    with pytest.raises(ReplyError, match="exceeds sensitivity"):
        check_reply(q, Reply(q.qid, 0, over, 1), "float32")
    check_reply(q, Reply(q.qid, 0, over, 10), "float32")  # ten records may sum to 10
    assert reply_tolerance("float32", 0, 100) < 1e-13  # an empty sample must reply exactly zero


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.int32])
def test_replies_of_another_dtype_than_float64_are_rejected(dtype):
    q = Query(1, "x-refresh", "dual-x", (Point(0, 0.0),), 0.1, 1.0, 2)
    with pytest.raises(ReplyError, match=f"dtype {np.dtype(dtype)}, expected float64"):
        check_reply(q, Reply(q.qid, 4, np.zeros(2, dtype=dtype), 1), "float32")


# ---- float64 sums: one record moves a released sum by at most S f(n) ----

def _records_of_norm_two(n: int, seed: int) -> torch.Tensor:
    """n float32 records of norm 2 (each is clipped to 1) with a positive first coordinate, so the sum's first
    coordinate grows to ~n / 2, where float32's grid step is ~n 2^-25."""
    v = torch.randn(n, 3, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    v = v / torch.linalg.vector_norm(v, dim=1, keepdim=True) * 2.0
    v[:, 0] = v[:, 0].abs()
    return v.float()


def test_float32_records_are_summed_in_float64_within_the_inflated_sensitivity():
    """Replacing one of n = 4096 float32 records with the null record (zero vector) moves the clipped sum by at
    most S f(n), f(n) - 1 = 3.8e-9 (``sum_rounding_factor``): the sum is float64 and within gamma_n n S of the
    exact sum of the clipped records. The same sums in float32 (the old chunk sums) move by up to 1 + 1.6e-4 and
    err by ~1e-4: far outside any bound the noise could be inflated for."""
    n, clip = 4096, 1.0
    f = sum_rounding_factor(n)
    assert f - 1 == pytest.approx(3.75e-9, rel=1e-2)
    float32_outside = 0
    for seed in range(8):
        v = _records_of_norm_two(n, seed)
        null = v.clone()
        null[-1] = 0.0
        total, clipped = clipped_sum_and_count(v, clip)
        other, _ = clipped_sum_and_count(null, clip)
        assert total.dtype == torch.float64 and clipped == n
        assert float(torch.linalg.vector_norm(total - other)) <= clip * f
        # against the exact sum of the clipped records: math.fsum of float64 products (each within u of exact)
        scale = _clip_factors(norm_upper_bound(v), clip).numpy()
        rows = v.double().numpy() * scale[:, None]
        assert np.all(np.linalg.norm(rows, axis=1) <= clip)
        exact = np.array([math.fsum(rows[:, j]) for j in range(3)])
        assert np.linalg.norm(total.numpy() - exact) <= gamma(n + 1) * n * clip
        # the old float32 chunk sum of the same clipped records
        sum32 = torch.as_tensor(scale).float() @ v
        assert np.linalg.norm(sum32.double().numpy() - exact) > 1e3 * gamma(n + 1) * n * clip
        moved32 = float(torch.linalg.vector_norm(sum32.double() - (torch.as_tensor(scale).float() @ null).double()))
        float32_outside += moved32 > clip * f
    assert float32_outside >= 2


def test_row_blocks_and_unclipped_sums_are_float64():
    v = _records_of_norm_two(300, 1)
    blocks = RowBlocks([v[:, :1].clone(), v[:, 1:].clone()], torch.full((300,), 0.5))
    total, clipped = clipped_sum_and_count(blocks, 0.7)
    ref, ref_clipped = clipped_sum_and_count(v * 0.5, 0.7)
    assert total.dtype == torch.float64 and clipped == ref_clipped == 300
    np.testing.assert_allclose(total.numpy(), ref.numpy(), rtol=4 * clip_margin(torch.float32))  # two norm bounds
    for inf_sum, want in ((clipped_sum_and_count(v, math.inf)[0], v.double().sum(0)),
                          (clipped_sum_and_count(blocks, math.inf)[0], 0.5 * v.double().sum(0))):
        assert inf_sum.dtype == torch.float64
        np.testing.assert_allclose(inf_sum.numpy(), want.numpy(), rtol=1e-12)


@pytest.mark.parametrize("slice_entries", [2**17, 3 * 1000, 10])  # one slice, slices of 3 rows, one row each
def test_sum64_sums_float32_rows_in_float64_slice_by_slice(monkeypatch, slice_entries):
    from dpdro.common import per_sample

    v = torch.randn(7, 1000, generator=torch.Generator().manual_seed(2)).float()
    coef = torch.rand(7, dtype=torch.float64)
    monkeypatch.setattr(per_sample, "SUM_SLICE_ENTRIES", slice_entries)
    total = per_sample.sum64(coef, v)
    exact = np.array([math.fsum(c) for c in (v.double().numpy() * coef.numpy()[:, None]).T])
    assert total.dtype == torch.float64
    np.testing.assert_allclose(total.numpy(), exact, rtol=0, atol=gamma(8) * float((coef @ v.double().abs()).max()))
    assert per_sample.sum64(coef[:0], v[:0]).tolist() == [0.0] * 1000


def test_sum_rounding_factor_values():
    assert sum_rounding_factor(60_000) - 1 == pytest.approx(8.0e-7, rel=1e-2)
    assert sum_rounding_factor(10**6) - 1 == pytest.approx(2.22e-4, rel=1e-2)
    assert 1 < sum_rounding_factor(0) < 1 + 1e-13
    with pytest.raises(ValueError, match="n must be >= 0"):
        sum_rounding_factor(-1)
