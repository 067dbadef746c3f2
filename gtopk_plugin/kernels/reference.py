"""Pure-torch reference kernels: the oracle every fast back end is tested
against and the last fallback on any device (docs/design.md §1, §9).

All functions work on *segmented* flat buffers: ``x`` is 1-D, ``offsets`` is an
int64 tensor of S+1 segment boundaries (``offsets[0] == 0``,
``offsets[-1] == x.numel()``) and ``k`` an int64 tensor of S per-segment
counts.  Index tensors are global positions into ``x``, sorted ascending.

Ordering rule (docs/design.md §2): larger ``|value|`` first, then smaller index.
NaN magnitudes rank as ``+inf`` (the reducer rejects or skips non-finite
gradients before selection; this only makes the kernels total functions).
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

Tensor = torch.Tensor

#: Indices travel as int32 unless a buffer has more elements than int32 holds.
INT32_LIMIT = 2**31 - 1


def index_dtype(numel: int) -> torch.dtype:
    """Wire/index dtype for a buffer of ``numel`` elements."""
    return torch.int32 if numel <= INT32_LIMIT else torch.int64


def magnitude(v: Tensor) -> Tensor:
    """|v| as float32 (exact for fp16/bf16/fp32), NaN mapped to +inf."""
    m = v.abs()
    if m.dtype not in (torch.float32, torch.float64):
        m = m.float()
    return torch.nan_to_num(m, nan=float("inf"), posinf=float("inf"))


def _segment_bounds(offsets: Tensor, k: Tensor):
    return offsets.tolist(), k.tolist()


def topk_segment(mag: Tensor, k: int) -> Tensor:
    """Positions (sorted ascending) of the exact top-``k`` of one segment's
    magnitudes under the tie rule: all entries strictly above the k-th largest
    magnitude, then the lowest-indexed entries equal to it."""
    n = mag.numel()
    if k >= n:
        return torch.arange(n, device=mag.device)
    if k <= 0:
        return torch.empty(0, dtype=torch.long, device=mag.device)
    kth = torch.topk(mag, k, sorted=False).values.min()
    above = torch.nonzero(mag > kth).squeeze(1)
    ties = torch.nonzero(mag == kth).squeeze(1)[: k - above.numel()]
    return torch.sort(torch.cat([above, ties])).values


def select_topk(x: Tensor, offsets: Tensor, k: Tensor) -> Tuple[Tensor, Tensor]:
    """Exact per-segment top-k.  Returns ``(indices, values)``, indices global
    into ``x`` (int32 unless ``x`` exceeds int32), ascending; exactly
    ``min(k_s, n_s)`` entries per segment."""
    offs, ks = _segment_bounds(offsets, k)
    mag = magnitude(x)
    parts = []
    for s, ks_ in enumerate(ks):
        lo, hi = offs[s], offs[s + 1]
        parts.append(topk_segment(mag[lo:hi], ks_) + lo)
    idx = torch.cat(parts) if parts else torch.empty(0, dtype=torch.long, device=x.device)
    return idx.to(index_dtype(x.numel())), x[idx]


#: Threshold selection accepts a count within this factor of k; otherwise it
#: corrects the threshold (DGC-style adaptive threshold).
THRESHOLD_TOLERANCE = 0.10
THRESHOLD_SAMPLE = 4096
#: The sample is THRESHOLD_SAMPLE // THRESHOLD_RUN runs of this many contiguous
#: entries spread evenly over the segment: whole cache lines, a few dozen
#: memory accesses instead of thousands of isolated ones.
THRESHOLD_RUN = 128
#: The sample rank sits this many standard deviations (sqrt of the expected
#: rank) above the expected rank of the k-th magnitude, so the threshold falls
#: at or below it with ~98% probability: the selected set then holds the whole
#: exact top-k (recall 1) and a count past the tolerance is cut to exactly k.
THRESHOLD_BIAS = 2.0


def threshold_sample_positions(n: int, device=None) -> Tensor:
    """Positions the threshold estimate samples in a segment of ``n``
    entries: all of them up to THRESHOLD_SAMPLE, else runs of THRESHOLD_RUN
    contiguous entries starting at r * (n // runs), r < runs."""
    if n <= THRESHOLD_SAMPLE:
        return torch.arange(n, device=device)
    runs = THRESHOLD_SAMPLE // THRESHOLD_RUN
    starts = torch.arange(runs, device=device) * (n // runs)
    return (starts[:, None] + torch.arange(THRESHOLD_RUN, device=device)).reshape(-1)


def _threshold_segment(mag: Tensor, k: int) -> Tensor:
    n = mag.numel()
    if k >= n:
        return torch.arange(n, device=mag.device)
    # 1. Estimate the threshold from a deterministic sample (DGC samples
    #    0.1-1% of the entries; fixed positions keep ranks reproducible).
    sample = mag[threshold_sample_positions(n, mag.device)]
    m = sample.numel()
    q = k * m / n  # expected rank of the k-th magnitude in the sample
    ks = max(1, min(m, math.ceil(q + THRESHOLD_BIAS * math.sqrt(max(q, 0.0)))))
    t = torch.topk(sample, ks, sorted=False).values.min()
    sel = torch.nonzero(mag >= t).squeeze(1)
    lo, hi = (1 - THRESHOLD_TOLERANCE) * k, (1 + THRESHOLD_TOLERANCE) * k
    if lo <= sel.numel() <= hi:
        return sel
    # 2. Adaptive correction.  Too many: the exact threshold lies among the
    #    candidates, so a top-k over the (small) candidate set fixes it.  Too
    #    few: fall back to the exact k-th magnitude of the whole segment.
    if sel.numel() > hi:
        pos = topk_segment(mag[sel], k)
        return sel[pos]
    return topk_segment(mag, k)


def select_threshold(x: Tensor, offsets: Tensor, k: Tensor) -> Tuple[Tensor, Tensor]:
    """Sampled-threshold selection: per segment, every entry with magnitude at
    or above an estimated threshold; the count lands within ±10% of ``k_s``
    (exactly ``k_s`` after a correction).  Returns exactly what it selected;
    the caller keeps everything else in the residual."""
    offs, ks = _segment_bounds(offsets, k)
    mag = magnitude(x)
    parts = []
    for s, ks_ in enumerate(ks):
        lo, hi = offs[s], offs[s + 1]
        parts.append(_threshold_segment(mag[lo:hi], ks_) + lo)
    idx = torch.cat(parts) if parts else torch.empty(0, dtype=torch.long, device=x.device)
    return idx.to(index_dtype(x.numel())), x[idx]


def segment_of(idx: Tensor, offsets: Tensor) -> Tensor:
    """Segment id of each global index (on ``idx``'s device: the layout's
    ``offsets`` are built on the CPU)."""
    return torch.searchsorted(offsets.to(idx.device), idx.long(), right=True) - 1


def merge_select(idx_a: Tensor, val_a: Tensor, idx_b: Tensor, val_b: Tensor,
                 offsets: Tensor, k: Tensor):
    """Union of two sparse sets (values summed on equal indices) and the
    per-segment top-k of the union under the tie rule.

    Both partners of a butterfly round call this with the operands swapped;
    the result is bit-identical because IEEE addition of two operands is
    commutative and the selection order is total.

    Returns ``(idx, val, keep_a, keep_b)``: the merged set (ascending indices,
    ``idx_a``'s dtype) and, for every entry of each operand, whether its index
    is in the merged set (what exact error feedback needs).
    """
    dev = val_a.device
    ia, ib = idx_a.long(), idx_b.long()
    cat_idx = torch.cat([ia, ib])
    uniq, inv = torch.unique(cat_idx, sorted=True, return_inverse=True)
    vals = torch.zeros(uniq.numel(), dtype=val_a.dtype, device=dev)
    vals.index_add_(0, inv, torch.cat([val_a, val_b.to(val_a.dtype)]))
    keep = topk_mask_sparse(uniq, vals, offsets, k)
    keep_a = keep[inv[: ia.numel()]]
    keep_b = keep[inv[ia.numel():]]
    return uniq[keep].to(idx_a.dtype), vals[keep], keep_a, keep_b


def member_sorted(values: Tensor, ascending: Tensor) -> Tensor:
    """``torch.isin(values, ascending)`` for a strictly ascending second
    operand (every merged gTop-k set is): a binary search per value instead
    of isin's sort of both operands."""
    if ascending.numel() == 0:
        return torch.zeros(values.shape, dtype=torch.bool, device=values.device)
    pos = torch.searchsorted(ascending, values).clamp_(max=ascending.numel() - 1)
    return ascending[pos] == values


def topk_mask_sparse(idx: Tensor, vals: Tensor, offsets: Tensor, k: Tensor) -> Tensor:
    """Boolean mask over a sparse set (ascending unique ``idx``) keeping the
    per-segment top-k by (|value| desc, index asc)."""
    n = idx.numel()
    if n == 0:
        return torch.zeros(0, dtype=torch.bool, device=vals.device)
    seg = segment_of(idx, offsets)
    mag = magnitude(vals)
    # Stable sorts compose into the lexicographic order (segment, -|v|, index):
    # input is ascending in index; sort by magnitude desc, then by segment.
    o1 = torch.sort(mag, descending=True, stable=True).indices
    o2 = torch.sort(seg[o1], stable=True).indices
    perm = o1[o2]
    seg_sorted = seg[perm]
    counts = torch.bincount(seg_sorted, minlength=k.numel())
    starts = torch.cumsum(counts, 0) - counts
    rank_in_seg = torch.arange(n, device=vals.device) - starts[seg_sorted]
    keep_sorted = rank_in_seg < k.to(vals.device)[seg_sorted]
    keep = torch.zeros(n, dtype=torch.bool, device=vals.device)
    keep[perm[keep_sorted]] = True
    return keep


def scatter_update(numel: int, idx: Tensor, vals: Tensor, divisor: int, dtype: torch.dtype) -> Tensor:
    """Dense buffer of ``numel`` zeros with ``vals / divisor`` at ``idx``
    (a true division, as docs/design.md §2 states the average: value / P)."""
    out = torch.zeros(numel, dtype=dtype, device=vals.device)
    if idx.numel():
        v = vals.to(dtype)
        out[idx.long()] = v / divisor if divisor != 1 else v
    return out


def all_finite(t: Tensor) -> bool:
    """Whether every entry of ``t`` is finite, in one read: a finite sum
    (accumulated in at least float32, so float16 sums cannot overflow) has
    only finite terms; a non-finite sum -- a NaN/Inf or a float32 overflow --
    falls back to the exact elementwise test."""
    acc = torch.float64 if t.dtype == torch.float64 else torch.float32
    if bool(torch.isfinite(t.sum(dtype=acc))):
        return True
    return bool(torch.isfinite(t).all())


def compensate(out: Tensor, grad: Tensor, residual) -> bool:
    """Error-feedback compensation (docs/design.md §3): ``out = grad +
    residual`` (``out = grad`` when ``residual`` is None), ``grad`` first
    converted to ``out``'s dtype; returns whether every entry of ``out`` is
    finite -- the accumulator, not only the gradient, so a non-finite
    residual or a sum that overflowed is caught as well.  ``out`` is the
    caller's scratch accumulator, so a non-finite step changes no state.
    Fast back ends do the check and the sum in one pass."""
    g = grad.reshape(-1).to(out.dtype)
    if residual is None:
        out.copy_(g)
    else:
        torch.add(g, residual.to(out.device), out=out)
    return all_finite(out)


def compensate_select_topk(acc: Tensor, grads, residual, offsets: Tensor, k: Tensor):
    """:func:`compensate` of every gradient into its slice of ``acc`` (the
    gradients concatenated cover ``acc``; ``residual``: None or 1-D like
    ``acc``), then :func:`select_topk` of ``acc``.  Returns ``(idx, vals,
    finite)``, ``finite`` a bool tensor: per gradient, all entries finite.
    Fast back ends fuse the three into one pass over grad and residual."""
    finite, o = [], 0
    for g in grads:
        n = g.numel()
        finite.append(compensate(acc[o:o + n], g, None if residual is None else residual[o:o + n]))
        o += n
    if o != acc.numel():
        raise ValueError(f"compensate_select_topk: the gradients hold {o} entries, acc {acc.numel()}")
    idx, vals = select_topk(acc, offsets, k)
    return idx, vals, torch.tensor(finite, dtype=torch.bool)


def nonzero_indices(x: Tensor, limit: Optional[int] = None) -> Optional[Tensor]:
    """The positions of the entries of 1-D ``x`` whose bits are not all zero
    (every value but +0.0: -0.0, NaN and denormals count, also where
    denormals are treated as zero), ascending, int64: the inverse of
    :func:`scatter_update`.  ``None`` when there are more than ``limit``."""
    idx = torch.nonzero(_bits(x) != 0).reshape(-1)
    return None if limit is not None and idx.numel() > limit else idx


def div_count_(x: Tensor, divisor: int, out: Optional[Tensor] = None) -> int:
    """``out = x / divisor`` (a true division; a copy when 1), in place when
    ``out`` is None or ``x``, and the number of nonzero entries of the
    result: a dense result turned into the update, and its count for the
    stats."""
    if out is None or out is x:
        out = x.div_(divisor) if divisor != 1 else x
    elif divisor != 1:
        torch.div(x, divisor, out=out)
    else:
        out.copy_(x)
    return int(torch.count_nonzero(out))


def _bits(x: Tensor) -> Tensor:
    """``x`` viewed as signed integers of its width (its raw bits)."""
    return x.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()])


