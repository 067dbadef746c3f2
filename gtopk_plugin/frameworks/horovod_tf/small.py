"""Small tensors go dense on the Horovod-TensorFlow layer (issue #17):
``Compression.<method>(..., dense_below=N)``, the TF twin of
``gtopk_plugin/small_tensors.py`` (``GradientReducer(dense_below=N)``).

Tensors with fewer than ``N`` entries (biases, norm scales: little
traffic, much per-tensor overhead, a large relative error when compressed)
are summed exactly in the same step, the others reduced by the method as on
a call without them.  Per step, the same on every rank:

- small tensors: the update is the allreduced sum (``hvd.Sum``) or that sum
  divided by P (``hvd.Average``), as ``method="dense"`` gives it, in their
  own dtype (never a narrower wire); no residual (everything is sent), so
  they hold no error-feedback state; DGC momentum correction runs on them
  as on a dense method (their velocity is the plain momentum buffer: no
  factor masking), and local clipping takes its norm over both parts;
- the other tensors: exactly what the method gives without the small ones
  (with ``granularity="global"`` the small tensors leave the global
  segment: k counts the large ones only);
- one consistency check for the whole step (shapes of both parts and the
  threshold in the fingerprint, non-finite values of both in the flag), so
  a NaN anywhere raises / skips the whole step on every rank.  The PyTorch
  reducer's dense part runs a second, redundant check (32 control bytes);
  this layer does not send it, so its ``control_bytes`` are the PyTorch
  side's less ``last_stats.parts["dense"].control_bytes``;
- bytes: the method's, plus the ring allreduce of the small part
  (2·(P−1)/P of its bytes each way, 2·(P−1) messages), exactly; ``numel``,
  ``k``, ``sent_entries``, ``rounds`` and ``dense_bytes`` add the small
  part's as ``small_tensors.SmallTensors`` adds them.

The sum runs on the gloo side channel (``exchange="gloo"``: the same
``ProcessGroupGloo`` allreduce as the torch.distributed transport, so the
same bits as ``GradientReducer(dense_below=N)``) or as a Horovod allreduce
(``exchange="horovod"``).
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

from gtopk_plugin.pipeline.traffic import StepTraffic
from gtopk_plugin.frameworks.horovod_tf._guard import hvd, tf

__all__ = ["split", "dense_sum", "dense_bytes"]


def split(sizes: Sequence[int], threshold: int) -> Tuple[List[int], List[int]]:
    """``(large, small)``: positions of the tensors the method reduces and of
    those below ``threshold`` entries (0: off, every tensor is large)."""
    small = [j for j, n in enumerate(sizes) if threshold > 0 and n < threshold]
    return [j for j in range(len(sizes)) if j not in small], small


def dense_sum(ops, flat, average: bool):
    """The exact update of the small tensors' flat buffer: the sum over the
    ranks, divided by P with ``average`` (the divisor carries the check's
    run-time zero, as the method's does: Grappler would otherwise turn the
    division by a constant into a multiplication, other bits for P = 3)."""
    total = flat if ops.P == 1 else ops.allreduce(flat, hvd.Sum, "dense")
    if not average:
        return total
    return total / tf.cast(ops.P + ops.zero, flat.dtype)


def dense_bytes(P: int, parts) -> int:
    """``dense_bytes`` of the step: the ring model of each part, summed, as
    the PyTorch reducer sums its two parts' statistics.  ``parts``: (numel,
    dtype size) per part."""
    return sum(StepTraffic.ring_allreduce(P, 0, n * esz).dense_bytes for n, esz in parts)
