"""The stages of a reduce() call from the accumulator on (docs/design.md §2,
steps 4-7): :class:`Select` (a selector's entries, as they go on the wire)
or :class:`Encode` (a codec's payload), :class:`Aggregate`,
:class:`Residual` (error feedback), :class:`Update` and :class:`Record` (the
call's :class:`~gtopk_plugin.pipeline.reduce_stats.ReduceStats`)."""
from __future__ import annotations

import time
from typing import Optional

import torch

from gtopk_plugin import collectives, kernels
from gtopk_plugin.collectives import Selection, payloads, wire
from gtopk_plugin.collectives.rounds import codec_contribution
from gtopk_plugin.compress import SelectionContext
from gtopk_plugin.pipeline import update_rounding
from gtopk_plugin.pipeline.reduce_stats import ReduceStats

__all__ = ["NearestWire", "StochasticWire", "Select", "Encode", "Aggregate", "Residual", "Update", "Record"]


def _context(c, config, transport) -> SelectionContext:
    return SelectionContext(step=c.step, segment_names=c.seg_names, seed=config.seed, rank=transport.rank,
                            kernels=config.kernels, shapes=[tuple(t.shape) for t in c.tensors])


class NearestWire:
    """The selected values as they travel: in ``value_dtype`` (default: the
    gradients' dtype), rounded to nearest.  ``call.exact``: they are the
    accumulator's values bit for bit."""

    def __init__(self, config):
        self.config = config

    def __call__(self, c):
        c.wire_vals = wire.to_wire(c.vals, self.config.value_dtype or c.grad_dtype)
        c.exact = c.wire_vals.dtype == c.dtype
        return c


class StochasticWire(NearestWire):
    """The int8 wire with stochastic rounding: draws keyed by (seed, step),
    like random-k's; an aggregation that re-rounds sums draws from the same
    key."""

    def __init__(self, config, transport, aggregation):
        super().__init__(config)
        self.transport, self.aggregation = transport, aggregation

    def __call__(self, c):
        draws = wire.Draws(self.config.seed, c.step, c.seg_names[0])
        if hasattr(self.aggregation, "draws"):  # aggregations that re-round sums (int8 wire)
            self.aggregation.draws = draws
        pos = torch.arange(c.numel, device=c.acc.device) if c.idx is None else c.idx
        c.wire_vals = wire.quantize(c.vals, draws(f"rank{self.transport.rank}", pos))[0]
        c.exact = c.wire_vals.dtype == c.dtype
        return c


class Select:
    """Step 4 for a selector: ``k_s`` entries per segment (the fused path
    picked them already), on the wire."""

    phase = "select"

    def __init__(self, config, compressor, segments, to_wire, aggregation_name: str, aggregation, transport):
        self.config, self.compressor, self.segments, self.to_wire = config, compressor, segments, to_wire
        self.aggregation_name, self.aggregation, self.transport = aggregation_name, aggregation, transport

    def __call__(self, c):
        c.offsets, c.k, c.seg_names = self.segments(c.names, c.sizes, c.density)
        c.aggregation_name, c.aggregation = self.aggregation_name, self.aggregation
        c.idx, c.vals = c.picked if c.picked is not None else self.compressor.select(
            c.acc, c.offsets, c.k, _context(c, self.config, self.transport))
        return self.to_wire(c)


class Encode:
    """Step 4 for a codec: its payload and what it decodes to (a rounds
    codec's contribution is filled by the aggregation).  A dense warm-up
    step (``start_iter``) is the dense method's: the accumulator, summed."""

    phase = "select"

    def __init__(self, config, compressor, segments, to_wire, aggregation_name: str, aggregation, transport):
        self.config, self.compressor, self.segments, self.to_wire = config, compressor, segments, to_wire
        self.aggregation_name, self.aggregation, self.transport = aggregation_name, aggregation, transport
        self.dense = collectives.get("dense")  # its draws stay None: the warm-up sums exactly

    def __call__(self, c):
        c.offsets, c.k, c.seg_names = self.segments(c.names, c.sizes, c.density)
        if self.compressor.dense_at(c.step):
            c.aggregation_name, c.aggregation = "dense", self.dense
            c.idx, c.vals = None, c.acc
            return self.to_wire(c)
        c.aggregation_name, c.aggregation = self.aggregation_name, self.aggregation
        c.payload, c.vals = codec_contribution(self.compressor, c.acc, c.offsets, c.numel, c.dtype,
                                               _context(c, self.config, self.transport))
        if self.aggregation_name == payloads.NAME:  # the codec's shards and server residual
            payloads.bind(c.payload, self.compressor, c.seg_names)
        c.idx, c.wire_vals, c.exact = None, c.vals, False
        return c


