"""The front ends: ``Compression`` (the PyTorch side's names), a drop-in
``DistributedGradientTape`` and Keras ``DistributedOptimizer``.  A dense
compression returns Horovod's own; a sparse one replaces the
``_allreduce_grads`` function they call with ``SparseCompression.reduce``.
"""
from __future__ import annotations

from gtopk_plugin.frameworks.compression_names import SPARSE_METHODS, CompressionNames
from gtopk_plugin.frameworks.horovod_tf._guard import HvdCompression as _HvdCompression
from gtopk_plugin.frameworks.horovod_tf._guard import HvdCompressor as _HvdCompressor
from gtopk_plugin.frameworks.horovod_tf._guard import hvd, hvd_keras, tf
from gtopk_plugin.frameworks.horovod_tf.tf_compression import SparseCompression
from gtopk_plugin.frameworks.horovod_tf.tf_momentum import setup_correction

__all__ = ["Compression", "DistributedGradientTape", "DistributedOptimizer"]


class Compression(CompressionNames):
    """The compressions of :func:`DistributedGradientTape` and
    :func:`DistributedOptimizer`, named as on the PyTorch side: ``none`` and
    ``fp16`` are Horovod's own (dense allreduce); every other name is a
    registered compressor, ``Compression.<name>(density, **kwargs)``
    (keywords of :class:`SparseCompression`)."""

    none = _HvdCompression.none
    fp16 = _HvdCompression.fp16
    _sparse = SparseCompression
    _public_name = "gtopk_plugin.tensorflow.Compression"


def _check_compression(compression):
    if isinstance(compression, SparseCompression):
        return True
    is_dense = (isinstance(compression, type) and issubclass(compression, _HvdCompressor)) or \
        isinstance(compression, _HvdCompressor)
    if not is_dense:
        hint = (f" (did you mean Compression.{compression}(density)?)"
                if isinstance(compression, str) and compression in SPARSE_METHODS else "")
        raise ValueError(
            f"unknown compression {compression!r}{hint}: pass Compression.none, Compression.fp16, "
            f"Compression.<method>(density) for a registered method ({', '.join(SPARSE_METHODS)}), or a "
            "Horovod Compressor")
    return False


def _sparse_reduce_fn(compression: SparseCompression, process_set, op, gradient_predivide_factor):
    """The ``_allreduce_grads`` that Horovod's tape and optimizer call."""
    if gradient_predivide_factor != 1.0 and op != hvd.Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")

    # AutoGraph would otherwise convert the whole reduce path at the first
    # traced step (about 25 s per process); it is graph-safe Python already
    # (tf.cond / executing_eagerly, no tensor-dependent Python branches).
    @tf.autograph.experimental.do_not_convert
    def allreduce_grads(grads, vars=None, use_generic_names=False):  # noqa: A002 - Horovod's signature
        return compression.reduce(list(grads), process_set=process_set, op=op,
                                  gradient_predivide_factor=gradient_predivide_factor)

    return allreduce_grads


def DistributedGradientTape(gradtape, device_dense='', device_sparse='', compression=Compression.none,
                            sparse_as_dense=False, op=hvd.Average, gradient_predivide_factor=1.0,
                            num_groups=0, groups=None, process_set=hvd.global_process_set,
                            scale_local_gradients=True, momentum_correction=False, optimizer=None):
    """``horovod.tensorflow.DistributedGradientTape`` with the same
    signature, plus the sparse ``compression=`` choices (with a dense one it
    is Horovod's own tape).  A sparse compression reduces all gradients of
    the call in one exchange (``groups``/``sparse_as_dense`` do not apply);
    pass the same compression object every step.
    ``momentum_correction=True, optimizer=opt`` (a Keras SGD): DGC momentum
    correction with ``opt``'s momentum, which ``opt`` then no longer applies
    (:func:`.tf_momentum.bind_momentum`); ``optimizer=`` alone checks that no
    momentum is applied twice."""
    sparse = _check_compression(compression)
    setup_correction(compression, sparse, momentum_correction, optimizer)
    tape = hvd.DistributedGradientTape(
        gradtape, device_dense=device_dense, device_sparse=device_sparse,
        compression=_HvdCompression.none if sparse else compression, sparse_as_dense=sparse_as_dense,
        op=op, gradient_predivide_factor=gradient_predivide_factor, num_groups=num_groups, groups=groups,
        process_set=process_set, scale_local_gradients=scale_local_gradients)
    if sparse:
        tape._allreduce_grads = _sparse_reduce_fn(compression, process_set, op, gradient_predivide_factor)
        tape.gtopk_compression = compression
    return tape


def DistributedOptimizer(optimizer, name=None, device_dense='', device_sparse='',
                         compression=Compression.none, sparse_as_dense=False, gradient_predivide_factor=1.0,
                         op=hvd.Average, backward_passes_per_step=1, average_aggregated_gradients=False,
                         num_groups=0, groups=None, process_set=hvd.global_process_set,
                         scale_local_gradients=True, momentum_correction=False):
    """``horovod.tensorflow.keras.DistributedOptimizer`` with the same
    signature, plus the sparse ``compression=`` choices.  The optimizer
    tracks a sparse compression (``gtopk_compression``), so checkpoints of
    the optimizer hold its state.  ``momentum_correction=True`` (a Keras
    SGD): DGC momentum correction with the optimizer's momentum, which the
    optimizer then no longer applies; a compression with its own momentum
    (``momentum_correction=0.9``) next to an SGD with momentum is a ``ValueError``."""
    sparse = _check_compression(compression)
    opt = hvd_keras.DistributedOptimizer(
        optimizer, name=name, device_dense=device_dense, device_sparse=device_sparse,
        compression=_HvdCompression.none if sparse else compression, sparse_as_dense=sparse_as_dense,
        gradient_predivide_factor=gradient_predivide_factor, op=op,
        backward_passes_per_step=backward_passes_per_step,
        average_aggregated_gradients=average_aggregated_gradients, num_groups=num_groups, groups=groups,
        process_set=process_set, scale_local_gradients=scale_local_gradients)
    if sparse:
        reduce_fn = _sparse_reduce_fn(compression, process_set, op, gradient_predivide_factor)
        opt._allreduce_grads = reduce_fn
        # backward_passes_per_step > 1: Horovod's local-aggregation helper keeps
        # its own reference to the reduction function (called once per exchange)
        helper = getattr(opt, "_agg_helper", None)
        if helper is not None:
            for attr in ("allreduce_grads", "_allreduce_grads"):
                if hasattr(helper, attr):
                    setattr(helper, attr, reduce_fn)
        opt.gtopk_compression = compression
    setup_correction(compression, sparse, momentum_correction, opt, warn_uncorrected=True)
    return opt
