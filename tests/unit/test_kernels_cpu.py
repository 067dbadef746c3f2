"""The compiled CPU back end (csrc/cpu) against the pure-torch reference and
the brute-force numpy oracles: bit-identical results for every kernel, on
random data (hypothesis), ties, duplicates, -0.0, denormals, NaN/Inf, k = 1,
k = n, tiny and empty segments, every internal path of the selection (sampled
bound, radix histogram with and without refinement, exact ties), 1 and 2
threads; plus the loader (build at install, compile on first use, fallback)
and the reducer's choice of back end."""
import logging
import os
import shutil
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import gtopk_plugin as gp
from gtopk_plugin import kernels
from gtopk_plugin.kernels import _build, cpu, reference
from oracles import assert_values_equal, mag_np, merge_values_np, topk_np
from test_kernels_cuda import _grads as cuda_grads

ROOT = Path(__file__).resolve().parents[2]
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INT_VIEW = {torch.float32: torch.int32, torch.float64: torch.int64,
            torch.float16: torch.int16, torch.bfloat16: torch.int16}


@pytest.fixture(scope="module", autouse=True)
def cpu_backend():
    if cpu.load() is None:
        pytest.skip("the CPU kernels could not be built here (no C++ compiler?)")
    return cpu


@pytest.fixture
def threads():
    """Run a block under 1 and 2 threads and restore the setting."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(INT_VIEW[t.dtype]) if t.dtype in INT_VIEW else t


def assert_same(a, b):
    """Same dtype, same shape, same bits (any NaN equals any NaN)."""
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    if a.dtype.is_floating_point:
        na, nb = torch.isnan(a), torch.isnan(b)
        assert torch.equal(na, nb)
        assert torch.equal(bits(a)[~na], bits(b)[~nb])
    else:
        assert torch.equal(a, b)


def assert_all_same(xs, ys):
    assert len(xs) == len(ys)
    for a, b in zip(xs, ys):
        assert_same(a, b)


def seg(offsets, ks):
    return torch.tensor(offsets, dtype=torch.int64), torch.tensor(ks, dtype=torch.int64)


def check_selection(x, offsets, ks, *, oracle=True):
    """select_topk and select_threshold equal the reference (and the oracle)."""
    off_t, k_t = seg(offsets, ks)
    got = cpu.select_topk(x, off_t, k_t)
    assert_all_same(got, reference.select_topk(x, off_t, k_t))
    assert got[0].dtype == torch.int32
    if oracle:
        expect = topk_np(x, offsets, [max(0, k) for k in ks])
        np.testing.assert_array_equal(got[0].long().numpy(), expect)
        # the values too, NaN entries included (NaN where the input has NaN)
        assert_values_equal(got[1].double().numpy(), x.double().numpy()[expect], "selected values")
    assert_same(got[1], x[got[0].long()])
    thr = cpu.select_threshold(x, off_t, k_t)
    assert_all_same(thr, reference.select_threshold(x, off_t, k_t))
    return got, thr


# ---------------------------------------------------------------------------
# Selection: random small cases

SPECIAL = [0.0, -0.0, 1.0, -1.0, 2.0, 1e-45, -1e-40, 6e-8, float("inf"), float("-inf"), float("nan")]


@st.composite
def segmented(draw):
    sizes = draw(st.lists(st.integers(0, 60), min_size=1, max_size=6))
    dtype = draw(st.sampled_from(DTYPES))
    n = sum(sizes)
    kind = draw(st.sampled_from(["ties", "specials", "normal", "denormal"]))
    if kind == "ties":
        x = torch.tensor(draw(st.lists(st.integers(-3, 3), min_size=n, max_size=n)), dtype=torch.float64)
    elif kind == "specials":
        x = torch.tensor(draw(st.lists(st.sampled_from(SPECIAL), min_size=n, max_size=n)), dtype=torch.float64)
    else:
        seed = draw(st.integers(0, 2**31 - 1))
        x = torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        if kind == "denormal":  # tiny magnitudes: denormal in every dtype
            x = x * {torch.float32: 1e-40, torch.float64: 1e-310,
                     torch.float16: 1e-6, torch.bfloat16: 1e-40}[dtype]
    x = x.to(dtype)
    ks = [draw(st.integers(0, s + 1)) for s in sizes]
    return x, list(np.cumsum([0] + sizes)), ks


@settings(max_examples=300, deadline=None)
@given(segmented())
def test_selection_matches_reference_and_oracle(case):
    x, offsets, ks = case
    check_selection(x, offsets, ks)


def test_tie_rule_negative_zero_and_nan_as_inf():
    x = torch.tensor([1.0, -2.0, 2.0, -0.0, 0.0, 2.0, -2.0])
    idx, vals = cpu.select_topk(x, *seg([0, 7], [3]))
    assert idx.tolist() == [1, 2, 5] and vals.tolist() == [-2.0, 2.0, 2.0]
    idx, _ = cpu.select_topk(torch.tensor([-0.0, 0.0, 0.0]), *seg([0, 3], [2]))
    assert idx.tolist() == [0, 1]
    # NaN ranks as +inf: NaN and +-inf tie, the smaller index wins
    x = torch.tensor([1.0, float("inf"), float("nan"), -float("inf"), float("nan")])
    idx, vals = cpu.select_topk(x, *seg([0, 5], [2]))
    assert idx.tolist() == [1, 2]
    idx, _ = cpu.select_topk(x, *seg([0, 5], [3]))
    assert idx.tolist() == [1, 2, 3]
    assert torch.isnan(cpu.select_topk(x, *seg([0, 5], [4]))[1]).sum() == 2


def test_k_edge_cases_and_empty_segments():
    x = torch.arange(10, dtype=torch.float32) - 4.5
    for ks in ([1, 1, 1], [0, 0, 0], [3, 0, 5], [3, 2, 5], [9, 9, 9]):
        check_selection(x, [0, 3, 3, 10], [ks[0], ks[1], ks[2]])
    # k = n and k > n: everything, in order
    idx, vals = cpu.select_topk(x, *seg([0, 10], [10]))
    assert idx.tolist() == list(range(10)) and torch.equal(vals, x)
    idx, _ = cpu.select_topk(x, *seg([0, 10], [25]))
    assert idx.tolist() == list(range(10))
    # no segments at all, an empty tensor
    for f in (cpu.select_topk, cpu.select_threshold):
        idx, vals = f(torch.zeros(0), *seg([0], []))
        assert idx.numel() == 0 and idx.dtype == torch.int32 and vals.dtype == torch.float32
        idx, vals = f(torch.zeros(0, dtype=torch.float16), *seg([0, 0], [1]))
        assert idx.numel() == 0 and vals.dtype == torch.float16


def test_bad_segments_raise():
    x = torch.randn(10)
    with pytest.raises(RuntimeError, match="offsets"):
        cpu.select_topk(x, *seg([0, 11], [1]))
    with pytest.raises(RuntimeError, match="offsets"):
        cpu.select_topk(x, *seg([0, 6, 4, 10], [1, 1, 1]))
    with pytest.raises(RuntimeError, match="len"):
        cpu.select_topk(x, torch.tensor([0, 10]), torch.tensor([1, 1]))


# ---------------------------------------------------------------------------
# Selection: large inputs through every internal path, 1 and 2 threads

def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _large_cases():
    n = 300_000
    g = _gen(1)
    yield "randn-sampled", torch.randn(n, generator=g), [1, 30, 300, 3000]
    yield "randn-dense-hist", torch.randn(n, generator=g), [30_000, 150_000, n - 1]
    yield "ties", torch.randint(-3, 4, (n,), generator=g).float(), [1, 300, 3000, 100_000]
    yield "zeros", torch.zeros(n), [1, 1000, n - 1]
    z = torch.zeros(n)
    z[::7] = -0.0
    z[5::1000] = 1e-45
    yield "signed-zeros-denormals", z, [10, 400, 1000]
    x = torch.randn(n, generator=g)
    x[::97] = float("nan")
    x[3::89] = float("inf")
    x[5::83] = -float("inf")
    yield "nan-inf", x, [1, 3000, 20_000]
    # one 16-bit bucket: the histogram refines to the last bits (exact ties)
    yield "one-bucket-f32", 1 + torch.randint(0, 2**12, (n,), generator=g).float() * 2**-23, [1, 50_000]
    yield "one-bucket-f64", (1 + torch.randint(0, 2**20, (n,), generator=g).double() * 2**-52), [7, 60_000]
    for dt in (torch.float16, torch.bfloat16, torch.float64):
        yield f"randn-{dt}", torch.randn(n, generator=g).to(dt), [1, 300, 3000, 90_000]
    # many candidates: the parallel emit (> 65536 candidates)
    yield "randn-2M", torch.randn(2_000_000, generator=g), [20_000, 100_000]


@pytest.mark.parametrize("name,x,ks", list(_large_cases()), ids=[c[0] for c in _large_cases()])
def test_large_single_segment_paths(name, x, ks, threads):
    n = x.numel()
    for k in ks:
        results = []
        for t in (1, 2):
            threads(t)
            results.append(check_selection(x, [0, n], [k], oracle=(n <= 300_000)))
        # deterministic across thread counts
        assert_all_same(results[0][0], results[1][0])
        assert_all_same(results[0][1], results[1][1])
        idx = results[0][0][0]
        assert idx.numel() == k


def _sample_runs_mask(n, runs=256, run=128):
    """The entries the sampled bound reads for a segment of n = 2^20: 256
    evenly spaced runs of 128 (select.cpp: kSampleMax = 32768 sampled
    entries).  Other spacings still give valid cases; only the path taken
    would differ."""
    m = torch.zeros(n, dtype=torch.bool)
    step = n // runs
    for r in range(runs):
        m[r * step:r * step + run] = True
    return m


@pytest.mark.parametrize("failure", ["too-few", "too-many"])
@pytest.mark.parametrize("nthreads", [1, 2])
def test_sampled_bound_that_misjudges_falls_back_exactly(threads, failure, nthreads):
    """Data whose sampled runs misrepresent the segment: large values only in
    the sampled runs (the bound is far too high: fewer than k candidates) or
    tiny values only there (far too low: the candidate cap overflows).  Both
    fall back to the radix histogram; the result is still the exact top-k
    (numpy oracle), for the plain kernel and the fused compensation, and
    with one thread (candidates collected in order into one array) as with
    two (per-block slots)."""
    threads(nthreads)
    n, k = 1 << 20, 10_000
    g = torch.Generator().manual_seed(41)
    x = torch.randn(n, generator=g)
    sampled = _sample_runs_mask(n)
    if failure == "too-few":
        x[sampled] = 100 + torch.rand(int(sampled.sum()), generator=g)
    else:
        x[sampled] = 1e-3 * torch.randn(int(sampled.sum()), generator=g)
    check_selection(x, [0, n], [k])
    half = torch.randn(n, generator=g) * 0.25  # the residual: acc = x - half + half
    got = cpu.compensate_select_topk(torch.empty(n), [x - half], half, torch.tensor([0, n]),
                                     torch.tensor([k]))
    acc = (x - half) + half
    expect = topk_np(acc, [0, n], [k])
    np.testing.assert_array_equal(got[0].long().numpy(), expect)
    assert_same(got[1], acc[got[0].long()])
    assert got[2].tolist() == [True]


def test_many_segments_mixed_sizes_and_threads(threads):
    g = _gen(2)
    sizes = [0, 1, 2, 5, 64, 1000, 0, 4097, 40_000, 33_000, 3, 250_000, 70_000, 1, 1_200_000, 17]
    sizes += list(torch.randint(1, 5000, (60,), generator=g).tolist())
    offsets = list(np.cumsum([0] + sizes))
    x = torch.randn(offsets[-1], generator=g)
    x[torch.randint(0, offsets[-1], (500,), generator=g)] = 0.5  # duplicate magnitudes
    for density in (0.001, 0.01, 0.3):
        ks = [gp.k_for(density, s) if s else 1 for s in sizes]
        out = []
        for t in (1, 2):
            threads(t)
            out.append(check_selection(x, offsets, ks, oracle=False))
        assert_all_same(out[0][0], out[1][0])
        assert_all_same(out[0][1], out[1][1])
        np.testing.assert_array_equal(out[0][0][0].long().numpy(), topk_np(x, offsets, ks))


def test_results_are_deterministic_across_runs():
    x = torch.randn(1_000_000, generator=_gen(3))
    off_t, k_t = seg([0, 400_000, 1_000_000], [400, 6000])
    first = cpu.select_topk(x, off_t, k_t), cpu.select_threshold(x, off_t, k_t)
    for _ in range(3):
        assert_all_same(cpu.select_topk(x, off_t, k_t), first[0])
        assert_all_same(cpu.select_threshold(x, off_t, k_t), first[1])


# ---------------------------------------------------------------------------
# Threshold selection: the three outcomes of reference._threshold_segment

def test_threshold_within_tolerance_too_many_and_too_few():
    n, k = 409_600, 400
    pos = reference.threshold_sample_positions(n)  # 32 runs of 128 entries
    assert pos.numel() == 4096 and pos[128].item() == n // 32
    # within tolerance (the count is not cut to k) for some k, on random data
    x = torch.randn(n, generator=_gen(4))
    within = 0
    for kk in range(2000, 40_001, 2000):
        idx, _ = check_selection(x, [0, n], [kk], oracle=False)[1]
        assert 0.9 * kk <= idx.numel() <= 1.1 * kk
        within += idx.numel() != kk
        # the selected set holds the whole exact top-k unless the sample overestimated
        covered = torch.isin(cpu.select_topk(x, *seg([0, n], [kk]))[0], idx).float().mean()
        assert covered >= 0.9
    assert within >= 1
    # too many: every sampled entry is large -> exact top-k among them
    x = torch.zeros(n)
    x[pos] = 10.0
    x[5000:6000] = 1.0
    idx, _ = check_selection(x, [0, n], [k])[1]
    assert idx.numel() == k and idx[:3].tolist() == [0, 1, 2] and idx[128].item() == n // 32
    # too few: the sample sees only 8 large entries -> exact top-k of the segment
    x = torch.full((n,), 0.25)
    x[1::2] = 5.0
    x[0:16:2] = 10.0
    idx, _ = check_selection(x, [0, n], [k])[1]
    assert idx.numel() == k and idx.tolist()[:9] == list(range(9))


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from([1, 3, 17, 100, 1000]), st.sampled_from(DTYPES))
def test_threshold_never_leaves_a_larger_entry_behind(seed, k, dtype):
    n = 50_000
    x = torch.randn(n, generator=_gen(seed)).to(dtype)
    idx, vals = cpu.select_threshold(x, *seg([0, n], [k]))
    assert_all_same((idx, vals), reference.select_threshold(x, *seg([0, n], [k])))
    m = mag_np(x)
    chosen = np.zeros(n, dtype=bool)
    chosen[idx.long().numpy()] = True
    assert m[~chosen].max() <= m[chosen].min()
    assert 0.9 * k <= idx.numel() <= 1.1 * k or idx.numel() == k


# ---------------------------------------------------------------------------
# Merge-and-select

POOL = [-2.0, -1.0, -0.5, -0.0, 0.0, 0.5, 1.0, 2.0, 3.0, 1e-45, 2049.0, 1.0009765625, 65504.0,
        float("inf"), float("nan")]


@st.composite
def sparse_pair(draw):
    sizes = draw(st.lists(st.integers(0, 40), min_size=1, max_size=5))
    offsets = list(np.cumsum([0] + sizes))
    n = int(offsets[-1])
    ks = [draw(st.integers(0, s + 1)) for s in sizes]
    dtype = draw(st.sampled_from(DTYPES))
    idtype = draw(st.sampled_from([torch.int32, torch.int64]))
    finite = draw(st.booleans())
    pool = POOL[:-2] if finite else POOL

    def one():
        chosen = sorted(draw(st.sets(st.integers(0, max(0, n - 1)), max_size=n))) if n else []
        vals = draw(st.lists(st.sampled_from(pool), min_size=len(chosen), max_size=len(chosen)))
        return torch.tensor(chosen, dtype=idtype), torch.tensor(vals, dtype=torch.float64).to(dtype)

    return one(), one(), offsets, ks


@settings(max_examples=300, deadline=None)
@given(sparse_pair())
def test_merge_select_matches_reference_oracle_and_is_symmetric(case):
    (ia, va), (ib, vb), offsets, ks = case
    off_t, k_t = seg(offsets, ks)
    got = cpu.merge_select(ia, va, ib, vb, off_t, k_t)
    assert_all_same(got, reference.merge_select(ia, va, ib, vb, off_t, k_t))
    idx2, vals2, keep_b2, keep_a2 = cpu.merge_select(ib, vb, ia, va, off_t, k_t)
    assert_all_same((idx2, vals2, keep_a2, keep_b2), got)
    # the numpy oracle, every dtype (one addition rounded as the dtype rounds
    # it), NaN/inf included: indices, and every summed value (NaN exactly
    # where the oracle has NaN, all other sums equal)
    e_idx, e_vals = merge_values_np(ia.numpy(), va.double().numpy(), ib.numpy(), vb.double().numpy(),
                                    offsets, [max(0, k) for k in ks], va.dtype)
    np.testing.assert_array_equal(got[0].long().numpy(), e_idx)
    assert_values_equal(got[1].double().numpy(), e_vals, "merged sums")
    kept = set(e_idx.tolist())
    assert got[2].tolist() == [i in kept for i in ia.tolist()]
    assert got[3].tolist() == [i in kept for i in ib.tolist()]


def test_merge_select_large_and_threads(threads):
    offsets = [0, 100_000, 100_000, 900_000, 1_000_000]
    ks = [1000, 5, 8000, 1000]

    def one(seed):
        idx, vals = cpu.select_topk(torch.randn(1_000_000, generator=_gen(seed)), *seg(offsets, ks))
        return idx, vals

    ia, va = one(6)
    ib, vb = one(7)
    vb[::3] = -va[: vb[::3].numel()]  # some cancellation
    ib[::5] = ia[::5]  # shared indices
    ib = torch.unique(ib).to(torch.int32)
    vb = vb[: ib.numel()]
    off_t, k_t = seg(offsets, ks)
    ref = reference.merge_select(ia, va, ib, vb, off_t, k_t)
    for t in (1, 2):
        threads(t)
        assert_all_same(cpu.merge_select(ia, va, ib, vb, off_t, k_t), ref)


@pytest.mark.parametrize("shape", ["balanced", "lopsided", "one-empty"])
@pytest.mark.parametrize("nthreads", [1, 2])
def test_merge_select_lanes_against_numpy(threads, shape, nthreads):
    """Large unions against the numpy oracle: shared
    indices (summed, some to zero), magnitudes from a small pool (ties at the
    k-th key fall in several lanes and must be taken in index order), one
    operand much shorter or empty, and k from 0 to past the union.  Indices,
    summed values and both keep flags against the numpy oracle."""
    threads(nthreads)
    gen = _gen(31)
    n = 200_000
    offsets = [0, n, 2 * n]
    sizes = {"balanced": (60_000, 50_000), "lopsided": (90_000, 3_000), "one-empty": (70_000, 0)}[shape]
    pool = torch.tensor([0.5, -0.5, 1.0, -1.0, 2.0, -2.0, 0.25])

    def one(m, shared=None):
        parts = []
        for s in range(2):
            pos = torch.randperm(n, generator=gen)[:m] + s * n
            if shared is not None and m:
                pos[: m // 4] = shared[s][: m // 4]
            parts.append(torch.unique(pos))
        idx = torch.cat(parts).to(torch.int32)
        return idx, pool[torch.randint(0, pool.numel(), (idx.numel(),), generator=gen)]

    ia, va = one(sizes[0])
    a_by_seg = [ia[(ia >= offsets[s]) & (ia < offsets[s + 1])].long() for s in range(2)]
    ib, vb = one(sizes[1], shared=[t[torch.randperm(t.numel(), generator=gen)] for t in a_by_seg])
    for ks in ([0, 1], [5_000, 40_000], [sizes[0] + sizes[1], 7], [2 * n, 2 * n]):
        off_t, k_t = seg(offsets, ks)
        got = cpu.merge_select(ia, va, ib, vb, off_t, k_t)
        e_idx, e_vals = merge_values_np(ia.numpy(), va.double().numpy(), ib.numpy(), vb.double().numpy(),
                                        offsets, ks, va.dtype)
        np.testing.assert_array_equal(got[0].long().numpy(), e_idx)
        np.testing.assert_array_equal(got[1].double().numpy(), e_vals)
        kept = set(e_idx.tolist())
        assert got[2].tolist() == [i in kept for i in ia.tolist()]
        assert got[3].tolist() == [i in kept for i in ib.tolist()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_merge_select_threshold_inside_a_crowded_key_bucket(dtype):
    """The merge finds the k-th largest key through a histogram of the keys'
    top bits and a select within the one bucket that holds it: here most
    magnitudes share that bucket (1 + j * 2^-10, j < 8: equal exponent and
    leading mantissa bits, distinct low bits, many ties), with a few larger
    and smaller ones around, and k cuts inside the crowd, at its edges and
    past the union.  Indices, sums and keep flags against numpy."""
    gen = _gen(41)
    n = 100_000
    offsets = [0, n]

    def one(m):
        idx = torch.randperm(n, generator=gen)[:m].sort().values.to(torch.int32)
        crowd = 1.0 + torch.randint(0, 8, (m,), generator=gen).double() * 2.0 ** -10
        sign = torch.where(torch.rand(m, generator=gen) < 0.5, -1.0, 1.0).double()
        mag = torch.where(torch.rand(m, generator=gen) < 0.05, torch.full((m,), 4.0, dtype=torch.float64),
                          torch.where(torch.rand(m, generator=gen) < 0.05,
                                      torch.full((m,), 0.25, dtype=torch.float64), crowd))
        return idx, (sign * mag).to(dtype)

    ia, va = one(30_000)
    ib, vb = one(25_000)
    union = torch.unique(torch.cat([ia, ib])).numel()
    for k in (1, 1_000, 2_600, 20_000, union - 1_000, union - 1, union, union + 5):
        got = cpu.merge_select(ia, va, ib, vb, *seg(offsets, [k]))
        e_idx, e_vals = merge_values_np(ia.numpy(), va.double().numpy(), ib.numpy(), vb.double().numpy(),
                                        offsets, [k], dtype)
        np.testing.assert_array_equal(got[0].long().numpy(), e_idx)
        np.testing.assert_array_equal(got[1].double().numpy(), e_vals)
        kept = set(e_idx.tolist())
        assert got[2].tolist() == [i in kept for i in ia.tolist()]
        assert got[3].tolist() == [i in kept for i in ib.tolist()]


def test_merge_select_unsorted_operands_use_the_reference():
    ia, va = torch.tensor([5, 1, 3], dtype=torch.int32), torch.tensor([1.0, 2.0, 3.0])
    ib, vb = torch.tensor([3, 0], dtype=torch.int32), torch.tensor([1.0, -4.0])
    off_t, k_t = seg([0, 8], [2])
    assert_all_same(cpu.merge_select(ia, va, ib, vb, off_t, k_t),
                    reference.merge_select(ia, va, ib, vb, off_t, k_t))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["narrow", "low_bit", "equal"])
def test_merge_select_radix_select_on_keys_that_share_their_top_bits(dtype, kind):
    """The union's k-th magnitude (a radix select that starts at the highest
    bit where the keys differ) on large unions whose magnitudes share most
    bits: within one binade, differing only in the lowest bit, all equal.
    Against the numpy oracle, whose threshold is a plain sort."""
    n = 100_000
    gen = _gen(11)
    sign = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0).double()
    if kind == "narrow":  # one binade: [2, 4)
        mag = 2.0 + 2.0 * torch.rand(n, generator=gen, dtype=torch.float64)
    elif kind == "low_bit":  # 1.0 or the next value up in the dtype
        mag = 1.0 + torch.finfo(dtype).eps * (torch.rand(n, generator=gen) < 0.3).double()
    else:
        mag = torch.full((n,), 3.0, dtype=torch.float64)
    vals = (sign * mag).to(dtype)
    perm = torch.randperm(2 * n, generator=gen)
    ia, _ = torch.sort(perm[:n])
    ib, _ = torch.sort(perm[n:n + n // 2])  # disjoint from ia: a union of 150k
    va, vb = vals, vals[: ib.numel()].flip(0)
    offsets, ks = [0, 2 * n], [3 * n // 4 + 7]
    off_t, k_t = seg(offsets, ks)
    got = cpu.merge_select(ia, va, ib, vb, off_t, k_t)
    assert_all_same(got, reference.merge_select(ia, va, ib, vb, off_t, k_t))
    e_idx, _ = merge_values_np(ia.numpy(), va.double().numpy(), ib.numpy(), vb.double().numpy(),
                               offsets, ks, va.dtype)
    np.testing.assert_array_equal(got[0].long().numpy(), e_idx)


# ---------------------------------------------------------------------------
# Scatter update

@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(1, 3000), st.sampled_from(DTYPES),
       st.sampled_from([1, 2, 3, 5, 7, 8]), st.booleans(), st.sampled_from([torch.int32, torch.int64]))
def test_scatter_match_reference(seed, numel, dtype, divisor, ordered, idtype):
    g = _gen(seed)
    nsel = int(torch.randint(0, numel + 1, (1,), generator=g))
    idx = torch.randperm(numel, generator=g)[:nsel]
    idx = (torch.sort(idx).values if ordered else idx).to(idtype)
    wire = torch.float16 if dtype != torch.float16 else torch.bfloat16
    vals = (torch.randn(nsel, generator=g) * 100).to(wire)
    assert_same(cpu.scatter_update(numel, idx, vals, divisor, dtype),
                reference.scatter_update(numel, idx, vals, divisor, dtype))


def test_scatter_large_and_input_untouched(threads):
    g = _gen(8)
    numel = 3_000_000
    idx = torch.sort(torch.randperm(numel, generator=g)[:30_000]).values.to(torch.int32)
    vals = torch.randn(idx.numel(), generator=g)
    keep = vals.clone()
    for t in (1, 2):
        threads(t)
        assert_same(cpu.scatter_update(numel, idx, vals, 3, torch.float32),
                    reference.scatter_update(numel, idx, vals, 3, torch.float32))
    assert torch.equal(vals, keep)
    with pytest.raises(RuntimeError, match="out of range"):
        cpu.scatter_update(10, torch.tensor([10]), torch.tensor([1.0]), 1, torch.float32)


# ---------------------------------------------------------------------------
# int64 indices past 2^31 - 1 elements (4 GiB of fp16; opt-in)

@pytest.mark.skipif(os.environ.get("GTOPK_TEST_BIG") != "1", reason="set GTOPK_TEST_BIG=1 (needs ~6 GiB)")
def test_int64_indices_past_int32():
    n = 2**31 + 1000
    x = torch.zeros(n, dtype=torch.float16)
    x[n - 3] = 5.0
    x[7] = -6.0
    x[n - 900] = 2.0
    idx, vals = cpu.select_topk(x, *seg([0, 100, n], [1, 2]))
    assert idx.dtype == torch.int64 and idx.tolist() == [7, n - 900, n - 3]
    assert vals.tolist() == [-6.0, 2.0, 5.0]


# ---------------------------------------------------------------------------
# Dispatch: the reducer picks the CPU back end; GTOPK_KERNELS forces one

def _count_calls(monkeypatch, module, name):
    calls = []
    real = getattr(module, name)

    def wrapped(*a, **kw):
        calls.append(name)
        return real(*a, **kw)

    monkeypatch.setattr(module, name, wrapped)
    return calls


@pytest.mark.parametrize("method", ["topk", "threshold", "gtopk"])
def test_reducer_uses_cpu_kernels_by_default(monkeypatch, method):
    monkeypatch.delenv("GTOPK_KERNELS", raising=False)
    assert kernels.backend("cpu") == "cpu"
    # exact top-k runs fused with the compensation
    name = "select_threshold" if method == "threshold" else "compensate_select_topk"
    fast = _count_calls(monkeypatch, cpu, name)
    ref = _count_calls(monkeypatch, reference, name)
    red = gp.GradientReducer(method=method, density=0.01, transport=gp.SingleProcessTransport())
    grads = {"a": torch.randn(300, 40), "b": torch.randn(77)}
    out = red.reduce(grads)
    assert fast and not ref
    # same answer as the reference reducer
    red_ref = gp.GradientReducer(method=method, density=0.01, transport=gp.SingleProcessTransport(),
                                 kernels="reference")
    for n, u in red_ref.reduce(grads).items():
        assert torch.equal(u, out[n])


def test_gtopk_kernels_env_forces_a_backend(monkeypatch):
    monkeypatch.setenv("GTOPK_KERNELS", "reference")
    assert kernels.backend("cpu") == "reference"
    # the reducer runs exact top-k fused with the compensation
    fast = _count_calls(monkeypatch, cpu, "compensate_select_topk")
    ref = _count_calls(monkeypatch, reference, "compensate_select_topk")
    gp.GradientReducer(method="topk", density=0.1,
                       transport=gp.SingleProcessTransport()).reduce({"w": torch.randn(100)})
    assert ref and not fast
    monkeypatch.setenv("GTOPK_KERNELS", "cpu")
    assert kernels.backend("cpu") == "cpu"
    gp.GradientReducer(method="topk", density=0.1,
                       transport=gp.SingleProcessTransport()).reduce({"w": torch.randn(100)})
    assert fast
    monkeypatch.setenv("GTOPK_KERNELS", "auto")
    assert kernels.backend("cpu") == "cpu"


def test_dtypes_the_kernels_do_not_take_go_to_the_reference():
    # a float divisor: the reference handles it
    out = cpu.scatter_update(4, torch.tensor([1]), torch.tensor([3.0]), 2.0, torch.float32)
    assert out.tolist() == [0.0, 1.5, 0.0, 0.0]


# ---------------------------------------------------------------------------
# Loader: package data, build at install, compile on first use, fallback

def test_sources_are_found_next_to_the_package():
    d = _build.source_dir("cpu")
    assert d is not None and (d / "select.cpp").is_file()
    names = {p.name for p in _build.source_files(d)}
    assert {"common.h", "ops.h", "select.cpp", "merge.cpp", "scatter.cpp", "register.cpp"} <= names
    assert torch.ops.gtopk_cpu.source_hash() == _build.source_hash(_build.source_files(d))
    assert cpu.origin() in ("installed", "jit")


@pytest.mark.timeout(600)
def test_wheel_ships_the_sources_and_an_installed_package_finds_them(tmp_path):
    # Build from a copy of the project (no build/ or egg-info in the tree),
    # without compiling (GTOPK_BUILD_EXT=0) and without build isolation.
    src = tmp_path / "src"
    src.mkdir()
    for f in ("setup.py", "README.md"):
        shutil.copy(ROOT / f, src / f)
    shutil.copytree(ROOT / "gtopk_plugin", src / "gtopk_plugin",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copytree(ROOT / "csrc", src / "csrc")
    env = dict(os.environ, GTOPK_BUILD_EXT="0", PIP_NO_INDEX="1")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-deps",
                    "-w", str(tmp_path / "w"), str(src)], check=True, env=env, cwd=tmp_path)
    whl = next((tmp_path / "w").glob("gtopk_plugin-*.whl"))
    names = set(zipfile.ZipFile(whl).namelist())
    for f in _build.source_files(ROOT / "csrc" / "cpu"):
        assert f"gtopk_plugin/csrc/cpu/{f.name}" in names
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                    "--target", str(target), str(whl)], check=True, env=env)
    out = subprocess.run(
        [sys.executable, "-c",
         "import gtopk_plugin, gtopk_plugin.kernels._build as b; "
         "print(gtopk_plugin.__file__); print(b.source_dir('cpu'))"],
        env=dict(os.environ, PYTHONPATH=str(target)), cwd=tmp_path, capture_output=True, text=True,
        check=True)
    pkg_file, srcdir = out.stdout.split()
    assert pkg_file.startswith(str(target)) and srcdir == str(target / "gtopk_plugin" / "csrc" / "cpu")


@pytest.fixture
def fresh_loader(monkeypatch, tmp_path):
    """The loader state as in a new process, with an empty compile cache."""
    monkeypatch.setattr(cpu, "_ext", None)
    monkeypatch.setattr(cpu, "_origin", None)
    monkeypatch.setattr(cpu, "_failed", False)
    monkeypatch.setattr(_build, "installed_library", lambda h: None)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path


def test_first_use_compiles_once_with_one_log_line(fresh_loader, monkeypatch, caplog):
    from torch.utils import cpp_extension

    seen = []
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: seen.append(kw))  # library already loaded
    with caplog.at_level(logging.INFO, logger="gtopk_plugin.kernels"):
        assert cpu.load() is cpu
        assert cpu.load() is cpu
    assert cpu.origin() == "jit" and len(seen) == 1
    kw = seen[0]
    assert kw["build_directory"].startswith(str(fresh_loader / "cache" / "gtopk_plugin" / "cpu_kernels"))
    assert kw["is_python_module"] is False
    assert sorted(Path(s).name for s in kw["sources"]) == ["compensate.cpp", "merge.cpp", "prescale.cpp",
                                                            "register.cpp", "scatter.cpp", "select.cpp"]
    lines = [r for r in caplog.records if "compiling the CPU kernels" in r.getMessage()]
    assert len(lines) == 1


def test_no_compiler_falls_back_to_the_reference_with_one_warning(fresh_loader, monkeypatch):
    monkeypatch.setenv("CXX", str(fresh_loader / "no-such-compiler"))
    monkeypatch.setattr(kernels, "_FAST_BACKENDS", {})
    monkeypatch.setattr(kernels, "_LOADERS", {"cpu": cpu.load})
    monkeypatch.delenv("GTOPK_KERNELS", raising=False)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert kernels.backend("cpu") == "reference"
        assert kernels.backend("cpu") == "reference"
        idx, _ = kernels.select_topk(torch.tensor([1.0, -3.0, 2.0]), *seg([0, 3], [1]))
    assert idx.tolist() == [1]
    msgs = [str(x.message) for x in w if issubclass(x.category, RuntimeWarning)]
    assert len(msgs) == 1 and "no C++ compiler" in msgs[0] and "reference" in msgs[0]
    monkeypatch.setenv("GTOPK_KERNELS", "cpu")
    with pytest.raises(RuntimeError, match="not available"):
        kernels.backend("cpu")


# ---------------------------------------------------------------------------
# gtopk-bench selection (gtopk_plugin/bench/selection_bench.py) runs (a tiny grid) and its ResNet-50 layout is right

def test_selection_benchmark_smoke(tmp_path, capsys):
    from gtopk_plugin.bench import selection_bench as selection

    shapes = selection.resnet50_shapes()
    assert len(shapes) == 161 and sum(selection._numel(s) for _, s in shapes) == 25_557_032
    res = selection.main(["--sizes", "100000", "--reps", "1", "--threads", "1", "--no-resnet",
                          "--out", str(tmp_path)])
    assert (tmp_path / "selection.json").is_file()
    rows = res["grid"]
    assert len(rows) == 2 and all(r["threshold_recall"] >= 0.9 for r in rows)
    assert "torch.topk" in capsys.readouterr().out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("nthreads", [1, 2])
def test_fused_compensation_and_selection_match_reference(threads, dtype, nthreads):
    """compensate_select_topk (float32: written with non-temporal stores and
    scanned in the same loop) against the reference: idx, vals, the finite
    flags and every bit of acc.  Odd tensor boundaries and an acc that is not
    16-byte aligned (the scalar head and tail of the vector loop), NaN/Inf
    gradients, a NaN made by the residual alone (ranks as +inf and flags its
    tensor: the accumulator is what is checked), sampled bounds at 1 % and 0.1 % of a 300k segment, accumulators
    past 4 MB (non-temporal stores), and the fallback when the bound fails
    (heavy ties: every block still written)."""
    threads(nthreads)
    g = torch.Generator().manual_seed(23)
    sizes = [0, 3, 701, 20_001, 300_003]
    N = sum(sizes)
    layer = torch.tensor([0] + np.cumsum(sizes).tolist())

    def check(grads, residual, offsets, ks, shift):
        n = sum(x.numel() for x in grads)
        base = torch.full((n + shift,), 7.0, dtype=dtype)
        acc, ref_acc = base[shift:], torch.full((n,), 7.0, dtype=dtype)
        got = cpu.compensate_select_topk(acc, grads, residual, offsets, torch.tensor(ks))
        ref = reference.compensate_select_topk(ref_acc, grads, residual, offsets, torch.tensor(ks))
        for a, b in zip(got, ref):
            assert_same(a, b)
        assert_same(acc, ref_acc)
        return got

    for bad in ((), (3,), (2, 4)):
        grads = cuda_grads(dtype, sizes, g, bad=bad)  # the CUDA tests' gradient sets
        for residual in (None, (torch.randn(N, generator=g) * 0.5).to(dtype)):
            if residual is not None:
                residual[N - 5] = float("nan")  # the sum is NaN, the gradient finite
            for offsets, ks in ((layer, [1, 1, 50, 200, 3000]), (layer, [0, 3, 700, 1, 300]),
                                (torch.tensor([0, N]), [3200])):
                for shift in (0, 1):
                    _, _, finite = check(grads, residual, offsets, ks, shift)
                    # the flag covers the accumulator: the residual's NaN too
                    nan_by_residual = (4,) if residual is not None else ()
                    assert finite.tolist() == [t not in bad + nan_by_residual for t in range(len(sizes))]
    # past 4 MB: float32 is written with non-temporal stores
    big = [torch.randn(700_001, generator=g).to(dtype), torch.randn(400_003, generator=g).to(dtype)]
    big[1][123] = float("inf")
    for ks in ([7000, 4000], [700, 400]):
        for shift in (0, 1):
            _, _, finite = check(big, torch.randn(1_100_004, generator=g).to(dtype),
                                 torch.tensor([0, 700_001, 1_100_004]), ks, shift)
            assert finite.tolist() == [True, False]
    zeros = [torch.zeros(200_000, dtype=dtype)]
    zeros[0][[5, 77, 100_000]] = torch.tensor([1.0, -2.0, 0.5], dtype=dtype)
    for ks in ([2], [3000]):
        check(zeros, None, torch.tensor([0, 200_000]), ks, 1)
    check([torch.zeros(1_100_000, dtype=dtype)], None, torch.tensor([0, 1_100_000]), [5000], 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_compensate_matches_reference_small_and_streamed(dtype):
    """compensate against the reference, bit for bit with its finite flag:
    small buffers (normal stores) and a float32 buffer past 4 MB (written
    with non-temporal stores), out aligned and not 16-byte aligned, with
    and without residual, NaN/Inf anywhere in the gradient."""
    g = torch.Generator().manual_seed(29)
    for n in (5, 20_001, 1_200_007):
        for bad_at in (None, 0, n // 2, n - 1):
            grad = torch.randn(n, generator=g).to(dtype)
            if bad_at is not None:
                grad[bad_at] = float("nan") if bad_at % 2 else float("inf")
            for residual in (None, torch.randn(n, generator=g).to(dtype)):
                for shift in (0, 1, 3):
                    base = torch.full((n + shift,), 7.0, dtype=dtype)
                    out, ref_out = base[shift:], torch.empty(n, dtype=dtype)
                    ok = cpu.compensate(out, grad, residual)
                    assert ok == reference.compensate(ref_out, grad, residual) == (bad_at is None)
                    assert_same(out, ref_out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_compensate_flags_an_accumulator_that_overflows(dtype):
    """The finite flag covers the accumulator, not only the gradient: a
    finite gradient plus a finite residual whose sum overflows (or a
    non-finite residual) is flagged, in the plain kernel, the streamed one
    (past 4 MB) and the fused compensation + selection, like the reference
    -- and the oracle is numpy's own isfinite of the float sum."""
    big = torch.finfo(dtype).max
    for n in (5, 20_001, 1_200_007):
        for at in (0, n // 2, n - 1):
            grad = torch.zeros(n, dtype=dtype)
            residual = torch.zeros(n, dtype=dtype)
            grad[at], residual[at] = big, big  # both finite; the sum is +inf
            want = bool(np.isfinite(grad.numpy() + residual.numpy()).all())
            assert want is False
            out, ref_out = torch.empty(n, dtype=dtype), torch.empty(n, dtype=dtype)
            assert cpu.compensate(out, grad, residual) is False
            assert reference.compensate(ref_out, grad, residual) is False
            assert_same(out, ref_out)
            acc, ref_acc = torch.empty(n, dtype=dtype), torch.empty(n, dtype=dtype)
            offs, k = torch.tensor([0, n]), torch.tensor([3])
            got = cpu.compensate_select_topk(acc, [grad], residual, offs, k)
            ref = reference.compensate_select_topk(ref_acc, [grad], residual, offs, k)
            assert got[2].tolist() == ref[2].tolist() == [False]
            residual[at] = float("nan")  # a NaN residual alone: flagged too
            assert cpu.compensate(out, torch.zeros(n, dtype=dtype), residual) is False


@pytest.mark.parametrize("itype", [torch.int32, torch.int64])
def test_member_sorted_matches_numpy_isin(itype):
    """member_sorted (the butterfly's survival test) against np.isin: the
    CPU walk for ascending values, the reference's binary search for
    unsorted ones, empty operands, values past either end."""
    g = torch.Generator().manual_seed(31)
    for n, m in ((0, 5), (5, 0), (1, 1), (3000, 7000), (250_000, 250_000)):
        a = torch.sort(torch.randperm(4 * max(n, m, 1), generator=g)[:m]).values.to(itype)
        v = torch.sort(torch.randperm(4 * max(n, m, 1), generator=g)[:n]).values.to(itype)
        if n > 10 and m > 10:
            v[n // 2] = a[m // 3]  # certainly shared entries
        v = torch.unique(v)
        for vals in (v, v[torch.randperm(v.numel(), generator=g)]):
            want = np.isin(vals.numpy(), a.numpy())
            for fn in (cpu.member_sorted, reference.member_sorted, kernels.member_sorted):
                got = fn(vals, a)
                assert got.dtype == torch.bool and np.array_equal(got.numpy(), want), (fn, n, m)
