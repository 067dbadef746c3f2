"""The tensor ops of the Horovod-TensorFlow layer that must be TensorFlow
ops (they sit between Horovod's collectives inside ``tf.function``): the
butterfly merge, set membership, the wire format, DGC momentum correction,
local clipping and wire rounding -- TF twins of
``gtopk_plugin.kernels.reference.merge_select``, ``collectives/wire.py``,
``compress/momentum.py`` and the reducer's clipping, op for op.  Needs
TensorFlow, not Horovod; the tests compare every function here with its
PyTorch twin bit for bit (ties, NaN/Inf, fp16/bf16/fp64).

Selection is not here: it runs the registry's torch compressors (and so the
project's C++ kernels) through :mod:`.selection`.
"""
from __future__ import annotations

import math

import numpy as np
import tensorflow as tf

# Indices are int32 global positions into the flat buffer, ascending.
def magnitude(v):
    """|v| as float32 (float64 stays float64), NaN mapped to +inf: the
    selection order of the reference kernels."""
    m = tf.abs(v)
    if m.dtype not in (tf.float32, tf.float64):
        m = tf.cast(m, tf.float32)
    return tf.where(tf.math.is_nan(m), tf.constant(np.inf, m.dtype), m)


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


def member_of(values, ascending):
    """Whether each of ``values`` is in the strictly ascending ``ascending``
    (binary search; a -1 sentinel keeps the gather in range when empty)."""
    asc = tf.concat([ascending, tf.constant([-1], ascending.dtype)], 0)
    pos = tf.minimum(tf.searchsorted(ascending, values, side="left", out_type=tf.int32), tf.size(ascending))
    return tf.gather(asc, pos) == values


# -- wire format: [int32 indices | values] bytes, 8 bytes per fp32 entry ----
def pack(idx, vals):
    return tf.concat([tf.reshape(tf.bitcast(idx, tf.uint8), [-1]),
                      tf.reshape(tf.bitcast(vals, tf.uint8), [-1])], 0)


def unpack(blob, val_dtype, extra_bytes=0):
    vsz = val_dtype.size
    eb = 4 + vsz
    body = tf.size(blob) - extra_bytes
    n = body // eb
    idx = tf.bitcast(tf.reshape(blob[:n * 4], [-1, 4]), tf.int32)
    vals = tf.reshape(blob[n * 4:body], [-1, vsz])
    vals = tf.bitcast(vals, val_dtype) if vsz > 1 else tf.bitcast(tf.reshape(vals, [-1]), val_dtype)
    return idx, vals, blob[body:]


def pack_bits(mask):
    n = tf.size(mask)
    pad = (8 - n % 8) % 8
    m = tf.concat([tf.cast(mask, tf.uint8), tf.zeros([pad], tf.uint8)], 0)
    w = tf.constant([1, 2, 4, 8, 16, 32, 64, 128], tf.uint8)
    return tf.reduce_sum(tf.reshape(m, [-1, 8]) * w, axis=1)


def unpack_bits(bits, n):
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
