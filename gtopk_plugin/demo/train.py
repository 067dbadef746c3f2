"""The demo's worker side: data, model, and one rank's training runs.

Every rank runs :func:`worker` (through :func:`gtopk_plugin._launch.launcher.run`):
for each method in turn it trains the CNN from the same seed, takes its shard
of every global batch, reduces the gradients with
:class:`gtopk_plugin.GradientReducer` (gTop-k S-SGD, Shi et al. 2019, arXiv
1901.04359: the global top-k average, error feedback keeping what was not
sent, Algorithm 2) and lets ``torch.optim.SGD`` apply the update.  The
recipe (DGC momentum correction, cosine learning rate, optional density
warm-up) is described in :mod:`gtopk_plugin.demo`.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import List, Optional

from gtopk_plugin.demo.report import fmt_bytes, fmt_ratio

WARMUP_START = 0.25  # DGC's first warm-up density
_TEST_FRACTION = 0.2  # fixed train/test split of the 1797 digits (1437 / 360)
_SPLIT_SEED = 0


# ------------------------------------------------------------------ data
def load_data() -> dict:
    """The 8x8 digits (scikit-learn's bundled copy, no download) as float32
    N x 1 x 8 x 8 arrays, split once and for all (stratified, fixed
    ``random_state``) into train and test sets, and standardised with the
    training set's mean and standard deviation."""
    import numpy as np
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = digits.images.astype(np.float32)[:, None, :, :]
    y = digits.target.astype(np.int64)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=_TEST_FRACTION, random_state=_SPLIT_SEED,
                                              stratify=y)
    mean, std = x_tr.mean(), x_tr.std()
    return {"x_train": (x_tr - mean) / std, "y_train": y_tr, "x_test": (x_te - mean) / std, "y_test": y_te}


# ----------------------------------------------------------------- model
def build_model():
    """A small CNN for 8x8 inputs (~39k parameters)."""
    from torch import nn

    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),  # 32 x 4 x 4
        nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10))


# --------------------------------------------------------------- worker
def _evaluate(model, x, y) -> float:
    import torch

    model.eval()
    with torch.no_grad():
        acc = (model(x).argmax(1) == y).float().mean().item()
    model.train()
    return acc


def _apply_reduced_gradients(model, reducer) -> None:
    """Reduce every parameter's gradient across workers and write the update
    (dense average, or the sparse global top-k average) back into ``p.grad``."""
    params = {n: p for n, p in model.named_parameters() if p.grad is not None}
    updates = reducer.reduce({n: p.grad for n, p in params.items()})
    for n, p in params.items():
        p.grad.copy_(updates[n])


def _epoch_batches(n: int, batch_size: int, seed: int, epoch: int):
    """Global batches of one epoch: the same permutation on every rank
    (seeded by (seed, epoch)); the last partial batch is dropped."""
    import torch

    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    perm = torch.randperm(n, generator=g)
    return [perm[i:i + batch_size] for i in range(0, n - batch_size + 1, batch_size)]


def warmup_schedule(method: str, args, steps_per_epoch: int):
    """DGC's exponential density warm-up as the reducer's one ``warmup=``
    argument (None for dense or ``--warmup-epochs 0``)."""
    from gtopk_plugin.config import DensityWarmup

    steps = int(round(args.warmup_epochs * steps_per_epoch))
    if method == "dense" or steps < 1:
        return None
    return DensityWarmup(steps=steps, start_density=max(WARMUP_START, args.density))


def uses_momentum_correction(method: str, args) -> bool:
    """Sparse methods correct momentum unless told not to; dense keeps the
    optimizer's momentum (for a dense reduction the two are the same)."""
    return method != "dense" and args.momentum > 0 and not args.no_momentum_correction


def lr_at(args, step: int, total_steps: int) -> float:
    """``--lr-schedule cosine``: lr·½(1 + cos(π·step/total)), the schedule of
    lab/convergence (sim.lr_at); else constant."""
    import math

    if args.lr_schedule == "cosine":
        return args.lr * 0.5 * (1.0 + math.cos(math.pi * step / total_steps))
    return args.lr


@dataclass
class _Traffic:
    """This rank's reducer traffic, summed over steps (``ReduceStats``)."""

    steps: int = 0
    bytes_sent: int = 0
    dense_bytes: int = 0
    control_bytes: int = 0

    def add(self, st) -> None:
        self.steps += 1
        self.bytes_sent += st.bytes_sent
        self.dense_bytes += st.dense_bytes
        self.control_bytes += st.control_bytes


def _progress(batches, desc: str, show: bool):
    """A tqdm bar over ``batches`` on rank 0 (stderr); the plain list elsewhere."""
    if not show:
        return batches
    from tqdm import tqdm

    return tqdm(batches, desc=desc, unit="step", leave=False, file=sys.stderr, dynamic_ncols=True)


