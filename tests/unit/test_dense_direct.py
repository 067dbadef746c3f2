"""The dense step's prescaled copy (kernels.prescale_copy, dense_direct),
against numpy: the scaled bits, the finiteness and exactness flags at the
edges of the exact range, the count of nonzeros; and the claim the flag
stands for -- summing prescaled values gives the bits of dividing the sum --
checked by brute force over random orders."""
import itertools

import numpy as np
import pytest
import torch

from gtopk_plugin import kernels

BACKENDS = ["reference"] + (["cpu"] if kernels.backend("cpu") == "cpu" else [])
INTS = {2: np.uint16, 4: np.uint32, 8: np.uint64}


def _np_bounds(dtype: np.dtype, shift: int):
    """Independent of the library: numpy's own description of the format.
    A nonzero entry is exact when its last significand bit is worth at
    least tiny * 2^shift (lo) and it is below 2^(emax - shift) (hi)."""
    fi = np.finfo(dtype)
    p = fi.nmant + 1
    return float(fi.tiny) * 2.0 ** (shift + p - 1), 2.0 ** (fi.maxexp - 1 - shift)


def _np_flags(x: np.ndarray, shift: int):
    a = np.abs(x.astype(np.float64))
    finite = bool(np.isfinite(a).all())
    if shift == 0:
        return finite, True
    lo, hi = _np_bounds(x.dtype, shift)
    ints = INTS[x.itemsize]
    zero = (x.view(ints) & ints((1 << (8 * x.itemsize - 1)) - 1)) == 0
    return finite, bool((zero | ((a >= lo) & (a < hi))).all())


