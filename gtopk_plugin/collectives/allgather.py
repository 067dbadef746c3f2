"""Sparse allgather (the Top-k S-SGD aggregation, "TopKAllReduce"): every
worker receives every other worker's (index, value) set, O(kP) traffic, and
sums them in rank order so every rank gets the same bits (DESIGN.md §3).
With the int8 wire each message carries its sender's own exponent byte
(``k·(b_idx + 1) + 1`` bytes) and is decoded exactly before the sum."""
from __future__ import annotations

import torch

from . import wire
from .base import Aggregated, Aggregation, Selection, register
from .transport import Transport


@register("allgather")
class SparseAllGather(Aggregation):
    """Dense sum (``sel.sum_dtype``) of all ranks' sparse sets.  Exact top-k
    sets have the same size on every rank, so no size headers travel.  Every
    local entry reaches the result."""

    def __call__(self, sel: Selection, transport: Transport) -> Aggregated:
        blob = wire.pack(sel.idx, sel.vals, sel.idx_dtype)
        P = transport.size
        sizes = [blob.numel()] * P if sel.static_count else None
        blobs = transport.allgather_blobs(blob, sizes) if P > 1 else [blob]
        out = torch.zeros(sel.numel, dtype=sel.sum_dtype, device=sel.vals.device)
        for b in blobs:  # rank order: identical bits on every rank
            i, v, _ = wire.unpack(b.to(sel.vals.device), sel.idx_dtype, sel.vals.dtype)
            out.index_add_(0, i.long(), wire.values(v, sel.sum_dtype).to(sel.sum_dtype))
        return Aggregated(None, out, None, P - 1)
