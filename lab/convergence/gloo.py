"""The same training run over a real ``torch.distributed`` gloo group: P
spawned processes, each computing its own shard's gradient and reducing it
with :class:`gtopk_plugin.GradientReducer` (default kernels), to show that the
simulated curves are the real ones.

Every worker builds the task, the initial weights, the batches and its
gradient with the functions :mod:`.sim` uses, so with an exact reducer the
two runs agree bit for bit; :func:`compare` reports the largest differences
(metric, training loss, final weights) and checks the byte formula against
the reducer's own counters (``ReduceStats.bytes_sent``, mean over ranks).

Processes, rendezvous and supervision (first failure or timeout kills
every worker) are the project's one launcher's (:mod:`gtopk_plugin._launch.launcher`).
"""
from __future__ import annotations

import math
import time

from lab.convergence import sim


def history_recorder(task, model, evaluates: bool = True):
    """A worker's evaluation history and the function that extends it:
    ``record(step)`` evaluates ``model`` on ``task`` and appends the step,
    the task's metric and the evaluation loss to ``hist``; with ``evaluates``
    false it does nothing (a rank that does not report).  Returns
    ``(hist, record)``."""
    hist = {"step": [], "metric": [], "eval_loss": []}

    def record(step):
        if evaluates:
            ev = task.evaluate(model)
            hist["step"].append(step)
            hist["metric"].append(ev[task.metric])
            hist["eval_loss"].append(ev["loss"])

    return hist, record


def worker(ctx, spec_d: dict) -> dict:
    """Launcher target (:func:`gtopk_plugin._launch.launcher.run`, gloo group joined):
    train ``spec_d`` on this rank; rank 0 returns the history, the mean
    training loss and bytes per step over ranks, and the final weights."""
    import torch
    import torch.distributed as dist

    import gtopk_plugin as gp

    from lab.convergence import tasks

    rank, P = ctx.rank, ctx.size
    spec = sim.RunSpec(**spec_d)
    task = tasks.get(spec.task)
    steps, lr, batch_size = sim.resolved(task, spec)
    model = sim.initial_model(task, spec.seed)
    names = [n for n, _ in model.named_parameters()]
    params = [p for _, p in model.named_parameters()]
    # momentum correction, clipping and warm-up: the reducer's own
    # (sim.reducer_kwargs), as in the simulation; BatchNorm buffers stay
    # per rank and rank 0 evaluates with its own (sim.Rank0Buffers)
    reducer = gp.GradientReducer(**sim.reducer_kwargs(spec, steps, sim.steps_per_epoch(task, batch_size)))
    opt = sim.make_optimizer(spec, params, lr)
    hist, record = history_recorder(task, model, evaluates=rank == 0)
    record(0)
    losses, sent = [], []
    ctx.barrier()
    t0 = time.perf_counter()
    for step in range(steps):
        batch = task.batch_indices(spec.seed, step, batch_size)
        loss, g = sim.worker_gradients(task, model, params, batch, rank, P)
        upd = reducer.reduce(dict(zip(names, g)))
        for n, p in zip(names, params):
            p.grad = upd[n]
        for grp in opt.param_groups:
            grp["lr"] = sim.lr_at(spec, lr, step, steps)
        opt.step()
        losses.append(loss.item())
        sent.append(reducer.last_stats.bytes_sent)
        if (step + 1) % task.eval_every == 0 or step + 1 == steps:
            record(step + 1)
    wall = time.perf_counter() - t0
    tot = torch.tensor([losses, sent], dtype=torch.float64)
    dist.all_reduce(tot)
    out = None
    if rank == 0:
        # the weights travel pickled: bit for bit
        out = {"params": torch.cat([p.detach().reshape(-1) for p in params]), "history": hist, "train_loss": (tot[0] / P).tolist(),
               "bytes_per_step": (tot[1] / P).tolist(), "wall_s": wall,
               "kernels": reducer.config.kernels}
    ctx.barrier()
    return out


def simulated(fn, *args, **kw):
    """``fn(*args, **kw)`` (a simulation to compare with :func:`run`) on one
    thread, as the launcher's workers run (OMP_NUM_THREADS=1): with more,
    the gradients' convolutions and matmuls split their sums differently
    and the runs part by an ulp (a check in a process that kept torch's
    default thread count reported 1e-9 differences)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn(*args, **kw)
    finally:
        torch.set_num_threads(threads)


def run(spec: sim.RunSpec, timeout: float = 600.0) -> dict:
    """Train ``spec`` on ``spec.workers`` gloo processes; return rank 0's
    history, the mean training loss and bytes per step over ranks, and the
    final weights (``params``, a flat tensor)."""
    from gtopk_plugin._launch import launcher as launch

    t0 = time.perf_counter()
    try:
        out = launch.run(spec.workers, worker, spec.as_dict(), timeout=timeout)[0]
    except launch.LaunchError as e:
        raise RuntimeError(f"gloo run of {spec.label} failed: {e}") from None
    out["total_wall_s"] = time.perf_counter() - t0
    return out


def compare(simulated: dict, real: dict) -> dict:
    """Largest differences between a simulated run (``sim.run(...,
    keep_params=True)``) and the gloo run of the same spec."""
    def maxdiff(a, b):
        if len(a) != len(b):
            return math.inf
        return max((abs(x - y) for x, y in zip(a, b)), default=0.0)

    p_s, p_r = simulated["params"], real["params"]
    return {
        "metric_max_abs_diff": maxdiff(simulated["history"]["metric"], real["history"]["metric"]),
        "train_loss_max_abs_diff": maxdiff(simulated["train_loss"], real["train_loss"]),
        "params_max_abs_diff": float((p_s - p_r).abs().max()) if p_s.shape == p_r.shape else math.inf,
        "params_bitwise_equal": bool(p_s.shape == p_r.shape and (p_s == p_r).all()),
        "bytes_formula_max_abs_diff": maxdiff(simulated["bytes_per_step_curve"], real["bytes_per_step"]),
        "simulated_metric": simulated["history"]["metric"], "real_metric": real["history"]["metric"],
        "steps": simulated["history"]["step"], "real_wall_s": real.get("total_wall_s"),
        "kernels": real.get("kernels"),
    }
