"""Collectives: dense allreduce, sparse allgather, the gTop-k butterfly and
the allgather of codec payloads, each an :class:`Aggregation` in a registry
(the names compressors declare as their ``aggregation``).  They speak only
to the :class:`Transport` protocol (never to a framework layer); the
torch.distributed transport, the reducer's default, lives here too
(torch.distributed ships with torch)."""
from gtopk_plugin.collectives import allgather, gtopk, payloads, rounds  # noqa: F401  (register aggregations)
from gtopk_plugin.collectives import dense_allreduce as dense
from gtopk_plugin.collectives.aggregation import Aggregated, Aggregation, Encoded, Selection, get, register
from gtopk_plugin.collectives.gtopk import ButterflyResult, gtopk_allreduce
from gtopk_plugin.collectives.torch_distributed import TorchDistributedTransport
from gtopk_plugin.collectives.transport import SingleProcessTransport, TrafficCounters, Transport

__all__ = ["Transport", "SingleProcessTransport", "TorchDistributedTransport", "TrafficCounters",
           "Aggregation", "Aggregated", "Selection", "Encoded", "get", "register", "gtopk_allreduce", "ButterflyResult"]
