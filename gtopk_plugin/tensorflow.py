"""``import gtopk_plugin.tensorflow``: the sparse methods for Horovod-TensorFlow
users -- a drop-in ``DistributedGradientTape`` and Keras ``DistributedOptimizer``
with Horovod's signatures and the PyTorch side's ``Compression`` names::

    tape = DistributedGradientTape(tape, compression=Compression.gtopk(0.01))

Needs TensorFlow 2.12-2.15 and Horovod built with TensorFlow support (else an
``ImportError`` names the install command); ``import gtopk_plugin`` never
imports TensorFlow.
"""
from gtopk_plugin.frameworks.horovod_tf.tf_compression import SparseCompression  # noqa: F401
from gtopk_plugin.frameworks.horovod_tf.tf_elastic import SparseKerasState  # noqa: F401
from gtopk_plugin.frameworks.horovod_tf.tf_optimizer import (  # noqa: F401
    Compression,
    DistributedGradientTape,
    DistributedOptimizer,
)

__all__ = ["DistributedGradientTape", "DistributedOptimizer", "Compression", "SparseCompression",
           "SparseKerasState"]