def _zero_bits(x: Tensor) -> Tensor:
    """Entries that are +-0 by their bits (a denormal is not zero, also where
    denormals are treated as zero in this thread)."""
    mask = (1 << (8 * x.element_size() - 1)) - 1
    return (_bits(x) & mask) == 0


def prescale_bounds(dtype, shift: int):
    """``(lo, hi)``: a nonzero entry is exactly prescalable by ``2**-shift``
    when ``lo <= |x| < hi``: ``lo = tiny * 2**(shift + p - 1)`` (``tiny``
    the smallest normal, ``p`` the significand's bits: the entry's last bit
    is worth at least ``tiny * 2**shift``, so no partial sum of such
    entries, scaled or not, is denormal) and ``hi = 2**(emax - shift)``
    (``2**emax`` the largest power of two: no partial sum of ``2**shift``
    of them overflows)."""
    fi = torch.finfo(dtype)
    p = 2 - math.frexp(fi.eps)[1]  # eps = 2**(1 - p) = 0.5 * 2**(2 - p)
    emax = math.frexp(fi.max)[1] - 1
    return math.ldexp(fi.tiny, shift + p - 1), math.ldexp(1.0, emax - shift)


def prescale_copy(out: Tensor, grad: Tensor, shift: int):
    """The dense step's one pass: ``out = grad * 2**-shift`` (a bit copy when
    ``shift`` is 0; ``out``'s dtype), returning ``(finite, exact, nnz)``:
    every entry of ``grad`` finite; every entry zero or within
    :func:`prescale_bounds` -- the condition under which a sum of
    ``2**shift`` such prescaled values, added in any order and grouping,
    equals the sum of the unscaled ones divided by ``2**shift`` bit for bit
    (also where denormals are flushed); and the number of nonzero entries of
    ``out``.  ``exact`` is True for ``shift`` 0."""
    if not 0 <= int(shift) <= 30:
        raise ValueError(f"prescale_copy: shift must be in [0, 30]; got {shift}")
    g = grad.reshape(-1).to(out.dtype)
    finite = bool(torch.isfinite(g).all())
    if shift == 0:
        out.copy_(g)
        exact = True
    else:
        lo, hi = prescale_bounds(out.dtype, shift)
        a = g.abs()
        exact = bool((_zero_bits(g) | ((a >= lo) & (a < hi))).all())
        torch.mul(g, 2.0 ** -shift, out=out)
    return finite, exact, int(torch.count_nonzero(out))


def subtract_at_(acc: Tensor, idx: Tensor, sent: Tensor, mask: Optional[Tensor] = None) -> Tensor:
    """In place ``acc[idx] -= sent`` (unique ``idx``; one subtraction in
    ``acc``'s dtype): the accumulator turned into the new residual, O(k).
    ``mask`` (bool, like ``idx``): only the entries where it is true (those
    of this worker's contribution that reached the result)."""
    if mask is not None:
        idx, sent = idx[mask], sent[mask]
    if idx.numel():
        i = idx.long()
        acc[i] = acc[i] - sent.to(acc.dtype)
    return acc


def scatter_reset_(out: Tensor, prev: Tensor, idx: Tensor, vals: Tensor, divisor: int) -> Tensor:
    """In place: ``out[prev] = 0``, then ``out[idx] = vals / divisor`` (the
    arithmetic of :func:`scatter_update`): a persistent update buffer reused
    by touching only the previous and the new result's entries."""
    if prev.numel():
        out[prev.long()] = 0
    if idx.numel():
        v = vals.to(out.dtype)
        out[idx.long()] = v / divisor if divisor != 1 else v
    return out
