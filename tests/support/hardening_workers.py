"""Worker functions of tests/distributed/test_hardening_distributed.py, run in real
torch.distributed gloo process groups (tests/dist_utils.run_workers).

They only drive the public API and record what a user can observe — each
call's input gradients, the residuals before and after, and the returned
update — as numpy arrays.  All checking happens in the test against numpy
oracles."""
import numpy as np
import torch
import torch.distributed as dist

import gtopk_plugin as gp

METHODS = ["dense", "topk", "gtopk", "rtopk", "randomk", "threshold"]
# Two buckets of the same sizes (134 entries each); the SAME values go into
# both, so that buckets drawing with one key would select the same positions.
BUCKET1 = {"a.weight": (8, 12), "a.bias": (8,), "b.weight": (30,)}
BUCKET2 = {"c.weight": (8, 12), "c.bias": (8,), "d.weight": (30,)}
LAYERS = {"conv.weight": (4, 3, 3), "fc.weight": (10, 12), "fc.bias": (10,)}


def _randn(shapes, rank, step, salt):
    g = torch.Generator().manual_seed(1_000_003 * salt + 1009 * step + rank)
    return {n: torch.randn(s, generator=g) for n, s in shapes.items()}


def _residuals(red, names):
    res = red.memory.residuals
    return {n: (res[n].detach().reshape(-1).numpy().copy() if n in res else None) for n in names}


def _call(red, grads, **kw):
    """One reduce() with what a test needs: grads, residuals before/after
    (flat, float32), update (flat)."""
    before = _residuals(red, list(grads))
    out = red.reduce(grads, **kw)
    return {"grads": {n: g.reshape(-1).numpy().copy() for n, g in grads.items()},
            "res_before": before, "res_after": _residuals(red, list(grads)),
            "update": {n: u.reshape(-1).numpy().copy() for n, u in out.items()}}


def buckets(rank, P, steps=10):
    """Two reduce() calls per step (advance_step=False on the first, as DDP
    does for all buckets but the last), granularity="global", random-k and
    rTop-k, identical values in both buckets."""
    out = {}
    for method, kw in (("randomk", {}), ("rtopk", dict(r_factor=2.0))):
        red = gp.GradientReducer(method=method, density=0.1, granularity="global", op="sum", seed=5,
                                 transport=gp.TorchDistributedTransport(timeout=60), **kw)
        calls = []
        for s in range(steps):
            g = _randn(BUCKET1, rank, s, salt=1)
            g2 = {n2: g[n1].clone() for n1, n2 in zip(BUCKET1, BUCKET2)}
            calls.append((_call(red, g, advance_step=False), _call(red, g2)))
        out[method] = calls
    return out


def methods(rank, P, steps=4):
    """Every method, op="sum" and op="average" on the same gradients, per-layer
    granularity: the calls for the oracle checks."""
    out = {}
    for method in METHODS:
        kw = dict(density=0.25, seed=3)
        if method == "rtopk":
            kw["r_factor"] = 2.0
        red_sum = gp.GradientReducer(method=method, op="sum",
                                     transport=gp.TorchDistributedTransport(timeout=60), **kw)
        red_avg = gp.GradientReducer(method=method, op="average",
                                     transport=gp.TorchDistributedTransport(timeout=60), **kw)
        calls = []
        for s in range(steps):
            g = _randn(LAYERS, rank, s, salt=2)
            c = _call(red_sum, g)
            c["update_avg"] = {n: u.reshape(-1).numpy().copy()
                               for n, u in red_avg.reduce({n: t.clone() for n, t in g.items()}).items()}
            calls.append(c)
        out[method] = {"calls": calls, "final_residuals": _residuals(red_sum, list(LAYERS))}
    return out


def ddp_buckets(rank, P, steps=4):
    """DDP with one bucket per layer (two layers of the same size) and the
    library's hook with random-k, granularity="global", each bucket reduced
    on its own (coalesce_buckets=False): each layer's grad
    after backward is its bucket's update; its nonzeros are the positions
    drawn for that bucket."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 20, bias=False), torch.nn.Tanh(),
                                torch.nn.Linear(20, 20, bias=False))
    state = gp.torch_ddp.SparseState(method="randomk", density=0.1, granularity="global", seed=9,
                                     named_parameters=model.named_parameters(),
                                     coalesce_buckets=False)  # per-bucket draws are the point
    ddp = DDP(model, bucket_cap_mb=0.001)  # 1 KB < one 20x20 fp32 weight: one bucket each
    log = []

    def hook(st, bucket):
        log.append((len(masks), bucket.index(), len(bucket.parameters())))
        return gp.torch_ddp.sparse_hook(st, bucket)

    ddp.register_comm_hook(state, hook)
    masks = []
    for s in range(steps):
        g = torch.Generator().manual_seed(100 * s + rank)
        x, y = torch.randn(16, 20, generator=g), torch.randn(16, 20, generator=g)
        ddp.zero_grad()
        ((ddp(x) - y) ** 2).mean().backward()
        masks.append([(p.grad.reshape(-1) != 0).numpy().copy() for p in model.parameters()])
    return {"masks": masks, "hook_calls": log, "world": dist.get_world_size()}


def everything(rank, P):
    """One process group per P for the whole module (spawning costs more
    than the checks): the bucket runs, the method runs and, at P = 2, DDP."""
    out = {"buckets": buckets(rank, P), "methods": methods(rank, P)}
    if P == 2:
        out["ddp"] = ddp_buckets(rank, P)
    return out
