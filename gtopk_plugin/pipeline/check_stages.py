"""The stages of a reduce() call up to the accumulator (docs/design.md §2,
steps 1-3): :class:`Validate` (local checks, the fingerprint), one of the
early compensations (:class:`GradsFinite`, :class:`CompensateEarly`,
:class:`FusedTopK`, or :class:`gtopk_plugin.pipeline.dense_direct.DensePath`),
:class:`Agree` (the cross-rank check) and :class:`Compensate` (``acc = grad
+ residual`` where it could not be built before the check).

Why compensate before the check: where nothing changes state first, the
compensation and the finiteness check of ``acc`` are one pass into the
scratch accumulator, and a step the check refuses leaves the residual as it
was (the scratch is discarded).  Momentum correction, clipping, an optimizer
binding, a changed loss scale or mixed dtypes change state or need the
agreement first: those calls check their gradients only and compensate after.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from gtopk_plugin import kernels
from gtopk_plugin.pipeline import input_check
from gtopk_plugin.pipeline.layout import (all_finite, clip_scale, flat_dtype, memory_check, segment_ks,
                                          state_dtype, validate_grads)
from gtopk_plugin.pipeline.reduce_stats import ReduceStats
from gtopk_plugin.pipeline.update_buffers import check_out

__all__ = ["Validate", "GradsFinite", "CompensateEarly", "FusedTopK", "Agree", "Compensate", "buffers",
           "compensates_after_check"]


def compensates_after_check(config, binding=None) -> bool:
    """Whether every call takes the general path whatever its gradients
    (momentum correction, clipping, an optimizer binding: they change state,
    so the accumulator is built after the check and its overflow agreed on
    separately)."""
    return config.momentum_correction is not None or config.clip_norm is not None or binding is not None


def _device_of(tensors):
    """The gradients' device (None when the input is not tensors: bad input)."""
    t = tensors[0] if tensors else None
    return t.device if isinstance(t, torch.Tensor) else None


def buffers(memory, names, sizes, dtype, device):
    """``(flatres, acc, acc views, residual views)``: this layout's
    persistent residual and scratch accumulator, per-name views (residual
    views ``None`` where it is known zero or error feedback is off: the
    compensation is then a copy)."""
    f = memory.layout(names, sizes, dtype, device)
    acc, parts = f.accumulator()
    res_parts = f.views[f.cur] if memory.enabled and not f.zero else [None] * len(parts)
    return f, acc, parts, res_parts


class Validate:
    """Step 1: the local checks, the call's fingerprint, and this layout's
    buffers.  A failure is not raised here: it becomes the call's bad input,
    which :class:`Agree` makes every rank raise."""

    phase = "check"

    def __init__(self, config, aggregation: str, compressor, state, transport):
        self.config, self.aggregation, self.compressor = config, aggregation, compressor
        self.state, self.transport = state, transport
        self.full = compressor.kind == "codec"  # a codec takes whole segments

    def __call__(self, c):
        c.step = self.state.step
        c.bad, c.names, c.tensors = validate_grads(c.grads)
        c.bad = c.bad or check_out(c.out, c.names, c.tensors)
        c.density = self.config.density_at(c.step)
        c.sizes = [t.numel() for t in c.tensors]
        c.numel = sum(c.sizes)
        c.layout = self.fingerprint(c)
        c.before, c.wait0 = self.transport.counters.copy(), self.transport.wait_seconds
        if not c.bad:
            # grad_dtype: the gradients' (the update's and, by default, the
            # wire's); dtype: the state's and the sums' -- float32 for
            # fp16/bf16 gradients (docs/design.md §3, half precision)
            c.grad_dtype = flat_dtype(c.tensors)
            c.dtype = state_dtype(c.grad_dtype)
            # local failures before the exchange (state that does not fit
            # the gradients, memory) go through the cross-rank check as bad
            # input, so every rank raises at once instead of waiting for a
            # peer that will never send
            try:
                c.bad = self.prepare(c)
            except (RuntimeError, ValueError) as e:
                c.local_error, c.bad = e, f"{type(e).__name__}: {e}"
        return c

    def prepare(self, c) -> Optional[str]:
        """The first call on a layout checks that its buffers fit in memory;
        the layout's residuals are imported (one that does not fit the
        gradient raises)."""
        memory, device = self.state.memory, c.tensors[0].device
        if not memory.has_layout(c.names, c.sizes, c.dtype, device):
            msg = memory_check(c.tensors, c.dtype)
            if msg:
                return msg
        memory.layout(c.names, c.sizes, c.dtype, device)
        return None

    def fingerprint(self, c) -> list:
        """What the ranks must agree on.  Everything that changes the result
        is here: the tensors, the method and its hyper-parameters, the wire
        and its rounding, the seed (random-k's shared draws, stochastic
        rounding), the non-finite policy, error feedback, momentum
        correction (and an optimizer binding's settings for these names),
        clipping, ``dense_below``, the step and the loss scale."""
        cfg, binding = self.config, self.state.binding
        ks = segment_ks(c.sizes, c.density, cfg.granularity, full=self.full)
        layout = [(n, tuple(t.shape), str(t.dtype)) for n, t in zip(c.names, c.tensors)]
        layout.append(("settings", cfg.method, self.aggregation, cfg.granularity, str(cfg.value_dtype),
                       cfg.wire_rounding, cfg.op, c.step, tuple(ks)))
        layout.append(("policy", cfg.seed, cfg.nonfinite, cfg.error_feedback,
                       cfg.momentum_correction, cfg.nesterov,
                       cfg.dampening, cfg.momentum_masking, cfg.clip_norm, cfg.dense_below,
                       None if c.loss_scale is None else float(c.loss_scale)))
        if binding is not None:
            layout.append(("optimizer",) + tuple(binding.fingerprint(c.names)))
        if self.compressor.hyperparams:
            layout.append(("hyper",) + tuple(sorted(self.compressor.hyper.items())))
        return layout


