"""Sparse allgather (the Top-k S-SGD aggregation, "TopKAllReduce"): every
worker receives every other worker's (index, value) set, O(kP) traffic, and
sums them in rank order so every rank gets the same bits (DESIGN.md §3)."""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from . import wire
from .transport import Transport


def sparse_allgather(idx: torch.Tensor, vals: torch.Tensor, numel: int, transport: Transport,
                     idx_dtype: torch.dtype, sum_dtype: torch.dtype,
                     static_count: bool) -> torch.Tensor:
    """Dense sum (``numel`` entries, ``sum_dtype``) of all ranks' sparse sets.

    ``static_count``: every rank sends the same number of entries (exact
    top-k), so no size headers travel.  Every local entry reaches the result.
    """
    blob = wire.pack(idx, vals, idx_dtype)
    P = transport.size
    sizes: Optional[List[int]] = [blob.numel()] * P if static_count else None
    blobs = transport.allgather_blobs(blob, sizes) if P > 1 else [blob]
    out = torch.zeros(numel, dtype=sum_dtype, device=vals.device)
    for b in blobs:  # rank order: identical bits on every rank
        i, v, _ = wire.unpack(b.to(vals.device), idx_dtype, vals.dtype)
        out.index_add_(0, i.long(), v.to(sum_dtype))
    return out
