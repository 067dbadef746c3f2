"""Elastic Horovod-TensorFlow (``hvd.elastic.run``) with sparse compressions:
:class:`SparseKerasState`, Horovod's ``TensorFlowKerasState`` plus the
residuals, momentum-correction velocities and step counters of
gtopk_plugin's ``SparseCompression`` objects.

Horovod's state commits and restores the model and optimizer variables and,
on ``sync()`` (after a reset), broadcasts them from rank 0.  The residuals
and velocities are neither (a Keras optimizer's ``variables()`` does not
list them), and must not be broadcast: each residual is this worker's own
unsent gradient mass (DESIGN.md §3), so copying rank 0's to everyone would
apply it P times, and each velocity is this worker's own momentum of its
own gradients (DGC momentum correction), the source of its next residuals.
Semantics, as the PyTorch layer's ``SparseOptimizerStateHandler``:

- ``commit()``/``save()`` keeps a copy of every residual, velocity and step
  counter, and of a stateful compressor's own state (``compressor_state``);
- ``restore()`` (after a failure) puts them back; a residual or velocity
  created after the last commit goes back to zero (it had no committed mass);
- ``sync()`` broadcasts the model and optimizer (Horovod's), then rank 0's
  step counter, so random-k/rTop-k draws and warm-ups agree again; each
  worker keeps its own residuals and velocities (a worker that joins starts
  with none).
"""
from __future__ import annotations

from typing import Iterable, List

from horovod.tensorflow.elastic import TensorFlowKerasState

from gtopk_plugin.frameworks.horovod_tf._guard import hvd, tf
from gtopk_plugin.frameworks.horovod_tf.tf_compression import SparseCompression

__all__ = ["SparseKerasState"]


class SparseKerasState(TensorFlowKerasState):
    """``hvd.elastic.TensorFlowKerasState(model, optimizer, **kwargs)`` that also
    commits, restores and syncs gtopk_plugin's sparse compression state.

    Args:
        model, optimizer, backend, kwargs: as Horovod's ``TensorFlowKerasState``.
        compressions: the ``SparseCompression`` objects to include; a Keras
            ``DistributedOptimizer`` of gtopk_plugin brings its own
            (``optimizer.gtopk_compression``), so this is for
            ``DistributedGradientTape`` users.
    """

    def __init__(self, model, optimizer=None, backend=None, compressions: Iterable = (), **kwargs):
        comps: List[SparseCompression] = []
        opt = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        for c in [getattr(opt, "gtopk_compression", None), *compressions]:
            if c is None or any(c is d for d in comps):
                continue
            if not isinstance(c, SparseCompression):
                raise ValueError(f"compressions must be gtopk_plugin sparse compressions "
                                 f"(Compression.topk/gtopk/...(density)); got {c!r}")
            if c.wire_dtype == tf.int8:  # the int8 wire runs only on the gloo side channel (.fused)
                raise ValueError(f"{c!r}: SparseKerasState exchanges as Horovod ops (exchange='horovod'), "
                                 "which cannot carry value_dtype=tf.int8; pass value_dtype=tf.float16 or "
                                 "tf.bfloat16 for elastic jobs")
            c.exchange = "horovod"  # a lost peer must surface as Horovod's error (reset, not abort)
            comps.append(c)
        self._compressions = comps
        self._saved_sparse = [self._snapshot(c) for c in comps]
        super().__init__(model, optimizer=optimizer, backend=backend, **kwargs)

    @property
    def compressions(self) -> List[SparseCompression]:
        return list(self._compressions)

    @staticmethod
    def _snapshot(c: SparseCompression) -> dict:
        state = c.codec_state()  # a stateful compressor's own state (.codec_state)
        return {"step": tf.identity(c.step),
                "residuals": {k: tf.identity(v) for k, v in c.residuals.items()},
                "velocities": {k: tf.identity(v) for k, v in c.velocities.items()},
                "compressor": None if state is None else tf.identity(state[1])}

    def save(self):
        super().save()
        self._saved_sparse = [self._snapshot(c) for c in self._compressions]

    def restore(self):
        super().restore()
        for c, saved in zip(self._compressions, self._saved_sparse):
            c.step.assign(saved["step"])
            if saved["compressor"] is not None:
                c.compressor_state.assign(saved["compressor"])
            for kind in ("residuals", "velocities"):
                for k, v in getattr(c, kind).items():
                    v.assign(saved[kind][k] if k in saved[kind] else tf.zeros_like(v))

    def sync(self):
        super().sync()
        for i, c in enumerate(self._compressions):
            if hvd.size() > 1:
                c.step.assign(hvd.broadcast(c.step, root_rank=0, name=f"gtopk.elastic.step.{i}"))
        self._saved_sparse = [self._snapshot(c) for c in self._compressions]
