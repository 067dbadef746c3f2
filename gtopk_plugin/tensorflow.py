"""``import gtopk_plugin.tensorflow``: the sparse methods for Horovod-TensorFlow
users — a drop-in ``DistributedGradientTape`` and a Keras
``DistributedOptimizer`` with Horovod's signatures and the ``Compression``
names of the PyTorch side (see :mod:`gtopk_plugin.frameworks.horovod_tf`)::

    import horovod.tensorflow as hvd
    from gtopk_plugin.tensorflow import DistributedGradientTape, Compression
    tape = DistributedGradientTape(tape, compression=Compression.gtopk(0.01))

Needs TensorFlow 2.12-2.15 and Horovod built with TensorFlow support; without
them this import raises an ``ImportError`` naming the install command
(``GTOPK_HOROVOD_TF=1 bash scripts/install_horovod.sh``).  ``import
gtopk_plugin`` never imports TensorFlow.
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
