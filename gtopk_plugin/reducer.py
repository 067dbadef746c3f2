"""GradientReducer: composes a compressor (a selector or a codec), error
feedback, an aggregation and a transport into one sparse (or dense, or
encoded) gradient reduction per call.

Semantics (DESIGN.md §3): ``acc = grad + residual``; the compressor picks
entries of ``acc`` (exactly ``k_s = max(1, ceil(density·n_s))`` per segment
for the exact selectors) or encodes it into a payload; the aggregation
combines the contributions across workers (dense allreduce, sparse
allgather, the gTop-k butterfly, or an allgather of payloads that every rank
decodes and sums); the residual becomes ``acc`` less what this worker's
contribution actually put into the global result (as it travelled, or as
decoded); the update is the result divided by P (``op="average"``) or the
plain sum (``op="sum"``).  Mass conservation holds for every method:
Σ_ranks Σ_steps grad = Σ_steps result(op=sum) + Σ_ranks residual.

The method, its hyper-parameters and its aggregation come from the registry
(:mod:`gtopk_plugin.registry`); the layout helpers (segments, k, checks)
from :mod:`gtopk_plugin.pipeline.layout`; the update buffers from
:mod:`gtopk_plugin.pipeline.update_buffers`.
"""
from __future__ import annotations

import math
import time
from typing import Dict, Mapping, Optional

import torch

from gtopk_plugin import collectives, kernels

from gtopk_plugin.pipeline import input_check as consistency

from gtopk_plugin.pipeline import dense_direct

from gtopk_plugin.pipeline import small_tensors

from gtopk_plugin.pipeline import update_rounding
from gtopk_plugin.collectives import Selection, Transport, payloads as _payloads, wire
from gtopk_plugin.collectives.rounds import codec_contribution
from gtopk_plugin.collectives.torch_distributed import TorchDistributedTransport
from gtopk_plugin.compress import ErrorFeedback, SelectionContext
from gtopk_plugin import registry
from gtopk_plugin.compress.momentum import MomentumCorrection, MomentumSpec
from gtopk_plugin.compress.topk import GTopKSelector, TopKSelector
from gtopk_plugin.config import ReducerConfig
from gtopk_plugin.pipeline.reducer_state import ReducerState
from gtopk_plugin.pipeline.layout import (Segments, all_finite, clip_scale, flat_dtype, global_segment_name,  # noqa: F401
                     k_for, local_grad_norm, memory_check, segment_ks, state_dtype, validate_grads)
from gtopk_plugin.pipeline.reduce_stats import ReduceStats
from gtopk_plugin.pipeline.update_buffers import UpdateBuffers, check_out

Tensor = torch.Tensor
_all_finite = all_finite  # the name before the split (issue #16)

__all__ = ["GradientReducer", "k_for", "global_segment_name", "local_grad_norm", "UpdateBuffers"]

# Selectors whose select() is exactly kernels.select_topk(acc, offsets, k):
# the reducer may fuse it with the compensation (kernels.compensate_select_topk).
# Exact types: a subclass may override select().
_FUSED_TOPK = (TopKSelector, GTopKSelector)


