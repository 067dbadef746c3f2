"""``gtopk-demo``: data-parallel training of a small CNN with sparse gradients.

Launches ``--workers`` local processes joined in a ``torch.distributed`` gloo
group, trains a small CNN on scikit-learn's 8x8 digits (bundled with
scikit-learn, no download) and reduces every step's gradients with
:class:`gtopk_plugin.GradientReducer`.  By default it trains twice from the
same seed, once with dense allreduce (S-SGD) and once with the chosen method
(gTop-k S-SGD: Shi et al., 2019, "A Distributed Synchronous SGD Algorithm with
Global Top-k Sparsification for Low Bandwidth Networks", arXiv 1901.04359),
and prints test accuracy and traffic side by side::

    gtopk-demo                       # 4 workers, gtopk vs dense
    python -m gtopk_plugin.demo --method rtopk --density 0.02 --json out.json

Each worker gets its shard of every global batch; the reducer's update (the
global top-k average for gTop-k, with error feedback keeping what was not
sent, Algorithm 2 of the paper) is written into ``p.grad`` and applied by
``torch.optim.SGD``.

The default run is the recipe the convergence study supports
(docs/convergence.md, "The recipe"): for the sparse method, DGC momentum
correction with momentum factor masking (Lin et al. 2018), turned on with
``reducer.correct_momentum(opt, model.named_parameters())``, so that the
SGD optimizer's momentum 0.9 moves in front of the compressor (the
optimizer then steps without momentum), and a cosine learning-rate decay to
zero for both runs.  DGC's exponential density warm-up is one flag away
(``--warmup-epochs 1``: ``DensityWarmup``, 25% down to the target over the
first epoch); it is off by default because in this configuration it did not
help (docs/convergence.md) and it raises the traffic above 15% of dense.
``--no-momentum-correction --lr-schedule const`` gives the old setup
(momentum applied by the optimizer to the sparse update), which ends
several points below dense.  Exit status is non-zero if any worker
raises, dies, or the run exceeds ``--timeout``; the surviving workers are
killed rather than left waiting in a collective.
"""
from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import multiprocessing.connection
import os
import shutil
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import List, Optional, Sequence

METHODS = ("dense", "topk", "gtopk", "rtopk", "randomk", "threshold")
DEFAULTS = dict(workers=4, method="gtopk", density=0.05, epochs=8, batch_size=32, lr=0.05,
                momentum=0.9, seed=0, timeout=600.0, warmup_epochs=0.0, lr_schedule="cosine")
WARMUP_START = 0.25  # DGC's first warm-up density
_TEST_FRACTION = 0.2  # fixed train/test split of the 1797 digits (1437 / 360)
_SPLIT_SEED = 0


# --------------------------------------------------------------------- CLI
def _density(text: str) -> float:
    try:
        d = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"density must be a number in (0, 1]; got {text!r}") from None
    if not (0.0 < d <= 1.0):  # also rejects NaN
        raise argparse.ArgumentTypeError(f"density must be in (0, 1] (fraction of gradient entries "
                                         f"sent, e.g. 0.05); got {text}")
    return d


def _positive(kind):
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}; got {text!r}") from None
        if not (v > 0):
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}; got {text}")
        return v
    return parse


