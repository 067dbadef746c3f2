"""The rounding of an update handed out in the gradients' narrower dtype
(docs/design.md §3, half precision).

With fp16/bf16 gradients the reducer keeps its state and sums in float32 and
hands the update out in the gradient's dtype.  That last rounding is part of
what was applied, so -- like every wire rounding -- it lands in exactly one
rank's residual: the owner of an entry is the rank whose shard of the layout
(``shard_bounds``, the dense sum's owners) holds it.  The owner adds
``exact − divisor · applied`` at its entries, and mass is conserved to float32
rounding for every dtype:
Σ_ranks Σ_steps grad = Σ_steps divisor · applied + Σ_ranks residual.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from gtopk_plugin.collectives import wire

Tensor = torch.Tensor


def owned_result(agg, sizes: Sequence[int], tensors, dtype: torch.dtype, rank: int, P: int
                 ) -> Optional[Tuple[Tensor, Tensor]]:
    """``(positions, exact values in dtype)`` of the aggregated result at the
    entries of narrower-dtype tensors that ``rank`` owns, or ``None``.  Taken
    before the update is formed (which may divide a dense sum in place)."""
    numel = sum(sizes)
    lo, hi = numel * rank // P, numel * (rank + 1) // P
    starts = [0]
    for n in sizes:
        starts.append(starts[-1] + n)
    ranges = [(max(a, lo), min(b, hi)) for a, b, t in zip(starts, starts[1:], tensors)
              if t.dtype != dtype and max(a, lo) < min(b, hi)]
    if not ranges:
        return None
    vals = wire.values(agg.vals, dtype).reshape(-1)
    if agg.idx is None:
        pos = torch.cat([torch.arange(a, b, device=vals.device) for a, b in ranges])
        return pos, vals[pos].to(dtype)
    idx = agg.idx.long()
    keep = torch.zeros_like(idx, dtype=torch.bool)
    for a, b in ranges:
        keep |= (idx >= a) & (idx < b)
    return idx[keep], vals[keep].to(dtype)


def charge(owed: Tuple[Tensor, Tensor], names: Sequence[str], sizes: Sequence[int], res,
           dtype: torch.dtype, divisor: int) -> Tuple[Tensor, Tensor]:
    """``(positions, exact − divisor · applied)``: ``applied`` is the update
    as handed out (read back from ``res``, name -> tensor in the gradient's
    dtype), widened to ``dtype``."""
    pos, exact = owed
    applied = torch.empty_like(exact)
    start = 0
    for n, size in zip(names, sizes):
        m = (pos >= start) & (pos < start + size)
        if bool(m.any()):
            applied[m] = res[n].reshape(-1)[pos[m] - start].to(dtype)
        start += size
    return pos, (exact - applied * divisor if divisor != 1 else exact - applied)
