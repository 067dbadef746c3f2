"""Collectives of the Horovod-TensorFlow layer (:mod:`.horovod_tf`), in
TensorFlow ops on ``horovod.tensorflow``: the named ops of one reduce call
with their byte accounting (:class:`_Ops`), the sparse allgather and the
gTop-k butterfly for any P (DESIGN.md §3; Shi et al. 2019), as the PyTorch
side's ``collectives/allgather.py`` and ``collectives/gtopk.py`` over
``HorovodTransport``.  They run eagerly and inside ``tf.function``; the
comments of :meth:`_Ops.phase` say what a traced graph needs so that no rank
waits forever for an op TensorFlow optimised away.
"""
from __future__ import annotations

from typing import Optional

import tensorflow as tf

import horovod.tensorflow as hvd

from .horovod_tf_kernels import _member_of, _pack, _pack_bits, _unpack, _unpack_bits, merge_select, round_to_wire

# Bytes of one step, as the PyTorch side's TrafficCounters (collectives/transport.py).
TRAFFIC_KEYS = ("payload_bytes_sent", "payload_bytes_received", "header_bytes_sent", "header_bytes_received",
                "control_bytes")


class _Ops:
    """Named Horovod-TF collectives of one reduce call.  Names are
    ``{prefix}.{kind}.{n}`` with ``n`` counting ops within the call, so the
    same op has the same name on every rank (Horovod pairs ops by name) and
    on every step."""

    def __init__(self, process_set, prefix):
        self.ps = process_set
        self.prefix = prefix
        self.n = 0
        self.P = process_set.size()
        self.rank = process_set.rank()
        self.zero = 0         # a run-time int32 zero once the consistency check ran
        self.threaded = False  # whether an unread collective output feeds self.zero
        # Bytes this rank moves, counted as the PyTorch side's Transport does
        # (collectives/transport.py: ring model for allgather and allreduce,
        # sizes exchanged first are headers), as int64 tensors.
        self.count = {k: tf.constant(0, tf.int64) for k in TRAFFIC_KEYS}

    def add(self, key, nbytes):
        self.count[key] = self.count[key] + tf.cast(nbytes, tf.int64)

    def traffic(self):
        return tf.stack([self.count[k] for k in TRAFFIC_KEYS])

    def _name(self, kind):
        self.n += 1
        return f"{self.prefix}.{kind}.{self.n}"

    def allgather(self, t, kind="allgather"):
        return hvd.allgather(t, name=self._name(kind), ignore_name_scope=True, process_set=self.ps)

    def allgather_blobs(self, blob, static_size: bool):
        """Every rank's uint8 blob, in rank order.  ``static_size``: every
        blob has this rank's size (else the sizes are gathered first).
        Counted as the ring allgather of the PyTorch transport: a rank sends
        every blob but its right neighbour's and receives every blob but its
        own."""
        P, r = self.P, self.rank
        own = tf.size(blob, out_type=tf.int64)
        if static_size:
            blobs = tf.split(self.allgather(blob), P)
            self.add("payload_bytes_sent", (P - 1) * own)
            self.add("payload_bytes_received", (P - 1) * own)
            return blobs
        sizes = self.allgather(tf.reshape(tf.size(blob), [1]), "sizes")
        self.add("header_bytes_sent", 4 * (P - 1))  # int32 sizes
        self.add("header_bytes_received", 4 * (P - 1))
        blobs = tf.split(self.allgather(blob), sizes, num=P)
        total = tf.reduce_sum(tf.cast(sizes, tf.int64))
        self.add("payload_bytes_sent", total - tf.cast(sizes[(r + 1) % P], tf.int64))
        self.add("payload_bytes_received", total - own)
        return blobs

    def alltoall(self, t, splits, kind):
        """``hvd.alltoall`` with ``splits`` (int32, one per rank): the
        received pieces concatenated in source-rank order.  Counted as
        point-to-point sends (the piece to oneself travels nowhere)."""
        out, _ = hvd.alltoall(t, splits=splits, name=self._name(kind), ignore_name_scope=True,
                              process_set=self.ps)
        esz = t.dtype.size
        own = tf.cast(splits[self.rank], tf.int64)
        self.add("payload_bytes_sent", (tf.cast(tf.reduce_sum(splits), tf.int64) - own) * esz)
        self.add("payload_bytes_received", (tf.size(out, out_type=tf.int64) - own) * esz)
        return out

    def allreduce(self, t, op, kind):
        out = hvd.allreduce(t, op=op, name=self._name(kind), ignore_name_scope=True, process_set=self.ps)
        nbytes = tf.size(t, out_type=tf.int64) * t.dtype.size  # run-time k with a warm-up
        if kind == "check":
            self.add("control_bytes", nbytes)
        else:  # the ring model
            ring = 2 * (self.P - 1) * nbytes // self.P
            self.add("payload_bytes_sent", ring)
            self.add("payload_bytes_received", ring)
        return out

    def phase(self, send_to: Optional[int], blob, recv_from: Optional[int]):
        """One butterfly step for every rank: an alltoall whose only
        non-zero split goes to ``send_to`` (idle ranks send nothing but
        still take part, as Horovod's collectives require).  ``blob``: this
        rank's current set, packed (only its type is used when idle)."""
        if send_to is None:
            # Nothing to send, but never a constant: Horovod's ops are not
            # marked stateful, so TF (shape inference while tracing, Grappler's
            # constant folding) would run an op whose inputs are all constants
            # ahead of time, on this rank alone, and wait there forever.  The
            # length comes from the consistency check: a run-time zero.
            blob = blob[:self.zero]
            splits = tf.zeros([self.P], tf.int32)
        else:
            splits = tf.one_hot(send_to, self.P, dtype=tf.int32) * tf.size(blob)
        out, _ = hvd.alltoall(blob, splits=splits, name=self._name("phase"), ignore_name_scope=True,
                              process_set=self.ps)
        if send_to is not None:
            self.add("payload_bytes_sent", tf.size(blob, out_type=tf.int64))
        if recv_from is not None:
            self.add("payload_bytes_received", tf.size(out, out_type=tf.int64))
        if recv_from is None:
            # Nobody reads this output, yet the op must run on this rank or its
            # peers wait forever.  In a traced graph an op is kept only if the
            # outputs depend on it, and through a data edge: Grappler's
            # dependency optimizer turns a non-stateful op (Horovod's are not
            # marked stateful) whose outputs only feed control dependencies into
            # a NoOp.  So the output feeds the run-time zero, which later idle
            # sends slice with (that also keeps two idle steps of one rank from
            # being merged as common subexpressions) and keep() threads into
            # the results.
            if not tf.executing_eagerly():
                self.zero = tf.minimum(self.zero, tf.size(out, out_type=tf.int32))
                self.threaded = True
            return None
        return out

    def keep(self, *tensors):
        """``tensors``, bit for bit, made to depend (by data) on every
        collective issued so far whose output nobody reads (see phase())."""
        if not self.threaded:
            return tensors
        # t[zero:] with a run-time zero: the whole tensor (TF forwards the
        # buffer), but Grappler cannot know it and must run what feeds zero.
        return tuple(tf.reshape(t[self.zero:], tf.shape(t)) for t in tensors)


