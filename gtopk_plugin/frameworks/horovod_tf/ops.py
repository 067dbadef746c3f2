"""The named Horovod-TensorFlow collectives of one reduce call, with their
byte accounting (:class:`Ops`).

Bytes are counted as the PyTorch side's ``Transport`` counts them
(``collectives/transport.py``): the ring model for allgather and allreduce,
sizes exchanged first as headers, point-to-point phases as sent, the
consistency vector as control bytes -- into the fields of
:class:`gtopk_plugin.pipeline.traffic.StepTraffic` (``TRANSPORT_FIELDS``), so
``last_step_traffic`` has the PyTorch layers' format.  Horovod's own
metadata (the alltoall splits, its negotiation) is not included, as on the
PyTorch-Horovod side.

The comments of :meth:`Ops.phase` say what a traced graph needs so that no
rank waits forever for an op TensorFlow optimised away.
"""
from __future__ import annotations

from typing import Optional

from gtopk_plugin.pipeline.traffic import TRANSPORT_FIELDS
from gtopk_plugin.frameworks.horovod_tf._guard import hvd, tf

__all__ = ["Ops", "TRANSPORT_FIELDS"]

# what the gloo side channel reduces (bfloat16 has no numpy twin torch reads)
_GLOO_DTYPES = (tf.float16, tf.float32, tf.float64, tf.int32, tf.int64)


class Ops:
    """Named Horovod-TF collectives of one reduce call.  Names are
    ``{prefix}.{kind}.{n}`` with ``n`` counting ops within the call, so the
    same op has the same name on every rank (Horovod pairs ops by name) and
    on every step."""

    def __init__(self, process_set, prefix, side=None):
        self.ps = process_set
        self.side = side      # a .side.TFSideChannel: the exchanges go there, not to Horovod
        self.prefix = prefix
        self.n = 0
        self.P = process_set.size()
        self.rank = process_set.rank()
        self.zero = 0         # a run-time int32 zero once the consistency check ran
        self.threaded = False  # whether an unread collective output feeds self.zero
        # what this rank moves, as int64 tensors (run-time sizes)
        self.count = {k: tf.constant(0, tf.int64) for k in TRANSPORT_FIELDS}

    def add(self, key, n):
        self.count[key] = self.count[key] + tf.cast(n, tf.int64)

    def traffic(self):
        """The counters so far, in ``TRANSPORT_FIELDS`` order (int64 vector)."""
        return tf.stack([self.count[k] for k in TRANSPORT_FIELDS])

    def _name(self, kind):
        self.n += 1
        return f"{self.prefix}.{kind}.{self.n}"

    def allgather(self, t, kind="allgather"):
        if self.side is not None:  # as bytes, rank order; sizes travel inside the channel
            esz = t.dtype.size
            out, _ = self.side.tf_allgather(tf.reshape(tf.bitcast(t, tf.uint8), [-1]), static_size=False)
            out = tf.bitcast(tf.reshape(out, [-1, esz]), t.dtype) if esz > 1 else tf.bitcast(out, t.dtype)
            return tf.reshape(out, tf.concat([[-1], tf.shape(t)[1:]], 0))
        return hvd.allgather(t, name=self._name(kind), ignore_name_scope=True, process_set=self.ps)

    def allgather_blobs(self, blob, static_size: bool):
        """Every rank's uint8 blob, in rank order.  ``static_size``: every
        blob has this rank's size (else the sizes are gathered first).
        Counted as the ring allgather of the PyTorch transport: a rank sends
        every blob but its right neighbour's and receives every blob but its
        own, in P−1 messages."""
        P, r = self.P, self.rank
        own = tf.size(blob, out_type=tf.int64)
        self.add("messages_sent", P - 1)
        if static_size:
            blobs = tf.split(self.side.tf_allgather(blob, True)[0] if self.side is not None
                             else self.allgather(blob), P)
            self.add("payload_bytes_sent", (P - 1) * own)
            self.add("payload_bytes_received", (P - 1) * own)
            return blobs
        if self.side is not None:  # one call: the channel exchanges the sizes first
            gathered, sizes = self.side.tf_allgather(blob, False)
        else:
            sizes = self.allgather(tf.reshape(tf.size(blob), [1]), "sizes")
            gathered = self.allgather(blob)
        self.add("header_bytes_sent", 4 * (P - 1))  # int32 sizes
        self.add("header_bytes_received", 4 * (P - 1))
        blobs = tf.split(gathered, sizes, num=P)
        total = tf.reduce_sum(tf.cast(sizes, tf.int64))
        self.add("payload_bytes_sent", total - tf.cast(sizes[(r + 1) % P], tf.int64))
        self.add("payload_bytes_received", total - own)
        return blobs

    def alltoall(self, t, splits, kind):
        """``hvd.alltoall`` with ``splits`` (int32, one per rank): the
        received pieces concatenated in source-rank order.  Counted as
        point-to-point sends (the piece to oneself travels nowhere)."""
        if self.side is not None:
            out = self.side.tf_alltoall(t, splits)
        else:
            out, _ = hvd.alltoall(t, splits=splits, name=self._name(kind), ignore_name_scope=True,
                                  process_set=self.ps)
        esz = t.dtype.size
        own = tf.cast(splits[self.rank], tf.int64)
        self.add("payload_bytes_sent", (tf.cast(tf.reduce_sum(splits), tf.int64) - own) * esz)
        self.add("payload_bytes_received", (tf.size(out, out_type=tf.int64) - own) * esz)
        self.add("messages_sent", self.P - 1)
        return out

    def allreduce(self, t, op, kind):
        if self.side is not None and t.dtype in _GLOO_DTYPES and op in (hvd.Max, hvd.Sum):
            out = self.side.tf_allreduce(t, "max" if op == hvd.Max else "sum")
        else:  # bfloat16 (numpy has none), other ops: Horovod's own
            out = hvd.allreduce(t, op=op, name=self._name(kind), ignore_name_scope=True, process_set=self.ps)
        nbytes = tf.size(t, out_type=tf.int64) * t.dtype.size  # run-time k with a warm-up
        if kind == "check":
            self.add("control_bytes", nbytes)
        else:  # the ring model
            ring = 2 * (self.P - 1) * nbytes // self.P
            self.add("payload_bytes_sent", ring)
            self.add("payload_bytes_received", ring)
            self.add("messages_sent", 2 * (self.P - 1))
        return out

    def phase(self, send_to: Optional[int], blob, recv_from: Optional[int]):
        """One butterfly step for every rank: an alltoall whose only
        non-zero split goes to ``send_to`` (idle ranks send nothing but
        still take part, as Horovod's collectives require).  ``blob``: this
        rank's current set, packed (only its type is used when idle)."""
        if self.side is not None:  # gloo send/recv; stateful: never pruned, run in order
            out = self.side.tf_phase(send_to, blob, recv_from)
            if send_to is not None:
                self.add("payload_bytes_sent", tf.size(blob, out_type=tf.int64))
                self.add("messages_sent", 1)
            if recv_from is None:
                return None
            self.add("payload_bytes_received", tf.size(out, out_type=tf.int64))
            return out
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
            self.add("messages_sent", 1)
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
