"""Selection and exchange in one call (issue #15): on the gloo side channel,
the TensorFlow layer runs the registry's compressor *and* the core's own
aggregation (``gtopk_plugin.collectives``: the sparse allgather, the gTop-k
butterfly of Shi et al. 2019, random-k's value allreduce) inside a single
stateful ``tf.numpy_function``, over a :class:`ChannelTransport` on the
side channel's gloo group.

Why: the TF twins of the butterfly's merge (:mod:`.kernels`,
:mod:`.collectives`) are a few dozen TF ops per round -- stable argsorts,
``unique``, segment sums over the 2k entries of the two sets -- about ten
times the project's C++ ``merge_select`` on the same sets (measured: 45 ms
against 4.7 ms for two 1%-sets of the 1.07M-entry MLP on this loaded
machine), and every exchange was a numpy function of its own.  Running the
core's aggregation instead makes the step one numpy function for select +
every round, with the merges on the C++ kernels; the results are the
core's, so they are the PyTorch side's bits by construction (the TF twins
stay for ``exchange="horovod"``, the elastic path, where every exchange
must be a Horovod op).

Which steps take it: a side channel (P > 1, ``exchange="gloo"``), a
selector with an exact count (``exact_count``: topk, gtopk, rtopk, randomk;
static message sizes) and one of those three aggregations.  The byte
counts are the core transport's, which for static sizes are exactly the
TF layer's own rules (:mod:`.ops`: payload as sent, no headers, ring
model for allgather and allreduce); selectors with varying counts
(threshold) keep the TF path, whose size headers are counted differently
(int32 here, int64 in the core).

The int8 wire (issue #17, ``value_dtype=tf.int8``) runs only here: each
message is quantized by the core (``wire.quantize``: codes + one exponent
byte, 5·k + 1 bytes; stochastic rounding keyed by ``wire.Draws(seed, step,
first segment name)`` as the reducer keys it), merged sums are re-rounded
by the core's aggregations, and this returns the values as they decode, so
the residual keeps each rounding error exactly.  At P = 1 (no side channel)
it runs on a :class:`SingleProcessTransport`, as the reducer does.

Error feedback and the update stay TensorFlow ops in :mod:`.step`, on what
this returns: this rank's selection (indices, wire values), which of its
entries reached the result, the result, and the wire roundings this rank
owns (``residual_add``).
"""
from __future__ import annotations

import dataclasses

import pickle
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from gtopk_plugin import collectives
from gtopk_plugin.collectives import Selection, Transport, wire
from gtopk_plugin.collectives.transport import SingleProcessTransport
from gtopk_plugin.compress.compressor import SelectionContext
from gtopk_plugin.kernels.reference import index_dtype
from gtopk_plugin.pipeline.traffic import TRANSPORT_FIELDS
from gtopk_plugin.frameworks.horovod_tf._guard import tf
from gtopk_plugin.frameworks.horovod_tf.codec_state import numpy_call
from gtopk_plugin.frameworks.horovod_tf.selection import _carrier, _numpy, _torch

__all__ = ["ChannelTransport", "FUSED_AGGREGATIONS", "fused_ok", "select_aggregate"]

# aggregations of the core run here; "allgather" returns a dense sum
FUSED_AGGREGATIONS = ("allgather", "gtopk", "allreduce_values")
_TORCH = {tf.float16: torch.float16, tf.bfloat16: torch.bfloat16, tf.float32: torch.float32,
          tf.float64: torch.float64, tf.int8: torch.int8}


class ChannelTransport(Transport):
    """The core's :class:`Transport` on a gloo side channel
    (:class:`..gloo_channel.GlooChannel`): the raw primitives are the
    channel's; the counting is the base class's."""

    def __init__(self, channel):
        super().__init__()
        self.ch = channel

    @property
    def rank(self) -> int:
        return self.ch.rank

    @property
    def size(self) -> int:
        return self.ch.size

    @staticmethod
    def _bytes(t):
        return t.contiguous().view(-1).view(torch.uint8)

    def _raw_sendrecv(self, dst, send, src, recv):
        got = self.ch.exchange(dst, self._bytes(send), src, recv.numel() * recv.element_size(), with_size=False)
        recv.view(-1).view(torch.uint8).copy_(got)

    def _raw_send(self, peer, send):
        self.ch.exchange(peer, self._bytes(send), None, with_size=False)

    def _raw_recv(self, peer, recv):
        got = self.ch.exchange(None, None, peer, recv.numel() * recv.element_size(), with_size=False)
        recv.view(-1).view(torch.uint8).copy_(got)

    def _raw_allreduce_sum_(self, t):
        self.ch.allreduce_(t, dist.ReduceOp.SUM)

    def _raw_allreduce_max_(self, t):
        self.ch.allreduce_(t, dist.ReduceOp.MAX)

    def _raw_allgather_object(self, obj):
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        return [pickle.loads(b.numpy().tobytes()) for b in self.ch.allgather(data)]

    def allgather_blobs(self, blob, nbytes=None):
        """One gloo allgather instead of the base class's P−1 ring steps,
        counted as the ring (what the base class counts)."""
        if nbytes is None:  # varying sizes: the base class (headers counted its way)
            return super().allgather_blobs(blob, nbytes)
        P, r = self.size, self.rank
        parts = self.ch.allgather(blob.contiguous(), list(nbytes))
        parts[r] = blob
        total = sum(int(n) for n in nbytes)
        c = self.counters
        c.payload_bytes_sent += total - int(nbytes[(r + 1) % P])
        c.payload_bytes_received += total - int(nbytes[r])
        c.messages_sent += P - 1
        return parts


