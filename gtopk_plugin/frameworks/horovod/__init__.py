"""The PyTorch Horovod layer (``gtopk_plugin.horovod`` re-exports it): a
:class:`~gtopk_plugin.collectives.transport.Transport` on Horovod's
collectives and a drop-in ``DistributedOptimizer`` whose ``compression=``
picks Horovod's dense allreduce or a sparse method of the core.

Cut as Horovod cuts ``horovod/torch/``, one concern per module:

=================  ==========================================================
``transport``      :class:`HorovodTransport` (butterfly steps as ``alltoall``)
``compression``    :class:`SparseCompression`, :class:`Compression`
``optimizer``      :func:`DistributedOptimizer` and the shared optimizer body
``sparse``         the sparse step (buckets reduced by ``GradientReducer``)
``dense``          the dense step Horovod cannot do (bfloat16), ring traffic
``elastic``        ``hvd.elastic`` state handler, elastic scheduler back end
=================  ==========================================================

Framework-neutral pieces live in the core: naming and bucketing in
:mod:`gtopk_plugin.pipeline.param_buckets`, the traffic record in :mod:`gtopk_plugin.pipeline.traffic`.
Imports go one way (``elastic`` → ``optimizer`` → ``sparse``/``dense`` →
``compression``/``transport``); no module imports this package's namespace.

This package (with :mod:`..elastic_horovod`) is the only place that imports
Horovod for PyTorch (docs/design.md §1); ``import gtopk_plugin`` never needs it.
"""
try:
    import horovod.torch  # noqa: F401  (the submodules import it again, now known to work)
except ImportError as _e:  # pragma: no cover - exercised only without Horovod
    raise ImportError(
        "gtopk_plugin.horovod needs Horovod built with PyTorch support "
        f"(import failed: {_e}). Install it into this environment with:  "
        "bash scripts/install_horovod.sh  (builds horovod==0.28.1 against the installed torch, "
        "cached after the first build)") from _e

from gtopk_plugin.frameworks.horovod.hvd_compression import Compression, SparseCompression  # noqa: E402
from gtopk_plugin.frameworks.horovod.hvd_resize_state import SparseOptimizerStateHandler  # noqa: E402  (registers it)
from gtopk_plugin.frameworks.horovod.hvd_scheduler_backend import HorovodDenseReduction  # noqa: E402  (registers it)
from gtopk_plugin.frameworks.horovod.hvd_optimizer import DistributedOptimizer  # noqa: E402
from gtopk_plugin.frameworks.horovod.hvd_transport import HorovodTransport  # noqa: E402

__all__ = ["HorovodTransport", "Compression", "SparseCompression", "DistributedOptimizer",
           "SparseOptimizerStateHandler", "HorovodDenseReduction"]
