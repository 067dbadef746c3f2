"""The PyTorch Horovod layer (``gtopk_plugin.horovod`` re-exports it): a
:class:`~gtopk_plugin.collectives.transport.Transport` on Horovod's
collectives and a drop-in ``DistributedOptimizer`` whose ``compression=``
picks Horovod's dense allreduce or a sparse method of the core.

One concern per module, as in ``horovod/torch/``: ``hvd_transport``
(:class:`HorovodTransport`), ``hvd_compression`` (:class:`SparseCompression`,
:class:`Compression`), ``hvd_optimizer`` (:func:`DistributedOptimizer`),
``hvd_sparse`` / ``hvd_dense`` (the two steps), ``hvd_resize_state``
(``hvd.elastic`` state handler), ``hvd_scheduler_backend`` (the elastic
scheduler's back end), ``side_channel`` and ``waiting``.  Imports go one
way (optimizer → sparse/dense → compression/transport); no module imports
this package's namespace.

This package is the only place that imports Horovod for PyTorch
(docs/design.md §1); ``import gtopk_plugin`` never needs it.
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
