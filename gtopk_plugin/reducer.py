"""GradientReducer: composes a selector, error feedback, an aggregation and a
transport into one sparse (or dense) gradient reduction per call.

Semantics (DESIGN.md §3): ``acc = grad + residual``; the selector picks
entries of ``acc`` (exactly ``k_s = max(1, ceil(density·n_s))`` per segment
for the exact selectors); the aggregation combines them across workers
(dense allreduce, sparse allgather, or the gTop-k butterfly); the residual
becomes ``acc`` less what actually reached the global result; the update is
the result divided by P (``op="average"``) or the plain sum (``op="sum"``).
Mass conservation holds for every method: Σ_ranks Σ_steps grad =
Σ_steps result(op=sum) + Σ_ranks residual.
"""
from __future__ import annotations

import math
import time
from typing import Dict, List, Mapping, Optional, Tuple

import torch

from . import consistency, kernels
from . import collectives
from .collectives import Selection, Transport
from .collectives import wire
from .compress import ErrorFeedback, SelectionContext, registry
from .compress.momentum import MomentumCorrection, MomentumSpec
from .compress.topk import GTopKSelector, TopKSelector
from .config import ReducerConfig
from .stats import ReduceStats

Tensor = torch.Tensor
_GLOBAL_SEGMENT = "__global__"


def global_segment_name(names) -> str:
    """Name of the one segment of a granularity="global" call: keyed by the
    tensors it holds, so that buckets of one step (DDP buckets, the elastic
    scheduler's layers) draw independent random positions, while every rank
    (same names) still draws the same ones where the method shares draws."""
    import hashlib

    h = hashlib.blake2b("\x00".join(names).encode(), digest_size=8).hexdigest()
    return f"{_GLOBAL_SEGMENT}:{h}"


def k_for(density: float, numel: int) -> int:
    """``max(1, ceil(density·numel))`` (the product rounded to 1e-6 first, so
    0.07·100 gives 7, not 8), capped at ``numel``."""
    return min(numel, max(1, math.ceil(round(density * numel, 6))))


def _all_finite(t: Tensor) -> bool:
    """Whether every entry of ``t`` is finite, in one read: a finite sum
    (accumulated in at least float32, so float16 sums cannot overflow) has
    only finite terms; a non-finite sum -- a NaN/Inf or a float32 overflow --
    falls back to the exact elementwise test.  torch.isfinite(t).all()
    materialises a bool tensor and is ~15x slower at 25M elements."""
    acc = torch.float64 if t.dtype == torch.float64 else torch.float32
    if bool(torch.isfinite(t.sum(dtype=acc))):
        return True
    return bool(torch.isfinite(t).all())


def local_grad_norm(tensors) -> float:
    """L2 norm over several tensors, accumulated in float64 (the clipping
    norm of one worker's whole step)."""
    total = 0.0
    for t in tensors:
        total += float(torch.linalg.vector_norm(t.detach().reshape(-1), dtype=torch.float64) ** 2)
    return math.sqrt(total)


def _storage_refs(t: Tensor) -> Optional[int]:
    """How many tensors share ``t``'s storage (``None`` where this torch
    does not say)."""
    f = getattr(torch._C, "_storage_Use_Count", None)
    if f is None:
        return None
    try:
        return int(f(t.untyped_storage()._cdata))
    except Exception:  # pragma: no cover - a torch without it
        return None


