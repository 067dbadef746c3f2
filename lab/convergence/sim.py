"""One training run of the convergence study, with P workers simulated in one
process by :class:`gtopk_plugin.testing.Oracle` (exact: the tests hold the
real collectives to it bit for bit), or -- for the codecs (onebit, qsgd,
powersgd), which the oracle does not model -- by P real
``GradientReducer`` ranks on threads
(:class:`gtopk_plugin.collectives.threads.ThreadGroup`; exact with respect
to gloo: tests/distributed/test_threads_vs_gloo.py), whose bytes are the
reducers' own counters.

Each step every simulated worker computes the gradient of its shard of the
global batch with the shared weights (the same call a real worker makes, see
:mod:`.gloo`), the oracle reduces the P gradients exactly as P
``GradientReducer`` ranks would, and plain ``torch.optim.SGD`` applies the
update.  Bytes communicated per worker come from the exact formulas of
docs/design.md §2 (checked against the reducer's own counters in the gloo run).

Momentum, four ways (``RunSpec.momentum_mode``), plain or Nesterov
(``RunSpec.nesterov``):

- ``"none"``: SGD without momentum.
- ``"opt"``: momentum in the optimizer, applied to the reduced update (what a
  user gets by putting ``torch.optim.SGD(momentum=m)`` after the reducer
  without turning the correction on).
- ``"corr"``: DGC momentum correction (Lin et al. 2018), the library's own
  (``Oracle(momentum_correction=m, nesterov=..., momentum_masking=False)``, i.e.
  :class:`gtopk_plugin.compress.momentum.MomentumCorrection` per simulated
  worker): each worker keeps a local velocity and feeds it to error
  feedback; the optimizer has no momentum.
- ``"dgc"``: the same with momentum factor masking
  (``momentum_masking=True``, the library's default).

For ``dense`` every mode but "none" is plain momentum SGD (the correction
of a dense reduction is the optimizer's momentum; study.canonical).

``RunSpec.optimizer="adamw"``: ``torch.optim.AdamW`` applies the reduced
update (error feedback alone, no correction: AdamW's first and second
moments are fed the *reduced, averaged* sparse update, zero at every
coordinate that no worker's value reached this step).

DGC's other two ingredients come from the library too: ``clip_norm``
(local clipping, threshold × P^-1/2, before the velocity) and
``warmup_epochs`` (``DensityWarmup``: density decays geometrically from
``warmup_start`` to the target over that many epochs).

BatchNorm running statistics (``glyphs_resnet``): every worker normalises
with its own shard's batch statistics in training (no SyncBatchNorm); the
running mean/variance used for evaluation are **rank 0's** (updated by rank
0's shards only), which is what DDP's default ``broadcast_buffers=True``
gives every rank and what the real gloo workers of :mod:`.gloo` evaluate.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import List, Optional

import torch

from gtopk_plugin.config import DensityWarmup, ReducerConfig
from gtopk_plugin.reducer import k_for
from gtopk_plugin.testing import Oracle

from lab.convergence.tasks import Task

MOMENTUM_MODES = ("none", "opt", "corr", "dgc")
OPTIMIZERS = ("sgd", "adamw")
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
    nesterov: bool = False
    optimizer: str = "sgd"            # "sgd" or "adamw" (error feedback alone)
    weight_decay: float = 0.0         # the optimizer's (AdamW: decoupled)
    clip_norm: Optional[float] = None  # DGC local clipping (library's clip_norm)
    warmup_epochs: float = 0.0        # DGC density warm-up over these epochs (library's DensityWarmup)
    warmup_start: float = 0.25
    lr_schedule: str = "const"        # "const" or "cosine" (decay to 0 at the last step)
    rank: Optional[int] = None        # powersgd's approximation rank (None: the codec's default)
    chunk: Optional[int] = None       # onebit's entries per scale (None: the codec's default, per tensor)
    merge: Optional[str] = None       # the aggregation (None: the method's default)
    codec_warmup_epochs: float = 0.0  # codecs: dense steps over these epochs (library's start_iter)

    def __post_init__(self):
        if self.momentum_mode not in MOMENTUM_MODES:
            raise ValueError(f"momentum_mode must be one of {MOMENTUM_MODES}; got {self.momentum_mode!r}")
        if self.lr_schedule not in ("const", "cosine"):
            raise ValueError(f"lr_schedule must be 'const' or 'cosine'; got {self.lr_schedule!r}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}; got {self.optimizer!r}")
        if self.optimizer == "adamw" and self.momentum_mode != "none":
            raise ValueError("AdamW keeps its own moments: momentum_mode must be 'none'")
        if self.method == "dense" or is_codec(self.method):
            object.__setattr__(self, "density", 1.0)  # codecs do not select: density means nothing
        if self.momentum_mode == "none":
            object.__setattr__(self, "momentum", 0.0)
            object.__setattr__(self, "nesterov", False)

    @property
    def label(self) -> str:
        lab = method_label(self.method, self.r_factor, self.rank)
        extra = ([f"chunk={self.chunk}"] if self.chunk is not None else []) + \
            (["two-phase"] if self.merge == "reduce_scatter_payloads" else
             [f"merge={self.merge}"] if self.merge else [])
        return f"{lab}({', '.join(extra)})" if extra else lab

    def as_dict(self) -> dict:
        return asdict(self)


def method_label(method: str, r_factor: float = 4.0, rank: Optional[int] = None) -> str:
    if method == "powersgd" and rank is not None:
        return f"powersgd(r={rank})"
    return f"rtopk(r={r_factor:g})" if method == "rtopk" else method


def is_codec(method: str) -> bool:
    """Whether ``method`` encodes the whole accumulator (onebit, qsgd,
    powersgd) rather than selecting entries: simulated on threads."""
    from gtopk_plugin.compress import describe

    return describe(method)["kind"] == "codec"


def warmup_schedule(steps: int) -> DensityWarmup:
    """The study's density warm-up: geometric decay from 25% to the target
    over the first sixth of training (DGC's exponential warm-up)."""
    return DensityWarmup(steps=max(1, steps // 6), start_density=0.25)


def dgc_warmup(epochs: float, steps_per_epoch: int, start_density: float = 0.25) -> DensityWarmup:
    """DGC's exponential density warm-up as the library's one argument:
    ``warmup=DensityWarmup(steps=epochs·steps_per_epoch, start_density=0.25)``
    (DGC: 25% → 6.25% → 1.56% → 0.4% → 0.1% over four epochs)."""
    return DensityWarmup(steps=max(1, int(round(epochs * steps_per_epoch))), start_density=start_density)


def reducer_kwargs(spec: RunSpec, steps: int, steps_per_epoch: Optional[int] = None) -> dict:
    """The ``GradientReducer`` / ``Oracle`` keyword arguments of a run
    (momentum correction, clipping and warm-up included)."""
    kw = dict(method=spec.method, density=spec.density, r_factor=spec.r_factor, seed=spec.seed,
              error_feedback=spec.error_feedback)
    if spec.rank is not None:
        kw["rank"] = spec.rank
    if spec.chunk is not None:
        kw["chunk"] = spec.chunk
    if spec.merge is not None:
        kw["merge"] = spec.merge
    if spec.method != "dense":
        if is_codec(spec.method):  # no density, so no density warm-up; a dense one instead
            if spec.codec_warmup_epochs > 0:
                if steps_per_epoch is None:
                    raise ValueError("codec_warmup_epochs needs steps_per_epoch")
                kw["start_iter"] = int(round(spec.codec_warmup_epochs * steps_per_epoch))
        elif spec.warmup:
            kw["warmup"] = warmup_schedule(steps)
        elif spec.warmup_epochs > 0:
            if steps_per_epoch is None:
                raise ValueError("warmup_epochs needs steps_per_epoch")
            kw["warmup"] = dgc_warmup(spec.warmup_epochs, steps_per_epoch, spec.warmup_start)
        if spec.momentum_mode in ("corr", "dgc"):
            kw.update(momentum_correction=spec.momentum, nesterov=spec.nesterov,
                      momentum_masking=spec.momentum_mode == "dgc")
    if spec.clip_norm is not None:
        kw["clip_norm"] = spec.clip_norm
    return kw


def make_optimizer(spec: RunSpec, params, lr: float):
    """The optimizer that applies the reduced update: SGD (momentum only in
    mode "opt", or for dense), or AdamW."""
    if spec.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=spec.weight_decay)
    m = optimizer_momentum(spec)
    return torch.optim.SGD(params, lr=lr, momentum=m, nesterov=spec.nesterov and m > 0,
                           weight_decay=spec.weight_decay)


def lr_at(spec: RunSpec, lr: float, step: int, steps: int) -> float:
    """The learning rate of ``step``: constant, or cosine decay from ``lr``
    to 0 over the run (the same schedule for every method)."""
    if spec.lr_schedule == "cosine":
        return lr * 0.5 * (1.0 + math.cos(math.pi * step / steps))
    return lr


def steps_per_epoch(task: Task, batch_size: int) -> int:
    return task.n_train // batch_size


def bytes_per_worker(aggregation: str, P: int, numel: int, k_total: int,
                     counts: Optional[List[int]] = None) -> float:
    """Bytes one worker sends in one step, averaged over the workers, from
    the exact formulas (docs/design.md §2; ``Transport`` counts them the same way):
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
    if aggregation == "butterfly":
        if P & (P - 1):
            raise ValueError("the butterfly byte formula here covers power-of-two P only")
        return float((P.bit_length() - 1) * ENTRY_BYTES * k_total)
    raise ValueError(f"unknown aggregation {aggregation!r}")


class OracleReduction:
    """The selector methods (and dense): ``testing.Oracle`` simulates the P
    workers; bytes from the exact formulas (:func:`bytes_per_worker`)."""

    def __init__(self, P: int, kw: dict, names, sizes):
        self.P, self.names, self.sizes = P, names, sizes
        self.cfg = ReducerConfig(**kw)
        self.oracle = Oracle(P, kernels="reference", **kw)

    def __call__(self, grads, step):
        """(the update every rank applies, bytes one worker sent this step)"""
        cfg, names, sizes = self.cfg, self.names, self.sizes
        density = cfg.density_at(step)
        upd = self.oracle.step(grads)
        numel = sum(sizes.values())
        counts = [int(s.numel()) for s in self.oracle.last_sent] if cfg.method == "threshold" else None
        k_total = numel if cfg.method == "dense" else sum(k_for(density, sizes[n]) for n in names)
        return upd, bytes_per_worker(cfg.aggregation, self.P, numel, k_total, counts)

    def info(self) -> dict:
        return {}

    def close(self):
        pass


class ThreadedReduction:
    """The codecs: P ``GradientReducer`` ranks (default kernels, as a real
    job) on a :class:`ThreadGroup`, each reducing its own worker's
    gradients; every rank gets the same bits, rank 0's update is applied;
    bytes are the reducers' own counters (payload + headers sent, mean over
    the ranks: ``ReduceStats.bytes_sent``, what the gloo run reads)."""

    def __init__(self, P: int, kw: dict, names, sizes):
        from gtopk_plugin import GradientReducer
        from gtopk_plugin.collectives.threads import ThreadGroup

        self.group = ThreadGroup(P)
        self.reducers = [GradientReducer(transport=t, **kw) for t in self.group.transports]

        # per step: the ranks' mean thread CPU time in reduce(), less the
        # transport's (waits and the in-process stand-in for the network)
        self.cpu_s = []

    def __call__(self, grads, step):
        def one(r):
            tr = self.group.transports[r]
            t0, x0 = time.thread_time(), tr.transport_cpu_s
            u = self.reducers[r].reduce(grads[r])
            return u, time.thread_time() - t0 - (tr.transport_cpu_s - x0)

        outs = self.group.map(one)
        self.cpu_s.append(sum(dt for _, dt in outs) / len(outs))
        sent = sum(red.last_stats.bytes_sent for red in self.reducers) / len(self.reducers)
        return outs[0][0], float(sent)

    def info(self) -> dict:
        c = sorted(self.cpu_s)
        return {"reduce_cpu_s_median": c[len(c) // 2] if c else None}

    def close(self):
        self.group.close()


def worker_gradients(task: Task, model, params, batch, rank: int, world: int):
    """The gradient of one worker's shard: the call both the simulated and
    the real workers make.  Returns (loss, [grad per param])."""
    loss = task.loss(model, task.shard(batch, rank, world))
    return loss.detach(), torch.autograd.grad(loss, params)


class Rank0Buffers:
    """Keep rank 0's module buffers (BatchNorm running statistics) while the
    simulation runs every worker's forward on the one shared model: after
    rank 0's forward the buffers are saved, after the last worker they are
    put back (DDP's ``broadcast_buffers=True``: every rank uses rank 0's)."""

    def __init__(self, model):
        self.buffers = [b for b in model.buffers()]
        self.saved = None

    def after(self, rank: int, world: int) -> None:
        if not self.buffers:
            return
        if rank == 0:
            self.saved = [b.clone() for b in self.buffers]
        if rank == world - 1 and self.saved is not None:
            for b, s in zip(self.buffers, self.saved):
                b.copy_(s)


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


def run(task: Task, spec: RunSpec, progress=None, keep_params: bool = False, reduction=None) -> dict:
    """Train one configuration; return its history and summary.

    ``progress``: optional callable(n) called after each step (a tqdm bar's
    ``update``).  ``keep_params``: also return the final weights (flat).
    ``reduction``: a factory ``(P, reducer kwargs, names, sizes)`` -> an
    object like :class:`OracleReduction` (``__call__(grads, step)``,
    ``info()``, ``close()``); default: the oracle, or the threads for a
    codec (the hierarchical study passes its node-sum reduction)."""
    steps, lr, batch_size = resolved(task, spec)
    P = spec.workers
    model = initial_model(task, spec.seed)
    names = [n for n, _ in model.named_parameters()]
    params = [p for _, p in model.named_parameters()]
    sizes = {n: p.numel() for n, p in zip(names, params)}
    numel = sum(sizes.values())
    kw = reducer_kwargs(spec, steps, steps_per_epoch(task, batch_size))
    if reduction is None:
        reduction = ThreadedReduction if is_codec(spec.method) else OracleReduction
    reduction = reduction(P, kw, names, sizes)
    opt = make_optimizer(spec, params, lr)
    buffers = Rank0Buffers(model)

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
            buffers.after(r, P)
            losses.append(loss.item())
            grads.append({n: gi for n, gi in zip(names, g)})
        train_loss.append(sum(losses) / P)
        if not all(math.isfinite(x) for x in losses):
            diverged = True
            break
        upd, sent = reduction(grads, step)
        step_bytes.append(sent)
        total_bytes += sent
        for n, p in zip(names, params):
            p.grad = upd[n]
        for g in opt.param_groups:
            g["lr"] = lr_at(spec, lr, step, steps)
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
    out.update(reduction.info())
    reduction.close()
    if keep_params:
        out["params"] = torch.cat([p.detach().reshape(-1) for p in params])
        out["buffers"] = [b.detach().clone() for b in model.buffers()]
        out["bytes_per_step_curve"] = step_bytes
    return out
