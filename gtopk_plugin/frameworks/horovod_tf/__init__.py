"""Horovod-TensorFlow layer: the compressors of the core for
``horovod.tensorflow`` users, as a drop-in ``DistributedGradientTape`` and a
Keras ``DistributedOptimizer`` whose ``compression=`` takes the same names as
the PyTorch side (none, fp16 and every registered compressor)::

    import horovod.tensorflow as hvd
    from gtopk_plugin.tensorflow import DistributedGradientTape, Compression

    hvd.init()
    compression = Compression.gtopk(0.01)          # once: it holds the residuals
    with tf.GradientTape() as tape:
        loss = loss_fn(model(x), y)
    tape = DistributedGradientTape(tape, compression=compression)
    grads = tape.gradient(loss, model.trainable_variables)

The layer is the framework-neutral core plus the tensor ops that must be
TensorFlow.  From the core: the settings and their validation
(``config.ReducerConfig``), segments, k and the density warm-up
(``layout``), the compressors themselves (the registry: selection and
encoding run the torch compressor objects -- and so the project's C++
kernels -- through ``tf.numpy_function``, see :mod:`.selection`; a
compressor registered from user code works here unchanged), the butterfly
schedule (``collectives/schedule.py``), the consistency fingerprint
(``consistency``) and the traffic record (``traffic.StepTraffic``).  In
TensorFlow ops, so that the step runs eagerly and inside ``tf.function``
(Keras ``fit`` included): the exchange on ``horovod.tensorflow``'s
``allgather`` / ``alltoall`` (the butterfly, one op per phase, every rank in
every phase) / ``allreduce``, the merge, the wire format, momentum
correction and clipping (:mod:`.kernels`, each bit-identical to its PyTorch
twin).  The tests feed identical gradients to this layer and to the
single-process oracle of the PyTorch side and compare bits.

Modules: :mod:`.compression` (``SparseCompression``: settings and state),
:mod:`.step` (one reduce step), :mod:`.selection` (the compressor bridge),
:mod:`.collectives` and :mod:`.ops` (aggregations, named Horovod ops and
their byte counts), :mod:`.side` (the gloo side channel), :mod:`.fused`
(selection and the core's aggregation in one call on the side channel),
:mod:`.rounds` (rounds codecs), :mod:`.small` (``dense_below``),
:mod:`.codec_state` (a compressor's own state in checkpoints),
:mod:`.kernels` (TF tensor ops), :mod:`.momentum` (Keras SGD binding of
DGC momentum correction), :mod:`.optimizer` (front ends), :mod:`.elastic`
(``SparseKerasState``).

With ``momentum_correction=True`` (or ``momentum=``) the compression runs
DGC's momentum correction with momentum factor masking and, with
``clip_norm=``, DGC's local clipping, as compress/momentum.py and the
reducer do.  With an fp16/bf16 wire, merged sums are added in float32 and
every later rounding is charged to one rank's residual (DESIGN.md §3).
Dense compression (``Compression.none``/``fp16`` or any Horovod
``Compressor``) returns Horovod's own tape/optimizer unchanged.

Residuals, velocities and the step counter are non-trainable ``tf.Variable``
objects held by the compression object (a ``tf.Module``): create it once,
not per step.  The Keras optimizer tracks it, so ``tf.train.Checkpoint(
model=..., optimizer=opt)`` and ``model.save_weights`` (TF format) save and
restore them with the model; with the tape, add it to the checkpoint
yourself (``tf.train.Checkpoint(model=model, gtopk=compression)``).

Only ``frameworks/`` imports TensorFlow (DESIGN.md §2); ``import
gtopk_plugin`` never does.  Importing this package is lazy: ``kernels`` and
``selection`` need TensorFlow only, the rest Horovod too.
"""
from __future__ import annotations

import importlib

__all__ = ["Compression", "SparseCompression", "DistributedGradientTape", "DistributedOptimizer",
           "SparseKerasState", "magnitude", "merge_select", "select_topk", "select_threshold"]

_WHERE = {"Compression": "tf_optimizer", "DistributedGradientTape": "tf_optimizer",
          "DistributedOptimizer": "tf_optimizer", "SparseCompression": "tf_compression",
          "SparseKerasState": "tf_elastic", "magnitude": "tf_kernels", "merge_select": "tf_kernels",
          "select_topk": "selection", "select_threshold": "selection"}


def __getattr__(name):
    if name in _WHERE:
        return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