class GradsFinite:
    """Before the check, where the compensation changes state (momentum
    correction, clipping): only the gradients' finiteness."""

    phase = "check"

    def __call__(self, c):
        c.nonfinite = [] if c.bad else [n for n, t in zip(c.names, c.tensors) if not all_finite(t)]
        return c


class CompensateEarly:
    """Step 3 ahead of the check, where nothing changes state first: ``acc =
    grad + residual`` and its finiteness in one pass into the scratch
    accumulator.  A call that cannot (bad input, mixed dtypes, a changed
    loss scale, an optimizer binding) only checks its gradients here."""

    phase = "select"  # the select phase includes compensation: phases tile the call

    def __init__(self, state, kernels_backend: Optional[str]):
        self.state, self.kernels = state, kernels_backend
        self.grads_finite = GradsFinite()

    def fits(self, c) -> bool:
        st = self.state
        return (not c.bad and not st.momentum.enabled and st.binding is None
                and all(t.dtype == c.grad_dtype for t in c.tensors)
                and (c.loss_scale is None or float(c.loss_scale) == st.loss_scale))

    def __call__(self, c):
        if not self.fits(c):
            return self.grads_finite(c)
        return self.compensate(c)

    def compensate(self, c):
        c.flatres, c.acc, parts, res_parts = buffers(self.state.memory, c.names, c.sizes, c.dtype,
                                                     c.tensors[0].device)
        c.nonfinite = [n for n, t, part, r in zip(c.names, c.tensors, parts, res_parts)
                       if not kernels.compensate(part, t.detach(), r, kernels=self.kernels)]
        return c


class FusedTopK(CompensateEarly):
    """:class:`CompensateEarly` for the exact top-k selectors (whose
    ``select()`` is ``kernels.select_topk``): compensation, finiteness check
    and the selection in one pass; the selection waits in ``call.picked``."""

    def __init__(self, state, kernels_backend: Optional[str], segments):
        super().__init__(state, kernels_backend)
        self.segments = segments

    def compensate(self, c):
        c.flatres, c.acc, _, res_parts = buffers(self.state.memory, c.names, c.sizes, c.dtype,
                                                 c.tensors[0].device)
        offsets, k, _ = self.segments(c.names, c.sizes, c.density)
        res = c.flatres.residual if res_parts[0] is not None else None
        idx, vals, finite = kernels.compensate_select_topk(
            c.acc, [t.detach() for t in c.tensors], res, offsets, k, kernels=self.kernels)
        c.picked = (idx, vals)
        c.nonfinite = [n for n, ok in zip(c.names, finite.tolist()) if not ok]
        return c


