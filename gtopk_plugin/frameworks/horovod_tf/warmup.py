"""A codec's dense warm-up on the Horovod-TensorFlow layer (issue #17):
``Compression.onebit(start_iter=s)``, ``.qsgd(start_iter=s)`` or any payload
codec declaring ``start_iter`` (``compress/base.py``, ``START_ITER``).

Steps ``0 .. s − 1`` are the dense method's step instead of the codec's,
as ``GradientReducer`` runs them (``reducer.py``, ``warm =``; torch's
``powerSGD_hook`` before ``start_powerSGD_iter``, 1-bit Adam's warm-up,
Tang et al. 2021 §4): per step, the same on every rank,

- update: the sum of the accumulators over the ranks (``hvd.Sum``: on the
  gloo side channel the same ``ProcessGroupGloo`` allreduce as the
  torch.distributed transport, so the PyTorch side's bits), divided by P
  for ``hvd.Average`` as the rest of the step divides;
- residual: zero (everything was sent exactly: ``acc − acc``);
- no momentum factor masking (a codec never masks: no entry "reached");
- traffic: a dense step's -- the ring allreduce of the accumulator
  (2·(P−1)/P of its bytes each way, 2·(P−1) messages), ``sent_entries`` N,
  ``rounds`` 2·(P−1) (0 for P = 1).

From step ``s`` on the codec runs as before.  PowerSGD (a rounds codec)
takes its warm-up inside its own generator (:mod:`.rounds`), not here.

Eagerly the step is a Python decision on the agreed step counter.  In a
traced graph (one graph serves every step) it is a ``tf.cond`` on it; only
built when ``start_iter > 0``, so the default graph is unchanged.  The
byte counters of :class:`.ops.Ops` are Python-side tensors: each branch
starts from the same pre-branch counters, and after the cond they are
rebuilt from its traffic output, so whatever the step counts afterwards
(the small tensors' part, ``ops.traffic()``) adds to valid tensors.
"""
from __future__ import annotations

from gtopk_plugin.frameworks.horovod_tf.ops import TRANSPORT_FIELDS
from gtopk_plugin.frameworks.horovod_tf._guard import tf
from gtopk_plugin.frameworks.horovod_tf.small import dense_sum

__all__ = ["dense_step", "unless_warm"]


def dense_step(ops, acc, average: bool):
    """The warm-up step on the flat accumulator, in ``_sparse``'s result
    format: ``(update, residual, traffic, reached, sent, rounds)``."""
    P, N = ops.P, int(acc.shape[0])
    update = dense_sum(ops, acc, average)
    return ops.keep(update, tf.zeros_like(acc)) + (
        ops.traffic(), tf.zeros([0], tf.int32), tf.constant(N, tf.int64),
        tf.constant(0 if P == 1 else 2 * (P - 1), tf.int64))


def unless_warm(ops, comp, step, warm, codec):
    """``warm()`` at a dense warm-up step of ``comp`` (before its
    ``start_iter``), else ``codec()``; both return ``_sparse``'s 6-tuple.
    ``step``: the agreed step counter (int64 tensor)."""
    start = int(getattr(comp, "start_iter", 0) or 0)
    if start <= 0:
        return codec()
    if tf.executing_eagerly():
        return warm() if comp.dense_at(int(step)) else codec()
    before = (dict(ops.count), ops.zero, ops.threaded, ops.n)
    names_used = []

    def branch(fn):
        def run():
            # every branch counts (and names its ops) from the same start
            ops.count, ops.zero, ops.threaded, ops.n = dict(before[0]), before[1], before[2], before[3]
            out = fn()
            names_used.append(ops.n)
            return out
        return run

    out = tf.cond(tf.less(step, tf.constant(start, step.dtype)), branch(warm), branch(codec))
    # the counters as the taken branch left them, valid outside the cond; a
    # branch's unread collectives are already threaded into its outputs
    ops.count = dict(zip(TRANSPORT_FIELDS, tf.unstack(out[2])))
    ops.zero, ops.threaded = before[1], before[2]
    ops.n = max(names_used)  # Horovod op names stay unique whichever branch ran
    return tuple(out)