def _train_epoch(model, opt, reducer, x, y, batches, rank: int, world: int, traffic: _Traffic,
                 fail_at_step: Optional[int], lr_of=None) -> float:
    """One epoch of S-SGD: each rank takes its shard of every global batch,
    backpropagates, reduces the gradients and steps.  Returns the mean loss
    over all ranks' shards."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    loss_sum = torch.zeros(2, dtype=torch.float64)  # (sum of losses, batches)
    for batch in batches:
        if fail_at_step is not None and traffic.steps == fail_at_step:
            raise RuntimeError(f"--fail-rank: rank {rank} fails on purpose at step {traffic.steps}")
        shard = torch.tensor_split(batch, world)[rank]
        opt.zero_grad(set_to_none=False)
        loss = F.cross_entropy(model(x[shard]), y[shard])
        loss.backward()
        _apply_reduced_gradients(model, reducer)
        if lr_of is not None:
            for g in opt.param_groups:
                g["lr"] = lr_of(traffic.steps)
        opt.step()
        traffic.add(reducer.last_stats)
        loss_sum += torch.tensor([loss.item(), 1.0], dtype=torch.float64)
    dist.all_reduce(loss_sum)
    return (loss_sum[0] / loss_sum[1]).item()


def train_one(method: str, args, data, rank: int, world: int, fail_at_step: Optional[int] = None) -> dict:
    """One full training run with ``method``; returns rank 0's test accuracy
    and history, and the traffic of all ranks.  Collective: every rank calls
    it together, with the same arguments but ``rank``."""
    import torch
    import torch.distributed as dist

    import gtopk_plugin as gp

    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = build_model()
    torch.manual_seed(args.seed * 1_000_003 + rank)  # then a per-process stream
    x_tr, y_tr = torch.from_numpy(data["x_train"]), torch.from_numpy(data["y_train"])
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    steps_per_epoch = len(y_tr) // args.batch_size
    corrected = uses_momentum_correction(method, args)
    # DGC momentum correction + factor masking: the velocity lives in the
    # reducer, per worker, in front of the compressor; opt.step() runs
    # without momentum (the reducer reads it from opt at every step)
    correction = dict(momentum_correction=True, optimizer=opt, named_parameters=model.named_parameters())
    reducer = gp.GradientReducer(method=method, density=args.density, seed=args.seed,
                                 warmup=warmup_schedule(method, args, steps_per_epoch),
                                 **(correction if corrected else {}))
    x_te, y_te = torch.from_numpy(data["x_test"]), torch.from_numpy(data["y_test"])
    show, traffic, history = rank == 0, _Traffic(), []

    dist.barrier()
    t0 = time.perf_counter()
    total_steps = args.epochs * steps_per_epoch
    for epoch in range(args.epochs):
        batches = _progress(_epoch_batches(len(y_tr), args.batch_size, args.seed, epoch),
                            f"{method:>9} epoch {epoch + 1}/{args.epochs}", show)
        loss = _train_epoch(model, opt, reducer, x_tr, y_tr, batches, rank, world, traffic, fail_at_step,
                            lambda step: lr_at(args, step, total_steps))
        if show:
            batches.close()
            acc = _evaluate(model, x_te, y_te)
            history.append({"epoch": epoch + 1, "loss": loss, "test_accuracy": acc})
            _print_epoch(method, epoch, args.epochs, loss, acc, traffic)
    wall = time.perf_counter() - t0

    totals = torch.tensor([traffic.bytes_sent, traffic.dense_bytes, traffic.control_bytes],
                          dtype=torch.float64)
    dist.all_reduce(totals)  # all workers together
    per_worker_step = traffic.steps * world
    return {"method": method, "density": 1.0 if method == "dense" else args.density,
            "test_accuracy": _evaluate(model, x_te, y_te),
            "final_loss": history[-1]["loss"] if history else None, "steps": traffic.steps,
            "bytes_per_step_per_worker": totals[0].item() / per_worker_step,
            "dense_bytes_per_step_per_worker": totals[1].item() / per_worker_step,
            "ratio_vs_dense": totals[0].item() / totals[1].item() if totals[1].item() else None,
            "total_bytes": int(totals[0].item()), "total_control_bytes": int(totals[2].item()),
            "momentum_correction": corrected, "wall_time_s": wall, "history": history}


def _print_epoch(method: str, epoch: int, epochs: int, loss: float, acc: float, traffic: _Traffic) -> None:
    """Rank 0's per-epoch line: loss, test accuracy, and the bytes it sent per
    step against what a dense ring allreduce would send (``last_stats``)."""
    sent, dense = traffic.bytes_sent / traffic.steps, traffic.dense_bytes / traffic.steps
    print(f"[{method}] epoch {epoch + 1}/{epochs}  loss {loss:.4f}  test acc {acc:.2%}  "
          f"rank 0 sent/step {fmt_bytes(sent)} vs dense allreduce {fmt_bytes(dense)} "
          f"({fmt_ratio(sent, dense)})",
          flush=True)


def worker(ctx, methods: List[str], args, data) -> Optional[List[dict]]:
    """Launcher target (:func:`gtopk_plugin._launch.launcher.run`, gloo group already
    joined): run each method in turn; rank 0 returns the results."""
    _thread_lock_for_tqdm()
    results = []
    for i, method in enumerate(methods):
        fail = 1 if (i == 0 and args.fail_rank == ctx.rank) else None
        results.append(train_one(method, args, data, ctx.rank, ctx.size, fail))
    ctx.barrier()
    return results if ctx.rank == 0 else None


def _thread_lock_for_tqdm() -> None:
    """Give tqdm a thread lock instead of its default multiprocessing RLock.

    Why: tqdm's default write lock creates a ``multiprocessing.RLock``, a
    named POSIX semaphore that a spawned worker registers with the
    launcher's resource tracker.  Workers leave through ``os._exit`` (no
    finalizers run), so the semaphore is never unregistered and the tracker
    prints "There appear to be 1 leaked semaphore objects to clean up at
    shutdown" when ``gtopk-demo`` ends.  Only rank 0 draws bars, in one
    process, so a thread lock is all the lock tqdm needs here."""
    import threading

    try:
        from tqdm import tqdm
    except ImportError:  # the launcher checked; nothing to do without tqdm
        return
    tqdm.set_lock(threading.RLock())
