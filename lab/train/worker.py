"""One rank of a ``python -m lab train`` job: a real data-parallel training
run through one engine, timed step by step.

Engines (``run["engine"]``):

- ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` on the launcher's
  torch.distributed gloo group (what ``torchrun`` sets up).  Dense: DDP's
  own allreduce (``none``) or PyTorch's ``fp16_compress_hook``; sparse:
  :func:`gtopk_plugin.torch_ddp.sparse_hook` with
  ``SparseState(..., momentum_correction=True, optimizer=opt, warmup=...)``.
- ``horovod``: ``hvd.init()`` on Horovod's gloo controller (the rendezvous
  ``horovodrun`` would start; :mod:`lab.cluster.hvd_rdzv`) and
  :func:`gtopk_plugin.horovod.DistributedOptimizer` with
  ``Compression.none`` / ``fp16`` (Horovod's own allreduce) or
  ``Compression.<method>(density, momentum_correction=True, warmup=...)``.
- ``elastic``: :class:`gtopk_plugin.elastic.ElasticScheduler` (barrier,
  norm β, variance) over a dense or a sparse ``GradientReducer`` whose
  Transport adds a per-round latency drawn from N(latency, jitter)
  (:class:`lab.elastic.DelayedTransport`: this kernel has no netem,
  so the latency is injected transport-side, and labelled so).

Every configuration starts from the same weights (``torch.manual_seed(seed)``)
and sees the same batches (a per-epoch permutation of the training set,
seeded by (seed, epoch), cut into P shards).  The optimizer is the user's:
``SGD(lr, momentum=0.9, weight_decay)`` with cosine decay to 0 over the
budget; with a sparse method the library's recipe moves momentum and weight
decay into the reducer (DGC momentum correction with factor masking) and
warms the density up (``DensityWarmup``).

Clock: a step is timed from ``zero_grad`` to the end of ``optimizer.step()``
(forward, backward with its communication, update); the run's wall-clock is
the sum of step times (evaluations are not counted: rank 0 evaluates on the
test set every ``eval_every`` steps while the others wait at a barrier).
Compute alone: at every evaluation each rank times forward + backward +
update of a twin of the model with no communication at all (same batch,
same processes, same machine load at that moment).
CPU: each rank records its process's CPU time per step (every thread: the
engine's background threads, gloo's, Horovod's), and rank 0 the whole
machine's busy ticks during the steps (/proc/stat: every worker, the
kernel's network stack): where the workers share a few cores, a step can
wait on the CPU, not on the link.  The training thread's run-queue wait per
step (/proc/thread-self/schedstat) says how much of its step it was ready
to run while every core ran something else.
"""
from __future__ import annotations

import copy
import math
import os
import time

import torch
import torch.nn.functional as F

from lab.cluster.cpu_account import Windows, thread_schedstat
from lab.cluster.netns import tx_bytes
from lab.train import workloads

DENSE = ("dense", "dense-fp16")


def _warmup(p):
    from gtopk_plugin.config import DensityWarmup

    return DensityWarmup(steps=int(p["warmup_steps"])) if p["warmup_steps"] > 0 else None


def _ring_bytes(P, numel, elem):
    """Bytes one worker sends in a ring allreduce (docs/design.md §2)."""
    return 2 * (P - 1) * numel * elem // P


