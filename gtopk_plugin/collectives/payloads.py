"""Allgather of codec payloads (issue #16): every worker's encoded payload
(1-bit signs and scales, say) travels to every other worker in one ring of
P−1 neighbour exchanges, and each rank decodes all P payloads and sums them
in rank order -- the same bytes decoded by the same code, so every rank gets
the same bits (DESIGN.md §3).  For payloads that do not sum in encoded form
(quantizers with per-worker scales); traffic per worker (P−1)·payload bytes
each way, no size headers (payload sizes depend only on the layout)."""
from __future__ import annotations

import torch

from . import wire
from .base import Aggregated, Aggregation, Selection, register
from .transport import Transport


@register("allgather_payloads")
class PayloadAllGather(Aggregation):
    """Dense sum (``sel.sum_dtype``) of every rank's decoded payload;
    ``sel.vals`` is this rank's own payload decoded (not decoded twice).
    Every contribution reaches the result."""

    def __call__(self, sel: Selection, transport: Transport) -> Aggregated:
        enc = sel.payload
        if enc is None:
            raise ValueError("allgather_payloads aggregates codec payloads; this method selects "
                             "entries (pick merge='allgather' or 'gtopk')")
        P, me = transport.size, transport.rank
        dev = sel.vals.device
        blob = wire.pack_tensors(enc.tensors)
        blobs = transport.allgather_blobs(blob, [blob.numel()] * P) if P > 1 else [blob]
        out = torch.zeros(sel.numel, dtype=sel.sum_dtype, device=dev)
        for q, b in enumerate(blobs):  # rank order: identical bits on every rank
            d = sel.vals if q == me else enc.decode(wire.unpack_tensors(b.to(dev), enc.tensors))
            out += d.to(sel.sum_dtype)
        return Aggregated(None, out, None, P - 1)
