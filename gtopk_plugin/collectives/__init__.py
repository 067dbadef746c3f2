"""Collectives: dense allreduce, sparse allgather, the gTop-k butterfly and
the allgather of codec payloads, each an :class:`Aggregation` in a registry
(the names compressors declare as their ``aggregation``).  They speak only
to the :class:`Transport` protocol (never to a framework layer); the
torch.distributed transport, the reducer's default, lives here too
(torch.distributed ships with torch)."""
from . import allgather, dense, gtopk, payloads, rounds  # noqa: F401  (register aggregations)
from .base import Aggregated, Aggregation, Encoded, Selection, get, register
from .gtopk import ButterflyResult, gtopk_allreduce
from .torch_distributed import TorchDistributedTransport
from .transport import SingleProcessTransport, TrafficCounters, Transport

__all__ = ["Transport", "SingleProcessTransport", "TorchDistributedTransport", "TrafficCounters",
           "Aggregation", "Aggregated", "Selection", "Encoded", "get", "register", "gtopk_allreduce", "ButterflyResult"]
