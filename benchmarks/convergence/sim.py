"""One training run of the convergence study, with P workers simulated in one
process by :class:`gtopk_plugin.testing.Oracle` (exact: the tests hold the
real collectives to it bit for bit).

Each step every simulated worker computes the gradient of its shard of the
global batch with the shared weights (the same call a real worker makes, see
:mod:`.gloo`), the oracle reduces the P gradients exactly as P
``GradientReducer`` ranks would, and plain ``torch.optim.SGD`` applies the
update.  Bytes communicated per worker come from the exact formulas of
DESIGN.md §3 (checked against the reducer's own counters in the gloo run).

Momentum, four ways (``RunSpec.momentum_mode``):

- ``"none"``: SGD without momentum.
- ``"opt"``: momentum in the optimizer, applied to the reduced update (what a
  user gets by putting ``torch.optim.SGD(momentum=m)`` after the reducer, as
  ``gtopk-demo`` does).
- ``"corr"``: DGC momentum correction (Lin et al. 2018): each worker keeps a
  local velocity ``u = m·u + g`` and feeds ``u`` to the reducer (whose error
  feedback then accumulates velocities); the optimizer has no momentum.
- ``"dgc"``: momentum correction plus momentum factor masking: the velocity
  is zeroed at the coordinates whose value reached the global result.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, replace
from typing import Dict, List, Optional

import torch

from gtopk_plugin.config import DensityWarmup, ReducerConfig
from gtopk_plugin.reducer import k_for
from gtopk_plugin.testing import Oracle

from .tasks import Task

MOMENTUM_MODES = ("none", "opt", "corr", "dgc")
ENTRY_BYTES = 8  # int32 index + fp32 value
HEADER_BYTES = 8


@dataclass(frozen=True)
class RunSpec:
    """One training run.  ``density`` is ignored for ``dense``."""

    task: str
    method: str
    density: float = 0.01
    workers: int = 4
    r_factor: float = 4.0
    error_feedback: bool = True
    warmup: bool = False
    momentum: float = 0.0
    momentum_mode: str = "none"
    seed: int = 0
    steps: Optional[int] = None       # None: the task's default
    lr: Optional[float] = None        # None: the task's default times lr_scale
    lr_scale: float = 1.0
    batch_size: Optional[int] = None  # global batch; None: the task's default

    def __post_init__(self):
        if self.momentum_mode not in MOMENTUM_MODES:
            raise ValueError(f"momentum_mode must be one of {MOMENTUM_MODES}; got {self.momentum_mode!r}")
        if self.method == "dense":
            object.__setattr__(self, "density", 1.0)
        if self.momentum_mode == "none":
            object.__setattr__(self, "momentum", 0.0)

    @property
    def label(self) -> str:
        return method_label(self.method, self.r_factor)

    def as_dict(self) -> dict:
        return asdict(self)


def method_label(method: str, r_factor: float = 4.0) -> str:
    return f"rtopk(r={r_factor:g})" if method == "rtopk" else method


def warmup_schedule(steps: int) -> DensityWarmup:
    """The study's density warm-up: geometric decay from 25% to the target
    over the first sixth of training (DGC's exponential warm-up)."""
    return DensityWarmup(steps=max(1, steps // 6), start_density=0.25)


def reducer_kwargs(spec: RunSpec, steps: int) -> dict:
    """The ``GradientReducer`` / ``Oracle`` keyword arguments of a run."""
    kw = dict(method=spec.method, density=spec.density, r_factor=spec.r_factor, seed=spec.seed,
              error_feedback=spec.error_feedback)
    if spec.warmup and spec.method != "dense":
        kw["warmup"] = warmup_schedule(steps)
    return kw


def bytes_per_worker(aggregation: str, P: int, numel: int, k_total: int,
                     counts: Optional[List[int]] = None) -> float:
    """Bytes one worker sends in one step, averaged over the workers, from
    the exact formulas (DESIGN.md §3; ``Transport`` counts them the same way):
    ring allreduce 2(P−1)/P·4N; value allreduce of random-k 2(P−1)/P·4k;
    sparse allgather (P−1)·8k, or with variable counts (threshold) the mean
    (P−1)/P·8·Σcounts plus an 8-byte size header per peer; gTop-k butterfly
    log2(P)·8k (power-of-two P)."""
    if P == 1:
        return 0.0
    if aggregation == "dense":
        return float((2 * (P - 1) * 4 * numel) // P)
    if aggregation == "allreduce_values":
        return float((2 * (P - 1) * 4 * k_total) // P)
    if aggregation == "allgather":
        if counts is None:
            return float((P - 1) * ENTRY_BYTES * k_total)
        return (P - 1) / P * ENTRY_BYTES * sum(counts) + HEADER_BYTES * (P - 1)
    if aggregation == "gtopk":
        if P & (P - 1):
            raise ValueError("the butterfly byte formula here covers power-of-two P only")
        return float((P.bit_length() - 1) * ENTRY_BYTES * k_total)
    raise ValueError(f"unknown aggregation {aggregation!r}")


def worker_gradients(task: Task, model, params, batch, rank: int, world: int):
    """The gradient of one worker's shard: the call both the simulated and
    the real workers make.  Returns (loss, [grad per param])."""
    loss = task.loss(model, task.shard(batch, rank, world))
    return loss.detach(), torch.autograd.grad(loss, params)


def resolved(task: Task, spec: RunSpec):
    """(steps, lr, global batch size) of a run."""
    return (spec.steps or task.steps, spec.lr or task.lr * spec.lr_scale,
            spec.batch_size or task.batch_size)


def initial_model(task: Task, seed: int):
    """The run's initial weights: the same on every (simulated or real) worker."""
    torch.manual_seed(seed)
    return task.build_model()


def optimizer_momentum(spec: RunSpec) -> float:
    """Momentum of the ``torch.optim.SGD`` that applies the reduced update:
    ``spec.momentum`` in mode "opt" (and for dense, where momentum
    correction is plain momentum), else 0 (the velocity lives in the workers)."""
    if spec.momentum_mode == "opt" or (spec.method == "dense" and spec.momentum_mode != "none"):
        return spec.momentum
    return 0.0


def run(task: Task, spec: RunSpec, progress=None, keep_params: bool = False) -> dict:
    """Train one configuration; return its history and summary.

    ``progress``: optional callable(n) called after each step (a tqdm bar's
    ``update``).  ``keep_params``: also return the final weights (flat)."""
    steps, lr, batch_size = resolved(task, spec)
    P = spec.workers
    model = initial_model(task, spec.seed)
    names = [n for n, _ in model.named_parameters()]
    params = [p for _, p in model.named_parameters()]
    sizes = {n: p.numel() for n, p in zip(names, params)}
    order = sorted(names)  # the oracle's flat layout
    numel = sum(sizes.values())
    kw = reducer_kwargs(spec, steps)
    cfg = ReducerConfig(**kw)
    oracle = Oracle(P, kernels="reference", **kw)
    opt = torch.optim.SGD(params, lr=lr, momentum=optimizer_momentum(spec))
    velocity = None
    if spec.momentum_mode in ("corr", "dgc") and spec.method != "dense":
        velocity = [[torch.zeros_like(p) for p in params] for _ in range(P)]

    hist = {"step": [], "bytes": [], "metric": [], "eval_loss": []}
    train_loss, total_bytes, step_bytes = [], 0.0, []
    t0, c0 = time.perf_counter(), time.process_time()

    def record(step):
        ev = task.evaluate(model)
        hist["step"].append(step)
        hist["bytes"].append(total_bytes)
        hist["metric"].append(ev[task.metric])
        hist["eval_loss"].append(ev["loss"])

    record(0)
    diverged = False
    for step in range(steps):
        batch = task.batch_indices(spec.seed, step, batch_size)
        grads, losses = [], []
        for r in range(P):
            loss, g = worker_gradients(task, model, params, batch, r, P)
            losses.append(loss.item())
            if velocity is not None:
                for u, gi in zip(velocity[r], g):
                    u.mul_(spec.momentum).add_(gi)
                g = velocity[r]
            grads.append({n: gi for n, gi in zip(names, g)})
        train_loss.append(sum(losses) / P)
        if not all(math.isfinite(x) for x in losses):
            diverged = True
            break
        density = cfg.density_at(step)
        upd = oracle.step(grads)
        if velocity is not None and spec.momentum_mode == "dgc":
            _mask_velocity(velocity, oracle.last_sent, names, order, sizes)
        counts = [int(s.numel()) for s in oracle.last_sent] if spec.method == "threshold" else None
        k_total = numel if spec.method == "dense" else sum(k_for(density, sizes[n]) for n in names)
        step_bytes.append(bytes_per_worker(cfg.aggregation, P, numel, k_total, counts))
        total_bytes += step_bytes[-1]
        for n, p in zip(names, params):
            p.grad = upd[n]
        opt.step()
        if (step + 1) % task.eval_every == 0 or step + 1 == steps:
            record(step + 1)
        if progress is not None:
            progress(1)
    final = hist["metric"][-1] if not diverged else (0.0 if task.higher_is_better else float("inf"))
    out = {"spec": spec.as_dict(), "label": spec.label, "task": task.name, "metric": task.metric,
            "steps": steps, "lr": lr, "batch_size": batch_size, "numel": numel, "history": hist,
            "train_loss": train_loss, "final": final, "final_eval_loss": hist["eval_loss"][-1],
            "initial_eval_loss": hist["eval_loss"][0], "total_bytes": total_bytes,
            "bytes_per_step": total_bytes / max(1, len(step_bytes)), "diverged": diverged,
            "wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0}
    if keep_params:
        out["params"] = torch.cat([p.detach().reshape(-1) for p in params])
        out["bytes_per_step_curve"] = step_bytes
    return out


def _mask_velocity(velocity, last_sent, names, order, sizes) -> None:
    """Momentum factor masking: zero each worker's velocity where its value
    reached the global result (``Oracle.last_sent``, flat indices in the
    oracle's sorted-name layout)."""
    offs, o = {}, 0
    for n in order:
        offs[n] = o
        o += sizes[n]
    for r, sent in enumerate(last_sent):
        for j, n in enumerate(names):
            lo = offs[n]
            sel = sent[(sent >= lo) & (sent < lo + sizes[n])] - lo
            if sel.numel():
                velocity[r][j].view(-1)[sel] = 0
