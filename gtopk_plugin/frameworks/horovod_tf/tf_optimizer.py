"""The Horovod-TensorFlow front ends: ``Compression`` (the names of the
PyTorch side, generated from the compressor registry), a drop-in
``DistributedGradientTape`` and a Keras ``DistributedOptimizer`` with
Horovod's signatures.  A dense compression returns Horovod's own
tape/optimizer unchanged; a sparse one replaces the ``_allreduce_grads``
function they call with :meth:`SparseCompression.reduce`.
"""
from __future__ import annotations

from gtopk_plugin.frameworks.compression_names import SPARSE_METHODS, CompressionNames
from gtopk_plugin.frameworks.horovod_tf._guard import HvdCompression as _HvdCompression
from gtopk_plugin.frameworks.horovod_tf._guard import HvdCompressor as _HvdCompressor
from gtopk_plugin.frameworks.horovod_tf._guard import hvd, hvd_keras
from gtopk_plugin.frameworks.horovod_tf.tf_compression import SparseCompression
from gtopk_plugin.frameworks.horovod_tf.tf_momentum import setup_correction

__all__ = ["Compression", "DistributedGradientTape", "DistributedOptimizer"]


class Compression(CompressionNames):
    """Gradient compression for :func:`DistributedGradientTape` and
    :func:`DistributedOptimizer`: the names of the PyTorch side.

    ``none`` and ``fp16`` are Horovod's own compressors (dense allreduce:
    Horovod's own tape/optimizer is returned).  Every other name is a
    compressor of the registry, a user-registered one included
    (``Compression.<name>(density, **kwargs)``; see
    ``frameworks/compression_names.py``): it takes the density (fraction of
    entries sent per tensor), its own hyper-parameters and the keywords of
    :class:`SparseCompression`.
    """

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
    """Replacement for the ``_allreduce_grads(grads, vars[, use_generic_names])``
    function that Horovod's tape and Keras optimizer call."""
    if gradient_predivide_factor != 1.0 and op != hvd.Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")

    def allreduce_grads(grads, vars=None, use_generic_names=False):  # noqa: A002 - Horovod's signature
        return compression.reduce(list(grads), process_set=process_set, op=op,
                                  gradient_predivide_factor=gradient_predivide_factor)

    return allreduce_grads


def DistributedGradientTape(gradtape, device_dense='', device_sparse='', compression=Compression.none,
                            sparse_as_dense=False, op=hvd.Average, gradient_predivide_factor=1.0,
                            num_groups=0, groups=None, process_set=hvd.global_process_set,
                            scale_local_gradients=True, momentum_correction=False, optimizer=None):
    """``horovod.tensorflow.DistributedGradientTape`` with the same signature,
    plus the sparse ``compression=`` choices.  With ``Compression.none`` /
    ``fp16`` (or any Horovod ``Compressor``) it is Horovod's own tape.  With
    a sparse compression, ``gradient()`` reduces all gradients of the call in
    one sparse exchange (``groups`` and ``sparse_as_dense`` do not apply:
    gradients are always reduced as dense tensors, together); local sources
    (``register_local_source``) and ``scale_local_gradients`` work as in
    Horovod.  Pass the same compression object every step: it holds the
    residuals (and velocities).

    ``momentum_correction=True, optimizer=opt`` (a Keras SGD with momentum):
    DGC momentum correction with factor masking in the compression, with
    ``opt``'s momentum and Nesterov flag; ``opt`` then applies the update
    without momentum (its ``update_step`` runs with momentum 0; weight decay
    stays with it; see ``momentum.bind_momentum``).  Or build ``opt`` without
    momentum and give the compression ``momentum=``.  ``optimizer=`` alone
    only checks that no momentum is applied twice.  With a dense compression
    ``momentum_correction`` changes nothing (the optimizer's momentum on the
    exact average is already the corrected one)."""
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
    signature, plus the sparse ``compression=`` choices.  With a sparse
    compression the optimizer tracks it (attribute ``gtopk_compression``),
    so its residuals, velocities and step counter checkpoint with the
    optimizer: ``tf.train.Checkpoint(model=model, optimizer=opt)`` or
    ``model.save_weights`` in TF format.

    ``momentum_correction=True`` (``optimizer`` a Keras SGD): DGC momentum
    correction with momentum factor masking, with the optimizer's momentum
    and Nesterov flag; the returned optimizer then applies the reduced
    update without momentum (its ``update_step`` runs with momentum 0, its
    config keeps the user's values) and keeps its (decoupled) weight decay.
    A compression built with ``momentum=`` next to an SGD with momentum is a
    ``ValueError`` (momentum applied twice)."""
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
        # backward_passes_per_step > 1: Horovod's local-aggregation helper
        # (eager or graph flavour) took its own reference to the reduction
        # function when it was built; it sums the passes locally and calls the
        # function once per exchange, so the sparse reduction sees the
        # aggregated gradient and its step counter counts exchanges.
        helper = getattr(opt, "_agg_helper", None)
        if helper is not None:
            for attr in ("allreduce_grads", "_allreduce_grads"):
                if hasattr(helper, attr):
                    setattr(helper, attr, reduce_fn)
        opt.gtopk_compression = compression
    setup_correction(compression, sparse, momentum_correction, opt, warn_uncorrected=True)
    return opt
