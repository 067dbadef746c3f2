"""Reference kernels against brute-force numpy oracles (hypothesis: shapes,
densities, ties, -0.0, NaN/Inf, dtypes)."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from gtopk_plugin import kernels, k_for
from gtopk_plugin.collectives import wire
from gtopk_plugin.kernels import reference
from oracles import assert_values_equal, merge_np, merge_values_np, mag_np, topk_np

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
SPECIALS = [0.0, -0.0, 1.0, -1.0, 2.0, float("inf"), float("-inf"), float("nan")]


@st.composite
def segmented(draw, allow_nonfinite=True):
    sizes = draw(st.lists(st.integers(1, 40), min_size=1, max_size=5))
    dtype = draw(st.sampled_from(DTYPES))
    n = sum(sizes)
    pool = SPECIALS if allow_nonfinite else SPECIALS[:5]
    # mix of tie-heavy small integers, specials and random normals
    kind = draw(st.sampled_from(["ties", "specials", "normal"]))
    if kind == "ties":
        vals = draw(st.lists(st.integers(-3, 3), min_size=n, max_size=n))
        x = torch.tensor(vals, dtype=torch.float64)
    elif kind == "specials":
        x = torch.tensor(draw(st.lists(st.sampled_from(pool), min_size=n, max_size=n)),
                         dtype=torch.float64)
    else:
        seed = draw(st.integers(0, 2**31 - 1))
        x = torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    density = draw(st.floats(0.001, 1.0))
    offsets = np.cumsum([0] + sizes)
    ks = [k_for(density, s) for s in sizes]
    return x.to(dtype), offsets, ks


def _t(offsets, ks):
    return torch.tensor(offsets, dtype=torch.int64), torch.tensor(ks, dtype=torch.int64)


@settings(max_examples=300, deadline=None)
@given(segmented())
def test_select_topk_matches_bruteforce(case):
    x, offsets, ks = case
    idx, vals = kernels.select_topk(x, *_t(offsets, ks))
    assert idx.dtype == torch.int32
    expect = topk_np(x, offsets, ks)
    np.testing.assert_array_equal(idx.long().numpy(), expect)
    # values: the input's own entries at the oracle's indices, checked on every
    # entry (NaN exactly where the input has NaN; the rest equal, sign of zero
    # included: selection copies, it does not add)
    assert vals.dtype == x.dtype
    want = x.double().numpy()[expect]
    assert_values_equal(vals.double().numpy(), want, "selected values")
    finite = ~np.isnan(want)
    np.testing.assert_array_equal(np.signbit(vals.double().numpy()[finite]), np.signbit(want[finite]))
    # exactly k per segment
    seg = np.searchsorted(offsets, idx.long().numpy(), side="right") - 1
    np.testing.assert_array_equal(np.bincount(seg, minlength=len(ks)), ks)


def test_topk_tie_rule_prefers_smaller_index_and_treats_negative_zero_as_zero():
    x = torch.tensor([1.0, -2.0, 2.0, -0.0, 0.0, 2.0, -2.0])
    idx, vals = kernels.select_topk(x, torch.tensor([0, 7]), torch.tensor([3]))
    assert idx.tolist() == [1, 2, 5]
    idx, _ = kernels.select_topk(torch.tensor([-0.0, 0.0, 0.0]), torch.tensor([0, 3]), torch.tensor([2]))
    assert idx.tolist() == [0, 1]


def test_topk_nan_ranks_as_inf_with_index_tie_break():
    x = torch.tensor([1.0, float("nan"), float("inf"), -float("inf")])
    idx, _ = kernels.select_topk(x, torch.tensor([0, 4]), torch.tensor([2]))
    assert idx.tolist() == [1, 2]


@settings(max_examples=200, deadline=None)
@given(segmented(allow_nonfinite=False))
def test_select_threshold_never_leaves_a_larger_entry_behind(case):
    x, offsets, ks = case
    idx, vals = kernels.select_threshold(x, *_t(offsets, ks))
    m = mag_np(x)
    chosen = set(idx.long().tolist())
    assert len(chosen) == idx.numel()
    assert torch.equal(idx.long(), torch.sort(idx.long()).values)
    for s, k in enumerate(ks):
        lo, hi = offsets[s], offsets[s + 1]
        sel = [i for i in range(lo, hi) if i in chosen]
        rest = [i for i in range(lo, hi) if i not in chosen]
        assert sel, "every segment selects at least one entry"
        if rest:
            assert m[rest].max() <= m[sel].min()
        assert 0.9 * k <= len(sel) <= 1.1 * k or len(sel) == k


def test_threshold_count_lands_near_k_on_large_segments():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200_000, generator=g)
    for k in (200, 2000, 20_000):
        idx, _ = kernels.select_threshold(x, torch.tensor([0, x.numel()]), torch.tensor([k]))
        assert 0.9 * k <= idx.numel() <= 1.1 * k


MERGE_POOL = [-2.0, -1.0, -0.5, -0.0, 0.0, 0.5, 1.0, 2.0, 3.0]
NONFINITE = [float("inf"), float("-inf"), float("nan"), 65504.0, -65504.0]


@st.composite
def sparse_pair(draw, nonfinite=False):
    sizes = draw(st.lists(st.integers(1, 30), min_size=1, max_size=4))
    offsets = np.cumsum([0] + sizes)
    n = int(offsets[-1])
    ks = [draw(st.integers(1, s)) for s in sizes]
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.float64]))

    def one():
        chosen = sorted(draw(st.sets(st.integers(0, n - 1), max_size=n)))
        pool = MERGE_POOL + NONFINITE if nonfinite else MERGE_POOL
        vals = draw(st.lists(st.sampled_from(pool), min_size=len(chosen), max_size=len(chosen)))
        return torch.tensor(chosen, dtype=torch.int32), torch.tensor(vals, dtype=dtype)

    return one(), one(), offsets, ks


@settings(max_examples=300, deadline=None)
@given(sparse_pair())
def test_merge_select_matches_bruteforce_and_is_symmetric(case):
    (ia, va), (ib, vb), offsets, ks = case
    off_t, k_t = _t(offsets, ks)
    idx, vals, keep_a, keep_b = kernels.merge_select(ia, va, ib, vb, off_t, k_t)
    idx2, vals2, keep_b2, keep_a2 = kernels.merge_select(ib, vb, ia, va, off_t, k_t)
    # both partners of a butterfly round compute the same bits
    assert torch.equal(idx, idx2) and torch.equal(vals.view(torch.uint8) if vals.dtype == torch.float16 else vals,
                                                    vals2.view(torch.uint8) if vals2.dtype == torch.float16 else vals2)
    np.testing.assert_array_equal(idx.long().numpy(), merge_np(ia, va.double(), ib, vb.double(), offsets, ks))
    # summed values too, rounded as the dtype rounds one addition (numpy oracle)
    e_idx, e_vals = merge_values_np(ia.numpy(), va.double().numpy(), ib.numpy(), vb.double().numpy(),
                                    offsets, ks, va.dtype)
    np.testing.assert_array_equal(idx.long().numpy(), e_idx)
    assert vals.dtype == va.dtype
    assert_values_equal(vals.double().numpy(), e_vals, "merged sums")
    kept = set(idx.long().tolist())
    assert keep_a.tolist() == [i in kept for i in ia.tolist()]
    assert keep_b.tolist() == [i in kept for i in ib.tolist()]
    assert torch.equal(keep_a, keep_a2) and torch.equal(keep_b, keep_b2)


@settings(max_examples=200, deadline=None)
@given(sparse_pair(nonfinite=True))
def test_merge_select_with_nan_and_inf_checks_every_sum(case):
    """NaN/±inf operands (inf − inf = NaN, 65504 + 65504 overflows fp16):
    indices equal the oracle's (NaN ranks as +inf), NaN sums sit exactly
    where the oracle's do, and every other sum equals the oracle's."""
    (ia, va), (ib, vb), offsets, ks = case
    idx, vals, keep_a, keep_b = kernels.merge_select(ia, va, ib, vb, *_t(offsets, ks))
    e_idx, e_vals = merge_values_np(ia.numpy(), va.double().numpy(), ib.numpy(), vb.double().numpy(),
                                    offsets, ks, va.dtype)
    np.testing.assert_array_equal(idx.long().numpy(), e_idx)
    assert_values_equal(vals.double().numpy(), e_vals, "merged sums")
    kept = set(e_idx.tolist())
    assert keep_a.tolist() == [i in kept for i in ia.tolist()]
    assert keep_b.tolist() == [i in kept for i in ib.tolist()]


def test_scatter_update():
    idx = torch.tensor([1, 2], dtype=torch.int32)
    out = kernels.scatter_update(4, idx, torch.tensor([4.0, 6.0]), 2, torch.float32)
    assert out.tolist() == [0.0, 2.0, 3.0, 0.0]


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 50), st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64]),
       st.sampled_from([torch.int32, torch.int64]))
def test_wire_round_trip(n, vdtype, idtype):
    idx = torch.arange(n, dtype=idtype) * 3
    vals = torch.randn(n).to(vdtype)
    blob = wire.pack(idx, vals, idtype)
    assert blob.dtype == torch.uint8 and blob.numel() == n * wire.entry_bytes(idtype, vdtype)
    i2, v2, tail = wire.unpack(blob, idtype, vdtype)
    assert torch.equal(i2, idx) and torch.equal(v2.view(torch.uint8), vals.view(torch.uint8))
    mask = torch.rand(n) > 0.5
    bits = wire.pack_bits(mask)
    assert bits.numel() == wire.bitmask_bytes(n)
    assert torch.equal(wire.unpack_bits(bits, n), mask)


def test_fp32_entry_is_eight_bytes_and_index_dtype_switches_past_int32():
    assert wire.entry_bytes(torch.int32, torch.float32) == 8
    assert wire.entry_bytes(torch.int32, torch.float16) == 6
    assert kernels.index_dtype(2**31 - 1) == torch.int32
    assert kernels.index_dtype(2**31) == torch.int64


def test_backend_names_reference_on_cpu_until_fast_kernels_register(monkeypatch):
    monkeypatch.setenv("GTOPK_KERNELS", "reference")
    assert kernels.backend("cpu") == "reference"
    monkeypatch.setenv("GTOPK_KERNELS", "cuda")
    with pytest.raises(ValueError):
        kernels.backend("cpu")
