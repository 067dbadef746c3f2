"""Aggregations of the Horovod-TensorFlow layer, in TensorFlow ops on
``horovod.tensorflow``: the sparse allgather, the gTop-k butterfly for any
P (Shi et al. 2019; DESIGN.md §3), random-k's value allreduce and the codec
payload allgather -- the TF counterparts of ``collectives/allgather.py``,
``gtopk.py``, ``dense.py`` and ``payloads.py``, keyed by the same
aggregation names the registry's compressors declare (:data:`AGGREGATIONS`).

What is shared with the PyTorch side rather than re-derived: the butterfly's
schedule and rounding ownership (``collectives/schedule.py``), the wire
format and byte model (``collectives/wire.py``, counted by :class:`.ops.Ops`)
and, for codecs, the payload packing and decoding (:mod:`.selection`).  What
stays TensorFlow: the tensor ops between Horovod's collectives, so that the
exchange runs inside ``tf.function``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional

from gtopk_plugin.collectives.schedule import butterfly_schedule, message_rounds
from gtopk_plugin.frameworks.horovod_tf import selection
from gtopk_plugin.frameworks.horovod_tf._guard import hvd, tf
from gtopk_plugin.frameworks.horovod_tf.tf_kernels import member_of, merge_select, pack, pack_bits, round_to_wire, unpack, unpack_bits
from gtopk_plugin.frameworks.horovod_tf.ops import Ops

__all__ = ["Contribution", "Result", "AGGREGATIONS", "aggregate"]


@dataclass
class Contribution:
    """This rank's part of one reduce call (the TF ``collectives.Selection``):
    ``idx``/``vals`` (wire dtype) of a selector, or ``blob``/``mine``/``spec``
    of a codec."""

    numel: int
    dtype: "tf.DType"              # the gradients' (flat) dtype: sums are taken in it
    acc_dtype: Optional["tf.DType"]  # a narrower wire's accumulation dtype, else None
    idx: Optional["tf.Tensor"] = None
    vals: Optional["tf.Tensor"] = None
    offsets_t: Optional["tf.Tensor"] = None
    k_t: Optional["tf.Tensor"] = None
    static_count: bool = True
    comp: object = None            # the compressor (codecs decode with it)
    blob: Optional["tf.Tensor"] = None
    mine: Optional["tf.Tensor"] = None
    spec: object = None


@dataclass
class Result:
    """The global result: ``vals`` at ``idx`` (``idx is None``: dense, length
    numel), in ``dtype``, summed (not divided); ``alive``: which of this
    rank's entries reached it (None: all); ``residual_fix``: the wire
    roundings this rank owns, a function residual -> residual (or None)."""

    idx: Optional["tf.Tensor"]
    vals: "tf.Tensor"
    alive: Optional["tf.Tensor"] = None
    residual_fix: Optional[Callable] = None
    rounds: int = 0                # message rounds, as the PyTorch aggregation reports them


def _allgather(ops: Ops, c: Contribution) -> Result:
    """Sparse allgather: every rank's (index, value) set, summed into a dense
    buffer in the gradients' dtype, in rank order (identical bits on every
    rank; nothing re-rounded)."""
    blob = pack(c.idx, c.vals)
    out = tf.zeros([c.numel], c.dtype)
    blobs = [blob] if ops.P == 1 else ops.allgather_blobs(blob, static_size=c.static_count)
    for b in blobs:  # rank order
        i, v, _ = unpack(b, c.vals.dtype)
        out = tf.tensor_scatter_nd_add(out, i[:, None], tf.cast(v, c.dtype))
    return Result(None, out, rounds=ops.P - 1)


class _Charges:
    """Wire roundings this rank owns (DESIGN.md §3, precision), as the
    PyTorch butterfly's ``_Charges``: a list of (global int32 indices,
    errors in the accumulation dtype), one entry per rounding (unique
    indices within one), kept only at indices that stay in the group's set
    through every later merge.  Applied to the residual one rounding after
    the other, so the additions happen in the PyTorch side's order and no
    scatter adds to one index twice (deterministic on GPU)."""

    def __init__(self):
        self.parts = []

    def record(self, idx, err):
        nz = tf.not_equal(err, 0)  # most entries are exact already
        self.parts.append((tf.boolean_mask(idx, nz), tf.boolean_mask(err, nz)))

    def survive(self, cur_i):
        """Keep the charges whose index is still in the group's set ``cur_i``."""
        kept = []
        for i, v in self.parts:
            m = member_of(i, cur_i)
            kept.append((tf.boolean_mask(i, m), tf.boolean_mask(v, m)))
        self.parts = kept

    def __call__(self, residual):
        for i, v in self.parts:
            residual = tf.tensor_scatter_nd_add(residual, i[:, None], tf.cast(v, residual.dtype))
        return residual


