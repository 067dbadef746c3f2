"""The gloo side channel of the Horovod-TensorFlow layer (issue #15): the
sparse step's exchanges as ``tf.numpy_function`` calls on a torch gloo
group of the process set's ranks made inside the job -- the TF twin of
``frameworks/horovod/side_channel.py`` -- instead of Horovod ops.

The group itself is :class:`..gloo_channel.GlooChannel`, shared with the
PyTorch layer; only the broadcast of the store's address is Horovod-TF's
(importing ``horovod.torch`` into a TensorFlow job rebinds the process sets'
shared back end, ``horovod.common.process_sets``, to the uninitialised
torch one, so ``process_set.size()`` fails afterwards).

Why: every Horovod op goes through Horovod's background loop -- a
negotiation among all ranks, then the data -- and on a loaded loopback job
that is tens of milliseconds per op, while a gloo send/recv of the same
bytes is a fraction of one.  A gTop-k step at P = 4 issues three Horovod ops
one after the other (the consistency check, two butterfly rounds), so its
fixed cost was several Horovod cycles against one for ``Compression.none``.
On the side channel the same bytes move in the same pattern (the byte
counts of :class:`.ops.Ops` do not change) and Horovod is used once, at the
first step, to tell the other ranks the store's port (one ``broadcast``).

Ordering: every call here is a *stateful* ``tf.numpy_function``, so inside
``tf.function`` TensorFlow's automatic control dependencies run them in
program order (the same on every rank: the sequence gloo pairs its messages
by) and never prune one whose output nobody reads.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from gtopk_plugin.frameworks.gloo_channel import GlooChannel, store_host
from gtopk_plugin.frameworks.horovod_tf._guard import hvd, tf

__all__ = ["TFSideChannel", "channel_for"]


class TFSideChannel(GlooChannel):
    """gloo send/recv/allgather/allreduce among the ranks of ``process_set``
    (:class:`..gloo_channel.GlooChannel`, shared with the PyTorch layer);
    the store's port reaches the other ranks by one Horovod-TF broadcast,
    run eagerly even while a ``tf.function`` is traced.  Collective to
    create: every rank of the set at the same point of its op sequence."""

    def __init__(self, process_set, name: str):
        def broadcast(words):
            with tf.init_scope():  # eager, also while tracing: every rank traces the step once
                return hvd.broadcast(tf.constant(np.asarray(words, np.int64)), root_rank=0,
                                     name=f"{name}.side_channel", process_set=process_set).numpy().tolist()

        super().__init__(process_set.rank(), process_set.size(), name,
                         store_host(hvd.local_size(), hvd.size()), broadcast)

    # -- TensorFlow ops (stateful numpy functions) ---------------------------
    def tf_allreduce(self, t, op: str):
        """Elementwise ``op`` ("max" or "sum") of ``t`` over the ranks."""
        red = {"max": dist.ReduceOp.MAX, "sum": dist.ReduceOp.SUM}[op]

        def run(a):
            x = torch.from_numpy(np.array(a))  # a private copy: gloo reduces in place
            return self.allreduce_(x, red).numpy()

        out = tf.numpy_function(run, [t], t.dtype, stateful=True)
        return tf.ensure_shape(out, t.shape)

    def tf_allgather(self, blob, static_size: bool):
        """Every rank's uint8 ``blob`` concatenated in rank order, and the
        sizes (int32, one per rank)."""
        def run(b):
            x = torch.from_numpy(b)
            outs = self.allgather(x, [x.numel()] * self.size if static_size else None)
            return (torch.cat(outs).numpy(),
                    np.asarray([o.numel() for o in outs], np.int32))

        out, sizes = tf.numpy_function(run, [blob], [tf.uint8, tf.int32], stateful=True)
        return tf.ensure_shape(out, [None]), tf.ensure_shape(sizes, [self.size])

    def tf_phase(self, send_to: Optional[int], blob, recv_from: Optional[int]):
        """One butterfly step: ``blob`` to ``send_to``, a blob (size sent
        first) from ``recv_from``; either may be None (empty result)."""
        def run(b):
            got = self.exchange(send_to, torch.from_numpy(b), recv_from)
            return np.zeros(0, np.uint8) if got is None else got.numpy()

        return tf.ensure_shape(tf.numpy_function(run, [blob], tf.uint8, stateful=True), [None])

    def tf_alltoall(self, t, splits):
        """``hvd.alltoall`` of ``t`` with ``splits`` (int32 per rank): pieces
        received concatenated in source-rank order.  Pairwise: step ``d``
        sends to ``r + d`` and receives from ``r - d`` (sizes first)."""
        def run(a, sp):
            x = torch.from_numpy(np.ascontiguousarray(a)).reshape(-1).view(torch.uint8)
            esz = a.dtype.itemsize
            b = np.concatenate([[0], np.cumsum(sp)]) * esz
            r, P = self.rank, self.size
            pieces = [None] * P
            pieces[r] = x[b[r]:b[r + 1]]
            for d in range(1, P):
                dst, src = (r + d) % P, (r - d) % P
                pieces[src] = self.exchange(dst, x[b[dst]:b[dst + 1]], src)
            return torch.cat(pieces).view(torch.from_numpy(a[:0]).dtype).numpy()

        out = tf.numpy_function(run, [t, splits], t.dtype, stateful=True)
        return tf.ensure_shape(out, [None])


def channel_for(holder, process_set, prefix: str) -> Optional[TFSideChannel]:
    """The side channel of ``holder`` (a compression) for ``process_set``,
    made at first use (collective: every rank reaches it at the same step),
    or None when the set has one rank."""
    if process_set.size() == 1:
        return None
    chans = holder.__dict__.setdefault("_side_channels", {})
    key = id(process_set)
    if key not in chans:
        chans[key] = TFSideChannel(process_set, f"{prefix}.side{len(chans) + 1}")
    return chans[key]