class Agree:
    """Step 2: the cross-rank check (bad input, layout, non-finite values;
    :mod:`gtopk_plugin.pipeline.input_check`).  Bad input or a mismatch
    raises on every rank; a non-finite step raises (``nonfinite="raise"``)
    or finishes the call on every rank with zero (``"skip"``) or +inf
    (``"propagate"``) updates, residuals untouched."""

    phase = "check"

    def __init__(self, config, aggregation: str, transport, updates, state):
        self.config, self.aggregation, self.transport, self.updates = config, aggregation, transport, updates
        self.state = state

    def __call__(self, c):
        layout, nonfinite, bad = c.extra
        bad, nonfinite = c.bad or bad, c.nonfinite + list(nonfinite)
        own = bad
        if self.state.joint_check is not None:
            # ranks outside the transport that must take the same path (the
            # other shards of an FSDP replica): their verdicts join this
            # rank's before the transport's agreement spreads them
            bad, nonfinite = self.state.joint_check(bad, nonfinite)
        # the flag: "no exact prescaled copy here" (dense_direct: any rank's makes all redo it)
        try:
            any_nonfinite, where, c.redo = input_check.check_flagged(
                self.transport, c.layout + list(layout), bad, nonfinite,
                flag=c.direct is None or c.direct.flag, device=_device_of(c.tensors))
        except ValueError as e:
            if c.local_error is not None:
                raise c.local_error from None  # every peer raises PeerInputError naming it
            if own is None:  # the joint check's: another rank's input
                raise input_check.PeerInputError(f"another rank passed invalid input to reduce(): {e}") from None
            raise
        if not any_nonfinite:
            return c
        if self.config.nonfinite == "raise":
            detail = "; ".join(f"rank {r}: {', '.join(n)}" for r, n in where)
            raise input_check.NonFiniteGradientError(
                f"gtopk_plugin: non-finite gradient or accumulator (NaN or Inf, or gradient + "
                f"residual overflowed) in {detail}; nothing was applied and residuals are "
                "unchanged (pass nonfinite='skip' to skip such steps)")
        return self.skip(c)

    def skip(self, c):
        """Every rank returns zero (+inf: ``"propagate"``) updates and keeps
        its residuals; the step's gradients are dropped on all ranks."""
        fill = math.inf if self.config.nonfinite == "propagate" else 0.0
        self.updates.forget_outs()  # every entry of out is written now
        c.updates = {n: c.out[n].fill_(fill) if c.out is not None else torch.full_like(t, fill)
                     for n, t in zip(c.names, c.tensors)}
        st = ReduceStats(method=self.config.method, aggregation=self.aggregation, step=c.step,
                         world_size=self.transport.size, numel=c.numel, k=0, density=c.density,
                         skipped=True, seconds=c.seconds)
        st.control_bytes = self.transport.counters.copy().minus(c.before).control_bytes
        c.stats = st
        return c


class Compensate:
    """Step 3 after the check, for calls not compensated before it: ``acc =
    grad (clipped, + weight decay, through the velocity) + residual``, and
    one more one-flag agreement that no rank's accumulator overflowed."""

    phase = "select"

    def __init__(self, config, state, transport):
        self.config, self.state, self.transport = config, state, transport

    def __call__(self, c):
        if c.acc is not None:  # compensated before the check
            return c
        cfg, st = self.config, self.state
        names, loss_scale = c.names, c.loss_scale
        st.follow_loss_scale(loss_scale)
        flat = [t.detach().reshape(-1).to(c.dtype) for t in c.tensors]
        scale = clip_scale(cfg.clip_norm, flat, c.grad_norm, loss_scale, self.transport.size)
        if scale != 1.0:
            flat = [g * scale for g in flat]
        if st.binding is not None:
            # the optimizer's momentum settings of this step, and its weight
            # decay added to the (clipped) gradient as SGD adds it (in the
            # gradient's units: times the loss scale under AMP)
            st.momentum.per_name.update(st.binding.specs(names))
            ls = 1.0 if loss_scale is None else float(loss_scale)
            flat = [st.binding.add_weight_decay(n, g, ls) for n, g in zip(names, flat)]
        c.flatres, c.acc, parts, res_parts = buffers(st.memory, names, c.sizes, c.dtype, c.tensors[0].device)
        if st.momentum.enabled:
            flat = st.momentum.accumulate(names, c.sizes, flat, c.dtype, c.acc.device, scratch=parts)
        overflow = [n for n, g, part, r in zip(names, flat, parts, res_parts)
                    if not kernels.compensate(part, g, r, kernels=cfg.kernels)]
        # the ranks outside the transport too (see Agree), where every call
        # on every rank takes this path: the number of joint checks per call
        # must not depend on one rank's gradients (mixed dtypes)
        if st.joint_check is not None and compensates_after_check(cfg, st.binding):
            overflow = st.joint_check(None, overflow)[1]
        input_check.check_state_finite(self.transport, overflow, device=c.acc.device)
        return c