def _butterfly(ops: Ops, c: Contribution) -> Result:
    """gTop-k butterfly for any P, on the schedule of
    ``collectives/schedule.py`` (the PyTorch butterfly's): fold-in of ranks
    >= P', log2 P' exchange rounds, fold-out with a bitmask of the folded
    rank's surviving entries.  The result (values in the wire dtype) has the
    same bits on every rank.

    A wire narrower than the gradients (``c.acc_dtype``): merges add, in the
    accumulation dtype, exactly the wire values both partners exchanged, so
    the sums agree bit for bit and cannot overflow; a merged set is rounded
    (clamped, never ±inf) to the wire before each send and once at the end,
    charged to the rank the schedule names.  Messages keep the wire dtype."""
    idx, vals, adt = c.idx, c.vals, c.acc_dtype
    wdt = vals.dtype
    alive = tf.ones_like(idx, dtype=tf.bool)
    if ops.P == 1:
        return Result(idx, tf.cast(vals, c.dtype), alive)
    sched = butterfly_schedule(ops.P, ops.rank)
    charges = None if adt is None else _Charges()

    def merge(a_i, a_v, b_i, b_v):
        return merge_select(a_i, a_v, b_i, b_v if adt is None else tf.cast(b_v, adt), c.offsets_t, c.k_t)

    def to_wire_set(cur_i, cur_v, owner):
        """(values to send, the set's values from now on)."""
        if adt is None:
            return cur_v, cur_v
        w, err = round_to_wire(cur_v, wdt)
        if owner:
            charges.record(cur_i, err)
        return w, tf.cast(w, adt)

    own = idx
    cur_i, cur_v = idx, (vals if adt is None else tf.cast(vals, adt))
    folded_i = folded_alive = None
    if sched.fold_in is not None:  # own wire values, nothing to round
        ph = sched.fold_in
        blob = ops.phase(ph.send_to, pack(idx, vals), ph.recv_from)
        if ph.recv_from is not None:
            o_i, o_v, _ = unpack(blob, wdt)
            cur_i, cur_v, keep_a, keep_b = merge(cur_i, cur_v, o_i, o_v)
            alive = alive & keep_a
            folded_i, folded_alive = o_i, keep_b
    for rnd in sched.rounds:
        send = vals  # (idle: only the blob's type is used)
        if rnd.peer is not None:
            send, cur_v = to_wire_set(cur_i, cur_v, owner=rnd.owns_rounding)
        blob = ops.phase(rnd.peer, pack(cur_i if rnd.peer is not None else idx, send), rnd.peer)
        if rnd.peer is None:
            continue
        o_i, o_v, _ = unpack(blob, wdt)
        cur_i, cur_v, _, _ = merge(cur_i, cur_v, o_i, o_v)
        alive = alive & member_of(own, cur_i)
        if folded_i is not None:
            folded_alive = folded_alive & member_of(folded_i, cur_i)
        if charges is not None:
            charges.survive(cur_i)
    if sched.in_core:  # the result, in the wire dtype everywhere: one last rounding
        cur_v, _ = to_wire_set(cur_i, cur_v, owner=sched.owns_final_rounding)
    if sched.fold_out is not None:
        ph = sched.fold_out
        out = pack(cur_i, cur_v) if sched.in_core else pack(idx, vals)
        if ph.send_to is not None:
            out = tf.concat([out, pack_bits(folded_alive)], 0)
        blob = ops.phase(ph.send_to, out, ph.recv_from)
        if ph.recv_from is not None:
            mask_bytes = (int(own.shape[0]) + 7) // 8 if own.shape[0] is not None else (tf.size(own) + 7) // 8
            res_i, res_v, bits = unpack(blob, wdt, mask_bytes)
            return Result(res_i, tf.cast(res_v, c.dtype), unpack_bits(bits, tf.size(own)), charges,
                          message_rounds(ops.P))
    return Result(cur_i, tf.cast(cur_v, c.dtype), alive, charges, message_rounds(ops.P))


