"""``import gtopk_plugin.horovod``: the drop-in Horovod ``DistributedOptimizer``
with sparse ``compression=`` choices (the package
:mod:`gtopk_plugin.frameworks.horovod`: transport, compression, optimizer,
elastic).

Needs Horovod built against the installed torch; without it this import
raises an ``ImportError`` naming the install command
(``bash scripts/install_horovod.sh``).  ``import gtopk_plugin`` never needs it.
"""
from gtopk_plugin.frameworks.horovod import (  # noqa: F401
    Compression,
    DistributedOptimizer,
    HorovodDenseReduction,
    HorovodTransport,
    SparseCompression,
    SparseOptimizerStateHandler,
)

__all__ = ["DistributedOptimizer", "Compression", "SparseCompression", "HorovodTransport",
           "SparseOptimizerStateHandler", "HorovodDenseReduction"]