class _DDP:
    def __init__(self, ctx, run, model, opt, p):
        import gtopk_plugin as gp
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as dh
        from torch.nn.parallel import DistributedDataParallel as DDP

        self.P, self.numel = ctx.size, sum(q.numel() for q in model.parameters())
        self.model, self.opt, self.method, self.state = model, opt, run["method"], None
        self.ddp = DDP(model, bucket_cap_mb=25.0)
        if run["method"] == "dense-fp16":
            self.ddp.register_comm_hook(None, dh.fp16_compress_hook)
        elif run["method"] not in DENSE:
            self.state = gp.torch_ddp.SparseState(
                method=run["method"], density=run["density"], named_parameters=model.named_parameters(),
                momentum_correction=True, optimizer=opt, warmup=_warmup(p))
            self.ddp.register_comm_hook(self.state, gp.torch_ddp.sparse_hook)

    def step(self, x, y):
        self.opt.zero_grad(set_to_none=False)
        loss = F.cross_entropy(self.ddp(x), y)
        loss.backward()
        self.opt.step()
        return loss.item()

    def bytes_last(self):
        if self.state is not None:
            return int(self.state.last_step_traffic["bytes_sent"])
        return _ring_bytes(self.P, self.numel, 2 if self.method == "dense-fp16" else 4)

    def drain(self):
        pass


class _Horovod:
    def __init__(self, ctx, run, model, opt, p):
        from gtopk_plugin.horovod import Compression, DistributedOptimizer

        if run["method"] == "dense":
            comp = Compression.none
        elif run["method"] == "dense-fp16":
            comp = Compression.fp16
        else:
            comp = getattr(Compression, run["method"])(run["density"], momentum_correction=True,
                                                       warmup=_warmup(p))
        self.model = model
        self.opt = DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=comp)

    def step(self, x, y):
        self.opt.zero_grad()
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        self.opt.step()
        return loss.item()

    def bytes_last(self):
        t = getattr(self.opt, "last_step_traffic", None)
        return int(t["bytes_sent"]) if t else None

    def drain(self):
        pass


class _Elastic:
    def __init__(self, ctx, run, model, opt, p):
        import torch.distributed as dist

        import gtopk_plugin as gp
        from gtopk_plugin.elastic import ElasticScheduler
        from gtopk_plugin.collectives.torch_distributed import TorchDistributedTransport

        from lab.elastic import DelayedTransport

        inner = TorchDistributedTransport(dist.new_group(list(range(ctx.size))), timeout=ctx.timeout)
        self.tr = DelayedTransport(inner, run["latency_ms"] / 1e3, run["jitter_ms"] / 1e3,
                                   seed=1000 * ctx.rank + p["seed"])
        kw = dict(policy=run["policy"], max_staleness=1, bucket_cap_mb=run.get("bucket_cap_mb", 0.0))
        if run.get("beta") is not None:
            kw["beta"] = run["beta"]
        if run["method"] == "dense":
            self.sched = ElasticScheduler(model, opt, transport=self.tr, **kw)
        else:
            red = gp.GradientReducer(run["method"], run["density"], transport=self.tr, warmup=_warmup(p))
            self.sched = ElasticScheduler(model, opt, reducer=red, momentum_correction=True, **kw)
        self.model, self.opt = model, opt
        self._c = self.tr.counters.copy()

    def step(self, x, y):
        self.sched.zero_grad()
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        self.sched.step()
        return loss.item()

    def bytes_last(self):
        c = self.tr.counters.copy()
        d = c.minus(self._c)
        self._c = c
        return int(d.payload_bytes_sent + d.header_bytes_sent)

    def drain(self):
        self.sched.finish()


ENGINES = {"ddp": _DDP, "horovod": _Horovod, "elastic": _Elastic}


def _batch(seed, step, n_train, gb):
    per_epoch = n_train // gb
    epoch, i = divmod(step, per_epoch)
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n_train, generator=g)[i * gb:(i + 1) * gb]


@torch.no_grad()
def _evaluate(model, x, y):
    was = model.training
    model.eval()
    logits = torch.cat([model(x[i:i + 500]) for i in range(0, len(y), 500)])
    model.train(was)
    return {"accuracy": (logits.argmax(1) == y).float().mean().item(), "loss": F.cross_entropy(logits, y).item()}


def _compute_only(twin, x, y, lr):
    """Seconds of forward + backward + a plain SGD update of ``twin`` (no
    hooks, no communication)."""
    t0 = time.perf_counter()
    twin.zero_grad(set_to_none=False)
    F.cross_entropy(twin(x), y).backward()
    with torch.no_grad():
        for q in twin.parameters():
            q.add_(q.grad, alpha=-lr * 1e-3)  # tiny: the twin is for timing only
    return time.perf_counter() - t0


