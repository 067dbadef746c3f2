"""Horovod-TensorFlow layer (public entry point: :mod:`gtopk_plugin.tensorflow`).

The framework-neutral core plus the tensor ops that must be TensorFlow:
settings, segments and k, DGC clipping and momentum correction, error
feedback, the compressors, the aggregations with their schedules and wire
format, and the traffic record come from the core; each step's exchange
runs the core's torch code in one ``tf.numpy_function``
(:func:`.tf_step.exchange`) over a gloo side channel or Horovod's ops
(:mod:`.tf_transport`).  TensorFlow ops: the check, flattening and the
update (:mod:`.tf_step`).  State: ``tf.Variable`` objects of the compression
(:mod:`.tf_compression`); front ends: :mod:`.tf_optimizer`,
:mod:`.tf_momentum`, :mod:`.tf_elastic`.  The public names are
:mod:`gtopk_plugin.tensorflow`'s; importing this package imports nothing.
"""
