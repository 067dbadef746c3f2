"""Elastic Horovod-TensorFlow (``hvd.elastic.run``): :class:`SparseKerasState`,
Horovod's ``TensorFlowKerasState`` plus the sparse compressions' state, as
the PyTorch layer's ``SparseOptimizerStateHandler``.  Residuals and
velocities are each worker's own (docs/design.md §3): never broadcast,
``commit()`` copies and ``restore()`` puts back every residual, velocity,
step counter and compressor state (one created after the commit goes back
to zero); ``sync()`` broadcasts the model, optimizer and rank 0's step.
"""
from __future__ import annotations

from typing import Iterable, List

from horovod.tensorflow.elastic import TensorFlowKerasState

from gtopk_plugin.frameworks.horovod_tf._guard import hvd, tf
from gtopk_plugin.frameworks.horovod_tf.tf_compression import SparseCompression

__all__ = ["SparseKerasState"]


class SparseKerasState(TensorFlowKerasState):
    """Horovod's ``TensorFlowKerasState`` plus the sparse compressions' state:
    ``compressions`` (``DistributedGradientTape`` users; a
    ``DistributedOptimizer`` of this package brings its own)."""

    def __init__(self, model, optimizer=None, backend=None, compressions: Iterable = (), **kwargs):
        comps: List[SparseCompression] = []
        opt = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        for c in [getattr(opt, "gtopk_compression", None), *compressions]:
            if c is None or any(c is d for d in comps):
                continue
            if not isinstance(c, SparseCompression):
                raise ValueError(f"compressions must be gtopk_plugin sparse compressions "
                                 f"(Compression.topk/gtopk/...(density)); got {c!r}")
            if c.wire_dtype == tf.int8:  # int8 runs on the gloo side channel only
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
        state = c.codec_state()
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
