"""TensorFlow twins of the reference kernels (gtopk_plugin.kernels.reference)
used by the Horovod-TensorFlow layer (:mod:`gtopk_plugin.frameworks.horovod_tf`):
selection, the butterfly merge and the wire format, in TensorFlow ops only, so
they run eagerly and inside ``tf.function``.  Needs TensorFlow, not Horovod;
the tests compare every function here with the reference kernel bit for bit
(ties, NaN/Inf, fp16/bf16/fp64).
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import tensorflow as tf
import torch

from ..compress.base import seeded_generator
from ..kernels import reference as _ref

# ---------------------------------------------------------------------------
# Kernels in TensorFlow ops (twins of gtopk_plugin.kernels.reference; the
# tests compare them bit for bit on random data with ties and NaN/Inf).
# Indices are int32 global positions into the flat buffer, ascending.
# ---------------------------------------------------------------------------
def magnitude(v):
    """|v| as float32 (float64 stays float64), NaN mapped to +inf: the
    selection order of the reference kernels."""
    m = tf.abs(v)
    if m.dtype not in (tf.float32, tf.float64):
        m = tf.cast(m, tf.float32)
    return tf.where(tf.math.is_nan(m), tf.constant(np.inf, m.dtype), m)


def _topk_positions(mag, k):
    """Positions (ascending) of the top-``k`` of ``mag`` under the tie rule:
    ``tf.math.top_k`` returns equal values lower index first."""
    n = tf.size(mag)
    k = tf.minimum(tf.cast(k, tf.int32), n)
    pos = tf.math.top_k(mag, k=k, sorted=True).indices
    return tf.sort(pos)


def _static(ks) -> bool:
    """Counts known while tracing (Python ints) rather than a run-time int32
    tensor (a density warm-up inside ``tf.function``)."""
    return not isinstance(ks, (tf.Tensor, tf.Variable))


def select_topk(x, offsets: Sequence[int], ks):
    """Exact per-segment top-k of the flat ``x`` (segments ``offsets``,
    counts ``ks``: Python ints, or a run-time int32 tensor):
    ``(int32 indices ascending, values)``."""
    mag = magnitude(x)
    parts = []
    for s in range(len(offsets) - 1):
        lo, hi = int(offsets[s]), int(offsets[s + 1])
        if _static(ks) and ks[s] >= hi - lo:
            parts.append(tf.range(lo, hi, dtype=tf.int32))
        else:  # a run-time k >= n selects every position too (ascending)
            parts.append(_topk_positions(mag[lo:hi], ks[s]) + lo)
    idx = tf.concat(parts, 0)
    return idx, tf.gather(x, idx)


def _threshold_positions(mag, n: int, k):
    """Positions of one segment selected by the sampled threshold; the same
    steps, constants and branches as kernels.reference._threshold_segment.
    ``k``: a Python int, or a run-time int32 tensor (a warm-up inside
    ``tf.function``) for which the sample size and tolerance band are float64
    ops that round as the reference's Python floats do (k·m exact, one
    correctly rounded division, sqrt, ceil)."""
    static = _static(k)
    if static and k >= n:
        return tf.range(n, dtype=tf.int32)
    pos = _ref.threshold_sample_positions(n).numpy().astype(np.int32)
    m = int(pos.size)
    if static:
        q = k * m / n
        ks = max(1, min(m, math.ceil(q + _ref.THRESHOLD_BIAS * math.sqrt(max(q, 0.0)))))
        kf = k
    else:
        k64 = tf.cast(k, tf.int64)
        q = tf.cast(k64 * m, tf.float64) / tf.constant(float(n), tf.float64)
        ks = tf.math.ceil(q + _ref.THRESHOLD_BIAS * tf.sqrt(tf.maximum(q, 0.0)))
        ks = tf.cast(tf.clip_by_value(ks, 1.0, float(m)), tf.int32)
        kf = tf.cast(k64, tf.float64)
    lo, hi = (1 - _ref.THRESHOLD_TOLERANCE) * kf, (1 + _ref.THRESHOLD_TOLERANCE) * kf

    def sampled():
        t = tf.reduce_min(tf.math.top_k(tf.gather(mag, pos), k=ks, sorted=False).values)
        sel = tf.cast(tf.where(mag >= t)[:, 0], tf.int32)
        cnt = tf.cast(tf.size(sel), tf.float64)

        def too_many():  # the exact threshold lies among the candidates
            return tf.gather(sel, _topk_positions(tf.gather(mag, sel), k))

        def too_few():
            return _topk_positions(mag, k)

        return tf.cond((cnt >= lo) & (cnt <= hi), lambda: sel, lambda: tf.cond(cnt > hi, too_many, too_few))

    if static:
        return sampled()
    return tf.cond(k64 >= n, lambda: tf.range(n, dtype=tf.int32), sampled)


def select_threshold(x, offsets: Sequence[int], ks):
    """Sampled-threshold selection per segment (count within ±10% of k_s);
    ``ks`` as for :func:`select_topk`."""
    mag = magnitude(x)
    parts = []
    for s in range(len(offsets) - 1):
        lo, hi = int(offsets[s]), int(offsets[s + 1])
        parts.append(_threshold_positions(mag[lo:hi], hi - lo, ks[s]) + lo)
    idx = tf.concat(parts, 0)
    return idx, tf.gather(x, idx)


def _randomk_positions(step, offsets, ks, names, seed, ks_at=None):
    """Random-k's shared positions, drawn by torch from (seed, step, name):
    the PyTorch side's draws, bit for bit.  ``ks_at(step) -> counts`` when
    the counts are only known at run time (``ks`` is then a tensor)."""
    def draw(step_value):
        parts = []
        counts = ks if ks_at is None else ks_at(int(step_value))
        for s, (k, name) in enumerate(zip(counts, names)):
            n = offsets[s + 1] - offsets[s]
            g = seeded_generator(seed, int(step_value), name)
            parts.append(torch.sort(torch.randperm(n, generator=g)[: min(k, n)]).values + offsets[s])
        return torch.cat(parts).numpy().astype(np.int32)

    out = tf.numpy_function(draw, [step], tf.int32, stateful=False)
    if ks_at is not None:
        return tf.ensure_shape(out, [None])
    total = sum(min(k, offsets[s + 1] - offsets[s]) for s, k in enumerate(ks))
    return tf.ensure_shape(out, [total])


def _rtopk_picks(step, rs, ks, names, seed, rank, layout_at=None):
    """rTop-k's per-rank picks (positions into the concatenated top-r sets),
    drawn by torch from (seed, step, name, rank) as the PyTorch side does.
    ``layout_at(step) -> (rs, ks)`` when they are only known at run time."""
    def draw(step_value):
        picks, start = [], 0
        r_list, k_list = (rs, ks) if layout_at is None else layout_at(int(step_value))
        for r_s, k_s, name in zip(r_list, k_list, names):
            g = seeded_generator(seed, int(step_value), name, rank=rank)
            perm = torch.randperm(r_s, generator=g)[:min(k_s, r_s)]
            picks.append(torch.sort(perm).values + start)
            start += r_s
        return torch.cat(picks).numpy().astype(np.int32)

    out = tf.numpy_function(draw, [step], tf.int32, stateful=False)
    if layout_at is not None:
        return tf.ensure_shape(out, [None])
    total = sum(min(k, r) for k, r in zip(ks, rs))
    return tf.ensure_shape(out, [total])


def _segment_of(idx, offsets_t):
    """Segment id of each global index (``offsets_t``: int32 S+1 bounds)."""
    return tf.searchsorted(offsets_t[1:], idx, side="right", out_type=tf.int32)


def topk_mask_sparse(idx, vals, offsets_t, k_t):
    """Mask over a sparse set (ascending unique ``idx``) keeping the
    per-segment top-k by (|value| desc, index asc): two stable sorts compose
    the order (segment, -|v|, index), as in the reference kernel."""
    n = tf.size(idx)
    seg = _segment_of(idx, offsets_t)
    o1 = tf.argsort(magnitude(vals), direction="DESCENDING", stable=True)
    o2 = tf.argsort(tf.gather(seg, o1), stable=True)
    perm = tf.gather(o1, o2)
    seg_sorted = tf.gather(seg, perm)
    S = tf.size(k_t)
    counts = tf.math.bincount(seg_sorted, minlength=S, maxlength=S, dtype=tf.int32)
    starts = tf.cumsum(counts) - counts
    rank_in_seg = tf.range(n, dtype=tf.int32) - tf.gather(starts, seg_sorted)
    keep_sorted = tf.cast(rank_in_seg < tf.gather(k_t, seg_sorted), tf.int32)
    return tf.scatter_nd(perm[:, None], keep_sorted, [n]) > 0


def merge_select(idx_a, val_a, idx_b, val_b, offsets_t, k_t):
    """Union of two sparse sets (values summed on equal indices) and its
    per-segment top-k.  Returns ``(idx, val, keep_a, keep_b)`` as
    kernels.reference.merge_select; both butterfly partners get the same bits
    (a sum of two operands is commutative)."""
    na = tf.size(idx_a)
    cat_i = tf.concat([idx_a, idx_b], 0)
    cat_v = tf.concat([val_a, tf.cast(val_b, val_a.dtype)], 0)
    order = tf.argsort(cat_i, stable=True)
    uniq, inv_sorted = tf.unique(tf.gather(cat_i, order), out_idx=tf.int32)  # ascending
    vals = tf.math.unsorted_segment_sum(tf.gather(cat_v, order), inv_sorted, tf.size(uniq))
    keep = topk_mask_sparse(uniq, vals, offsets_t, k_t)
    inv = tf.scatter_nd(order[:, None], inv_sorted, [tf.size(cat_i)])
    keep_a = tf.gather(keep, inv[:na])
    keep_b = tf.gather(keep, inv[na:])
    return tf.boolean_mask(uniq, keep), tf.boolean_mask(vals, keep), keep_a, keep_b


def _member_of(values, ascending):
    """Whether each of ``values`` is in the strictly ascending ``ascending``
    (binary search; a -1 sentinel keeps the gather in range when empty)."""
    asc = tf.concat([ascending, tf.constant([-1], ascending.dtype)], 0)
    pos = tf.minimum(tf.searchsorted(ascending, values, side="left", out_type=tf.int32), tf.size(ascending))
    return tf.gather(asc, pos) == values


# -- wire format: [int32 indices | values] bytes, 8 bytes per fp32 entry ----
def _pack(idx, vals):
    return tf.concat([tf.reshape(tf.bitcast(idx, tf.uint8), [-1]),
                      tf.reshape(tf.bitcast(vals, tf.uint8), [-1])], 0)


def _unpack(blob, val_dtype, extra_bytes=0):
    vsz = val_dtype.size
    eb = 4 + vsz
    body = tf.size(blob) - extra_bytes
    n = body // eb
    idx = tf.bitcast(tf.reshape(blob[:n * 4], [-1, 4]), tf.int32)
    vals = tf.reshape(blob[n * 4:body], [-1, vsz])
    vals = tf.bitcast(vals, val_dtype) if vsz > 1 else tf.bitcast(tf.reshape(vals, [-1]), val_dtype)
    return idx, vals, blob[body:]


def _pack_bits(mask):
    n = tf.size(mask)
    pad = (8 - n % 8) % 8
    m = tf.concat([tf.cast(mask, tf.uint8), tf.zeros([pad], tf.uint8)], 0)
    w = tf.constant([1, 2, 4, 8, 16, 32, 64, 128], tf.uint8)
    return tf.reduce_sum(tf.reshape(m, [-1, 8]) * w, axis=1)


def _unpack_bits(bits, n):
    w = tf.constant([1, 2, 4, 8, 16, 32, 64, 128], tf.uint8)
    return tf.reshape(tf.bitwise.bitwise_and(bits[:, None], w) != 0, [-1])[:n]


# -- DGC momentum correction and local clipping (Lin et al. 2018) -----------
# Twins of compress/momentum.py's MomentumCorrection.accumulate and of the
# reducer's local clipping, op for op, so that fp32 results are the PyTorch
# side's bits.
def momentum_step(grads, velocities, momentum, nesterov: bool, dampening: float):
    """One step of DGC's momentum correction per flat tensor: returns
    ``(increments, new velocities)``.  ``u <- m·u + (1 - dampening)·g``
    (increment ``u``), or Nesterov ``u <- m·(u + g)`` (increment ``u + g``),
    as ``torch.optim.SGD`` / compress/momentum.py.  ``momentum``: a Python
    float or a scalar tensor (a Keras optimizer's variable), cast to the
    gradients' dtype as torch casts a Python scalar."""
    incs, new = [], []
    for g, u in zip(grads, velocities):
        m = tf.cast(momentum, g.dtype)
        if nesterov:
            un = (u + g) * m
            # Snapshot: Grappler's arithmetic optimizer would otherwise fold
            # (un + g) + residual into one AddN and add in another order
            incs.append(tf.raw_ops.Snapshot(input=un + g))
        else:
            un = u * m + (g if float(dampening) == 0.0 else g * tf.cast(1.0 - float(dampening), g.dtype))
            incs.append(un)
        new.append(un)
    return incs, new


def clip_factor(grads, clip_norm: float, world_size: int):
    """DGC local clipping: the factor (float64 scalar) that brings this
    worker's L2 norm over all ``grads`` down to ``clip_norm · P^-1/2``, else
    1.  As the reducer: per-tensor norms in float64, their squares summed in
    order, ``thr / (norm + 1e-6·thr)`` when ``norm > thr``.  The summation
    order inside a tensor is TensorFlow's, not torch's: the norms agree to
    double rounding (~1e-16 relative), which changes the fp32 factor only if
    it lies that close to a float32 rounding boundary."""
    thr = float(clip_norm) / math.sqrt(world_size)
    total = tf.constant(0.0, tf.float64)
    for g in grads:
        n = tf.sqrt(tf.reduce_sum(tf.square(tf.cast(g, tf.float64))))
        total = total + n * n
    norm = tf.sqrt(total)
    return tf.where(norm > thr, thr / (norm + 1e-6 * thr), tf.constant(1.0, tf.float64))


def to_wire(vals, wire_dtype):
    """``vals`` rounded to the wire dtype, never to ±inf: values beyond its
    finite range are clamped to it first (collectives/wire.py::to_wire; the
    sender's residual keeps the remainder, since it is acc less what was
    sent).  DESIGN.md §3: a value the wire cannot hold never reaches it as
    ±inf.  NaN stays NaN (the consistency check has raised or skipped)."""
    if vals.dtype == wire_dtype:
        return vals
    if wire_dtype.is_floating and wire_dtype.max < vals.dtype.max:
        big = tf.constant(wire_dtype.max, vals.dtype)
        vals = tf.clip_by_value(vals, -big, big)
    return tf.cast(vals, wire_dtype)


def round_to_wire(vals, wire_dtype):
    """``(w, err)``: ``w = to_wire(vals)`` (clamped, never ±inf) and
    ``err = vals − w`` in ``vals``' dtype: the rounding (and clamping) error
    that one rank's residual owns (collectives/wire.py::round_to_wire)."""
    w = to_wire(vals, wire_dtype)
    return w, vals - tf.cast(w, vals.dtype)


def accumulation_dtype(wire_dtype, sum_dtype):
    """Sums of wire values are taken in the gradients' dtype, at least
    float32, when the wire is narrower (collectives/wire.py); None when the
    wire carries the gradients' dtype itself."""
    if wire_dtype == sum_dtype:
        return None
    return tf.float64 if sum_dtype == tf.float64 else tf.float32