class Aggregate:
    """Step 5: one message per partner per round for the whole call."""

    phase = "communicate"

    def __init__(self, config, compressor, transport):
        self.config, self.compressor, self.transport = config, compressor, transport

    def __call__(self, c):
        numel = c.numel
        # A dense sum in the gradients' dtype is taken in place in the
        # accumulator: such a step sends acc exactly, so its residual is zero
        # and error feedback never reads acc again; the update is then one
        # division out of it (no copy of N).
        out_buf = c.acc if c.aggregation_name == "dense" and c.wire_vals is c.acc else None
        c.agg = c.aggregation(Selection(
            idx=c.idx, vals=c.wire_vals, numel=numel, offsets=c.offsets, k=c.k,
            idx_dtype=kernels.index_dtype(numel), sum_dtype=c.dtype, static_count=self.compressor.exact_count,
            kernels=self.config.kernels, payload=c.payload, out=out_buf), self.transport)
        return c


class Residual:
    """Step 6: the residual becomes ``acc`` less what reached the global
    result, as it travelled (error feedback, the same rule for selectors and
    codecs); with momentum correction the velocity restarts where it was
    sent (DGC's momentum factor masking; not for dense methods, where the
    velocity is the plain momentum buffer)."""

    phase = "update"

    def __init__(self, config, memory, momentum):
        self.config, self.memory, self.momentum = config, memory, momentum

    def __call__(self, c):
        agg = c.agg
        sent_vals = wire.values(c.wire_vals, c.dtype)  # the int8 wire decoded (exact)
        c.reached = agg.reached if c.idx is not None and agg.reached is not None and \
            not bool(agg.reached.all()) else None  # None: every sent entry reached it
        self.memory.commit_step(c.flatres, c.acc, c.idx, sent_vals, c.exact, agg.residual_add,
                                self.config.kernels, reached=c.reached)
        if self.momentum.enabled and c.idx is not None:
            self.momentum.mask_(c.names, c.idx if c.reached is None else c.idx[c.reached])
        return c


class Update:
    """Step 7: the result divided by P (``op="average"``) or the sum, in the
    callers' shapes and dtypes, into ``out`` or the persistent update
    buffers.  An update handed out in a narrower dtype than the sums is
    clamped to its range, and that rounding lands in the owning rank's
    residual (:mod:`gtopk_plugin.pipeline.update_rounding`)."""

    phase = "update"

    def __init__(self, config, memory, updates, transport):
        self.config, self.memory, self.updates, self.transport = config, memory, updates, transport

    def form(self, c, divisor: int):
        """``(update, nnz)``; ``update`` is None when it went into ``out``."""
        return self.updates.result(c.agg, (tuple(c.names), c.dtype, c.acc.device), c.numel, divisor,
                                   c.flatres.bufs, self.config.kernels, c.out and [c.out[n] for n in c.names],
                                   c.out_reuse)

    def __call__(self, c):
        P, dtype = self.transport.size, c.dtype
        divisor = P if self.config.op == "average" else 1
        # narrower gradients: the exact result at the entries this rank
        # owns, taken before the update is formed (it may divide in place)
        owed = update_rounding.owned_result(c.agg, c.sizes, c.tensors, dtype, self.transport.rank, P) if any(
            t.dtype != dtype for t in c.tensors) and self.memory.enabled else None
        update, c.nnz = self.form(c, divisor)
        c.updates = {n: c.out[n] for n in c.names} if c.out is not None else {
            # narrower dtypes: clamped to their range, never ±inf
            n: u.view_as(t) if t.dtype == dtype else wire.to_wire(u.view_as(t), t.dtype)
            for n, u, t in zip(c.names, torch.split(update, c.sizes), c.tensors)}
        if owed is not None:
            self.memory.add_at(c.flatres, *update_rounding.charge(owed, c.names, c.sizes, c.updates, dtype,
                                                                  divisor))
        return c


class Record:
    """The call's statistics (bytes from the transport's counters, entries,
    phases' seconds); finishes the call."""

    phase = "update"

    def __init__(self, config, transport):
        self.config, self.transport = config, transport

    def __call__(self, c):
        tr = self.transport
        c.seconds["total"] = time.perf_counter() - c.t0
        c.seconds["wait"] = tr.wait_seconds - c.wait0  # inside the transport's primitives
        numel = c.numel
        reached: Optional[torch.Tensor] = c.reached
        sent = numel if c.idx is None else int(c.idx.numel()) if reached is None else int(reached.sum())
        c.stats = ReduceStats.from_counters(
            tr.counters.copy().minus(c.before), method=self.config.method, aggregation=c.aggregation_name,
            step=c.step, world_size=tr.size, numel=numel, k=int(c.k.sum()), density=c.density,
            selected=int(c.vals.numel()), result_nnz=int(c.nnz), sent_entries=sent, rounds=c.agg.rounds,
            seconds=c.seconds, dtype=c.dtype)
        return c
