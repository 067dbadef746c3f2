"""Allgather of codec payloads: every worker's encoded payload
(1-bit signs and scales, say) travels to every other worker in one ring of
P−1 neighbour exchanges, and each rank decodes all P payloads and sums them
in rank order -- the same bytes decoded by the same code, so every rank gets
the same bits (docs/design.md §2).  For payloads that do not sum in encoded form
(quantizers with per-worker scales); traffic per worker (P−1)·payload bytes
each way, no size headers (payload sizes depend only on the layout).

``reduce_scatter_payloads``, the two-phase variant: a
reduce-scatter of payload shards, a re-compression of each shard sum by its
owner (with a server-side error-feedback residual), and an allgather of the
compressed sums -- the compressed allreduce of 1-bit Adam (Tang et al. 2021,
arXiv 2102.02888, §4.1; DeepSpeed), with error feedback on both sides as in
EF-signSGD (Karimireddy et al. 2019, arXiv 1901.09847).

Aggregation name ``"reduce_scatter_payloads"``; ``onebit`` offers it as
``merge="reduce_scatter_payloads"`` (compress/onebit.py holds the
semantics: the shard plan, decode and re-compression of a shard, and the
server residuals, which are the codec's state).  This module only moves the
bytes, through the Transport protocol:

1. phase 1 (reduce-scatter): in steps s = 1..P−1 rank r sends shard
   (r+s) mod P of its payload to that rank while receiving shard r of rank
   (r−s) mod P's (one sendrecv per step, sizes known from the layout: no
   headers); it sums the P decoded contributions of shard r in rank order,
   adds its server residual and re-compresses;
2. phase 2: a ring allgather of the P compressed shards; every rank decodes
   them into the dense result (identical bits everywhere: the same bytes
   decoded by the same code; the owner uses its own decode).

Bytes per rank (``traffic.onebit_reduce_scatter_bytes``): phase 1 sends
every other shard's message once and receives P−1 messages of its own
shard; phase 2 is the ring allgather of messages of the same sizes.  The
worker's own error feedback is unchanged (residual = acc − its payload
decoded): ``sel.vals`` is that decode.
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