def _allgather_sum(ops: _Ops, idx, vals, numel, sum_dtype, static_count):
    """Sparse allgather: every rank's (index, value) set, summed into a dense
    buffer in rank order (identical bits on every rank)."""
    P = ops.P
    blob = _pack(idx, vals)
    out = tf.zeros([numel], sum_dtype)
    blobs = [blob] if P == 1 else ops.allgather_blobs(blob, static_size=static_count)
    for b in blobs:  # rank order
        i, v, _ = _unpack(b, vals.dtype)
        out = tf.tensor_scatter_nd_add(out, i[:, None], tf.cast(v, sum_dtype))
    return out


class _Charges:
    """Wire roundings this rank owns (DESIGN.md §3, precision), as the
    PyTorch butterfly's ``_Charges``: a list of (global int32 indices,
    errors in the accumulation dtype), one entry per rounding (unique
    indices within one), kept only at indices that stay in the group's set
    through every later merge.  Applied to the residual one rounding after
    the other (``apply``), so the additions happen in the PyTorch side's
    order and no scatter adds to one index twice (deterministic on GPU)."""

    def __init__(self):
        self.parts = []

    def record(self, idx, err):
        nz = tf.not_equal(err, 0)  # most entries are exact already
        self.parts.append((tf.boolean_mask(idx, nz), tf.boolean_mask(err, nz)))

    def survive(self, cur_i):
        """Keep the charges whose index is still in the group's set ``cur_i``."""
        kept = []
        for i, v in self.parts:
            m = _member_of(i, cur_i)
            kept.append((tf.boolean_mask(i, m), tf.boolean_mask(v, m)))
        self.parts = kept

    def apply(self, residual):
        for i, v in self.parts:
            residual = tf.tensor_scatter_nd_add(residual, i[:, None], tf.cast(v, residual.dtype))
        return residual