def train(ctx, p):
    """Worker: one configuration ``p["run"]``; per-step times, losses, bytes
    and eth0 bytes, compute-only probes, evaluations (rank 0)."""
    torch.set_num_threads(1)
    run, P, rank = p["run"], ctx.size, ctx.rank
    data = workloads.load_data(p["n_train"], p["n_test"], p["data_seed"])
    x, y = data["x_train"], data["y_train"]
    torch.manual_seed(p["seed"])
    model = workloads.build_model(p["workload"], p["model"])
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=p["lr"], momentum=0.9, weight_decay=p["weight_decay"])
    eng = ENGINES[run["engine"]](ctx, run, model, opt, p)
    steps = p["steps"]
    sched_opt = getattr(eng, "opt", opt)
    lr_sched = torch.optim.lr_scheduler.LambdaLR(
        sched_opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    gb = p["batch"] * P
    out = {"times": [], "cpu": [], "proc_cpu": [], "runq": [], "losses": [], "bytes": [], "tx": [], "compute": [],
           "evals": []}
    machine = Windows() if rank == 0 else None
    ctx.barrier()
    for s in range(steps):
        idx = torch.tensor_split(_batch(p["seed"], s, len(y), gb), P)[rank]
        xb, yb = x[idx], y[idx]
        tx0 = tx_bytes(p["iface"])
        if machine is not None:
            machine.start()
        r0 = thread_schedstat()
        t0, c0, q0 = time.perf_counter(), time.thread_time(), time.process_time()
        loss = eng.step(xb, yb)
        dt, dc, dq = time.perf_counter() - t0, time.thread_time() - c0, time.process_time() - q0
        r1 = thread_schedstat()
        if machine is not None:
            machine.stop()
        tx1 = tx_bytes(p["iface"])
        lr_sched.step()
        out["times"].append(dt)
        out["cpu"].append(dc)  # the training thread's CPU time: compute, hooks, selection
        out["proc_cpu"].append(dq)  # every thread of this worker's process
        # the training thread ready to run but without a core (shared machine)
        out["runq"].append(None if r0 is None or r1 is None else r1[1] - r0[1])
        out["losses"].append(loss)
        out["bytes"].append(eng.bytes_last())
        out["tx"].append(None if tx0 is None else tx1 - tx0)
        if (s + 1) % p["eval_every"] == 0 or s + 1 == steps:
            out["compute"].append(_compute_only(twin, xb, yb, p["lr"]))
            eng.drain()
            ev = _evaluate(model, data["x_test"], data["y_test"]) if rank == 0 else None
            ctx.barrier()
            out["evals"].append({"step": s + 1, "eval": ev})
            acc = f" acc {100 * ev['accuracy']:.1f}%" if ev else ""
            ctx.progress(what=f"{run['name']} step {s + 1}/{steps}{acc}")
    eng.drain()
    if machine is not None:
        out["machine_ticks"] = machine.as_dict()
        out["ticks_per_s"] = os.sysconf("SC_CLK_TCK")
        out["cores"] = os.cpu_count()
    with torch.no_grad():
        out["checksum"] = float(sum(q.double().sum().item() for q in model.parameters()))
    stats = getattr(getattr(eng, "sched", None), "stats", None)
    if stats is not None:
        st = stats.as_dict()
        out["elastic"] = {k: st.get(k) for k in ("steps", "barrier_breaks", "late_updates", "seconds_waiting",
                                                 "mean_applied_fraction_at_break")}
        out["latency"] = {"waits": eng.tr.waits, "wanted_s": eng.tr.wanted_s, "slept_s": eng.tr.slept_s,
                          "inner_s": eng.tr.inner_s}
        eng.sched.close()
    return out
