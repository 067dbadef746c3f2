"""Collectives: dense allreduce, sparse allgather and the gTop-k butterfly,
each an :class:`Aggregation` in a registry.  They speak only to the
:class:`Transport` protocol (never to a framework)."""
from . import allgather, dense, gtopk  # noqa: F401  (register aggregations)
from .base import Aggregated, Aggregation, Selection, get, register
from .gtopk import ButterflyResult, gtopk_allreduce
from .transport import SingleProcessTransport, TrafficCounters, Transport

__all__ = ["Transport", "SingleProcessTransport", "TrafficCounters", "Aggregation", "Aggregated",
           "Selection", "get", "register", "gtopk_allreduce", "ButterflyResult"]