def build_parser() -> argparse.ArgumentParser:
    d = DEFAULTS
    p = argparse.ArgumentParser(
        prog="gtopk-demo",
        description="Train a small CNN on the 8x8 digits with P local gloo workers, reducing "
                    "gradients with gtopk_plugin (gTop-k S-SGD, Shi et al. 2019), and compare "
                    "accuracy and traffic with dense allreduce.")
    p.add_argument("--workers", type=_positive(int), default=d["workers"],
                   help=f"number of worker processes P (default {d['workers']})")
    p.add_argument("--method", choices=METHODS, default=d["method"],
                   help=f"gradient reduction method (default {d['method']})")
    p.add_argument("--density", type=_density, default=d["density"],
                   help=f"fraction of entries each worker sends per layer, in (0, 1] "
                        f"(default {d['density']})")
    p.add_argument("--epochs", type=_positive(int), default=d["epochs"],
                   help=f"training epochs per run (default {d['epochs']})")
    p.add_argument("--batch-size", type=_positive(int), default=d["batch_size"],
                   help=f"global batch size, split across workers (default {d['batch_size']})")
    p.add_argument("--lr", type=_positive(float), default=d["lr"],
                   help=f"SGD learning rate (default {d['lr']})")
    p.add_argument("--momentum", type=float, default=d["momentum"],
                   help=f"SGD momentum (default {d['momentum']})")
    p.add_argument("--no-momentum-correction", action="store_true",
                   help="keep momentum in the optimizer, applied to the sparse update (by default the "
                        "sparse method runs DGC momentum correction + masking: "
                        "reducer.correct_momentum(optimizer, named_parameters))")
    p.add_argument("--warmup-epochs", type=float, default=d["warmup_epochs"],
                   help=f"DGC density warm-up: the density decays geometrically from {WARMUP_START:g} to "
                        f"--density over this many epochs (default {d['warmup_epochs']:g}; 0: off)")
    p.add_argument("--lr-schedule", choices=("cosine", "const"), default=d["lr_schedule"],
                   help=f"learning rate: cosine decay to 0 over the run, or constant (default {d['lr_schedule']})")
    p.add_argument("--seed", type=int, default=d["seed"], help=f"random seed (default {d['seed']})")
    p.add_argument("--no-compare", action="store_true",
                   help="skip the dense-allreduce baseline run")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON to PATH")
    p.add_argument("--timeout", type=_positive(float), default=d["timeout"],
                   help=f"seconds before the whole run is abandoned (default {d['timeout']:g})")
    # Test-only hook (tests/distributed/test_demo.py): rank N raises at training step 1 of
    # the first run, to check that a failing worker ends the demo non-zero
    # without hanging.  Hidden from --help.
    p.add_argument("--fail-rank", type=int, default=None, help=argparse.SUPPRESS)
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.batch_size < args.workers:
        parser.error(f"--batch-size ({args.batch_size}) must be at least --workers ({args.workers}) "
                     "so that every worker gets a sample of each batch")
    if not (0.0 <= args.momentum < 1.0):
        parser.error(f"--momentum must be in [0, 1); got {args.momentum}")
    if not (args.warmup_epochs >= 0.0) or args.warmup_epochs > args.epochs:
        parser.error(f"--warmup-epochs must be in [0, --epochs]; got {args.warmup_epochs}")
    if args.fail_rank is not None and not (0 <= args.fail_rank < args.workers):
        parser.error(f"--fail-rank must be in [0, {args.workers - 1}]; got {args.fail_rank}")
    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        parser.error(f"--json {args.json}: directory {os.path.dirname(os.path.abspath(args.json))} "
                     "does not exist")
    return args


