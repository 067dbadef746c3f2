"""Workers of tests/distributed/test_checkpoint_gloo.py (real gloo groups):
a job trains, saves its reducers' checkpoints with ``gp.save_job``, and
jobs of other world sizes load them with ``gp.load_job`` and train on."""
import copy
import os

import torch
import torch.distributed as dist

import gtopk_plugin as gp
from gtopk_plugin import checkpoint

SHAPES = {"w": (16, 12), "v": (50,), "b": (5,)}
CONFIGS = {
    # op="sum": mass conservation reads Σ grad = Σ result + Σ residual
    "gtopk": dict(method="gtopk", density=0.1, op="sum", seed=1),
    "momentum": dict(method="gtopk", density=0.1, op="sum", seed=1, momentum_correction=0.9, dense_below=10),
    "powersgd": dict(method="powersgd", rank=1, op="sum", seed=1),
}


def grads(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}


def params():
    return {n: torch.zeros(s) for n, s in SHAPES.items()}


def snapshot(red):
    """Residuals, velocities (and the dense part's), compressor state, step."""
    sd = red.state_dict()
    return copy.deepcopy({"residuals": sd["residuals"], "velocities": sd["velocities"],
                          "small": (sd.get("small") or {}).get("velocities", {}),
                          "compressor": sd["compressor"], "step": sd["step"]})


def _train(red, rank, steps, first):
    """``steps`` steps; the float64 sums of this rank's gradients and of the
    (identical on every rank) results, and every result for the agreement
    check."""
    gsum = {n: torch.zeros(s, dtype=torch.float64) for n, s in SHAPES.items()}
    usum = copy.deepcopy(gsum)
    outs = []
    for t in range(first, first + steps):
        g = grads(rank, t)
        u = red.reduce(g)
        for n in SHAPES:
            gsum[n] += g[n].double()
            usum[n] += u[n].double()
        outs.append({n: u[n].clone() for n in SHAPES})
    return gsum, usum, outs


def save_worker(rank, P, root, steps):
    out = {}
    for name, kw in CONFIGS.items():
        red = gp.GradientReducer(**kw)
        gsum, usum, _ = _train(red, rank, steps, 0)
        gp.save_job(red, os.path.join(root, name))
        out[name] = dict(state=snapshot(red), gsum=gsum, usum=usum)
    # every rank loading one rank's state (what "every rank saves to one
    # path" amounts to): only that rank may
    red = gp.GradientReducer(**CONFIGS["gtopk"])
    sd0 = torch.load(checkpoint.rank_file(os.path.join(root, "gtopk"), 0), weights_only=True)["state"]
    try:
        red.load_state_dict(sd0)
        out["rank0_state"] = None
    except ValueError as e:
        out["rank0_state"] = str(e)
    return out


def load_worker(rank, P, root, steps, first, corrupt):
    """Load every config's checkpoint at world size P, train ``steps``
    more; ``corrupt``: a copy of one checkpoint with a NaN in one old rank's
    file, which every rank must refuse with nothing changed."""
    out = {}
    for name, kw in CONFIGS.items():
        red = gp.GradientReducer(**kw)
        # a generator, as model.named_parameters() gives (read once)
        gp.load_job(red, os.path.join(root, name), named_parameters=iter(params().items()))
        loaded = snapshot(red)
        gsum, usum, outs = _train(red, rank, steps, first)
        out[name] = dict(loaded=loaded, end=snapshot(red), gsum=gsum, usum=usum, outs=outs, step=red.step)
        if name == "gtopk":
            before = snapshot(red)
            try:
                gp.load_job(red, corrupt, named_parameters=params())
                out["corrupt"] = None
            except gp.CheckpointError as e:
                out["corrupt"] = str(e)
            out["corrupt_unchanged"] = _same(snapshot(red), before)
            # one old rank's file loaded directly: refused (another world
            # size, or another rank)
            sd = torch.load(checkpoint.rank_file(os.path.join(root, name), rank % 4), weights_only=True)
            try:
                red.load_state_dict(sd["state"])
                out["direct"] = None
            except ValueError as e:
                out["direct"] = str(e)
    return out


def live_worker(rank, P, root):
    """Horovod elastic's rule on live states, on gloo: the 4-rank job loses
    rank 2; the survivors [0, 1, 3] (new ranks 0, 1, 2) exchange their
    states with checkpoint.exchange_live and train on."""
    red = gp.GradientReducer(**CONFIGS["gtopk"])
    gp.load_job(red, os.path.join(root, "gtopk"))
    old = snapshot(red)
    sub = dist.new_group([0, 1, 3])  # every rank of the default group takes part
    if rank == 2:
        return {"old": old}
    t = gp.TorchDistributedTransport(group=sub)
    new = gp.GradientReducer(transport=t, **CONFIGS["gtopk"])
    new._load_own_state(red.state_dict())
    moved = checkpoint.exchange_live(new, (rank, P), t.allgather_object)
    after = snapshot(new)
    gsum, usum, outs = _train(new, rank, 2, 50)
    return {"old": old, "moved": moved, "after": after, "end": snapshot(new), "gsum": gsum, "usum": usum,
            "new_rank": t.rank}


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and set(a) == set(b) and all(_same(a[k], b[k]) for k in a)
    return a == b