def _butterfly(ops: _Ops, idx, vals, offsets_t, k_t, acc_dtype=None):
    """gTop-k butterfly for any P (DESIGN.md §3), as collectives.gtopk does:
    fold-in of ranks >= P', log2 P' exchange rounds, fold-out with a bitmask
    of the folded rank's surviving entries.  Returns ``(idx, vals, alive,
    charges)``: the global set (same bits on every rank, values in the wire
    dtype ``vals.dtype``), which of this rank's own entries reached it, and
    the :class:`_Charges` this rank owns (None with a full-width wire).

    ``acc_dtype`` (a wire narrower than the gradients: float32 at least):
    merges add, in ``acc_dtype``, exactly the wire values both partners
    exchanged, so the sums agree bit for bit and cannot overflow; a merged
    set is rounded (clamped, never ±inf) to the wire before each send --
    charged to the lowest rank of the group that holds it -- and once at the
    end, charged to rank 0.  Messages keep the wire dtype."""
    P, r = ops.P, ops.rank
    wdt = vals.dtype
    alive = tf.ones_like(idx, dtype=tf.bool)
    if P == 1:
        return idx, vals, alive, None
    charges = None if acc_dtype is None else _Charges()

    def merge(a_i, a_v, b_i, b_v):
        return merge_select(a_i, a_v, b_i, b_v if acc_dtype is None else tf.cast(b_v, acc_dtype), offsets_t, k_t)

    def to_wire_set(cur_i, cur_v, owner):
        """(values to send, the set's values from now on)."""
        if acc_dtype is None:
            return cur_v, cur_v
        w, err = round_to_wire(cur_v, wdt)
        if owner:
            charges.record(cur_i, err)
        return w, tf.cast(w, acc_dtype)

    Pp = 1 << (P.bit_length() - 1)
    n_extra = P - Pp
    own = idx
    cur_i, cur_v = idx, (vals if acc_dtype is None else tf.cast(vals, acc_dtype))
    folded_i = folded_alive = None
    if n_extra:  # fold-in: own wire values, nothing to round
        send_to = r - Pp if r >= Pp else None
        recv_from = r + Pp if r < n_extra else None
        blob = ops.phase(send_to, _pack(idx, vals), recv_from)
        if recv_from is not None:
            o_i, o_v, _ = _unpack(blob, wdt)
            cur_i, cur_v, keep_a, keep_b = merge(cur_i, cur_v, o_i, o_v)
            alive = alive & keep_a
            folded_i, folded_alive = o_i, keep_b
    for j in range(Pp.bit_length() - 1):
        peer = (r ^ (1 << j)) if r < Pp else None
        send = vals  # (idle: only the blob's type is used)
        if peer is not None:
            # the group of r before round j: the 2^j ranks < P' that agree
            # with r above bit j (+ folded partners); its lowest rank owns
            # the rounding
            send, cur_v = to_wire_set(cur_i, cur_v, owner=r % (1 << j) == 0)
        blob = ops.phase(peer, _pack(cur_i if peer is not None else idx, send), peer)
        if peer is None:
            continue
        o_i, o_v, _ = _unpack(blob, wdt)
        cur_i, cur_v, _, _ = merge(cur_i, cur_v, o_i, o_v)
        alive = alive & _member_of(own, cur_i)
        if folded_i is not None:
            folded_alive = folded_alive & _member_of(folded_i, cur_i)
        if charges is not None:
            charges.survive(cur_i)
    if r < Pp:  # the result, in the wire dtype everywhere: one last rounding, owned by rank 0
        cur_v, _ = to_wire_set(cur_i, cur_v, owner=r == 0)
    if n_extra:
        send_to = r + Pp if r < n_extra else None
        recv_from = r - Pp if r >= Pp else None
        out = _pack(cur_i, cur_v) if r < Pp else _pack(idx, vals)
        if send_to is not None:
            out = tf.concat([out, _pack_bits(folded_alive)], 0)
        blob = ops.phase(send_to, out, recv_from)
        if recv_from is not None:
            mask_bytes = (int(own.shape[0]) + 7) // 8 if own.shape[0] is not None else None
            if mask_bytes is None:
                mask_bytes = (tf.size(own) + 7) // 8
            res_i, res_v, bits = _unpack(blob, wdt, mask_bytes)
            return res_i, res_v, _unpack_bits(bits, tf.size(own)), charges
    return cur_i, cur_v, alive, charges


def _sharded_sum(ops: _Ops, vals, acc_dtype):
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
    nz = tf.cast(tf.where(tf.not_equal(err, 0))[:, 0], tf.int32)
    return out, (nz + b[r], tf.gather(err, nz))
