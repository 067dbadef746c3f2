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
from .compress import ErrorFeedback, SelectionContext, registry
from .config import ReducerConfig
from .stats import ReduceStats

Tensor = torch.Tensor
_GLOBAL_SEGMENT = "__global__"


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
    """

    def __init__(self, method: str = "gtopk", density: float = 0.01, r_factor: float = 4.0,
                 merge: Optional[str] = None, granularity: str = "layer",
                 value_dtype: Optional[torch.dtype] = None, op: str = "average",
                 transport: Optional[Transport] = None, seed: int = 0, warmup=None,
                 nonfinite: str = "raise", error_feedback: bool = True,
                 kernels: Optional[str] = None):
        kw = {} if kernels is None else {"kernels": kernels}
        self.config = ReducerConfig(method=method, density=density, r_factor=r_factor, merge=merge,
                                    granularity=granularity, value_dtype=value_dtype, op=op,
                                    seed=seed, warmup=warmup, nonfinite=nonfinite,
                                    error_feedback=bool(error_feedback), **kw)
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
        self.step = 0
        self.last_stats: Optional[ReduceStats] = None

    # ------------------------------------------------------------------ API
    def reduce(self, grads: Mapping[str, Tensor], *, advance_step: bool = True) -> Dict[str, Tensor]:
        """Reduce ``grads`` (name -> dense gradient) across all ranks and return
        name -> dense update (same shapes and dtypes).  Collective: every rank
        calls it with the same names, shapes and dtypes.

        ``advance_step=False`` keeps the step counter (and so the warm-up
        density and random-k seeds) for a further call in the same training
        step, as the DDP hook does for all buckets but the last.
        """
        t0 = time.perf_counter()
        cfg = self.config
        bad, names, tensors = self._validate(grads)
        density = cfg.density_at(self.step)
        layout, sizes = self._layout(names, tensors, density)
        nonfinite = [] if bad else [n for n, t in zip(names, tensors) if not _all_finite(t)]
        before = self.transport.counters.copy()
        any_nonfinite, where = consistency.check(self.transport, layout, bad, nonfinite)
        P = self.transport.size
        t1 = time.perf_counter()  # the select phase includes compensation: phases tile the call
        seconds = {"check": t1 - t0}
        if any_nonfinite:
            detail = "; ".join(f"rank {r}: {', '.join(n)}" for r, n in where)
            if cfg.nonfinite == "raise":
                raise consistency.NonFiniteGradientError(
                    f"gtopk_plugin: non-finite gradient (NaN or Inf) in {detail}; nothing was "
                    "applied and residuals are unchanged (pass nonfinite='skip' to skip such steps)")
            return self._skip(names, tensors, sizes, density, P, before, seconds, advance_step)

        dtype = self._flat_dtype(tensors)
        # One flat buffer, written once: acc = grad + residual per segment
        # (a fresh allocation per step: the residual views kept below alias it).
        numel = sum(sizes)
        acc = torch.empty(numel, dtype=dtype, device=tensors[0].device)
        for n, t, part in zip(names, tensors, torch.split(acc, sizes)):
            self.memory.compensate_into(n, t.detach().reshape(-1).to(dtype), part)
        offsets, k, seg_names = self._segments(names, sizes, density, acc.device)
        ctx = SelectionContext(step=self.step, segment_names=seg_names, seed=cfg.seed,
                               rank=self.transport.rank, kernels=cfg.kernels)
        idx, vals = self.selector.select(acc, offsets, k, ctx)
        wire_vals = vals.to(cfg.value_dtype or dtype)
        seconds["select"] = time.perf_counter() - t1

        t2 = time.perf_counter()
        agg = self._aggregation(Selection(
            idx=idx, vals=wire_vals, numel=numel, offsets=offsets, k=k,
            idx_dtype=kernels.index_dtype(numel), sum_dtype=dtype,
            static_count=self.selector.exact_count, kernels=cfg.kernels), self.transport)
        seconds["communicate"] = time.perf_counter() - t2

        t3 = time.perf_counter()
        divisor = P if cfg.op == "average" else 1
        if agg.idx is None:
            update = agg.vals.to(dtype)
            update = update / divisor if divisor != 1 else update
        else:
            update = kernels.scatter_update(numel, agg.idx, agg.vals, divisor, dtype, kernels=cfg.kernels)
        # Residual: acc less what reached the global result, as it travelled.
        sent_vals = wire_vals.to(dtype)
        if idx is not None and agg.reached is not None:
            idx, sent_vals = idx[agg.reached], sent_vals[agg.reached]
        if self.memory.enabled:
            if idx is None:
                residual = acc - sent_vals
            else:
                # acc is this call's own buffer and nothing else refers to it:
                # turn it into the residual in place, O(k) instead of a copy of N
                residual = self.memory.remainder_(acc, idx, sent_vals)
            for n, part in zip(names, torch.split(residual, sizes)):
                self.memory.update(n, part)
        selected = int(vals.numel())
        sent = numel if idx is None else int(idx.numel())
        rounds = agg.rounds
        # nonzeros of the update: only the aggregated entries can be nonzero
        nnz = torch.count_nonzero(update if agg.idx is None else update[agg.idx.long()])
        out = {n: u.view_as(t).to(t.dtype) for n, u, t in zip(names, torch.split(update, sizes), tensors)}
        seconds["update"] = time.perf_counter() - t3
        seconds["total"] = time.perf_counter() - t0
        self.last_stats = self._stats(density, P, numel, int(k.sum()), selected, sent, int(nnz),
                                      rounds, before, seconds, dtype)
        if advance_step:
            self.step += 1
        return out

    def reset(self) -> None:
        """Forget residuals (e.g. after the set of parameters changed)."""
        self.memory.reset()

    def state_dict(self) -> dict:
        """Residuals and step: everything a bit-exact resume needs (random
        draws are keyed by (seed, step, name), so the step is the RNG state)."""
        return {"version": 1, "method": self.config.method, "seed": self.config.seed,
                "step": self.step, "residuals": self.memory.state_dict()}

    def load_state_dict(self, sd: dict) -> None:
        if sd.get("version") != 1:
            raise ValueError(f"unsupported GradientReducer state version {sd.get('version')!r}")
        if sd.get("method") != self.config.method:
            raise ValueError(f"state was saved by method {sd.get('method')!r}, this reducer runs "
                             f"{self.config.method!r}")
        self.step = int(sd["step"])
        self.memory.load_state_dict(sd["residuals"])

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
        if self.config.granularity == "layer":
            offs = [0]
            for s in sizes:
                offs.append(offs[-1] + s)
            ks = [k_for(density, s) for s in sizes]
            seg_names = list(names)
        else:
            offs = [0, sum(sizes)]
            ks = [k_for(density, sum(sizes))]
            seg_names = [_GLOBAL_SEGMENT]
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
        out = {n: torch.zeros_like(t) for n, t in zip(names, tensors)}
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
