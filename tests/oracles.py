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
