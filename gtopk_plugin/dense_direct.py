"""The dense method's step with one pass of local work (issue #15).

S-SGD's allreduce needs the gradients in one flat buffer, and the update
is that buffer's sum divided by P.  The general path writes the gradients
into the scratch accumulator (with the finiteness check), sums there, and
divides into an update buffer: two passes over N.  Here the gradients are
written straight into the update buffer -- already divided by P where P is
a power of two, and with their nonzeros counted -- which the engine then
sums in place: one pass, plus a read that counts the sum's nonzeros for
the stats where P > 1 (at P = 1 the copy is the update).

Bit for bit the general path's result.  A sum of values prescaled by 2^-s
equals the sum divided by 2^s afterwards when every scaled value is exact
and no partial sum can overflow (``kernels.prescale_copy`` checks both,
per entry, in the same pass; the consistency check makes every rank agree).
Where any rank's values fail it, every rank redoes the copy unscaled and
divides after the sum; likewise for a P that is not a power of two.

Taken when the step needs nothing else of the accumulator: the ``dense``
method with values sent in the gradients' dtype, no momentum, clipping,
optimizer binding or loss-scale change, a zero residual (always so after
a dense step; a residual loaded from a sparse method takes the general
path once), no ``out=`` tensors, on CPU (the CUDA back end keeps its own
compensation and division kernels).
"""
from __future__ import annotations

from typing import List, Optional

import torch

from . import kernels
from .compress.dense import DenseSelector

Tensor = torch.Tensor


def _shift(P: int, op: str) -> int:
    """log2 of the divisor folded into the copy: P for op="average" when a
    power of two, else none (op="sum", or a division after the sum)."""
    if op == "average" and P > 1 and P & (P - 1) == 0:
        return P.bit_length() - 1
    return 0


def applies(red, out, dtype, device) -> bool:
    """Whether this call of ``red`` (a GradientReducer) takes the one-pass
    dense step; the same answer on every rank for the same call."""
    cfg = red.config
    return (out is None and type(red.compressor) is DenseSelector and red.aggregation == "dense"
            and (cfg.value_dtype is None or cfg.value_dtype == dtype)
            and torch.device(device).type == "cpu")


class DirectStep:
    """One call's buffers: ``update`` (a ring buffer of the reducer's
    UpdateBuffers, which the engine sums in place and the caller receives)
    and the flags of the copy."""

    def __init__(self, red, names, sizes, tensors, dtype, P: int):
        self.red, self.P = red, P
        self.flatres = red.memory.layout(names, sizes, dtype, tensors[0].device)
        self.update, _ = red._updates.take((tuple(names), dtype, tensors[0].device), sum(sizes), dtype,
                                           tensors[0].device, None)
        self.parts = list(torch.split(self.update, list(sizes)))
        self.shift = _shift(P, red.config.op)
        self.nonfinite: List[str] = []
        self.exact, self.nnz = True, 0
        self.copy(names, tensors, self.shift)

    @staticmethod
    def residual_zero(red, names, sizes, dtype, device) -> bool:
        """No residual to add (the step's gradients are the accumulator)."""
        return not red.memory.enabled or red.memory.layout(names, sizes, dtype, device).zero

    def copy(self, names, tensors, shift: int) -> None:
        """grad * 2^-shift into the update buffer, with the flags."""
        self.shift, self.nonfinite, self.exact, self.nnz = shift, [], True, 0
        for n, t, part in zip(names, tensors, self.parts):
            finite, exact, nnz = kernels.prescale_copy(part, t.detach(), shift, kernels=self.red.config.kernels)
            if not finite:
                self.nonfinite.append(n)
            self.exact &= exact
            self.nnz += nnz

    def redo_unscaled(self, names, tensors) -> None:
        """Some rank's prescaled values were not exact: every rank copies
        its gradients as they are and divides after the sum."""
        self.copy(names, tensors, 0)

    def finish(self, agg, divisor: int):
        """``(update, nnz)``: the summed buffer, divided (unless the copy
        was prescaled) and counted in one pass."""
        if agg.vals is not self.update:  # an engine that did not sum in place
            self.update.copy_(agg.vals.view(-1))
        elif self.P == 1 and divisor == 1:
            return self.update, self.nnz  # the copy was the update, counted as it was written
        d = 1 if self.shift else divisor
        return self.update, kernels.div_count_(self.update, d, kernels=self.red.config.kernels)


def start(red, out, names, sizes, tensors, dtype, P: int) -> Optional[DirectStep]:
    """The one-pass step's copy when this call (on the reducer's fused
    path: nothing but the residual goes into the accumulator) takes it,
    else ``None``."""
    if not applies(red, out, dtype, tensors[0].device):
        return None
    if not DirectStep.residual_zero(red, names, sizes, dtype, tensors[0].device):
        return None
    return DirectStep(red, names, sizes, tensors, dtype, P)