def _sharded_sum(ops: Ops, vals, acc_dtype):
    """Sum of every rank's wire-dtype ``vals`` (same positions everywhere;
    random-k's values), accumulated in ``acc_dtype`` and rounded once to the
    wire, as collectives.dense.sharded_sum: rank q owns the shard
    ``[n·q//P, n·(q+1)//P)``, gets every rank's piece of it (one alltoall,
    pieces in rank order), adds them in rank order, rounds (clamped, never
    ±inf), and the rounded shards are allgathered.  Returns ``(sum in the
    wire dtype, (positions, errors))``: this rank's rounding errors, to be
    charged to its residual (every entry reaches the result).  ``n`` may be
    a run-time count (a warm-up inside ``tf.function``)."""
    P, r = ops.P, ops.rank
    n = tf.size(vals, out_type=tf.int64)
    b = tf.cast(n * tf.range(P + 1, dtype=tf.int64) // P, tf.int32)
    splits = b[1:] - b[:-1]
    wdt = vals.dtype
    # as bit patterns: Horovod's alltoall/allgather take no bfloat16
    carrier = {2: tf.int16, 4: tf.int32, 8: tf.int64}[wdt.size]
    got = tf.bitcast(ops.alltoall(tf.bitcast(vals, carrier), splits, "shard"), wdt)
    pieces = tf.split(got, tf.fill([P], splits[r]), num=P)
    acc = tf.zeros([splits[r]], acc_dtype)
    for q in range(P):  # rank order: the owner's bits are the result's bits
        acc = acc + tf.cast(pieces[q], acc_dtype)
    mine, err = round_to_wire(acc, wdt)
    out = tf.bitcast(ops.allgather(tf.bitcast(mine, carrier), "shards"), wdt)
    esz = vals.dtype.size  # the ring model of the allgather (sizes known to all: no headers)
    ops.add("payload_bytes_sent", (n - tf.cast(splits[(r + 1) % P], tf.int64)) * esz)
    ops.add("payload_bytes_received", (n - tf.cast(splits[r], tf.int64)) * esz)
    ops.add("messages_sent", P - 1)
    nz = tf.cast(tf.where(tf.not_equal(err, 0))[:, 0], tf.int32)
    return out, (nz + b[r], tf.gather(err, nz))


def _allreduce_values(ops: Ops, c: Contribution) -> Result:
    """Values at indices every rank shares (random-k): summed by Horovod's
    allreduce, or -- a narrower wire -- by :func:`_sharded_sum`, whose
    roundings this rank owns."""
    fix = None
    if ops.P == 1:
        summed = c.vals
    elif c.acc_dtype is None:
        summed = ops.allreduce(c.vals, hvd.Sum, "values")
    else:
        summed, (pos, err) = _sharded_sum(ops, c.vals, c.acc_dtype)
        where = tf.gather(c.idx, pos)

        def fix(residual):
            return tf.tensor_scatter_nd_add(residual, where[:, None], tf.cast(err, residual.dtype))
    return Result(c.idx, tf.cast(summed, c.dtype), None, fix, 0 if ops.P == 1 else 2 * (ops.P - 1))


def _allgather_payloads(ops: Ops, c: Contribution) -> Result:
    """Codecs: every rank's payload bytes (sizes fixed by the layout: no
    headers), decoded and summed in rank order (:func:`.selection.decode_sum`)."""
    blobs = [c.blob] if ops.P == 1 else ops.allgather_blobs(c.blob, static_size=True)
    out = selection.decode_sum(blobs, c.mine, ops.rank, c.comp, c.spec, c.dtype)
    return Result(None, out, rounds=ops.P - 1)


# aggregation name (as compressors declare it) -> TF implementation
AGGREGATIONS: Dict[str, Callable[[Ops, Contribution], Result]] = {
    "allgather": _allgather,
    "gtopk": _butterfly,
    "allreduce_values": _allreduce_values,
    "allgather_payloads": _allgather_payloads,
}


def aggregate(name: str, ops: Ops, c: Contribution) -> Result:
    try:
        fn = AGGREGATIONS[name]
    except KeyError:
        raise ValueError(f"the TensorFlow layer has no aggregation {name!r} (it has "
                         f"{', '.join(AGGREGATIONS)}); 'dense' is Compression.none") from None
    return fn(ops, c)
