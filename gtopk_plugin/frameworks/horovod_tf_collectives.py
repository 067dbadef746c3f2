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

from .horovod_tf_kernels import _member_of, _pack, _pack_bits, _unpack, _unpack_bits, merge_select

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


def _butterfly(ops: _Ops, idx, vals, offsets_t, k_t):
    """gTop-k butterfly for any P (DESIGN.md §3), as collectives.gtopk does:
    fold-in of ranks >= P', log2 P' exchange rounds, fold-out with a bitmask
    of the folded rank's surviving entries.  Returns ``(idx, vals, alive)``:
    the global set (same bits on every rank) and which of this rank's own
    entries reached it."""
    P, r = ops.P, ops.rank
    alive = tf.ones_like(idx, dtype=tf.bool)
    if P == 1:
        return idx, vals, alive
    Pp = 1 << (P.bit_length() - 1)
    n_extra = P - Pp
    own = idx
    cur_i, cur_v = idx, vals
    folded_i = folded_alive = None
    if n_extra:
        send_to = r - Pp if r >= Pp else None
        recv_from = r + Pp if r < n_extra else None
        blob = ops.phase(send_to, _pack(cur_i, cur_v), recv_from)
        if recv_from is not None:
            o_i, o_v, _ = _unpack(blob, vals.dtype)
            cur_i, cur_v, keep_a, keep_b = merge_select(cur_i, cur_v, o_i, o_v, offsets_t, k_t)
            alive = alive & keep_a
            folded_i, folded_alive = o_i, keep_b
    for j in range(Pp.bit_length() - 1):
        peer = (r ^ (1 << j)) if r < Pp else None
        blob = ops.phase(peer, _pack(cur_i, cur_v), peer)
        if peer is None:
            continue
        o_i, o_v, _ = _unpack(blob, vals.dtype)
        cur_i, cur_v, _, _ = merge_select(cur_i, cur_v, o_i, o_v, offsets_t, k_t)
        alive = alive & _member_of(own, cur_i)
        if folded_i is not None:
            folded_alive = folded_alive & _member_of(folded_i, cur_i)
    if n_extra:
        send_to = r + Pp if r < n_extra else None
        recv_from = r - Pp if r >= Pp else None
        out = _pack(cur_i, cur_v)
        if send_to is not None:
            out = tf.concat([out, _pack_bits(folded_alive)], 0)
        blob = ops.phase(send_to, out, recv_from)
        if recv_from is not None:
            mask_bytes = (int(own.shape[0]) + 7) // 8 if own.shape[0] is not None else None
            if mask_bytes is None:
                mask_bytes = (tf.size(own) + 7) // 8
            res_i, res_v, bits = _unpack(blob, vals.dtype, mask_bytes)
            return res_i, res_v, _unpack_bits(bits, tf.size(own))
    return cur_i, cur_v, alive
