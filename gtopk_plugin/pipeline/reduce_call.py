"""One ``GradientReducer.reduce()`` call as it moves through the stages
(docs/design.md §2): :class:`Call` carries the caller's arguments and what
each stage adds to them; :func:`run` passes it through a sequence of stages
(:class:`Stages`).

A stage is any callable ``Call -> Call``.  Each has a ``phase`` ("check",
"select", "communicate" or "update") that its time is counted under in
``last_stats.seconds``.  A stage that finishes the call early (a step every
rank skips) sets ``call.stats``; the stages after it do not run.
"""
from __future__ import annotations

import time
from typing import Any, Optional, Sequence

__all__ = ["Call", "Stages", "run"]


class Call:
    """The context of one call.  Stages fill in the fields in the order of
    docs/design.md §2; a field is ``None`` until then (class defaults: a
    call costs no more than the fields it sets)."""

    # check: the local checks, the fingerprint, the agreement
    step = density = bad = local_error = names = tensors = sizes = numel = layout = None
    grad_dtype = dtype = nonfinite = redo = before = wait0 = None
    # compensate / select or encode
    flatres = acc = picked = direct = offsets = k = seg_names = aggregation = aggregation_name = None
    idx = vals = wire_vals = payload = exact = None
    # aggregate, residual, update; stats: set when the call is finished
    agg = reached = updates = nnz = stats = None

    def __init__(self, grads, grad_norm: Optional[float] = None, loss_scale: Optional[float] = None,
                 out=None, out_reuse: bool = False):
        self.grads, self.grad_norm, self.loss_scale = grads, grad_norm, loss_scale
        self.out, self.out_reuse = out, out_reuse
        # what another stage adds to the cross-rank check: (layout entries,
        # non-finite names, bad input) -- the small tensors' part
        self.extra: Any = ((), (), None)
        self.t0 = time.perf_counter()
        self.seconds = {}


def run(stages: Sequence, call: Call) -> Call:
    """``call`` through ``stages`` in order, each stage's time added to its
    phase; stops after a stage that set ``call.stats`` (a finished call)."""
    seconds, clock = call.seconds, time.perf_counter
    t = clock()
    for stage in stages:
        call = stage(call)
        now, phase = clock(), stage.phase
        seconds[phase] = seconds.get(phase, 0.0) + (now - t)
        t = now
        if call.stats is not None:
            break
    return call


class Stages(tuple):
    """A sequence of stages, itself a stage: :func:`run` over them."""

    def __call__(self, call: Call) -> Call:
        return run(self, call)
