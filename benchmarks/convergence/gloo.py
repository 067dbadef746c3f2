"""The same training run over a real ``torch.distributed`` gloo group: P
spawned processes, each computing its own shard's gradient and reducing it
with :class:`gtopk_plugin.GradientReducer` (default kernels), to show that the
simulated curves are the real ones.

Every worker builds the task, the initial weights, the batches and its
gradient with the functions :mod:`.sim` uses, so with an exact reducer the
two runs agree bit for bit; :func:`compare` reports the largest differences
(metric, training loss, final weights) and checks the byte formula against
the reducer's own counters (``ReduceStats.bytes_sent``, mean over ranks).

Process supervision (first failure or timeout kills every worker) is the
demo's (:mod:`gtopk_plugin.demo`).
"""
from __future__ import annotations

import datetime
import json
import math
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
import traceback

from . import sim


def _worker(rank: int, P: int, rendezvous: str, outdir: str, spec_d: dict, timeout: float) -> None:
    status = 1
    try:
        import torch
        import torch.distributed as dist

        import gtopk_plugin as gp

        from . import tasks

        torch.set_num_threads(1)
        spec = sim.RunSpec(**spec_d)
        task = tasks.get(spec.task)
        steps, lr, batch_size = sim.resolved(task, spec)
        dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=P,
                                timeout=datetime.timedelta(seconds=timeout))
        model = sim.initial_model(task, spec.seed)
        names = [n for n, _ in model.named_parameters()]
        params = [p for _, p in model.named_parameters()]
        # momentum correction, clipping and warm-up: the reducer's own
        # (sim.reducer_kwargs), as in the simulation; BatchNorm buffers stay
        # per rank and rank 0 evaluates with its own (sim.Rank0Buffers)
        reducer = gp.GradientReducer(**sim.reducer_kwargs(spec, steps, sim.steps_per_epoch(task, batch_size)))
        opt = sim.make_optimizer(spec, params, lr)
        hist = {"step": [], "metric": [], "eval_loss": []}

        def record(step):
            if rank == 0:
                ev = task.evaluate(model)
                hist["step"].append(step)
                hist["metric"].append(ev[task.metric])
                hist["eval_loss"].append(ev["loss"])

        record(0)
        losses, sent = [], []
        dist.barrier()
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
        if rank == 0:
            flat = torch.cat([p.detach().reshape(-1) for p in params])
            torch.save(flat, os.path.join(outdir, "params.pt"))
            out = {"history": hist, "train_loss": (tot[0] / P).tolist(),
                   "bytes_per_step": (tot[1] / P).tolist(), "wall_s": wall,
                   "kernels": reducer.config.kernels}
            with open(os.path.join(outdir, "result.json"), "w") as f:
                json.dump(out, f)
        dist.barrier()
        dist.destroy_process_group()
        status = 0
    except BaseException:  # noqa: BLE001 - reported by the launcher
        with open(os.path.join(outdir, f"error.{rank}"), "w") as f:
            f.write(traceback.format_exc())
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def run(spec: sim.RunSpec, timeout: float = 600.0) -> dict:
    """Train ``spec`` on ``spec.workers`` gloo processes; return rank 0's
    history, the mean training loss and bytes per step over ranks, and the
    final weights (``params``, a flat tensor)."""
    import torch

    from gtopk_plugin.demo import DemoError, _kill, _supervise

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ctx = mp.get_context("spawn")
    tmp = tempfile.mkdtemp(prefix="gtopk-conv-")
    procs = []
    t0 = time.perf_counter()
    try:
        rdzv = f"file://{os.path.join(tmp, 'rendezvous')}"
        procs = [ctx.Process(target=_worker, args=(r, spec.workers, rdzv, tmp, spec.as_dict(), timeout),
                             daemon=True, name=f"gtopk-conv-rank{r}") for r in range(spec.workers)]
        for p in procs:
            p.start()
        try:
            _supervise(procs, tmp, timeout)
        except DemoError as e:
            raise RuntimeError(f"gloo run of {spec.label} failed: {e}") from None
        with open(os.path.join(tmp, "result.json")) as f:
            out = json.load(f)
        out["params"] = torch.load(os.path.join(tmp, "params.pt"))
        out["total_wall_s"] = time.perf_counter() - t0
        return out
    finally:
        _kill(procs)
        shutil.rmtree(tmp, ignore_errors=True)


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
