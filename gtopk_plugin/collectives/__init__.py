"""Collectives: dense allreduce, sparse allgather and the gTop-k butterfly.
They speak only to the :class:`Transport` protocol (never to a framework)."""
from .allgather import sparse_allgather
from .dense import dense_allreduce
from .gtopk import ButterflyResult, gtopk_allreduce
from .transport import SingleProcessTransport, TrafficCounters, Transport

__all__ = ["Transport", "SingleProcessTransport", "TrafficCounters", "dense_allreduce", "sparse_allgather",
           "gtopk_allreduce", "ButterflyResult"]
