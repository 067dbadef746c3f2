"""Codec payload aggregations (docs/design.md §2).

``"allgather_payloads"``: every worker's encoded payload travels to every
other worker in one ring of P−1 neighbour exchanges; each rank decodes the
P payloads and sums them in rank order, so every rank gets the same bits.
For payloads that do not sum in encoded form; (P−1)·payload bytes each
way, no size headers.

``"reduce_scatter_payloads"`` (onebit's ``merge=``; the compressed
allreduce of 1-bit Adam, Tang et al. 2021, arXiv 2102.02888): phase 1, in
steps s = 1..P−1 rank r sends shard (r+s) mod P of its payload to its owner
and receives shard r of rank (r−s) mod P, sums the P decoded pieces in
rank order with its server residual and re-compresses; phase 2, a ring
allgather of the compressed shards, decoded by every rank.  The codec
(compress/onebit.py) holds the semantics and the server residuals; this
module only moves bytes through the Transport protocol
(``traffic.onebit_reduce_scatter_bytes``).  The worker's own residual is
``acc`` less its payload decoded (``sel.vals``).
"""
from __future__ import annotations

import torch

from gtopk_plugin.collectives import wire
from gtopk_plugin.collectives.aggregation import Aggregated, Aggregation, Selection, register
from gtopk_plugin.collectives.transport import Transport


@register("allgather_payloads")
class PayloadAllGather(Aggregation):
    """Dense sum (``sel.sum_dtype``) of every rank's decoded payload;
    ``sel.vals`` is this rank's own payload decoded (not decoded twice).
    Every contribution reaches the result."""

    def __call__(self, sel: Selection, transport: Transport) -> Aggregated:
        enc = sel.payload
        if enc is None:
            raise ValueError("allgather_payloads aggregates codec payloads; this method selects "
                             "entries (pick merge='allgather' or 'butterfly')")
        P, me = transport.size, transport.rank
        dev = sel.vals.device
        blob = wire.pack_tensors(enc.tensors)
        blobs = transport.allgather_blobs(blob, [blob.numel()] * P) if P > 1 else [blob]
        out = torch.zeros(sel.numel, dtype=sel.sum_dtype, device=dev)
        for q, b in enumerate(blobs):  # rank order: identical bits on every rank
            d = sel.vals if q == me else enc.decode(wire.unpack_tensors(b.to(dev), enc.tensors))
            out += d.to(sel.sum_dtype)
        return Aggregated(None, out, None, P - 1)


NAME = "reduce_scatter_payloads"


def bind(payload, codec, segment_names) -> None:
    """Give the aggregation the codec (shard plan, re-compression, server
    residuals) and the layout key its server residual is stored under."""
    payload.codec = codec
    payload.key = "\x00".join(segment_names)


@register(NAME)
class PayloadReduceScatter(Aggregation):
    """Reduce-scatter of payload shards, owner re-compression with a server
    residual, allgather of the compressed sums (module docstring).  Every
    contribution reaches the result (the rest is in a server residual)."""

    def __call__(self, sel: Selection, transport: Transport) -> Aggregated:
        enc = sel.payload
        codec = getattr(enc, "codec", None)
        if codec is None or not hasattr(codec, "shard_plan"):
            raise ValueError(f"{NAME} aggregates payloads of a codec that shards them (onebit); "
                             "use merge='allgather_payloads' for other codecs")
        P, me = transport.size, transport.rank
        offsets = sel.offsets.tolist()
        plan = codec.shard_plan(offsets, sel.numel, P)
        if plan is None:  # fewer sign bytes than ranks: nothing to shard
            return PayloadAllGather()(sel, transport)
        dev, dt = sel.vals.device, sel.sum_dtype
        parts = [codec.shard_payload(enc.tensors, sh) for sh in plan]
        blobs = [wire.pack_tensors(p) for p in parts]
        own = plan[me]
        # phase 1: shard j of every rank's payload to rank j
        got = [None] * P
        for s in range(1, P):
            dst, src = (me + s) % P, (me - s) % P
            got[src] = transport._ring_step(dst, src, blobs[dst], blobs[me].numel())
        t = torch.zeros(own.hi - own.lo, dtype=dt, device=dev)
        for q in range(P):  # rank order: the owner's sum is deterministic
            d = sel.vals[own.lo:own.hi] if q == me else \
                codec.decode_shard(wire.unpack_tensors(got[q].to(dev), parts[me]), offsets, own, dt)
            t += d.to(dt)
        key = f"{enc.key}\x00P{P}"
        t += codec.server_residual(key, t.numel(), dt, dev)
        mine = codec.encode_shard(t, offsets, own)
        c = codec.decode_shard(mine, offsets, own, dt)
        # phase 2: allgather of the compressed shard sums (the same sizes as phase 1's)
        blob = wire.pack_tensors(mine)
        out_blobs = transport.allgather_blobs(blob, [b.numel() for b in blobs]) if P > 1 else [blob]
        out = torch.empty(sel.numel, dtype=dt, device=dev)
        for j, sh in enumerate(plan):
            out[sh.lo:sh.hi] = c if j == me else \
                codec.decode_shard(wire.unpack_tensors(out_blobs[j].to(dev), parts[j]), offsets, sh, dt)
        codec.set_server_residual(key, t.sub_(c))  # committed once the exchange succeeded
        return Aggregated(None, out, None, 2 * (P - 1))
