"""gtopk_plugin: sparse gradient reduction for data-parallel training on slow
networks — gTop-k S-SGD (Shi et al. 2019), rTop-k (Barnes et al. 2020), and
the elastic consistency scheduler (Nadiradze et al. 2020) — as drop-in parts
of torch.distributed / DDP, Horovod and BytePS.

``import gtopk_plugin`` needs only torch; framework layers are imported on
demand (``gtopk_plugin.torch_ddp``, ``gtopk_plugin.horovod``, ...).
"""
from . import compress, kernels  # noqa: F401
from .collectives.transport import ConcurrentUseError, SingleProcessTransport, TrafficCounters, Transport
from .config import DensityWarmup, ReducerConfig
from .consistency import (JoinedRankError, LayoutMismatchError, NonFiniteGradientError,
                          NonFiniteStateError, PeerInputError)
from .collectives.torch_distributed import TorchDistributedTransport
from .reducer import GradientReducer, k_for
from .hierarchical import HierarchicalReducer
from .stats import ReduceStats
from . import checkpoint  # noqa: E402  (whole-job checkpoints: save_job / load_job)
from .checkpoint import load_job, save_job
from .reducer_state import CheckpointError
from . import elastic  # noqa: E402
from .elastic import ElasticScheduler
# torch.distributed ships with torch: register its asynchronous allreduce as the
# elastic scheduler's default back end now (Horovod's registers on its import).
from .frameworks import elastic_torch as _elastic_torch  # noqa: F401

__version__ = "0.1.0"


def __getattr__(name):
    # Lazy framework layers: importing them pulls nothing heavy for users who
    # never touch them, and keeps ``gp.torch_ddp`` working as an attribute.
    # importlib, not "from . import x": that form looks the name up on this
    # module first and would re-enter __getattr__ forever.
    if name in ("torch_ddp", "testing", "horovod", "byteps"):
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'gtopk_plugin' has no attribute {name!r}")


__all__ = ["GradientReducer", "HierarchicalReducer", "TorchDistributedTransport", "SingleProcessTransport", "Transport", "TrafficCounters",
           "ReducerConfig", "DensityWarmup", "ReduceStats", "LayoutMismatchError",
           "NonFiniteGradientError", "NonFiniteStateError", "PeerInputError", "JoinedRankError",
           "ConcurrentUseError", "k_for", "ElasticScheduler",
           "checkpoint", "save_job", "load_job", "CheckpointError", "__version__"]
