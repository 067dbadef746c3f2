"""``import gtopk_plugin.horovod``: the drop-in Horovod ``DistributedOptimizer``
with sparse ``compression=`` choices (see :mod:`gtopk_plugin.frameworks.horovod`).

Needs Horovod built against the installed torch; without it this import
raises an ``ImportError`` naming the install command
(``bash scripts/install_horovod.sh``).  ``import gtopk_plugin`` never needs it.
"""
from .frameworks.horovod import (  # noqa: F401
    Compression,
    DistributedOptimizer,
    HorovodTransport,
    SparseCompression,
    SparseOptimizerStateHandler,
)

__all__ = ["DistributedOptimizer", "Compression", "SparseCompression", "HorovodTransport",
           "SparseOptimizerStateHandler"]
