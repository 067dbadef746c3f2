"""DGC momentum correction with a Keras optimizer (Lin et al. 2018): how the
Horovod-TensorFlow front ends take a Keras SGD's momentum over
(``momentum_correction=True``) or refuse to apply momentum twice.

The correction itself is the core's ``MomentumCorrection``, run in the
exchange (:func:`.tf_step.exchange`); this module only binds it to the
optimizer.
"""
from __future__ import annotations

import warnings

from gtopk_plugin.compress.momentum import MomentumSpec
from gtopk_plugin.frameworks.horovod_tf._guard import tf

__all__ = ["keras_sgd_momentum", "bind_momentum", "setup_correction"]


def keras_sgd_momentum(optimizer):
    """``(momentum, nesterov, 0.0)`` of a Keras SGD, or None when its
    momentum is the Python number 0 (nothing to correct).  A tensor or
    variable momentum is used as it is, at run time."""
    m = optimizer.momentum
    if isinstance(m, (int, float)):
        if float(m) == 0.0:
            return None
        MomentumSpec(float(m), bool(optimizer.nesterov))  # [0, 1): ValueError (Keras allows 1)
        m = float(m)
    return m, bool(optimizer.nesterov), 0.0


def _keras_momentum_of(optimizer):
    """What momentum ``optimizer`` applies itself (for error messages), or None."""
    if getattr(optimizer, "_gtopk_momentum_taken", False):
        return None
    if isinstance(optimizer, tf.keras.optimizers.SGD):
        m = optimizer.momentum
    else:
        hyper = getattr(optimizer, "_hyper", None)  # legacy Keras optimizers
        if not (isinstance(hyper, dict) and "momentum" in hyper and getattr(optimizer, "_momentum", True)):
            return None
        m = hyper["momentum"]
    return None if isinstance(m, (int, float)) and float(m) == 0.0 else f"momentum={m!r}"


def bind_momentum(compression, optimizer) -> None:
    """``momentum_correction=True``: ``compression`` takes the Keras SGD's
    momentum and Nesterov flag over (read at every call) and the optimizer's
    ``update_step`` runs with momentum 0 from now on.

    Keras 2.15's ``SGD.update_step`` reads ``self.momentum`` and
    ``self.nesterov`` each time it runs or is traced; with momentum 0 it is
    ``w -= lr·g`` bit for bit.  So ``update_step`` is wrapped to see
    momentum 0 while it runs: ``optimizer.momentum`` and its config keep the
    user's values, and (decoupled) ``weight_decay`` stays with it.
    """
    if not isinstance(optimizer, tf.keras.optimizers.SGD):
        raise ValueError(
            f"momentum_correction=True needs a Keras SGD optimizer (tf.keras.optimizers.SGD with "
            f"momentum); got {type(optimizer).__name__}. Adam-style optimizers keep their own moments: use "
            "error feedback alone (momentum_correction=False). For a legacy or other optimizer, build it "
            "without momentum and pass the momentum to the compression instead "
            "(Compression.gtopk(0.01, momentum_correction=0.9))")
    if compression.config.momentum_correction is not None:
        raise ValueError("the compression has its own momentum (momentum_correction=<momentum>): pass "
                         "momentum_correction=True (the optimizer's) or the number, not both")
    keras_sgd_momentum(optimizer)  # validates
    compression._momentum_from = optimizer
    if getattr(optimizer, "_gtopk_momentum_taken", False):
        return
    inner = optimizer.update_step  # bound method (SGD's, or a subclass')

    def update_step(gradient, variable):
        saved = optimizer.momentum, optimizer.nesterov
        optimizer.momentum, optimizer.nesterov = 0.0, False  # the correction applied it
        try:
            return inner(gradient, variable)
        finally:
            optimizer.momentum, optimizer.nesterov = saved

    optimizer.update_step = update_step
    optimizer._gtopk_momentum_taken = True


def setup_correction(compression, sparse: bool, momentum_correction: bool, optimizer,
                      warn_uncorrected: bool = False) -> None:
    """Front ends: bind (momentum_correction) or refuse a double momentum."""
    if not sparse:  # dense: the optimizer's own momentum is already the corrected one
        return
    momentum_correction = momentum_correction or compression.momentum_correction
    if momentum_correction:
        if optimizer is None:
            raise ValueError("momentum_correction=True needs the Keras optimizer: "
                             "DistributedGradientTape(..., momentum_correction=True, optimizer=opt), or "
                             "pass the momentum to the compression (momentum_correction=0.9) and build "
                             "the optimizer without momentum")
        bind_momentum(compression, optimizer)
    elif optimizer is not None and compression.config.momentum_correction is not None:
        own = _keras_momentum_of(optimizer)
        if own is not None:
            raise ValueError(
                f"{compression!r} corrects momentum itself (momentum_correction="
                f"{compression.config.momentum_correction}), and the optimizer has {own}: it would apply momentum "
                "a second time. Build the optimizer without momentum, or pass momentum_correction=True instead "
                "of the compression's own momentum")
    elif warn_uncorrected and optimizer is not None and _keras_momentum_of(optimizer) is not None:
        warnings.warn(
            f"{compression!r} with an optimizer that has {_keras_momentum_of(optimizer)}: the optimizer applies "
            "its momentum to the sparse update, which usually trains worse than dense; pass "
            "momentum_correction=True (DGC momentum correction)", UserWarning, stacklevel=3)