def _check_extras() -> None:
    """Fail early, in the launcher, if the demo's extra dependencies are missing."""
    missing = []
    for mod, pkg in (("sklearn", "scikit-learn"), ("tqdm", "tqdm"), ("numpy", "numpy")):
        try:
            __import__(mod)
        except ImportError:
            missing.append(pkg)
    if missing:
        raise DemoError(f"the demo needs {', '.join(missing)}: pip install 'gtopk-plugin[demo]'")


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
    from .config import DensityWarmup

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
    benchmarks/convergence (sim.lr_at); else constant."""
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
    reducer = gp.GradientReducer(method=method, density=args.density, seed=args.seed,
                                 warmup=warmup_schedule(method, args, steps_per_epoch))
    corrected = uses_momentum_correction(method, args)
    if corrected:
        # DGC momentum correction + factor masking: the velocity lives in the
        # reducer, per worker, in front of the compressor; opt.step() runs
        # without momentum (the binding reads it from opt at every step)
        reducer.correct_momentum(opt, model.named_parameters())
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
          f"rank 0 sent/step {_fmt_bytes(sent)} vs dense allreduce {_fmt_bytes(dense)} "
          f"({_fmt_ratio(sent, dense)})",
          flush=True)


def _worker(rank: int, world: int, rendezvous: str, outdir: str, methods: List[str], args) -> None:
    """Process entry point: join the gloo group, run each method in turn,
    write rank 0's results; on any exception write the traceback and exit 1."""
    try:
        import numpy as np
        import torch
        import torch.distributed as dist

        with np.load(os.path.join(outdir, "data.npz")) as z:
            data = {k: z[k] for k in z.files}

        torch.set_num_threads(1)
        _thread_lock_for_tqdm()
        dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=args.timeout))
        results = []
        for i, method in enumerate(methods):
            fail = 1 if (i == 0 and args.fail_rank == rank) else None
            results.append(train_one(method, args, data, rank, world, fail))
        dist.barrier()
        if rank == 0:
            _write_json(os.path.join(outdir, "results.json"), results)
        dist.destroy_process_group()
        status = 0
    except BaseException:  # noqa: BLE001 - everything goes back to the launcher
        with open(os.path.join(outdir, f"error.{rank}"), "w") as f:
            f.write(traceback.format_exc())
        status = 1
    # Skip interpreter teardown: after a failure it may wait on dead peers,
    # and after success torch's teardown alone takes seconds per process.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


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


def _prepare_kernels() -> None:
    """Load (and, after a source change, compile) the CPU kernels once in the
    launcher, before the workers start: otherwise every worker waits on the
    same compilation inside ``--timeout`` (minutes on a loaded machine), and
    the demo times out before training begins.  Nothing to do with
    ``GTOPK_KERNELS=reference``; a failed build falls back to the reference
    kernels with the library's own warning."""
    import torch

    from . import kernels

    kernels.backend(torch.device("cpu"))


# --------------------------------------------------------------- launcher
class DemoError(RuntimeError):
    """A worker failed, died or timed out."""


