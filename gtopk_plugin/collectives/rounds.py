"""Allreduce rounds of a codec whose messages sum: PowerSGD's
two allreduces per step (Vogels et al. 2019, arXiv 1905.13727) and any
other linear sketch.

The codec (``compress/``, never communicating) is a generator:
``codec.rounds(acc, offsets, ctx, world_size)`` yields each flat message,
receives its sum over the workers (``s = yield msg``), and finally returns
``(result, contribution)``: the dense sum over workers and what this
worker's error feedback subtracts from ``acc``.  This module drives it:
each yielded message is summed by ``transport.allreduce_sum_`` in its own
dtype (counted with the ring model, 2·(P−1)/P of its bytes sent and
received, as the dense path counts it) and sent back into the generator.

:func:`codec_contribution` is the reducer's one codec entry point: for a
codec aggregated by payload allgather it encodes and decodes this worker's
payload (the contribution is known before the exchange); for a rounds codec
the contribution is known only after the rounds, so ``Selection.vals`` is a
buffer that :class:`RoundsAllReduce` fills before the reducer's error
feedback reads it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Generator

import torch

from gtopk_plugin.collectives.aggregation import Aggregated, Aggregation, Encoded, Selection, register
from gtopk_plugin.collectives.transport import Transport

Tensor = torch.Tensor
ROUNDS = "allreduce_rounds"


@dataclass
class Rounds:
    """A rounds codec's contribution in flight: ``start(world_size)`` makes
    the generator (see the module docstring)."""

    start: Callable[[int], Generator[Tensor, Tensor, tuple]]


def codec_contribution(codec, acc: Tensor, offsets: Tensor, numel: int, dtype: torch.dtype, ctx):
    """``(payload, vals)`` for the reducer's :class:`Selection` of a codec:
    an :class:`Encoded` payload and its decode (what every rank adds for
    this worker, and what error feedback keeps back), or for a rounds codec
    a :class:`Rounds` and the (still empty) buffer its contribution goes to."""
    if codec.aggregation == ROUNDS:
        return Rounds(lambda P: codec.rounds(acc, offsets, ctx, P)), torch.empty_like(acc)
    tensors = codec.encode(acc, offsets, ctx)
    payload = Encoded(tensors, lambda ts: codec.decode(ts, offsets, numel, dtype))
    return payload, payload.decode(list(tensors)).to(dtype)


@register(ROUNDS)
class RoundsAllReduce(Aggregation):
    """Drive a rounds codec: every message summed by one allreduce; the
    result is the codec's dense sum; ``sel.vals`` receives this worker's
    contribution (every contribution reaches the result)."""

    def __call__(self, sel: Selection, transport: Transport) -> Aggregated:
        if not isinstance(sel.payload, Rounds):
            raise ValueError("allreduce_rounds aggregates a codec that declares rounds() "
                             "(PowerSGD); this method's aggregation is another one")
        P = transport.size
        gen = sel.payload.start(P)
        allreduces = 0
        try:
            msg = next(gen)
            while True:
                msg = msg.contiguous()
                if P > 1:
                    transport.allreduce_sum_(msg)
                allreduces += 1
                msg = gen.send(msg)
        except StopIteration as stop:
            result, contribution = stop.value
        sel.vals.copy_(contribution)
        return Aggregated(None, result.to(sel.sum_dtype), None, allreduces * (0 if P == 1 else 2 * (P - 1)))
