"""Sparse allgather (the Top-k S-SGD aggregation, "TopKAllReduce"): every
worker receives every other worker's (index, value) set, O(kP) traffic, and
sums them in rank order so every rank gets the same bits (docs/design.md §2).
With the int8 wire each message carries its sender's own exponent byte
(``k·(b_idx + 1) + 1`` bytes) and is decoded exactly before the sum.

The sum stays sparse: the union of the P sets, at most P·k
entries, built by merging the sets in rank order -- each merge adds
``(0 + running sum) + next`` on shared indices, exactly the additions a
zero vector with one ``index_add_`` per rank makes -- so no N-sized vector
is allocated, zeroed and scanned, and the reducer writes the update in
O(P·k).  Sets that are not strictly ascending take the dense sum."""
from __future__ import annotations

import torch

from gtopk_plugin import kernels
from gtopk_plugin.collectives import wire
from gtopk_plugin.collectives.aggregation import Aggregated, Aggregation, Selection, register
from gtopk_plugin.collectives.transport import Transport


@register("allgather")
class SparseAllGather(Aggregation):
    """Sum (``sel.sum_dtype``) of all ranks' sparse sets, as a sparse union
    in ascending index order.  Exact top-k sets have the same size on every
    rank, so no size headers travel.  Every local entry reaches the result."""

    def __call__(self, sel: Selection, transport: Transport) -> Aggregated:
        blob = wire.pack(sel.idx, sel.vals, sel.idx_dtype)
        P = transport.size
        sizes = [blob.numel()] * P if sel.static_count else None
        blobs = transport.allgather_blobs(blob, sizes) if P > 1 else [blob]
        dev = sel.vals.device
        sets = []
        for b in blobs:  # rank order: identical bits on every rank
            i, v, _ = wire.unpack(b.to(dev), sel.idx_dtype, sel.vals.dtype)
            sets.append((i, wire.values(v, sel.sum_dtype).to(sel.sum_dtype)))
        if not all(i.numel() < 2 or bool((i[1:] > i[:-1]).all()) for i, _ in sets):
            out = torch.zeros(sel.numel, dtype=sel.sum_dtype, device=dev)
            for i, v in sets:
                out.index_add_(0, i.long(), v)
            return Aggregated(None, out, None, P - 1)
        # keep every entry of the union: k_s = the segment's length
        offsets = sel.offsets.to(torch.int64).cpu()
        keep_all = offsets[1:] - offsets[:-1]
        idx, vals = sets[0]
        vals = vals + 0.0 if P == 1 else vals  # (0 + v): -0.0 -> +0.0, as the zero vector's sum
        for i, v in sets[1:]:
            idx, vals, _, _ = kernels.merge_select(idx, vals, i, v, offsets, keep_all, kernels=sel.kernels)
        return Aggregated(idx, vals, None, P - 1)
