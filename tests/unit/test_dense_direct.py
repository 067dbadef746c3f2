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


def _np_flags(x: np.ndarray, shift: int):
    """Independent oracle: exponent fields from the bits (numpy)."""
    a = x.astype(np.float64) if x.dtype != np.float64 else x
    finite = bool(np.isfinite(a).all())
    if shift == 0:
        return finite, True
    fi = np.finfo(x.dtype) if x.dtype != np.float16 else np.finfo(np.float16)
    mant, expo = np.frexp(np.abs(a))  # |a| = mant * 2**expo, mant in [0.5, 1)
    # exact: zero, or at least the smallest normal times 2**shift, and below 2**(emax - shift)
    zero = (x.view(INTS[x.itemsize]) & np.array((1 << (8 * x.itemsize - 1)) - 1).astype(INTS[x.itemsize])) == 0
    emax = int(np.floor(np.log2(float(fi.max))))
    ok = zero | ((np.abs(a) >= float(fi.tiny) * 2.0 ** shift) & (expo - 1 < emax - shift) & np.isfinite(a))
    return finite, bool(ok.all())


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
def test_prescale_copy_flags_at_the_edges(kern):
    """float32 at shift s: exact on [2^(s-126), 2^(127-s)) and at +-0; the
    first value below, a denormal, the bound above, Inf and NaN are not."""
    for shift in (1, 2, 3, 5):
        lo, hi = 2.0 ** (shift - 126), 2.0 ** (127 - shift)
        lo32 = torch.tensor([lo], dtype=torch.float32)
        hi32 = torch.tensor([hi], dtype=torch.float32)
        cases = {
            "lo": (lo32, True), "-lo": (-lo32, True),
            "below lo": (torch.nextafter(lo32, torch.zeros(1)), False),
            "denormal": (torch.tensor([1e-45]), False),
            "below hi": (torch.nextafter(hi32, torch.zeros(1)), True),
            "hi": (hi32, False), "-hi": (-hi32, False),
            "inf": (torch.tensor([float("inf")]), False), "nan": (torch.tensor([float("nan")]), False),
            "-0": (torch.tensor([-0.0]), True),
        }
        for name, (v, want) in cases.items():
            for pos in (0, 5, 37):  # head, SIMD body, tail of a 41-entry buffer
                x = torch.ones(41)
                x[pos] = v[0]
                out = torch.empty(41)
                finite, exact, _ = kernels.prescale_copy(out, x, shift, kernels=kern)
                assert exact == want, (shift, name, pos)
                assert finite == bool(torch.isfinite(v).all()), (shift, name, pos)
        # shift 0 is a bit copy, always exact (nothing is divided)
        x = torch.tensor([1e-45, 3e38, -0.0, 1.0] * 5)
        out = torch.empty_like(x)
        assert kernels.prescale_copy(out, x, 0, kernels=kern) == (True, True, 15)
        assert torch.equal(out.view(torch.int32), x.view(torch.int32))


def test_prescaled_sums_equal_divided_sums_when_exact():
    """The theorem behind the flag, by brute force: for P = 2^s float32
    vectors flagged exact, every order of adding the prescaled vectors
    gives the bits of the same order's unscaled sum times 2^-s; and inputs
    flagged inexact can break it (so the flag is not vacuous)."""
    rng = np.random.default_rng(3)
    for s in (1, 2):
        P = 1 << s
        # values spread over the whole exponent range, many near the edges
        e = rng.integers(-126 + s, 127 - s, size=(P, 4000))
        vals = (rng.uniform(1, 2, size=(P, 4000)) * 2.0 ** e * rng.choice([-1, 1], size=(P, 4000))).astype(np.float32)
        vals[:, ::7] = 0
        x = [torch.from_numpy(v.copy()) for v in vals]
        scaled = []
        for v in x:
            out = torch.empty_like(v)
            finite, exact, _ = kernels.prescale_copy(out, v, s, kernels="reference")
            assert finite and exact
            scaled.append(out)
        for order in itertools.permutations(range(P)):
            a = torch.zeros(4000)
            b = torch.zeros(4000)
            for r in order:
                a = a + x[r]
                b = b + scaled[r]
            assert torch.equal((a * 2.0 ** -s).view(torch.int32), b.view(torch.int32)), order
    # flagged inexact: a denormal halves to zero, a large sum overflows unscaled only
    a, b = torch.tensor([1e-45, 3e38]), torch.tensor([2e-45, 3e38])
    outs = [torch.empty(2), torch.empty(2)]
    flags = [kernels.prescale_copy(o, v, 1, kernels="reference")[1] for o, v in zip(outs, (a, b))]
    assert flags == [False, False]
    assert not torch.equal((a + b) / 2, outs[0] + outs[1])
