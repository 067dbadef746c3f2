"""The tensor ops of the TensorFlow layer that stay TensorFlow (they run
inside ``tf.function``, before the exchange): DGC momentum correction and
local clipping (Lin et al. 2018), op for op the twins of
``compress/momentum.py`` and the reducer's clipping; the tests compare them
with the PyTorch side bit for bit.  Needs TensorFlow, not Horovod."""
from __future__ import annotations

import math

import tensorflow as tf

__all__ = ["momentum_step", "clip_factor"]


def momentum_step(grads, velocities, momentum, nesterov: bool, dampening: float):
    """One step of DGC's momentum correction per flat tensor: returns
    ``(increments, new velocities)``.  ``u <- m·u + (1 - dampening)·g``
    (increment ``u``), or Nesterov ``u <- m·(u + g)`` (increment ``u + g``),
    as ``torch.optim.SGD`` / compress/momentum.py.  ``momentum``: a Python
    float or a scalar tensor (a Keras optimizer's variable), cast to the
    gradients' dtype as torch casts a Python scalar."""
    incs, new = [], []
    for g, u in zip(grads, velocities):
        m = tf.cast(momentum, g.dtype)
        if nesterov:
            un = (u + g) * m
            # Snapshot: Grappler's arithmetic optimizer would otherwise fold
            # (un + g) + residual into one AddN and add in another order
            incs.append(tf.raw_ops.Snapshot(input=un + g))
        else:
            un = u * m + (g if float(dampening) == 0.0 else g * tf.cast(1.0 - float(dampening), g.dtype))
            incs.append(un)
        new.append(un)
    return incs, new


def clip_factor(grads, clip_norm: float, world_size: int):
    """DGC local clipping: the factor (float64 scalar) that brings this
    worker's L2 norm over all ``grads`` down to ``clip_norm · P^-1/2``, else
    1.  As the reducer: per-tensor norms in float64, their squares summed in
    order, ``thr / (norm + 1e-6·thr)`` when ``norm > thr``.  The summation
    order inside a tensor is TensorFlow's, not torch's: the norms agree to
    double rounding (~1e-16 relative), which changes the fp32 factor only if
    it lies that close to a float32 rounding boundary."""
    thr = float(clip_norm) / math.sqrt(world_size)
    total = tf.constant(0.0, tf.float64)
    for g in grads:
        n = tf.sqrt(tf.reduce_sum(tf.square(tf.cast(g, tf.float64))))
        total = total + n * n
    norm = tf.sqrt(total)
    return tf.where(norm > thr, thr / (norm + 1e-6 * thr), tf.constant(1.0, tf.float64))
