"""Dense allreduce (the S-SGD baseline) and the value-only allreduce of
random-k, whose indices every rank already knows."""
from __future__ import annotations

from .base import Aggregated, Aggregation, Selection, register
from .transport import Transport


def _allreduce(vals, transport: Transport):
    out = vals.clone()
    if transport.size > 1:
        transport.allreduce_sum_(out)
    return out


def _ring_rounds(P: int) -> int:
    return 0 if P == 1 else 2 * (P - 1)


@register("dense")
class DenseAllReduce(Aggregation):
    """Sum of the whole accumulator (``sel.idx is None``)."""

    def __call__(self, sel: Selection, transport: Transport) -> Aggregated:
        return Aggregated(None, _allreduce(sel.vals, transport), None, _ring_rounds(transport.size))


@register("allreduce_values")
class ValueAllReduce(Aggregation):
    """Random-k: the same indices on every rank, values summed by allreduce."""

    def __call__(self, sel: Selection, transport: Transport) -> Aggregated:
        return Aggregated(sel.idx, _allreduce(sel.vals, transport), None, _ring_rounds(transport.size))