def launch(methods: List[str], args, data) -> List[dict]:
    """Run ``methods`` on ``args.workers`` spawned gloo processes; return rank
    0's results.  Raises :class:`DemoError` (after killing every worker) if
    any worker fails or the run exceeds ``args.timeout``."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ctx = mp.get_context("spawn")
    tmpdir = tempfile.mkdtemp(prefix="gtopk-demo-")
    procs = []
    try:
        # The data goes through a file, not the spawn pipe: arguments larger
        # than a pipe buffer make each start() wait for the previous child to
        # finish importing, serialising the start-up of all workers.
        _save_npz(os.path.join(tmpdir, "data.npz"), data)
        rendezvous = f"file://{os.path.join(tmpdir, 'rendezvous')}"
        procs = [ctx.Process(target=_worker, args=(r, args.workers, rendezvous, tmpdir, methods, args),
                             name=f"gtopk-demo-rank{r}", daemon=True) for r in range(args.workers)]
        for p in procs:
            p.start()
        _supervise(procs, tmpdir, args.timeout)
        try:
            with open(os.path.join(tmpdir, "results.json")) as f:
                return json.load(f)
        except (OSError, ValueError) as e:
            raise DemoError(f"all workers exited cleanly but rank 0 left no results: {e}") from e
    finally:
        _kill(procs)
        shutil.rmtree(tmpdir, ignore_errors=True)


def _save_npz(path: str, data) -> None:
    import numpy as np

    np.savez(path, **data)


def _supervise(procs, tmpdir: str, timeout: float) -> None:
    """Wait for all workers; on the first failure or at the deadline, raise."""
    deadline = time.monotonic() + timeout
    while True:
        codes = [p.exitcode for p in procs]
        failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            raise DemoError(_failure_message(failed, codes, tmpdir))
        if all(c == 0 for c in codes):
            return
        left = deadline - time.monotonic()
        if left <= 0:
            hung = [r for r, c in enumerate(codes) if c is None]
            raise DemoError(f"timed out after {timeout:g} s (ranks {hung} still running); "
                            "all workers were killed (raise --timeout for slower machines)")
        mp.connection.wait([p.sentinel for p in procs if p.exitcode is None], timeout=min(left, 1.0))


def _failure_message(failed: List[int], codes, tmpdir: str) -> str:
    lines = []
    for r in failed:
        path = os.path.join(tmpdir, f"error.{r}")
        if os.path.exists(path):
            with open(path) as f:
                tb = f.read().rstrip()
            last = tb.splitlines()[-1] if tb else "unknown error"
            lines.append(f"worker rank {r} failed (exit code {codes[r]}): {last}\n{tb}")
        else:
            lines.append(f"worker rank {r} died with exit code {codes[r]}")
    return "\n".join(lines) + "\nall workers were killed"


def _kill(procs) -> None:
    for p in procs:
        if p.exitcode is None:
            p.kill()
    for p in procs:
        p.join(5)


# ----------------------------------------------------------------- report
def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000.0
    return f"{n:.1f} GB"  # pragma: no cover


def _fmt_ratio(sent: float, dense: float) -> str:
    return f"{sent / dense:.2%}" if dense else "n/a"


def format_table(results: List[dict]) -> str:
    """method | test accuracy | bytes sent/step/worker | total bytes | wall time."""
    head = ["method", "density", "test accuracy", "bytes sent/step/worker", "vs dense", "total bytes",
            "wall time"]
    rows = [[r["method"], f"{r['density']:g}", f"{r['test_accuracy']:.2%}",
             _fmt_bytes(r["bytes_per_step_per_worker"]),
             _fmt_ratio(r["bytes_per_step_per_worker"], r["dense_bytes_per_step_per_worker"]),
             _fmt_bytes(r["total_bytes"]), f"{r['wall_time_s']:.1f} s"] for r in results]
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]

    def line(cells):
        return " | ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()

    return "\n".join([line(head), "-+-".join("-" * w for w in widths)] + [line(r) for r in rows])


def _write_json(path: str, obj) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
    os.replace(tmp, path)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Console entry point ``gtopk-demo``; returns the exit status."""
    args = parse_args(argv)
    methods = [args.method] if (args.no_compare or args.method == "dense") else ["dense", args.method]
    recipe = []
    if args.method != "dense" and args.momentum > 0:
        recipe.append("no momentum correction (momentum in the optimizer)" if args.no_momentum_correction
                      else f"momentum {args.momentum:g} with DGC correction + masking")
    if args.method != "dense" and args.warmup_epochs > 0:
        recipe.append(f"density warm-up over {args.warmup_epochs:g} epoch(s)")
    recipe.append(f"{args.lr_schedule} lr {args.lr:g}")
    print(f"gtopk-demo: {args.workers} workers (gloo), methods {', '.join(methods)}, density "
          f"{args.density:g}, {args.epochs} epochs, global batch {args.batch_size}; {', '.join(recipe)}",
          flush=True)
    t0 = time.perf_counter()
    try:
        _check_extras()
        data = load_data()
        _prepare_kernels()
        results = launch(methods, args, data)
    except DemoError as e:
        print(f"gtopk-demo: error: {e}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print("gtopk-demo: interrupted; all workers were killed", file=sys.stderr, flush=True)
        return 130
    total = time.perf_counter() - t0
    print()
    print(format_table(results))
    print(f"\n(total wall time including process start-up: {total:.1f} s)", flush=True)
    if args.json:
        out = {"workers": args.workers, "method": args.method, "density": args.density,
               "epochs": args.epochs, "batch_size": args.batch_size, "lr": args.lr,
               "momentum": args.momentum, "momentum_correction": not args.no_momentum_correction,
               "warmup_epochs": args.warmup_epochs, "lr_schedule": args.lr_schedule,
               "seed": args.seed, "methods": methods,
               "total_wall_time_s": total, "results": {r["method"]: r for r in results}}
        try:
            _write_json(args.json, out)
        except OSError as e:
            print(f"gtopk-demo: error: cannot write --json {args.json}: {e}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
