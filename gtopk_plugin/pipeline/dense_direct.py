"""The dense method's step with one pass of local work.

The gradients are written straight into the update buffer -- prescaled by
1/P where P is a power of two, nonzeros counted -- and the engine sums in
place: one pass instead of the general path's copy, sum and divide.  Bit
for bit the general path's result: ``kernels.prescale_copy`` checks per
entry that prescaling is exact, and the consistency check's flag makes
every rank redo the copy unscaled (dividing after the sum) where any rank
fails it.  float16 and a P that is not a power of two are never prescaled.
The argument: docs/design.md §9, "The dense method in one pass".

Stages of a reducer running ``dense`` with its dense aggregation:
:class:`DensePath` (the copy, before the check), :class:`RedoCopy` (the
redo, after it) and :class:`DirectUpdate`.  A call takes this path only
when it needs nothing else of the accumulator: values in the gradients'
dtype, no momentum, clipping, optimizer binding or loss-scale change, a
zero residual, no ``out=`` tensors, on CPU.  The gradients must not change
during the call (a redo reads them again).
"""
from __future__ import annotations

from typing import Optional

import torch

from gtopk_plugin import kernels
from gtopk_plugin.pipeline.check_stages import CompensateEarly
from gtopk_plugin.pipeline.exchange_stages import Update

Tensor = torch.Tensor


def _shift(P: int, op: str, dtype) -> int:
    """log2 of the divisor folded into the copy: P for op="average" when a
    power of two, else none (op="sum", float16, or a division after the
    sum)."""
    if op == "average" and P > 1 and P & (P - 1) == 0 and dtype != torch.float16:
        return P.bit_length() - 1
    return 0


class DensePath(CompensateEarly):
    """The early compensation of the dense method: the gradients straight
    into an update buffer (``call.direct``) where the call allows, else
    :class:`CompensateEarly`'s.

    Back-off: data that is never exactly prescalable would pay a third
    pass (the redo) every call.  After a call whose prescaled copy had to
    be redone, the reducer tries prescaling again only on calls whose step
    is a multiple of 2, then 4, ... (up to 2^:attr:`MAX_LEVEL`), copying
    unscaled up front on the others; a prescaled call that goes through
    resets it.  The schedule follows the step counter, the same on every
    rank, so ranks whose levels differ (one could not take the path for a
    call) still try together at the higher level's multiples and agree."""

    MAX_LEVEL = 6

    def __init__(self, config, state, updates, transport):
        super().__init__(state, config.kernels)
        self.config, self.updates, self.transport = config, updates, transport
        self.level = 0  # try prescaling on steps that are multiples of 2^level

    def compensate(self, c):
        c.direct = self.start(c) if c.grad_dtype == c.dtype else None
        if c.direct is None:
            return super().compensate(c)
        c.flatres, c.acc, c.nonfinite = c.direct.flatres, c.direct.update, c.direct.nonfinite
        return c

    def start(self, c) -> Optional["DirectStep"]:
        """The one-pass step's copy when this call takes it, else ``None``."""
        cfg, memory, device = self.config, self.state.memory, c.tensors[0].device
        if not (c.out is None and (cfg.value_dtype is None or cfg.value_dtype == c.dtype)
                and device.type == "cpu"):
            return None
        flatres = memory.layout(c.names, c.sizes, c.dtype, device)
        if memory.enabled and not flatres.zero:
            return None  # a residual to add: the accumulator's path
        P = self.transport.size
        shift = _shift(P, cfg.op, c.dtype)
        if c.step % (1 << self.level):
            shift = 0  # backing off: unscaled up front (and flagged)
        update, _ = self.updates.take((tuple(c.names), c.dtype, device), c.numel, c.dtype, device, None)
        return DirectStep(update, flatres, c.names, c.sizes, c.tensors, P, shift, cfg.kernels)

class RedoCopy:
    """The stage after the cross-rank check: redo the copy unscaled where
    any rank did not prescale exactly, and move ``path``'s back-off."""

    phase = "check"

    def __init__(self, path: DensePath):
        self.path = path

    def __call__(self, c):
        step, path = c.direct, self.path
        if step is None or not step.shift:
            return c
        if c.redo:
            path.level = min(path.level + 1, path.MAX_LEVEL)
            step.copy(c.names, c.tensors, 0)
        else:
            path.level = 0
        return c


class DirectUpdate(Update):
    """:class:`Update` that finishes the one-pass step where the call took it."""

    def form(self, c, divisor: int):
        return c.direct.finish(c.agg, divisor) if c.direct is not None else super().form(c, divisor)


class DirectStep:
    """One call's buffers: ``update`` (a ring buffer of the reducer's
    UpdateBuffers, which the engine sums in place and the caller receives)
    and the flags of the copy."""

    def __init__(self, update, flatres, names, sizes, tensors, P: int, shift: int, kernels_backend):
        self.P, self.flatres, self.update, self.kernels = P, flatres, update, kernels_backend
        self.parts = list(torch.split(self.update, list(sizes)))
        self.copy(names, tensors, shift)

    @property
    def flag(self) -> bool:
        """The consistency check's flag: this rank's copy is not an exact
        prescaled one (every rank that prescaled must then redo it)."""
        return not (self.shift and self.exact)

    def copy(self, names, tensors, shift: int) -> None:
        """grad * 2^-shift into the update buffer, with the flags."""
        self.shift, self.nonfinite, self.exact, self.nnz = shift, [], True, 0
        for n, t, part in zip(names, tensors, self.parts):
            finite, exact, nnz = kernels.prescale_copy(part, t.detach(), shift, kernels=self.kernels)
            if not finite:
                self.nonfinite.append(n)
            self.exact &= exact
            self.nnz += nnz

    def finish(self, agg, divisor: int):
        """``(update, nnz)``: the summed buffer, divided (unless the copy
        was prescaled) and counted in one pass."""
        if agg.vals is not self.update:  # an engine that did not sum in place
            self.update.copy_(agg.vals.view(-1))
        elif self.P == 1:
            return self.update, self.nnz  # the copy was the update, counted as it was written
        d = 1 if self.shift else divisor
        return self.update, kernels.div_count_(self.update, d, kernels=self.kernels)