class GradientReducer(ReducerState):
    """Reduce a dict of named gradients across workers.

    Example::

        red = GradientReducer(method="gtopk", density=0.01)
        updates = red.reduce({n: p.grad for n, p in model.named_parameters()})

    Args (hyper-parameters; validated, ``ValueError`` on bad values):
        method: a registered compressor: ``gtopk_plugin.compress.available()``
            ("dense", "topk", "gtopk", "rtopk", "randomk", "threshold",
            "onebit", and any registered from user code).
        density: fraction of entries kept per segment, in (0, 1] (ignored by
            methods that do not select: ``describe(method)["uses_density"]``).
        r_factor: rTop-k's r (keep k of the top r·k), >= 1; routed to any
            method that declares ``r_factor``.
        **hyper: the method's own hyper-parameters, as it declares them
            (``gtopk_plugin.compress.describe(method)["hyperparams"]``).
        merge: None (the method's own aggregation) or one of the method's
            ``merges`` ("allgather" or "gtopk" for the sparse selectors:
            ``merge="gtopk"`` puts any of them on the butterfly).
        granularity: "layer" (k per tensor) or "global" (k over the bucket).
        value_dtype: None, torch.float16, torch.bfloat16, or torch.int8 (5
            bytes per entry: int8 codes with a power-of-two scale per message,
            the rounding error kept exactly in the residual; docs/api.md):
            values on the wire (selectors; a codec sets its own wire format).
        wire_rounding: the int8 wire's rounding, "nearest" (default) or
            "stochastic" (unbiased; draws keyed by (seed, step), like
            random-k's).
        op: "average" (divide by P) or "sum".
        transport: a :class:`Transport`; default: torch.distributed's default group.
        seed: seed of random-k's shared draws and rTop-k's per-rank draws
            (both keyed by (seed, step, tensor name), so the step counter is
            the whole RNG state).
        warmup: density schedule for the first steps (``DensityWarmup``, a
            sequence of densities, or a callable step -> density).
        nonfinite: "raise" (error on every rank, nothing applied) or "skip"
            (the step is skipped on every rank; residuals untouched).
        error_feedback: keep the residual (default True).
        kernels: force a kernels back end ("reference", "cpu", "cuda");
            default: ``GTOPK_KERNELS`` or automatic.
        momentum, nesterov, dampening: DGC momentum correction (Lin et al.
            2018): each worker keeps a velocity u <- m·u + g and accumulates
            u, not g, into the residual; the optimizer that applies the
            update must then have no momentum of its own (the Horovod and
            DDP layers arrange that from the optimizer; see docs/momentum.md).
            ``None`` (default): off.
        momentum_masking: zero the velocity where the accumulator reached the
            result (DGC's momentum factor masking; default True).
        clip_norm: DGC local gradient clipping: each worker scales its
            gradient so that its L2 norm over the step's tensors is at most
            ``clip_norm · P^-1/2`` before it enters the velocity/accumulator.
        dense_below: tensors with fewer entries go dense (exact allreduce, no
            residual) in the same call; 0 = off (:mod:`.small_tensors`).

    ``nonfinite="propagate"`` (for AMP loss scalers) returns updates filled
    with +inf on every rank, residuals and velocities untouched, so every
    rank's ``GradScaler`` skips the step and lowers its scale together.
    """

    def __init__(self, method: str = "gtopk", density: float = 0.01, r_factor: float = 4.0,
                 merge: Optional[str] = None, granularity: str = "layer",
                 value_dtype: Optional[torch.dtype] = None, op: str = "average",
                 transport: Optional[Transport] = None, seed: int = 0, warmup=None,
                 nonfinite: str = "raise", error_feedback: bool = True,
                 kernels: Optional[str] = None, momentum: Optional[float] = None,
                 nesterov: bool = False, dampening: float = 0.0, momentum_masking: bool = True,
                 clip_norm: Optional[float] = None, dense_below: int = 0, wire_rounding: str = "nearest",
                 **hyper):
        kw = {} if kernels is None else {"kernels": kernels}
        self.config = ReducerConfig(method=method, density=density, r_factor=r_factor, merge=merge,
                                    granularity=granularity, value_dtype=value_dtype, op=op,
                                    seed=seed, warmup=warmup, nonfinite=nonfinite,
                                    error_feedback=bool(error_feedback), momentum=momentum,
                                    nesterov=bool(nesterov), dampening=dampening,
                                    momentum_masking=bool(momentum_masking), clip_norm=clip_norm,
                                    hyper=hyper, dense_below=dense_below, wire_rounding=wire_rounding, **kw)
        if transport is None:
            transport = TorchDistributedTransport()
        if not isinstance(transport, Transport):
            raise ValueError(f"transport must be a gtopk_plugin Transport; got {type(transport).__name__}")
        self.transport = transport
        # the compressor, built with its declared hyper-parameters (validated)
        self.compressor = registry.get(method)(**self.config.method_hyper)
        self.codec = self.compressor.kind == "codec"
        self.aggregation = self.config.aggregation
        self._aggregation = collectives.get(self.aggregation)
        # -- internal state (checkpointed) --
        self.memory = ErrorFeedback(self.config.error_feedback)
        cfg = self.config
        self.momentum = MomentumCorrection(
            None if cfg.momentum is None else MomentumSpec(cfg.momentum, cfg.nesterov, cfg.dampening),
            masking=cfg.momentum_masking)
        self.binding = None  # OptimizerBinding: momentum and weight decay from an optimizer
        # the loss scale the residuals and velocities are expressed in (AMP)
        self.loss_scale: Optional[float] = None
        self.step = 0
        self.last_stats: Optional[ReduceStats] = None
        # persistent dense update buffers per layout (see reduce(): lifetime)
        self._updates = UpdateBuffers()
        self._segments = Segments(cfg.granularity, full=self.codec)
        self._also = None  # the small tensors' part of the check (small_tensors.py)
        self._small = small_tensors.SmallTensors(self) if cfg.dense_below else None
        self._dense = dense_direct.DensePath(self)  # the dense method's one-pass step (CPU)

    @property
    def selector(self):
        """The compressor (the name from before codecs existed)."""
        return self.compressor

    # ------------------------------------------------------------------ API
    def reduce(self, grads: Mapping[str, Tensor], *, advance_step: bool = True,
               grad_norm: Optional[float] = None, loss_scale: Optional[float] = None,
               out: Optional[Mapping[str, Tensor]] = None, out_reuse: bool = False) -> Dict[str, Tensor]:
        """Reduce ``grads`` (name -> dense gradient) across all ranks and return
        name -> dense update (same shapes and dtypes).  Collective: every rank
        calls it with the same names, shapes and dtypes.

        ``advance_step=False`` keeps the step counter (and so the warm-up
        density and random-k seeds) for a further call in the same training
        step, as the DDP hook does for all buckets but the last.

        ``grad_norm``: with ``clip_norm``, this worker's gradient L2 norm over
        the whole step when the step spans several calls (buckets); default:
        the norm of this call's tensors.  ``loss_scale``: the AMP loss scale
        the gradients carry (``GradScaler.get_scale()``); residuals and
        velocities are kept in the scale of the latest call and rescaled
        exactly (powers of two) when it changes, and the clipping threshold
        is scaled with it.  ``out``: name -> contiguous tensor like the
        gradient (it may be the gradient itself: it is written only after
        the gradients were read) to receive each update, returned as the
        dict; a sparse update then costs a zero fill and O(k) writes there.
        ``out_reuse=True`` promises that ``out`` holds what this reducer
        wrote there last, untouched since: only those entries are cleared.

        Memory (issue #15): no N-sized allocation in steady state on the
        butterfly and dense paths.  Residuals and the scratch accumulator
        are persistent per layout (see :mod:`.compress.error_feedback`);
        without ``out`` the updates are views into persistent buffers,
        reused once the caller has dropped every tensor of an earlier call
        (see :class:`UpdateBuffers`): do not write into them.
        """
        parts = self._small and small_tensors.split(grads, self._small.threshold)
        kw = dict(advance_step=advance_step, grad_norm=grad_norm, loss_scale=loss_scale, out=out,
                  out_reuse=out_reuse)
        # not thread-safe (state and the group's collective order): a second
        # thread inside meanwhile gets ConcurrentUseError, never a crash
        with self.transport.exclusive("GradientReducer.reduce()"):
            return self._small.reduce(self, *parts, **kw) if parts else self._reduce(grads, **kw)

    def _reduce(self, grads, *, advance_step, grad_norm, loss_scale, out=None, out_reuse=False):
        t0 = time.perf_counter()
        cfg = self.config
        bad, names, tensors = validate_grads(grads)
        bad = bad or check_out(out, names, tensors)
        density = cfg.density_at(self.step)
        layout, sizes = self._layout(names, tensors, density, loss_scale)
        P = self.transport.size
        before, wait0 = self.transport.counters.copy(), self.transport.wait_seconds
        # grad_dtype: the gradients' (the update's and, by default, the
        # wire's); dtype: the state's and the sums' -- float32 for fp16/bf16
        # gradients (docs/design.md §3, half precision)
        grad_dtype = flat_dtype(tensors) if not bad else None
        dtype = state_dtype(grad_dtype) if not bad else None
        # Fast path: nothing changes state before the cross-rank check, so
        # the compensation acc = grad + residual and the finiteness check of
        # acc run as one pass into the scratch accumulator, ahead of the
        # check.  Momentum, clipping, an optimizer binding, a changed loss
        # scale or mixed dtypes take the general path: check first.
        fused = (not bad and not self.momentum.enabled and cfg.clip_norm is None
                 and self.binding is None and all(t.dtype == grad_dtype for t in tensors)
                 and (loss_scale is None or float(loss_scale) == self.loss_scale))
        t_comp = 0.0
        flatres = acc = picked = direct = None
        local_error = None
        if not bad:
            # local failures before the exchange (state that does not fit
            # the gradients, memory) go through the cross-rank check as bad
            # input, so every rank raises at once instead of waiting for a
            # peer that will never send
            try:
                bad = self._prepare(names, sizes, tensors, dtype)
            except (RuntimeError, ValueError) as e:
                local_error, bad = e, f"{type(e).__name__}: {e}"
            if bad:
                fused = False
        if bad:
            nonfinite = []
        elif fused:
            tc = time.perf_counter()
            # the dense method: the gradients straight into the update buffer
            if grad_dtype == dtype:
                direct = self._dense.start(out, names, sizes, tensors, dtype, P)
            if direct is None:
                flatres, acc, parts, res_parts = self._buffers(names, sizes, dtype, tensors[0].device)
            if direct is not None:
                flatres, acc, nonfinite = direct.flatres, direct.update, direct.nonfinite
            elif type(self.compressor) in _FUSED_TOPK:
                # compensation, finiteness check and exact top-k in one pass
                offsets, k, seg_names = self._segments(names, sizes, density)
                res = flatres.residual if res_parts[0] is not None else None
                idx, vals, finite = kernels.compensate_select_topk(
                    acc, [t.detach() for t in tensors], res, offsets, k, kernels=cfg.kernels)
                picked = (idx, vals)
                nonfinite = [n for n, ok in zip(names, finite.tolist()) if not ok]
            else:
                nonfinite = [n for n, t, part, r in zip(names, tensors, parts, res_parts)
                             if not kernels.compensate(part, t.detach(), r, kernels=cfg.kernels)]
            t_comp = time.perf_counter() - tc
        else:
            nonfinite = [n for n, t in zip(names, tensors) if not all_finite(t)]
        extra, extra_nonfinite, extra_bad = self._also or ((), (), None)
        # the flag: "no exact prescaled copy here" (dense_direct: any rank's makes all redo it)
        try:
            any_nonfinite, where, redo = consistency.check_flagged(
                self.transport, layout + list(extra), bad or extra_bad, nonfinite + list(extra_nonfinite),
                flag=direct is None or direct.flag)
        except ValueError:
            if local_error is not None:
                raise local_error from None  # every peer raises PeerInputError naming it
            raise
        t1 = time.perf_counter()  # the select phase includes compensation: phases tile the call
        seconds = {"check": t1 - t0 - t_comp}
        if any_nonfinite:
            detail = "; ".join(f"rank {r}: {', '.join(n)}" for r, n in where)
            if cfg.nonfinite == "raise":
                raise consistency.NonFiniteGradientError(
                    f"gtopk_plugin: non-finite gradient or accumulator (NaN or Inf, or gradient + "
                    f"residual overflowed) in {detail}; nothing was applied and residuals are "
                    "unchanged (pass nonfinite='skip' to skip such steps)")
            return self._skip(names, tensors, sizes, density, P, before, seconds, advance_step, out)

        if direct is not None:
            self._dense.agreed(direct, redo, names, tensors)
        if not fused:
            flatres, acc, overflow = self._compensate(names, sizes, tensors, dtype, grad_norm, loss_scale, P)
            # the general path built acc after the check (momentum, clipping
            # and loss scaling change state): one more one-flag agreement
            # that no rank's accumulator overflowed
            consistency.check_state_finite(self.transport, overflow)
        numel = sum(sizes)
        offsets, k, seg_names = self._segments(names, sizes, density)
        ctx = SelectionContext(step=self.step, segment_names=seg_names, seed=cfg.seed,
                               rank=self.transport.rank, kernels=cfg.kernels,
                               shapes=[tuple(t.shape) for t in tensors])
        payload = None
        # a codec's dense warm-up step (start_iter): the dense method's path
        warm = self.codec and self.compressor.dense_at(self.step)
        aggregation = "dense" if warm else self.aggregation
        if self.codec and not warm:  # its payload as decoded (rounds codecs: filled by the aggregation)
            payload, vals = codec_contribution(self.compressor, acc, offsets, numel, dtype, ctx)
            if self.aggregation == _payloads.NAME:  # the codec's shards and server residual
                _payloads.bind(payload, self.compressor, seg_names)
            idx, wire_vals = None, vals
        else:
            idx, vals = (None, acc) if warm else picked if picked is not None else \
                self.compressor.select(acc, offsets, k, ctx)
            draws = None if cfg.wire_rounding == "nearest" else wire.Draws(cfg.seed, self.step, seg_names[0])
            if hasattr(self._aggregation, "draws"):  # aggregations that re-round sums (int8 wire)
                self._aggregation.draws = draws
            wire_vals = wire.to_wire(vals, cfg.value_dtype or grad_dtype) if draws is None else \
                wire.quantize(vals, draws(f"rank{self.transport.rank}",
                                          torch.arange(numel, device=acc.device) if idx is None else idx))[0]
        seconds["select"] = time.perf_counter() - t1 + t_comp

        t2 = time.perf_counter()
        # A dense sum in the gradients' dtype is taken in place in the
        # accumulator: such a step sends acc exactly, so its residual is zero
        # and error feedback never reads acc again (commit_step); the update
        # is then one division out of it (issue #15: no copy of N).
        out_buf = acc if aggregation == "dense" and wire_vals is acc else None
        agg = (collectives.get("dense") if warm else self._aggregation)(Selection(
            idx=idx, vals=wire_vals, numel=numel, offsets=offsets, k=k,
            idx_dtype=kernels.index_dtype(numel), sum_dtype=dtype,
            static_count=self.compressor.exact_count, kernels=cfg.kernels, payload=payload, out=out_buf),
            self.transport)
        seconds["communicate"] = time.perf_counter() - t2

        t3 = time.perf_counter()
        divisor = P if cfg.op == "average" else 1
        # narrower gradients: the exact result at the entries this rank owns,
        # taken before the update is formed (it may divide the sum in place)
        owed = update_rounding.owned_result(agg, sizes, tensors, dtype, self.transport.rank, P) if any(
            t.dtype != dtype for t in tensors) and self.memory.enabled else None
        update, nnz = direct.finish(agg, divisor) if direct is not None else self._updates.result(
            agg, (tuple(names), dtype, acc.device), numel, divisor, flatres.bufs, cfg.kernels,
            out and [out[n] for n in names], out_reuse)
        # Residual: acc less what reached the global result, as it travelled
        # (error feedback, the same wrapper for selectors and codecs).
        sent_vals = wire.values(wire_vals, dtype)  # the int8 wire decoded (exact)
        reached = agg.reached if idx is not None and agg.reached is not None and \
            not bool(agg.reached.all()) else None  # None: every sent entry reached it
        exact = (warm or not self.codec) and wire_vals.dtype == dtype
        self.memory.commit_step(flatres, acc, idx, sent_vals, exact, agg.residual_add, cfg.kernels,
                                reached=reached)
        if self.momentum.enabled and idx is not None:
            # momentum factor masking: the velocity restarts where v was sent.
            # Not for dense methods: there u is the plain momentum buffer.
            self.momentum.mask_(names, idx if reached is None else idx[reached])
        selected = int(vals.numel())
        sent = numel if idx is None else int(idx.numel()) if reached is None else int(reached.sum())
        res = {n: out[n] for n in names} if out is not None else {
            # narrower dtypes: clamped to their range, never ±inf (update_rounding
            # charges the remainder to the owner's residual)
            n: u.view_as(t) if t.dtype == dtype else wire.to_wire(u.view_as(t), t.dtype)
            for n, u, t in zip(names, torch.split(update, sizes), tensors)}
        if owed is not None:
            # the update is applied in the gradients' narrower dtype: that
            # rounding lands in the owning rank's residual too
            self.memory.add_at(flatres, *update_rounding.charge(owed, names, sizes, res, dtype, divisor))
        seconds["update"] = time.perf_counter() - t3
        seconds["total"] = time.perf_counter() - t0
        seconds["wait"] = self.transport.wait_seconds - wait0  # inside the transport's primitives
        self.last_stats = ReduceStats.from_counters(
            self.transport.counters.copy().minus(before), method=cfg.method, aggregation=aggregation,
            step=self.step, world_size=P, numel=numel, k=int(k.sum()), density=density, selected=selected,
            result_nnz=int(nnz), sent_entries=sent, rounds=agg.rounds, seconds=seconds, dtype=dtype)
        if advance_step:
            self.step += 1
        return res

    def _prepare(self, names, sizes, tensors, dtype) -> Optional[str]:
        """The local work before the cross-rank check that can fail: the
        first call on a layout checks that its buffers fit in memory, and
        the layout's residuals are imported (a residual that does not fit
        the gradient raises).  A message, or an exception, is turned into
        bad input of the check: every rank then raises together."""
        device = tensors[0].device
        if not self.memory.has_layout(names, sizes, dtype, device):
            msg = memory_check(tensors, dtype)
            if msg:
                return msg
        self.memory.layout(names, sizes, dtype, device)
        return None

    def _compensate(self, names, sizes, tensors, dtype, grad_norm, loss_scale, P):
        """The general path's ``acc = grad (clipped, + weight decay, through
        the velocity) + residual``, after the cross-rank check; returns
        ``(flatres, acc, names whose accumulator is not finite)``."""
        cfg = self.config
        self._follow_loss_scale(loss_scale)
        flat = [t.detach().reshape(-1).to(dtype) for t in tensors]
        scale = clip_scale(cfg.clip_norm, flat, grad_norm, loss_scale, P)
        if scale != 1.0:
            flat = [g * scale for g in flat]
        if self.binding is not None:
            # the optimizer's momentum settings of this step, and its weight
            # decay added to the (clipped) gradient as SGD adds it (in the
            # gradient's units: times the loss scale under AMP)
            self.momentum.per_name.update(self.binding.specs(names))
            ls = 1.0 if loss_scale is None else float(loss_scale)
            flat = [self.binding.add_weight_decay(n, g, ls) for n, g in zip(names, flat)]
        flatres, acc, parts, res_parts = self._buffers(names, sizes, dtype, tensors[0].device)
        if self.momentum.enabled:
            flat = self.momentum.accumulate(names, sizes, flat, dtype, acc.device, scratch=parts)
        overflow = [n for n, g, part, r in zip(names, flat, parts, res_parts)
                    if not kernels.compensate(part, g, r, kernels=cfg.kernels)]
        return flatres, acc, overflow

    def _buffers(self, names, sizes, dtype, device):
        """This layout's persistent residual and scratch accumulator, with
        per-name views (residual views ``None`` where it is known zero or
        error feedback is off: the compensation is then a copy)."""
        f = self.memory.layout(names, sizes, dtype, device)
        acc, parts = f.accumulator()
        if self.memory.enabled and not f.zero:
            res_parts = f.views[f.cur]
        else:
            res_parts = [None] * len(parts)
        return f, acc, parts, res_parts

    # ------------------------------------------------------------ internals
    def _layout(self, names, tensors, density, loss_scale=None):
        """The call's fingerprint for the cross-rank consistency check and
        the sizes.  Everything that changes the result must agree across
        ranks, so it is all here: the tensors, the method and its
        hyper-parameters, the wire and its rounding, the seed (random-k's
        shared draws, stochastic rounding), the non-finite policy, error
        feedback, momentum correction (and an optimizer binding's settings
        for these names), clipping, ``dense_below``, the step and the loss
        scale the gradients carry."""
        sizes = [t.numel() for t in tensors]
        cfg = self.config
        ks = segment_ks(sizes, density, cfg.granularity, full=self.codec)
        layout = [(n, tuple(t.shape), str(t.dtype)) for n, t in zip(names, tensors)]
        layout.append(("settings", cfg.method, self.aggregation, cfg.granularity, str(cfg.value_dtype),
                       cfg.wire_rounding, cfg.op, self.step, tuple(ks)))
        layout.append(("policy", cfg.seed, cfg.nonfinite, cfg.error_feedback, cfg.momentum, cfg.nesterov,
                       cfg.dampening, cfg.momentum_masking, cfg.clip_norm, cfg.dense_below,
                       None if loss_scale is None else float(loss_scale)))
        if self.binding is not None:
            layout.append(("optimizer",) + tuple(self.binding.fingerprint(names)))
        if self.compressor.hyperparams:
            layout.append(("hyper",) + tuple(sorted(self.compressor.hyper.items())))
        return layout, sizes

    def _skip(self, names, tensors, sizes, density, P, before, seconds, advance_step, out=None):
        """nonfinite="skip": every rank returns zero updates for this step and
        keeps its residuals; the step's gradients are dropped on all ranks."""
        fill = math.inf if self.config.nonfinite == "propagate" else 0.0
        self._updates.forget_outs()  # every entry of out is written now
        out = {n: out[n].fill_(fill) if out is not None else torch.full_like(t, fill)
               for n, t in zip(names, tensors)}
        numel = sum(sizes)
        st = ReduceStats(method=self.config.method, aggregation=self.aggregation, step=self.step,
                         world_size=P, numel=numel, k=0, density=density, skipped=True,
                         seconds=seconds)
        delta = self.transport.counters.copy().minus(before)
        st.control_bytes = delta.control_bytes
        self.last_stats = st
        if advance_step:
            self.step += 1
        return out
