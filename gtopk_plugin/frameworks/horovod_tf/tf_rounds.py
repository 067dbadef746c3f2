"""Rounds codecs on the Horovod-TensorFlow layer (issue #17): PowerSGD's
two allreduces per step (Vogels et al. 2019) and any codec of aggregation
``allreduce_rounds`` (``collectives/rounds.py``, docs/compressors.md).

The codec is a generator (``codec.rounds(acc, offsets, ctx, P)`` yields
each flat message, receives its sum over the workers, returns ``(result,
contribution)``).  Its rounds depend on run-time values (``start_iter``
against the agreed step), so the whole generator runs inside one stateful
``tf.numpy_function`` and each message is summed there on the gloo side
channel (:mod:`.side`) -- the same ``ProcessGroupGloo`` allreduce the
torch.distributed transport uses, so the sums have the PyTorch side's bits.
With ``exchange="horovod"`` (elastic jobs) there is no such channel and a
rounds codec raises a ``ValueError`` naming the fix.

Bytes: each message counted with the ring model, 2·(P−1)/P of its bytes
sent and received in 2·(P−1) messages, as ``RoundsAllReduce`` counts it.
The codec's warm-start state (PowerSGD's Q) lives in the torch compressor
object and, after every step, in the compression's ``compressor_state``
variable (:mod:`.codec_state`): checkpoints hold it and a restored job
resumes the warm start bit for bit.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
import torch.distributed as dist

from gtopk_plugin.compress.compressor import SelectionContext
from gtopk_plugin.frameworks.horovod_tf._guard import tf
from gtopk_plugin.frameworks.horovod_tf.codec_state import numpy_call
from gtopk_plugin.frameworks.horovod_tf.selection import _carrier, _numpy, _torch

__all__ = ["run_rounds"]


def run_rounds(ops, acc, offsets: Sequence[int], comp, shapes, *, step, names, seed: int, kernels=None,
               state=None):
    """Drive ``comp.rounds`` on the flat ``acc``: ``(result, contribution,
    allreduces)`` -- the dense sum over workers (not divided), what this
    worker's error feedback subtracts, and the number of messages summed
    (int64 scalar).  Adds the ring-model bytes to ``ops``.  ``state``: the
    compressor state to thread through (:func:`.codec_state.numpy_call`)."""
    P, side = ops.P, ops.side
    if P > 1 and side is None:
        raise ValueError(f"{comp.name if hasattr(comp, 'name') else type(comp).__name__}: a rounds codec "
                         "(aggregation 'allreduce_rounds', e.g. powersgd) runs on the TensorFlow layer's gloo "
                         "side channel; build the compression with exchange='gloo' (the default; elastic "
                         "states set 'horovod', which rounds codecs do not support)")
    bf16 = acc.dtype == tf.bfloat16
    offs_t = torch.tensor(list(offsets), dtype=torch.int64)
    shapes = None if shapes is None else [tuple(int(d) for d in s) for s in shapes]
    names = list(names)
    ring = 2 * (P - 1)

    def run(a, st):
        x = _torch(a, bf16).clone()  # the codec keeps views of acc; TF's buffer is read-only
        ctx = SelectionContext(step=int(st), segment_names=names, seed=seed, rank=ops.rank, kernels=kernels,
                               shapes=shapes)
        gen = comp.rounds(x, offs_t, ctx, P)
        n_msgs, ring_bytes = 0, 0
        try:
            msg = next(gen)
            while True:
                msg = msg.contiguous().clone()
                if P > 1:
                    side.allreduce_(msg, dist.ReduceOp.SUM)
                n_msgs += 1
                ring_bytes += ring * msg.numel() * msg.element_size() // P
                msg = gen.send(msg)
        except StopIteration as stop:
            result, contribution = stop.value
        return (_numpy(result.to(x.dtype).reshape(-1)), _numpy(contribution.to(x.dtype).reshape(-1)),
                np.asarray([n_msgs, ring_bytes], np.int64))

    carrier = _carrier(acc)
    result, contribution, counts = numpy_call(state, run, [carrier, tf.cast(step, tf.int64)],
                                              [carrier.dtype, carrier.dtype, tf.int64], stateful=True)
    if bf16:
        result, contribution = tf.bitcast(result, tf.bfloat16), tf.bitcast(contribution, tf.bfloat16)
    numel = int(offsets[-1])
    result, contribution = tf.ensure_shape(result, [numel]), tf.ensure_shape(contribution, [numel])
    counts = tf.ensure_shape(counts, [2])
    if P > 1:
        ops.add("payload_bytes_sent", counts[1])
        ops.add("payload_bytes_received", counts[1])
        ops.add("messages_sent", counts[0] * ring)
    return result, contribution, counts[0]
