"""Dense allreduce (the S-SGD baseline) and the value-only allreduce of
random-k, whose indices every rank already knows.

With the gradients' dtype on the wire this is the engine's own allreduce.
With a narrower wire (fp16/bf16/int8 ``value_dtype``) it is a
reduce-scatter summed in float32 (or the gradients' wider dtype) at each
shard's owner, in rank order, then an allgather of the shard rounded and
clamped to the wire; the owner's rounding error is returned in
``Aggregated.residual_add``.  Bytes: those of a ring allreduce of the wire
dtype (int8: plus one exponent byte per message).  Details:
docs/design.md §3.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from gtopk_plugin.collectives import wire
from gtopk_plugin.collectives.aggregation import Aggregated, Aggregation, Selection, register
from gtopk_plugin.collectives.transport import Transport

Tensor = torch.Tensor


def _ring_rounds(P: int) -> int:
    return 0 if P == 1 else 2 * (P - 1)


def shard_bounds(n: int, P: int) -> List[int]:
    """Shard q of an ``n``-vector is ``[b[q], b[q+1])``: sizes differ by at
    most one, rank q owns (sums and rounds) shard q."""
    return [n * q // P for q in range(P + 1)]


def sharded_sum(vals: Tensor, acc_dtype: torch.dtype, transport: Transport, draws=None
                ) -> Tuple[Tensor, Optional[Tuple[Tensor, Tensor]]]:
    """Sum of every rank's wire-dtype ``vals`` (same length everywhere),
    accumulated in ``acc_dtype`` and rounded once to the wire dtype.

    Returns ``(sum in the wire dtype (int8: decoded), (positions, errors))``: the positions
    (int64, into ``vals``) and ``acc_dtype`` rounding errors this rank owns.
    Reduce-scatter: in step s = 1..P−1 rank r sends shard r+s to its owner
    while receiving its own shard from rank r−s (every rank takes part in
    every step, as Horovod's alltoall-based sendrecv needs); the owner adds
    the P pieces in rank order.  Allgather: the rounded shards, in a ring.
    """
    P, r = transport.size, transport.rank
    wdt, dev = vals.dtype, vals.device
    n = wire.count(vals)
    b = shard_bounds(n, P)
    esz, hb = vals.element_size(), wire.header_bytes(wdt)
    # int8: decoded once; each piece goes out re-encoded (lossless, see above)
    vals = wire.values(vals, acc_dtype).contiguous()
    pieces: List[Optional[Tensor]] = [None] * P
    pieces[r] = vals[b[r]:b[r + 1]]
    for s in range(1, P):
        dst, src = (r + s) % P, (r - s) % P
        send = wire.to_wire(vals[b[dst]:b[dst + 1]], wdt).view(torch.uint8)
        # a counted point-to-point step (sendrecv to dst, from src) of the
        # base Transport: exact byte accounting, and HorovodTransport runs it
        # as one alltoall (every rank calls it at once)
        got = transport._ring_step(dst, src, send, (b[r + 1] - b[r]) * esz + hb)
        pieces[src] = wire.values(wire.unpack_values(got.to(dev), wdt), acc_dtype)
    acc = torch.zeros(b[r + 1] - b[r], dtype=acc_dtype, device=dev)
    for q in range(P):  # rank order: the owner's bits are the result's bits
        acc += pieces[q].to(acc_dtype)
    mine, err = wire.round_to_wire(acc, wdt, None if draws is None else draws(f"shard{r}", torch.arange(b[r], b[r + 1], device=dev)))
    blobs = transport.allgather_blobs(mine.contiguous().view(torch.uint8),
                                      [(b[q + 1] - b[q]) * esz + hb for q in range(P)])
    out = torch.cat([wire.values(wire.unpack_values(x.to(dev), wdt), acc_dtype) for x in blobs])
    nz = torch.nonzero(err).squeeze(1)
    return out, (nz + b[r], err[nz])


def _copy(sel: Selection, vals: Tensor) -> Tensor:
    """The tensor the sum is taken in place on: ``vals`` itself when
    ``sel.out`` is ``vals`` (the reducer's accumulator of a step whose
    residual will be zero), else ``vals`` copied into ``sel.out`` where it
    fits, else a fresh clone, so that ``vals`` stays untouched."""
    out = sel.out
    if out is vals:  # the caller's own buffer, free to be summed in place
        return out
    if out is not None and out.shape == vals.shape and out.dtype == vals.dtype and out.device == vals.device:
        return out.copy_(vals)
    return vals.clone()


def _reduce(sel: Selection, transport: Transport, draws=None):
    """(sum in the wire dtype, residual_add as (positions, errors) or None)."""
    P = transport.size
    if P == 1:
        out = wire.values(sel.vals, sel.sum_dtype)  # int8: decoded (a fresh tensor)
        return (_copy(sel, out) if out is sel.vals else out), None
    adt = wire.accumulation_dtype(sel.vals.dtype, sel.sum_dtype)
    if adt is None:
        out = _copy(sel, sel.vals)
        transport.allreduce_sum_(out)
        return out, None
    return sharded_sum(sel.vals, adt, transport, draws)


@register("dense")
class DenseAllReduce(Aggregation):
    """Sum of the whole accumulator (``sel.idx is None``).  ``draws``: the
    int8 wire's stochastic-rounding key (see ``GTopKAllReduce.draws``)."""

    draws = None

    def __call__(self, sel: Selection, transport: Transport) -> Aggregated:
        out, charged = _reduce(sel, transport, self.draws)
        return Aggregated(None, out, None, _ring_rounds(transport.size), charged)


@register("allreduce_values")
class ValueAllReduce(Aggregation):
    """Random-k: the same indices on every rank, values summed by allreduce."""

    draws = None

    def __call__(self, sel: Selection, transport: Transport) -> Aggregated:
        out, charged = _reduce(sel, transport, self.draws)
        if charged is not None:  # positions in the value vector -> global indices
            charged = (sel.idx.long()[charged[0]], charged[1])
        return Aggregated(sel.idx, out, None, _ring_rounds(transport.size), charged)
