"""gtopk_plugin: sparse gradient reduction for data-parallel training on slow
networks — gTop-k S-SGD (Shi et al. 2019), rTop-k (Barnes et al. 2020), and
the elastic consistency scheduler (Nadiradze et al. 2020) — as drop-in parts
of torch.distributed / DDP, Horovod and BytePS.

``import gtopk_plugin`` needs only torch; framework layers are imported on
demand (``gtopk_plugin.torch_ddp``, ``gtopk_plugin.horovod``, ...).
"""
from gtopk_plugin import compress, kernels  # noqa: F401
from gtopk_plugin.collectives.transport import ConcurrentUseError, SingleProcessTransport, TrafficCounters, Transport
from gtopk_plugin.config import DensityWarmup, ReducerConfig
from gtopk_plugin.pipeline.input_check import (JoinedRankError, LayoutMismatchError, NonFiniteGradientError,
                          NonFiniteStateError, PeerInputError)
from gtopk_plugin.collectives.torch_distributed import TorchDistributedTransport
from gtopk_plugin.reducer import GradientReducer, k_for
from gtopk_plugin.two_level.hierarchical_reducer import HierarchicalReducer
from gtopk_plugin.pipeline.reduce_stats import ReduceStats
from gtopk_plugin import checkpoint  # noqa: E402  (whole-job checkpoints: save_job / load_job)
from gtopk_plugin.checkpoint import load_job, save_job
from gtopk_plugin.pipeline.reducer_state import CheckpointError
from gtopk_plugin import elastic  # noqa: E402
from gtopk_plugin.elastic import ElasticScheduler
# torch.distributed ships with torch: register its asynchronous allreduce as the
# elastic scheduler's default back end now (Horovod's registers on its import).
from gtopk_plugin.elastic import torch_backend as _elastic_torch  # noqa: F401

__version__ = "0.1.0"


def __getattr__(name):
    # Lazy framework layers: importing them pulls nothing heavy for users who
    # never touch them, and keeps ``gp.torch_ddp`` working as an attribute.
    # importlib, not "from . import x": that form looks the name up on this
    # module first and would re-enter __getattr__ forever.
    if name in ("torch_ddp", "torch_fsdp", "testing", "horovod", "byteps"):
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'gtopk_plugin' has no attribute {name!r}")


__all__ = ["GradientReducer", "HierarchicalReducer", "TorchDistributedTransport", "SingleProcessTransport", "Transport", "TrafficCounters",
           "ReducerConfig", "DensityWarmup", "ReduceStats", "LayoutMismatchError",
           "NonFiniteGradientError", "NonFiniteStateError", "PeerInputError", "JoinedRankError",
           "ConcurrentUseError", "k_for", "ElasticScheduler",
           "checkpoint", "save_job", "load_job", "CheckpointError", "__version__"]