class UpdateBuffers:
    """Persistent dense update buffers, a small ring per layout.

    Lifetime contract of the tensors ``reduce()`` returns: they are views
    into one of these buffers and stay valid while the caller holds any of
    them (or any view of them); once every returned tensor of a call has
    been dropped, the buffer is reused by a later ``reduce()`` on the same
    layout (same names, dtype, device).  A buffer is reused only when no
    tensor outside the reducer refers to its storage (torch's storage use
    count), so a caller that keeps updates across steps -- the elastic
    scheduler holds several steps of one layer in flight -- gets a second
    buffer instead of a clobbered one (up to :attr:`RING` per layout, then
    fresh allocations).  Callers that copy the update right away (DDP's
    bucket, Horovod's ``p.grad``) cycle through one buffer.

    Reset cost: a sparse update rewrites only the entries the buffer's
    previous sparse result set (O(k)); after a dense result it is zeroed once.
    Dense results (dense allreduce, the sparse allgather's summed vector) do
    not use the ring: the aggregation's own fresh sum is divided in place and
    returned, so those updates belong to the caller outright.
    """

    RING = 4

    def __init__(self):
        self._rings: Dict[tuple, list] = {}

    def clear(self) -> None:
        self._rings.clear()

    def take(self, key, numel: int, dtype, device, idx: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
        """``(buf, prev)``: a buffer of ``numel`` for this step's result at
        ``idx`` (``idx is None``: a dense result, which overwrites the whole
        buffer) and the indices of its previous sparse result, which the
        caller zeroes (everything else in ``buf`` is zero for a sparse
        result).  The buffer remembers ``idx`` for its next reset."""
        ring = self._rings.get(key)
        if ring is None:
            names = set(key[0])
            for other in [k for k in self._rings if names.intersection(k[0])]:
                del self._rings[other]  # a name moved to another layout (DDP rebuild)
            ring = self._rings[key] = []
        none = torch.empty(0, dtype=torch.int64, device=device)
        entry = None
        for e in ring:
            refs = _storage_refs(e["buf"])
            if e["base"] is not None and refs is not None and refs <= e["base"]:
                entry = e
                break
        if entry is None:
            buf = torch.zeros(numel, dtype=dtype, device=device)
            if len(ring) >= self.RING:
                return buf, none  # untracked, fresh: every ring buffer is still held
            entry = {"buf": buf, "prev": None, "base": _storage_refs(buf)}
            ring.append(entry)
        buf, prev = entry["buf"], entry["prev"]
        if prev is None:
            prev = none
        elif isinstance(prev, str):  # "dense": every entry was written
            if idx is not None:
                buf.zero_()
            prev = none
        entry["prev"] = "dense" if idx is None else idx.clone()
        return buf, prev


# Selectors whose select() is exactly kernels.select_topk(acc, offsets, k):
# the reducer may fuse it with the compensation (kernels.compensate_select_topk).
_FUSED_TOPK = (TopKSelector, GTopKSelector)


class GradientReducer:
    """Reduce a dict of named gradients across workers.

    Example::

        red = GradientReducer(method="gtopk", density=0.01)
        updates = red.reduce({n: p.grad for n, p in model.named_parameters()})

    Args (hyper-parameters; validated, ``ValueError`` on bad values):
        method: "dense", "topk", "gtopk", "rtopk", "randomk" or "threshold".
        density: fraction of entries kept per segment, in (0, 1].
        r_factor: rTop-k's r (keep k of the top r·k), >= 1.
        merge: None (the method's own aggregation), "allgather" or "gtopk"
            (puts any sparse selector on the butterfly).
        granularity: "layer" (k per tensor) or "global" (k over the bucket).
        value_dtype: None, torch.float16 or torch.bfloat16: values on the wire.
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
                 clip_norm: Optional[float] = None):
        kw = {} if kernels is None else {"kernels": kernels}
        self.config = ReducerConfig(method=method, density=density, r_factor=r_factor, merge=merge,
                                    granularity=granularity, value_dtype=value_dtype, op=op,
                                    seed=seed, warmup=warmup, nonfinite=nonfinite,
                                    error_feedback=bool(error_feedback), momentum=momentum,
                                    nesterov=bool(nesterov), dampening=dampening,
                                    momentum_masking=bool(momentum_masking), clip_norm=clip_norm, **kw)
        if transport is None:
            from .frameworks.torch_distributed import TorchDistributedTransport
            transport = TorchDistributedTransport()
        if not isinstance(transport, Transport):
            raise ValueError(f"transport must be a gtopk_plugin Transport; got {type(transport).__name__}")
        self.transport = transport
        self.selector = registry.get(method)(r_factor=self.config.r_factor)
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
        self._segment_cache: Dict[tuple, tuple] = {}

    # ------------------------------------------------------------------ API
    def reduce(self, grads: Mapping[str, Tensor], *, advance_step: bool = True,
               grad_norm: Optional[float] = None, loss_scale: Optional[float] = None) -> Dict[str, Tensor]:
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
        is scaled with it.

        Memory (issue #15): no N-sized allocation in steady state on the
        sparse butterfly path.  Residuals and the scratch accumulator are
        persistent per layout (see :mod:`.compress.error_feedback`), and the
        returned updates are views into persistent buffers that are reused
        once the caller has dropped every tensor of an earlier call (see
        :class:`UpdateBuffers`): hold on to them as long as you need them,
        but do not write into them (a later step may reuse the storage once
        they are gone).  Dense results are fresh tensors of their own.
        """
        t0 = time.perf_counter()
        cfg = self.config
        bad, names, tensors = self._validate(grads)
        density = cfg.density_at(self.step)
        layout, sizes = self._layout(names, tensors, density)
        P = self.transport.size
        before = self.transport.counters.copy()
        dtype = self._flat_dtype(tensors) if not bad else None
        # Fast path: nothing changes state before the cross-rank check, so
        # the compensation acc = grad + residual and the finiteness check run
        # as one pass into the scratch accumulator, ahead of the check
        # (issue #15).  Momentum, clipping, an optimizer binding, a changed
        # loss scale or mixed dtypes take the general path: check first.
        fused = (not bad and not self.momentum.enabled and cfg.clip_norm is None
                 and self.binding is None and all(t.dtype == dtype for t in tensors)
                 and (loss_scale is None or float(loss_scale) == self.loss_scale))
        t_comp = 0.0
        flatres = acc = picked = None
        if bad:
            nonfinite = []
        elif fused:
            tc = time.perf_counter()
            flatres, acc, parts, res_parts = self._buffers(names, sizes, dtype, tensors[0].device)
            if type(self.selector) in _FUSED_TOPK:
                # compensation, finiteness check and exact top-k in one pass
                offsets, k, seg_names = self._segments(names, sizes, density, acc.device)
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
            nonfinite = [n for n, t in zip(names, tensors) if not _all_finite(t)]
        any_nonfinite, where = consistency.check(self.transport, layout, bad, nonfinite)
        t1 = time.perf_counter()  # the select phase includes compensation: phases tile the call
        seconds = {"check": t1 - t0 - t_comp}
        if any_nonfinite:
            detail = "; ".join(f"rank {r}: {', '.join(n)}" for r, n in where)
            if cfg.nonfinite == "raise":
                raise consistency.NonFiniteGradientError(
                    f"gtopk_plugin: non-finite gradient (NaN or Inf) in {detail}; nothing was "
                    "applied and residuals are unchanged (pass nonfinite='skip' to skip such steps)")
            return self._skip(names, tensors, sizes, density, P, before, seconds, advance_step)

        if not fused:
            self._follow_loss_scale(loss_scale)
            flat = [t.detach().reshape(-1).to(dtype) for t in tensors]
            scale = self._clip_scale(flat, grad_norm, loss_scale, P)
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
            for g, part, r in zip(flat, parts, res_parts):
                kernels.compensate(part, g, r, kernels=cfg.kernels)
        numel = sum(sizes)
        if picked is None:
            offsets, k, seg_names = self._segments(names, sizes, density, acc.device)
            ctx = SelectionContext(step=self.step, segment_names=seg_names, seed=cfg.seed,
                                   rank=self.transport.rank, kernels=cfg.kernels)
            idx, vals = self.selector.select(acc, offsets, k, ctx)
        wire_vals = wire.to_wire(vals, cfg.value_dtype or dtype)
        seconds["select"] = time.perf_counter() - t1 + t_comp

        t2 = time.perf_counter()
        agg = self._aggregation(Selection(
            idx=idx, vals=wire_vals, numel=numel, offsets=offsets, k=k,
            idx_dtype=kernels.index_dtype(numel), sum_dtype=dtype,
            static_count=self.selector.exact_count, kernels=cfg.kernels), self.transport)
        seconds["communicate"] = time.perf_counter() - t2

        t3 = time.perf_counter()
        divisor = P if cfg.op == "average" else 1
        if agg.idx is None and self._owned(agg.vals, dtype, numel, flatres):
            # a dense result is the aggregation's own fresh sum (allreduce,
            # allgather-and-add): divided in place and handed out as is, no
            # further N-sized buffer touched
            update = agg.vals
            nnz = kernels.div_count_(update, divisor, kernels=cfg.kernels)
        elif agg.idx is None:
            update, _ = self._updates.take((tuple(names), dtype, acc.device), numel, dtype, acc.device,
                                           None)
            torch.div(agg.vals, divisor, out=update) if divisor != 1 else update.copy_(agg.vals)
        else:
            update, prev = self._updates.take((tuple(names), dtype, acc.device), numel, dtype,
                                              acc.device, agg.idx)
            # O(k): zero the previous result's entries, write this one's
            # (the reference scatter_update's arithmetic: vals / divisor)
            kernels.scatter_reset_(update, prev, agg.idx, agg.vals, divisor, kernels=cfg.kernels)
        # Residual: acc less what reached the global result, as it travelled.
        if idx is not None and agg.reached is not None and not bool(agg.reached.all()):
            idx, wire_reached = idx[agg.reached], wire_vals[agg.reached]
        else:
            wire_reached = wire_vals
        if self.memory.enabled:
            if idx is None and wire_vals.dtype == dtype and (
                    agg.residual_add is None or not agg.residual_add[0].numel()):
                # dense, sent exactly: acc - acc is zero everywhere
                self.memory.commit_zero(flatres)
            else:
                if idx is None:
                    acc.sub_(wire_vals)  # the wire value widened to dtype, one rounding
                else:
                    # O(k): the accumulator becomes the residual in place
                    kernels.subtract_at_(acc, idx, wire_reached, kernels=cfg.kernels)
                if agg.residual_add is not None and agg.residual_add[0].numel():
                    # wire rounding of merged sums that this rank owns (DESIGN.md §3)
                    acc.index_add_(0, agg.residual_add[0].long(), agg.residual_add[1].to(dtype))
                self.memory.commit_accumulator(flatres)
        if self.momentum.enabled and idx is not None:
            # momentum factor masking: the velocity restarts where v was sent.
            # Not for dense methods: there u is the plain momentum buffer.
            self.momentum.mask_(names, idx)
        selected = int(vals.numel())
        sent = numel if idx is None else int(idx.numel())
        rounds = agg.rounds
        # nonzeros of the update: only the aggregated entries can be nonzero,
        # and those hold vals / divisor (computed on the k values, not
        # gathered back from the N-sized buffer)
        if agg.idx is None:
            if update is not agg.vals:
                nnz = torch.count_nonzero(update)
        else:
            v = agg.vals.to(dtype)
            nnz = torch.count_nonzero(v / divisor if divisor != 1 else v)
        out = {n: u.view_as(t) if t.dtype == dtype else u.view_as(t).to(t.dtype)
               for n, u, t in zip(names, torch.split(update, sizes), tensors)}
        seconds["update"] = time.perf_counter() - t3
        seconds["total"] = time.perf_counter() - t0
        self.last_stats = self._stats(density, P, numel, int(k.sum()), selected, sent, int(nnz),
                                      rounds, before, seconds, dtype)
        if advance_step:
            self.step += 1
        return out

    @staticmethod
    def _owned(vals: Tensor, dtype, numel: int, flatres) -> bool:
        """Whether a dense aggregation result can be divided in place and
        returned: right dtype and shape, contiguous, and not sharing storage
        with this layout's residual or accumulator."""
        if vals.dtype != dtype or vals.dim() != 1 or vals.numel() != numel or not vals.is_contiguous():
            return False
        ptr = vals.untyped_storage().data_ptr()
        return all(b is None or b.untyped_storage().data_ptr() != ptr for b in flatres.bufs)

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

    def correct_momentum(self, optimizer, named_parameters) -> "GradientReducer":
        """Turn on DGC momentum correction with ``optimizer``'s own settings:
        its SGD momentum (nesterov, dampening) and weight decay move in
        front of the compressor, read from its param groups at every call,
        and ``optimizer.step()`` runs with momentum and weight decay 0 for
        those groups (restored right after the step).  ``named_parameters``
        gives the names this reducer sees.  Returns ``self``.

        Raises ``ValueError`` for optimizers without SGD momentum (Adam,
        AdamW: use plain error feedback)."""
        from .compress.optimizer_binding import OptimizerBinding

        if self.binding is not None:
            self.binding.remove()
        self.binding = OptimizerBinding(optimizer, named_parameters)
        return self

    def reset(self) -> None:
        """Forget residuals and velocities (e.g. after the set of parameters changed)."""
        self.memory.reset()
        self.momentum.reset()
        self._updates.clear()

    # ------------------------------------------------- clipping, loss scale
    def _follow_loss_scale(self, loss_scale: Optional[float]) -> None:
        """Keep residuals and velocities in the units of the incoming
        gradients: when the AMP loss scale changed since the last call,
        multiply them by new/old (a power of two for GradScaler: exact)."""
        if loss_scale is None:
            return
        s = float(loss_scale)
        if not (s > 0.0) or math.isinf(s):
            raise ValueError(f"loss_scale must be a positive finite number; got {loss_scale!r}")
        if self.loss_scale is not None and s != self.loss_scale:
            f = s / self.loss_scale
            self.memory.rescale_(f)
            self.momentum.rescale_(f)
        self.loss_scale = s

    def _clip_scale(self, flat, grad_norm, loss_scale, P) -> float:
        """DGC local clipping: the factor that brings this worker's gradient
        norm down to ``clip_norm · P^-1/2`` (times the loss scale), else 1."""
        c = self.config.clip_norm
        if c is None:
            return 1.0
        if grad_norm is None:
            grad_norm = local_grad_norm(flat)
        thr = c / math.sqrt(P) * (1.0 if loss_scale is None else float(loss_scale))
        grad_norm = float(grad_norm)
        return 1.0 if grad_norm <= thr else thr / (grad_norm + 1e-6 * thr)

    def state_dict(self) -> dict:
        """Residuals and step: everything a bit-exact resume needs (random
        draws are keyed by (seed, step, name), so the step is the RNG state)."""
        return {"version": 1, "method": self.config.method, "seed": self.config.seed,
                "step": self.step, "residuals": self.memory.state_dict(),
                "velocities": self.momentum.state_dict(), "loss_scale": self.loss_scale}

    def load_state_dict(self, sd: dict) -> None:
        if sd.get("version") != 1:
            raise ValueError(f"unsupported GradientReducer state version {sd.get('version')!r}")
        if sd.get("method") != self.config.method:
            raise ValueError(f"state was saved by method {sd.get('method')!r}, this reducer runs "
                             f"{self.config.method!r}")
        self.step = int(sd["step"])
        self.memory.load_state_dict(sd["residuals"])
        self.momentum.load_state_dict(sd.get("velocities", {}))
        self.loss_scale = sd.get("loss_scale")

    # ------------------------------------------------------------ internals
    @staticmethod
    def _validate(grads) -> Tuple[Optional[str], List[str], List[Tensor]]:
        """Local input checks.  Returns an error message instead of raising, so
        that the consistency check can make every rank raise together."""
        if not isinstance(grads, Mapping):
            return f"grads must be a dict name -> tensor; got {type(grads).__name__}", [], []
        if not grads:
            return "grads is empty: pass at least one named gradient tensor", [], []
        names = sorted(grads)
        tensors = []
        for n in names:
            t = grads[n]
            if not isinstance(n, str):
                return f"gradient names must be str; got {n!r}", [], []
            if not isinstance(t, torch.Tensor):
                return f"gradient {n!r} is a {type(t).__name__}, not a torch.Tensor", [], []
            if not t.is_floating_point():
                return (f"gradient {n!r} has dtype {t.dtype}; pass a floating-point tensor "
                        "(float32, float16, bfloat16 or float64)"), [], []
            if t.dim() == 0:
                return (f"gradient {n!r} is 0-d; pass it as a 1-element tensor "
                        "(t.reshape(1)) or leave it out of the reducer"), [], []
            if t.numel() == 0:
                return f"gradient {n!r} is empty (shape {tuple(t.shape)}); leave it out of the reducer", [], []
            tensors.append(t)
        devices = {t.device for t in tensors}
        if len(devices) > 1:
            return f"gradients are on several devices {sorted(map(str, devices))}; pass one device per call", [], []
        return None, names, tensors

    def _layout(self, names, tensors, density):
        sizes = [t.numel() for t in tensors]
        cfg = self.config
        if cfg.granularity == "layer":
            ks = [k_for(density, n) for n in sizes]
        else:
            ks = [k_for(density, sum(sizes))] if sizes else []
        layout = [(n, tuple(t.shape), str(t.dtype)) for n, t in zip(names, tensors)]
        layout.append(("settings", cfg.method, self.aggregation, cfg.granularity, str(cfg.value_dtype),
                       cfg.op, self.step, tuple(ks)))
        return layout, sizes

    def _segments(self, names, sizes, density, device):
        # cached per layout and density: two small host tensors, every call
        key = (tuple(names), tuple(sizes), density)
        hit = self._segment_cache.get(key)
        if hit is None:
            if len(self._segment_cache) > 64:
                self._segment_cache.clear()
            hit = self._segment_cache[key] = self._make_segments(names, sizes, density)
        return hit

    def _make_segments(self, names, sizes, density):
        if self.config.granularity == "layer":
            offs = [0]
            for s in sizes:
                offs.append(offs[-1] + s)
            ks = [k_for(density, s) for s in sizes]
            seg_names = list(names)
        else:
            offs = [0, sum(sizes)]
            ks = [k_for(density, sum(sizes))]
            seg_names = [global_segment_name(names)]
        return (torch.tensor(offs, dtype=torch.int64), torch.tensor(ks, dtype=torch.int64), seg_names)

    @staticmethod
    def _flat_dtype(tensors) -> torch.dtype:
        dtype = tensors[0].dtype
        for t in tensors[1:]:
            dtype = torch.promote_types(dtype, t.dtype)
        return dtype

    def _skip(self, names, tensors, sizes, density, P, before, seconds, advance_step):
        """nonfinite="skip": every rank returns zero updates for this step and
        keeps its residuals; the step's gradients are dropped on all ranks."""
        fill = math.inf if self.config.nonfinite == "propagate" else 0.0
        out = {n: torch.full_like(t, fill) for n, t in zip(names, tensors)}
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

    def _stats(self, density, P, numel, k, selected, sent, nnz, rounds, before, seconds, dtype):
        d = self.transport.counters.copy().minus(before)
        esz = torch.empty(0, dtype=dtype).element_size()
        return ReduceStats(
            method=self.config.method, aggregation=self.aggregation, step=self.step, world_size=P,
            numel=numel, k=k, density=density, selected=selected,
            result_nnz=nnz, sent_entries=sent,
            bytes_sent=d.payload_bytes_sent + d.header_bytes_sent,
            bytes_received=d.payload_bytes_received + d.header_bytes_received,
            payload_bytes_sent=d.payload_bytes_sent, payload_bytes_received=d.payload_bytes_received,
            header_bytes_sent=d.header_bytes_sent, header_bytes_received=d.header_bytes_received,
            control_bytes=d.control_bytes, messages_sent=d.messages_sent, rounds=rounds,
            dense_bytes=(2 * (P - 1) * numel * esz) // P, seconds=seconds)