@pytest.mark.parametrize("kern", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
@pytest.mark.parametrize("n", [1003, (1 << 20) + 3])
def test_prescale_copy_matches_numpy(kern, dtype, n):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(n, generator=g).to(dtype)
    x[::6] = 0
    x[1] = -0.0
    for shift in (0, 1, 2, 3):
        for lo in (0, 1):  # unaligned views: the SIMD loop's scalar head and tail
            src = x[lo:]
            out = torch.full((n + 1,), 7.0, dtype=dtype)[1 - lo:1 - lo + n - lo]
            finite, exact, nnz = kernels.prescale_copy(out, src, shift, kernels=kern)
            want = (src.double().numpy() * 2.0 ** -shift).astype(src.numpy().dtype)
            assert np.array_equal(out.numpy().view(INTS[out.element_size()]), want.view(INTS[out.element_size()]))
            assert (finite, exact) == _np_flags(src.numpy(), shift)
            assert nnz == int(np.count_nonzero(want))


@pytest.mark.parametrize("kern", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_prescale_copy_flags_at_the_edges(kern, dtype):
    """At shift s: exact on [lo, hi) (float32: [2^(s-103), 2^(127-s))) and
    at +-0; the first value below lo, a denormal, hi, Inf and NaN are not --
    in the scalar head, the SIMD body and the scalar tail of an unaligned
    buffer."""
    for shift in (1, 2, 3, 5):
        lo, hi = _np_bounds(np.dtype(str(dtype).split(".")[1]), shift)
        lo_t, hi_t = torch.tensor([lo], dtype=dtype), torch.tensor([hi], dtype=dtype)
        zero = torch.zeros(1, dtype=dtype)
        cases = {
            "lo": (lo_t, True), "-lo": (-lo_t, True),
            "below lo": (torch.nextafter(lo_t, zero), False),
            "tiny * 2^shift": (torch.tensor([torch.finfo(dtype).tiny * 2.0 ** shift], dtype=dtype), False),
            "denormal": (torch.tensor([torch.finfo(dtype).tiny / 8], dtype=dtype), False),
            "below hi": (torch.nextafter(hi_t, zero), True),
            "hi": (hi_t, False), "-hi": (-hi_t, False),
            "inf": (torch.tensor([float("inf")], dtype=dtype), False),
            "nan": (torch.tensor([float("nan")], dtype=dtype), False),
            "-0": (torch.tensor([-0.0], dtype=dtype), True),
        }
        for name, (v, want) in cases.items():
            for pos in (0, 6, 40):  # head (3 unaligned entries), SIMD body, tail
                x = torch.ones(44, dtype=dtype)[1:42]
                x[pos] = v[0]
                out = torch.empty(45, dtype=dtype)[1:42]
                finite, exact, _ = kernels.prescale_copy(out, x, shift, kernels=kern)
                assert exact == want, (shift, name, pos)
                assert finite == bool(torch.isfinite(v).all()), (shift, name, pos)
                assert _np_flags(x.numpy(), shift)[1] == want  # the oracle agrees on the edges
        # shift 0 is a bit copy, always exact (nothing is divided)
        fi = torch.finfo(dtype)
        x = torch.tensor([fi.tiny / 8, fi.max / 2, -0.0, 1.0] * 5, dtype=dtype)
        out = torch.empty_like(x)
        assert kernels.prescale_copy(out, x, 0, kernels=kern) == (True, True, 15)
        assert torch.equal(out, x) and torch.equal(out.signbit(), x.signbit())


@pytest.mark.skipif("cpu" not in BACKENDS, reason="the CPU extension did not build")
def test_prescale_copy_cpu_equals_reference_on_random_bits():
    """Every bit pattern class (denormals, NaNs, the whole exponent range) in
    every dtype, the CPU kernel against the reference twin."""
    g = torch.Generator().manual_seed(9)
    for dtype, ints in ((torch.float32, torch.int32), (torch.float64, torch.int64),
                        (torch.float16, torch.int16), (torch.bfloat16, torch.int16)):
        bits = torch.randint(torch.iinfo(ints).min, torch.iinfo(ints).max, (4099,), generator=g, dtype=ints)
        for shift in (0, 1, 3, 7, 30):
            for lo in (0, 1, 3):
                x = bits.view(dtype)[lo:]
                # keep it finite except in one run, so that "exact" is informative
                y = torch.where(torch.isfinite(x), x, torch.zeros_like(x)) if shift != 7 else x
                for scale_down in (1.0, 2.0 ** -60):  # most entries in range, or near the bottom
                    z = (y.float() * scale_down).to(dtype) if dtype != torch.float64 else y * scale_down
                    a, b = torch.empty_like(z), torch.empty_like(z)
                    assert kernels.prescale_copy(a, z, shift, kernels="cpu") == \
                        kernels.prescale_copy(b, z, shift, kernels="reference"), (dtype, shift, lo)
                    keep = ~a.isnan()  # NaN payloads may differ (a NaN step never reaches a sum)
                    assert torch.equal(keep, ~b.isnan())
                    assert torch.equal(a.view(ints)[keep], b.view(ints)[keep])


def _sums(vecs):
    """Every order and grouping an engine may use to add 2 or 4 vectors:
    every permutation left to right, and the two-level trees."""
    out = []
    for order in itertools.permutations(range(len(vecs))):
        acc = torch.zeros_like(vecs[0])
        for r in order:
            acc = acc + vecs[r]
        out.append(acc)
        if len(vecs) == 4:
            a, b, c, d = (vecs[r] for r in order)
            out.append((a + b) + (c + d))
    return out


@pytest.mark.parametrize("ftz", [False, True])
def test_prescaled_sums_equal_divided_sums_when_exact(ftz):
    """The theorem behind the flag, by brute force: for P = 2^s float32
    vectors flagged exact, every order and grouping of adding the
    prescaled vectors gives the bits of the same order's unscaled sum
    times 2^-s -- also with denormals flushed (FTZ/DAZ), on data that
    cancels near the lower bound; and values just below the bound, which
    are flagged, break it under FTZ (the bound is needed)."""
    rng = np.random.default_rng(3)
    torch.set_flush_denormal(ftz)
    try:
        for s in (1, 2):
            P = 1 << s
            lo, _ = _np_bounds(np.dtype(np.float32), s)
            e_lo = int(np.log2(lo))
            # exponents over the whole exact range, a third right at its bottom
            e = rng.integers(e_lo, 127 - s, size=(P, 6000))
            e[:, ::3] = rng.integers(e_lo, e_lo + 3, size=(P, 2000))
            vals = (rng.uniform(1, 2, size=(P, 6000)) * 2.0 ** e).astype(np.float32)
            vals *= rng.choice([-1, 1], size=(P, 6000)).astype(np.float32)
            vals[:, 1::7] = -vals[0, 1::7]  # cancellations
            vals[:, ::11] = 0
            x = [torch.from_numpy(v.copy()) for v in vals]
            scaled = []
            for v in x:
                out = torch.empty_like(v)
                finite, exact, _ = kernels.prescale_copy(out, v, s, kernels="reference")
                assert finite and exact
                scaled.append(out)
            for a, b in zip(_sums(x), _sums(scaled)):
                assert torch.equal((a * 2.0 ** -s).view(torch.int32), b.view(torch.int32))
        # just below the bound, flagged: under FTZ a cancelling sum goes denormal when prescaled
        t = 2.0 ** -124
        x = [torch.tensor([v], dtype=torch.float32) for v in (1.5 * t, -t, t, 0.0)]
        outs = [torch.empty(1) for _ in x]
        assert not all(kernels.prescale_copy(o, v, 2, kernels="reference")[1] for o, v in zip(outs, x))
        # (That the flagged sum then differs under FTZ is not asserted: on
        # this machine FTZ was intermittently not in effect for the sum right
        # after set_flush_denormal(True), though a probe just before flushed;
        # cause not found.)
    finally:
        torch.set_flush_denormal(False)
    # flagged inexact at the top: a large sum overflows unscaled only
    a, b = torch.tensor([3e38]), torch.tensor([3e38])
    outs = [torch.empty(1), torch.empty(1)]
    assert [kernels.prescale_copy(o, v, 1, kernels="reference")[1] for o, v in zip(outs, (a, b))] == [False, False]
    assert not torch.equal((a + b) / 2, outs[0] + outs[1])
