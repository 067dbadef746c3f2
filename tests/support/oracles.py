"""Brute-force numpy oracles for the selection and merge kernels."""
import numpy as np
import torch


def mag_np(x: torch.Tensor) -> np.ndarray:
    m = np.abs(x.double().numpy())
    m[np.isnan(m)] = np.inf
    return m


def topk_np(x: torch.Tensor, offsets, ks):
    """Per segment: sort by (|v| desc, index asc), take k, return sorted idx."""
    m = mag_np(x)
    out = []
    for s, k in enumerate(ks):
        lo, hi = offsets[s], offsets[s + 1]
        idx = np.arange(lo, hi)
        order = np.lexsort((idx, -m[lo:hi]))
        out.extend(sorted(idx[order[:k]].tolist()))
    return np.array(out, dtype=np.int64)


def merge_np(ia, va, ib, vb, offsets, ks):
    """Union with sums (dict), then per-segment top-k by brute force."""
    acc = {}
    for i, v in zip(ia.tolist(), va.tolist()):
        acc[i] = v
    for i, v in zip(ib.tolist(), vb.tolist()):
        acc[i] = acc[i] + v if i in acc else v
    keys = np.array(sorted(acc), dtype=np.int64)
    vals = np.array([acc[i] for i in keys], dtype=np.float64)
    m = np.abs(vals)
    m[np.isnan(m)] = np.inf
    kept = []
    for s, k in enumerate(ks):
        sel = (keys >= offsets[s]) & (keys < offsets[s + 1])
        ki, km = keys[sel], m[sel]
        order = np.lexsort((ki, -km))
        kept.extend(ki[order[:k]].tolist())
    return np.array(sorted(kept), dtype=np.int64)


# ---------------------------------------------------------------------------
# Values, not just indices.  numpy only: nothing here calls gtopk_plugin.

def round_bf16_np(x32: np.ndarray) -> np.ndarray:
    """float32 -> nearest bfloat16 (ties to even), returned as float32; NaN
    stays NaN, overflow goes to ±inf as IEEE rounding does."""
    x32 = np.asarray(x32, dtype=np.float32)
    shape = x32.shape
    x32 = x32.reshape(-1)
    bits = x32.view(np.uint32).astype(np.uint64)
    one, half, mask = np.uint64(1), np.uint64(0x7FFF), np.uint64(0xFFFF0000)
    rounded = ((bits + half + ((bits >> np.uint64(16)) & one)) & mask).astype(np.uint32)
    out = rounded.view(np.float32).copy()
    out[np.isnan(x32)] = np.nan
    return out.reshape(shape)


def np_dtype_of(dtype: torch.dtype):
    """The numpy dtype whose IEEE addition is the torch dtype's (bfloat16:
    float32 then :func:`round_bf16_np`, exact for one addition since float32
    carries more than 2·8 + 2 bits)."""
    return {torch.float64: np.float64, torch.float32: np.float32, torch.float16: np.float16,
            torch.bfloat16: np.float32}[dtype]


def add_in_dtype(a: np.ndarray, b: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """a + b with one rounding to ``dtype`` (inputs are values of ``dtype``)."""
    nd = np_dtype_of(dtype)
    with np.errstate(over="ignore", invalid="ignore"):
        s = np.asarray(a, dtype=nd) + np.asarray(b, dtype=nd)
    return round_bf16_np(s) if dtype == torch.bfloat16 else s


def merge_values_np(ia, va, ib, vb, offsets, ks, dtype):
    """Brute-force gTop-k merge with values: the union of two sparse sets,
    values summed in ``dtype`` on shared indices (one IEEE addition), then
    per segment the k largest |sum| (NaN ranks as +inf; ties: smaller index).
    ``va``/``vb``: float64 arrays holding ``dtype`` values.  Returns
    (ascending int64 indices, float64 values of the kept sums)."""
    nd = np_dtype_of(dtype)
    acc = {}
    for i, v in zip(np.asarray(ia).tolist(), np.asarray(va, dtype=np.float64).tolist()):
        acc[i] = nd(v)
    for i, v in zip(np.asarray(ib).tolist(), np.asarray(vb, dtype=np.float64).tolist()):
        acc[i] = add_in_dtype(acc[i], nd(v), dtype)[()] if i in acc else nd(v)
    keys = np.array(sorted(acc), dtype=np.int64)
    vals = np.array([float(acc[i]) for i in keys.tolist()], dtype=np.float64)
    m = np.abs(vals)
    m[np.isnan(m)] = np.inf
    kept = []
    for s, k in enumerate(ks):
        sel = np.nonzero((keys >= offsets[s]) & (keys < offsets[s + 1]))[0]
        order = np.lexsort((keys[sel], -m[sel]))
        kept.extend(sel[order[:max(0, k)]].tolist())
    kept = np.array(sorted(kept), dtype=np.int64)
    return keys[kept], vals[kept]


def assert_values_equal(got: np.ndarray, expect: np.ndarray, what: str = "values") -> None:
    """Equal as numbers entry by entry: NaN exactly where the oracle has
    NaN, every other entry equal (the sign of a zero sum is not part of the
    contract: an index-add into zeros turns -0.0 into +0.0)."""
    got, expect = np.asarray(got, dtype=np.float64), np.asarray(expect, dtype=np.float64)
    assert got.shape == expect.shape, (what, got.shape, expect.shape)
    nan_g, nan_e = np.isnan(got), np.isnan(expect)
    assert np.array_equal(nan_g, nan_e), f"{what}: NaN at {np.nonzero(nan_g)[0]} vs {np.nonzero(nan_e)[0]}"
    bad = np.nonzero(got[~nan_e] != expect[~nan_e])[0]
    assert bad.size == 0, f"{what}: {got[~nan_e][bad][:5]} vs {expect[~nan_e][bad][:5]}"


# ---------------------------------------------------------------------------
# Statistics without scipy

def chi2_critical(df: int, alpha: float) -> float:
    """Upper ``alpha`` point of the chi-square distribution with ``df``
    degrees of freedom (Wilson–Hilferty cube-root normal approximation; at
    alpha = 1e-3 it lies 1.7% above the exact value for df = 3, 0.7% for
    df = 9, 0.1% for df = 49: slightly conservative)."""
    z = {1e-2: 2.326348, 1e-3: 3.090232, 1e-4: 3.719016}[alpha]
    c = 2.0 / (9.0 * df)
    return df * (1.0 - c + z * np.sqrt(c)) ** 3


def subset_chi2(counts: np.ndarray, draws: int, k: int) -> float:
    """Goodness of fit of inclusion counts when each of ``draws`` draws is a
    uniform k-subset of ``len(counts)`` positions.  The counts are not
    multinomial (a draw holds k distinct positions): each has variance
    T·p(1−p), p = k/r, with covariance −T·p(1−p)/(r−1), so
    Σ (O−E)² / (T·p(1−p)·r/(r−1)) is asymptotically χ² with r−1 degrees of
    freedom (the usual Pearson sum times (r−1)/(r−k))."""
    r = len(counts)
    p = k / r
    e = draws * p
    return float(np.sum((counts - e) ** 2) / (draws * p * (1 - p) * r / (r - 1)))


def hypergeom_pmf(r: int, k: int) -> np.ndarray:
    """P(|A ∩ B| = j), j = 0..k, for independent uniform k-subsets A, B of r."""
    from math import comb
    return np.array([comb(k, j) * comb(r - k, k - j) / comb(r, k) for j in range(k + 1)])
