"""Horovod-TensorFlow layer: the compressors of the core for
``horovod.tensorflow`` users, as a drop-in ``DistributedGradientTape`` and
Keras ``DistributedOptimizer`` (public entry point:
:mod:`gtopk_plugin.tensorflow`; usage in docs/).

The layer is the framework-neutral core plus the tensor ops that must be
TensorFlow: settings (``config.ReducerConfig``), segments and k, the
compressors (the registry), the aggregations with their schedules and wire
format (``collectives/``) and the traffic record all come from the core;
the exchange runs the core's aggregation inside one ``tf.numpy_function``
per step (:func:`.tf_step.exchange`) on a gloo side channel or on Horovod's ops
(:mod:`.tf_transport`).  TensorFlow ops: the check, DGC clipping and
momentum correction (:mod:`.tf_kernels`), error feedback and the update
(:mod:`.tf_step`).  State lives in ``tf.Variable`` objects of the
compression (:mod:`.tf_compression`), so checkpoints hold it; front ends:
:mod:`.tf_optimizer`, :mod:`.tf_momentum` (Keras SGD binding),
:mod:`.tf_elastic` (``SparseKerasState``).  Only ``frameworks/`` imports
TensorFlow; this package imports it lazily.
"""
from __future__ import annotations

import importlib

__all__ = ["Compression", "SparseCompression", "DistributedGradientTape", "DistributedOptimizer",
           "SparseKerasState", "select_topk", "select_threshold"]

_WHERE = {"Compression": "tf_optimizer", "DistributedGradientTape": "tf_optimizer",
          "DistributedOptimizer": "tf_optimizer", "SparseCompression": "tf_compression",
          "SparseKerasState": "tf_elastic", "select_topk": "tf_bridge", "select_threshold": "tf_bridge"}


def __getattr__(name):
    if name in _WHERE:
        return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