def fused_ok(cmp, aggregation: str, ops, int8: bool = False) -> bool:
    """Whether this step's selection and exchange run here (see the module
    docstring; the int8 wire at P = 1 too)."""
    return ((ops.side is not None or (int8 and ops.P == 1)) and aggregation in FUSED_AGGREGATIONS
            and getattr(cmp, "kind", "selector") == "selector" and bool(getattr(cmp, "exact_count", False)))


def _transport(ops) -> Transport:
    if ops.side is None:  # P = 1 (the int8 wire): no peers, no bytes
        return SingleProcessTransport()
    t = getattr(ops.side, "_core_transport", None)
    if t is None:
        t = ops.side._core_transport = ChannelTransport(ops.side)
    return t


def select_aggregate(ops, acc, offsets, ks, cmp, aggregation: str, wire_dtype, *, step, names, seed: int,
                     rank: int, kernels: Optional[str] = None, state=None, rounding: str = "nearest"):
    """Select from the flat ``acc`` and aggregate over the side channel.
    Returns ``(idx, wire_vals, reached, res_idx, res_vals, fix_idx, fix_vals,
    rounds)``: this rank's selection (int32, wire dtype), which of it
    reached the result (bool), the result (int32 indices -- empty for a
    dense result -- and values in ``acc``'s dtype, summed, not divided),
    the wire roundings this rank owns (int32 indices, values in ``acc``'s
    dtype; added in order) and the rounds; adds the bytes to ``ops``."""
    transport = _transport(ops)
    names = list(names)
    bf16 = acc.dtype == tf.bfloat16
    offs_t = torch.tensor(list(offsets), dtype=torch.int64)
    numel = int(offsets[-1])
    agg = collectives.get(aggregation)
    wdt = _TORCH[wire_dtype]
    int8 = wdt == wire.QUANTIZED
    k_in = tf.constant(list(ks), tf.int64) if isinstance(ks, list) else tf.cast(ks, tf.int64)

    def run(a, k, st):
        x = _torch(a, bf16)
        k_t = torch.from_numpy(np.asarray(k, np.int64))
        ctx = SelectionContext(step=int(st), segment_names=names, seed=seed, rank=rank, kernels=kernels)
        idx, vals = cmp.select(x, offs_t, k_t, ctx)
        # the int8 wire's stochastic rounding: keyed as the reducer keys it
        draws = None if rounding == "nearest" else wire.Draws(seed, int(st), names[0])
        if hasattr(agg, "draws"):  # aggregations that re-round sums (int8 wire)
            agg.draws = draws
        wvals = wire.to_wire(vals, wdt) if draws is None else wire.quantize(vals, draws(f"rank{rank}", idx))[0]
        before = transport.counters.copy()
        res = agg(Selection(idx=idx, vals=wvals, numel=numel, offsets=offs_t, k=k_t, idx_dtype=index_dtype(numel),
                            sum_dtype=x.dtype, static_count=True, kernels=kernels), transport)
        delta = transport.counters.copy().minus(before)
        reached = torch.ones(idx.numel(), dtype=torch.bool) if res.reached is None else res.reached
        if aggregation == "allgather" and res.idx is not None:
            # the core's allgather returns its sum as a sparse union; this
            # layer's contract is the dense sum (the same bits: zeros elsewhere)
            dense = torch.zeros(numel, dtype=res.vals.dtype)
            dense[res.idx.long()] = res.vals
            res = dataclasses.replace(res, idx=None, vals=dense)
        res_idx = torch.zeros(0, dtype=torch.int32) if res.idx is None else res.idx.to(torch.int32)
        fix_i, fix_v = res.residual_add if res.residual_add is not None else (torch.zeros(0), torch.zeros(0))
        sent = wire.values(wvals, x.dtype) if int8 else wvals  # int8: decoded (exact)
        return (idx.to(torch.int32).numpy(), _numpy(sent), reached.numpy(), res_idx.numpy(),
                _numpy(res.vals.to(x.dtype)), fix_i.to(torch.int32).numpy(), _numpy(fix_v.to(x.dtype)),
                np.asarray([getattr(delta, f) for f in TRANSPORT_FIELDS] + [res.rounds], np.int64))

    carrier = _carrier(acc)
    wcarrier = carrier if int8 else _carrier(tf.zeros([0], wire_dtype))
    outs = numpy_call(state, run, [carrier, k_in, tf.cast(step, tf.int64)],
                      [tf.int32, wcarrier.dtype, tf.bool, tf.int32, carrier.dtype, tf.int32, carrier.dtype,
                       tf.int64], stateful=True)
    idx, wvals, reached, res_idx, res_vals, fix_i, fix_v, counts = outs
    if wire_dtype == tf.bfloat16 or (int8 and bf16):
        wvals = tf.bitcast(wvals, tf.bfloat16)
    if bf16:
        res_vals, fix_v = tf.bitcast(res_vals, tf.bfloat16), tf.bitcast(fix_v, tf.bfloat16)
    counts = tf.ensure_shape(counts, [len(TRANSPORT_FIELDS) + 1])
    for i, f in enumerate(TRANSPORT_FIELDS):
        ops.add(f, counts[i])
    shape = [None]
    return (tf.ensure_shape(idx, shape), tf.ensure_shape(wvals, shape), tf.ensure_shape(reached, shape),
            tf.ensure_shape(res_idx, shape), tf.ensure_shape(res_vals, shape), tf.ensure_shape(fix_i, shape),
            tf.ensure_shape(fix_v, shape), counts[-1])
