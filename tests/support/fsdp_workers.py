"""Workers of tests/distributed/test_fsdp.py: FSDP2 models on a real gloo
(replicate x shard) mesh, stock HSDP beside the replica reduction.

Every worker returns plain data (local shards with their global offsets,
the reducer's inputs and outputs per step) that the test checks against
independent references: stock HSDP, the single-process oracle, mass
conservation, the same run without a checkpoint in between.
"""
import copy
import os
import pickle

import torch
import torch.distributed as dist
import torch.nn as nn

import gtopk_plugin as gp
import gtopk_plugin.torch_fsdp  # noqa: F401 - the layer under test

IN, OUT = 9, 3


class Net(nn.Module):
    """Three FSDP units; 11 and 7 rows do not divide by 2 or 3 (uneven
    shards, an empty shard for the 1-row bias at 3 shards)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(IN, 11)
        self.b = nn.Linear(11, 7)
        self.c = nn.Linear(7, OUT)
        self.s = nn.Parameter(torch.ones(1))

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x))))) * self.s


def mesh_of(R, S):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (R, S), mesh_dim_names=("replicate", "shard"))


def sharded(mesh, mp=None, seed=0):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(seed)
    net = Net()
    kw = {} if mp is None else {"mp_policy": MixedPrecisionPolicy(param_dtype=mp, reduce_dtype=mp)}
    for m in (net.a, net.b, net.c):
        fully_shard(m, mesh=mesh, **kw)
    fully_shard(net, mesh=mesh, **kw)
    return net


def batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(5, IN, generator=g), torch.randn(5, OUT, generator=g)


def train_step(model, opt, step, rank):
    x, y = batch(step, rank)
    opt.zero_grad()
    ((model(x) - y) ** 2).mean().backward()
    opt.step()


def shards(model):
    """name -> (global offset of the local rows, local shard) of every parameter."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    out = {}
    for n, p in model.named_parameters():
        _, off = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        out[n] = (tuple(off), p.to_local().detach().clone())
    return out


def record(state, params=None):
    """Wrap the state's reducer: per step, the local shards it was given and
    the updates it returned (clones); with ``params`` (name -> parameter),
    also the parameters' local shards at the call."""
    log = []
    reduce = state.reducer.reduce

    def recorded(grads, **kw):
        inp = {n: g.detach().clone() for n, g in grads.items()}
        here = {n: params[n].to_local().detach().clone() for n in grads} if params else None
        out = reduce(grads, **kw)
        log.append((inp, {n: u.detach().clone() for n, u in out.items()}) + ((here,) if params else ()))
        return out

    state.reducer.reduce = recorded
    return log


# ------------------------------------------------------------- the checks
SPARSE = {  # name -> sparse_replica_reduction keywords (and the oracle's)
    "gtopk": {"method": "gtopk", "density": 0.2},
    "topk": {"method": "topk", "density": 0.2},
    "randomk": {"method": "randomk", "density": 0.2},
    "gtopk momentum": {"method": "gtopk", "density": 0.2, "momentum_correction": 0.9},
}
CODEC = {"method": "onebit"}  # the oracle simulates selectors; a codec is checked by conservation
STEPS = 3
CLIP = 0.05
WD = 0.01


def _coords(mesh):
    c = mesh.get_coordinate()
    return int(c[0]), int(c[1])


def dense_vs_stock(rank, mesh):
    """Stock HSDP and method='dense' from one initialisation and data."""
    stock, ours = sharded(mesh), sharded(mesh)
    gp.torch_fsdp.sparse_replica_reduction(ours, method="dense")
    so, oo = torch.optim.SGD(stock.parameters(), lr=0.1), torch.optim.SGD(ours.parameters(), lr=0.1)
    for step in range(STEPS):
        train_step(stock, so, step, rank)
        train_step(ours, oo, step, rank)
    a, b = shards(stock), shards(ours)
    return {n: (a[n][1], b[n][1]) for n in a}


def removed_vs_stock(rank, mesh):
    """A reduction attached and removed before training: stock HSDP again."""
    stock, ours = sharded(mesh), sharded(mesh)
    gp.torch_fsdp.sparse_replica_reduction(ours, method="gtopk", density=0.2).remove()
    so, oo = torch.optim.SGD(stock.parameters(), lr=0.1), torch.optim.SGD(ours.parameters(), lr=0.1)
    for step in range(STEPS):
        train_step(stock, so, step, rank)
        train_step(ours, oo, step, rank)
    a, b = shards(stock), shards(ours)
    return all(torch.equal(a[n][1], b[n][1]) for n in a)


def accumulation_vs_stock(rank, mesh):
    """Two micro-batches per step, the first without the replica reduction
    (set_requires_all_reduce(False)), then a step whose gradients add to
    the last step's (no zero_grad): stock HSDP and method='dense'."""
    out = []
    for reduce_ours in (False, True):
        model = sharded(mesh)
        if reduce_ours:
            gp.torch_fsdp.sparse_replica_reduction(model, method="dense")
        for micro in range(2):
            model.set_requires_all_reduce(micro == 1)
            x, y = batch(10 + micro, rank)
            ((model(x) - y) ** 2).mean().backward()
        x, y = batch(12, rank)
        ((model(x) - y) ** 2).mean().backward()
        out.append({n: p.grad.to_local().clone() for n, p in model.named_parameters()})
    return out


def nonfinite(rank, mesh, policy):
    """A NaN in one shard of one rank: what every rank does with it."""
    model = sharded(mesh)
    state = gp.torch_fsdp.sparse_replica_reduction(model, method="gtopk", density=0.2, nonfinite=policy)
    grads = {n: torch.ones(p.to_local().shape) for n, p in model.named_parameters() if p.to_local().numel()}
    if rank == dist.get_world_size() - 1:
        next(iter(grads.values()))[0] = float("nan")
    try:
        state._reduce(grads)
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return {"zero": all(bool((g == 0).all()) for g in grads.values()), "step": state.step}


def joined_faults(rank, mesh):
    """Faults whose rank has no reducer peer on this rank's transport:
    invalid input on one shard, and a NaN seen by a rank that holds no
    entries at all (a 1-entry model on 2 shards).  What every rank raises
    or does."""
    from torch.distributed.fsdp import fully_shard

    last = rank == dist.get_world_size() - 1
    out = {}
    for key, kw in (("bad", {}), ("bad clipped", {"clip_norm": 1.0})):
        state = gp.torch_fsdp.sparse_replica_reduction(sharded(mesh), method="gtopk", density=0.2, **kw)
        grads = {n: torch.ones(p.to_local().shape) for n, p in state.model.named_parameters()
                 if p.to_local().numel()}
        if last:
            grads["a.weight"] = grads["a.weight"].to(torch.int32)
        try:
            state._reduce(grads)
            out[key] = None
        except Exception as e:  # noqa: BLE001
            out[key] = f"{type(e).__name__}: {e}"
    for policy, kw in (("raise", {}), ("skip", {}), ("skip clipped", {"clip_norm": 1.0})):
        torch.manual_seed(0)
        tiny = fully_shard(nn.Linear(1, 1, bias=False), mesh=mesh)
        state = gp.torch_fsdp.sparse_replica_reduction(tiny, method="gtopk", density=0.5,
                                                       nonfinite=policy.split()[0], **kw)
        for step in range(2):  # a NaN, then finite gradients (the rank without entries mirrors the calls)
            g = {n: torch.full(p.to_local().shape, float("nan") if step == 0 and (last or rank == 2) else 1.0)
                 for n, p in tiny.named_parameters() if p.to_local().numel()}
            try:
                state._reduce(g)
                out[policy, step] = {"entries": sum(t.numel() for t in g.values()), "step": state.step,
                                     "zero": all(bool((t == 0).all()) for t in g.values())}
            except Exception as e:  # noqa: BLE001
                out[policy, step] = f"{type(e).__name__}: {e}"
    return out


def momentum_from_optimizer(rank, mesh):
    """momentum_correction=True with SGD(momentum=0.9) against the momentum
    given explicitly with SGD without momentum: the same parameters."""
    out = []
    for from_optimizer in (True, False):
        model = sharded(mesh)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9 if from_optimizer else 0.0)
        gp.torch_fsdp.sparse_replica_reduction(model, method="gtopk", density=0.2, optimizer=opt if
                                               from_optimizer else None, momentum_correction=True if
                                               from_optimizer else 0.9)
        for step in range(STEPS):
            train_step(model, opt, step, rank)
        out.append(shards(model))
    # with weight decay: the reducer adds wd times the local shard
    model = sharded(mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=WD)
    state = gp.torch_fsdp.sparse_replica_reduction(model, method="gtopk", density=0.2, optimizer=opt,
                                                   momentum_correction=True)
    log = record(state, dict(model.named_parameters()))
    for step in range(STEPS):
        train_step(model, opt, step, rank)
    out.append({"log": log})
    return out


def compiled(rank, mesh):
    """gTop-k on a model compiled after fully_shard, on one compiled block by
    block before it (aot_eager: the eager kernels, so the same bits), and
    the error compiled autograd gets."""
    from torch.distributed.fsdp import fully_shard

    out = {}
    for where in ("after", "before"):
        torch._dynamo.reset()
        if where == "after":
            model = sharded(mesh)
            run = torch.compile(model, backend="aot_eager")
        else:
            torch.manual_seed(0)
            model = run = Net()
            for m in (model.a, model.b, model.c):
                m.compile(backend="aot_eager")
                fully_shard(m, mesh=mesh)
            fully_shard(model, mesh=mesh)
        state = gp.torch_fsdp.sparse_replica_reduction(model, **SPARSE["gtopk"])
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(STEPS):
            train_step(run, opt, step, rank)
        out[where] = {"params": shards(model), "steps": state.step}
    try:
        with torch._dynamo.compiled_autograd._enable(torch.compile(backend="aot_eager")):
            train_step(run, opt, STEPS, rank)
        out["compiled autograd"] = None
    except RuntimeError as e:
        out["compiled autograd"] = str(e)
    torch._dynamo.reset()
    return out


def sparse_run(rank, mesh, kw, mp=None, steps=STEPS, model=None):
    """The reducer's inputs and outputs per step and its final residuals."""
    model = model or sharded(mesh, mp)
    state = gp.torch_fsdp.sparse_replica_reduction(model, **kw)
    log = record(state)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        train_step(model, opt, step, rank)
    sd = state.reducer.state_dict()
    return {"log": log, "residuals": sd["residuals"], "params": shards(model),
            "traffic": state.last_step_traffic}


class App:
    """The DCP tutorial's Stateful: model and optimizer through
    get_state_dict / set_state_dict."""

    def __init__(self, model, opt):
        self.model, self.opt = model, opt

    def state_dict(self):
        from torch.distributed.checkpoint.state_dict import get_state_dict

        m, o = get_state_dict(self.model, self.opt)
        return {"model": m, "optim": o}

    def load_state_dict(self, sd):
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


def _make(mesh, kw):
    model = sharded(mesh)
    state = gp.torch_fsdp.sparse_replica_reduction(model, **kw)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    return model, state, opt


def residual_shards(state):
    """name -> (global offset, local residual) as the checkpoint holds them."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mine = state.state_dict()[f"replica{state.topology.replica}"]["residuals"]
    out = {}
    for n, d in mine.items():
        _, off = compute_local_shape_and_global_offset(d.shape, d.device_mesh, d.placements)
        out[n] = (tuple(off), d.to_local().clone())
    return out


def dcp_resume(rank, mesh, path, kw):
    """2 steps, save, 2 more; a fresh model loads and runs the same 2: the
    parameters and residuals after them, both ways, and the saved residuals."""
    import torch.distributed.checkpoint as dcp

    model, state, opt = _make(mesh, kw)
    for step in range(2):
        train_step(model, opt, step, rank)
    dcp.save({"app": App(model, opt), "reduction": state}, checkpoint_id=path)
    saved = residual_shards(state)
    for step in range(2, 4):
        train_step(model, opt, step, rank)
    model2, state2, opt2 = _make(mesh, kw)
    dcp.load({"app": App(model2, opt2), "reduction": state2}, checkpoint_id=path)
    for step in range(2, 4):
        train_step(model2, opt2, step, rank)
    return {"saved": saved, "params": (shards(model), shards(model2)),
            "residuals": (residual_shards(state), residual_shards(state2)), "steps": (state.step, state2.step)}


def dcp_load(rank, mesh, path, kw):
    """Load ``path`` (saved on another mesh) into a fresh model: the loaded
    residuals, or the error every rank raised."""
    import torch.distributed.checkpoint as dcp

    model, state, opt = _make(mesh, kw)
    try:
        dcp.load({"app": App(model, opt), "reduction": state}, checkpoint_id=path)
    except BaseException as e:  # noqa: BLE001 - DCP raises CheckpointException, a BaseException
        return {"error": f"{type(e).__name__}: {e}"}
    return {"residuals": residual_shards(state), "step": state.step}


def bad_inputs(mesh):
    """The error each misuse raises (every rank runs the same)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    out = {}

    def attempt(key, fn):
        try:
            fn()
            out[key] = None
        except Exception as e:  # noqa: BLE001
            out[key] = f"{type(e).__name__}: {e}"

    attempt("not sharded", lambda: gp.torch_fsdp.sparse_replica_reduction(Net()))
    flat = init_device_mesh("cpu", (dist.get_world_size(),))
    attempt("1-D mesh", lambda: gp.torch_fsdp.sparse_replica_reduction(fully_shard(Net(), mesh=flat)))
    attempt("keyword", lambda: gp.torch_fsdp.sparse_replica_reduction(sharded(mesh), denisty=0.1))
    attempt("replicate_group on 2-D", lambda: gp.torch_fsdp.sparse_replica_reduction(
        sharded(mesh), replicate_group=mesh.get_group(0)))
    return out


def mesh_checks(rank, world, R, S, ckdir):
    """Everything one (R, S) spawn checks; plain data for the test."""
    mesh = mesh_of(R, S)
    rep = {"coords": _coords(mesh), "dense": dense_vs_stock(rank, mesh)}
    rep["sparse"] = {name: sparse_run(rank, mesh, kw) for name, kw in SPARSE.items()}
    rep["codec"] = sparse_run(rank, mesh, CODEC)
    gt = SPARSE["gtopk"]
    if (R, S) == (2, 2):
        rep["bf16"] = sparse_run(rank, mesh, gt, mp=torch.bfloat16)
        rep["dcp"] = dcp_resume(rank, mesh, os.path.join(ckdir, "2x2"), gt)
        rep["errors"] = bad_inputs(mesh)
        rep["accumulation"] = accumulation_vs_stock(rank, mesh)
        rep["removed"] = removed_vs_stock(rank, mesh)
        rep["nonfinite"] = {p: nonfinite(rank, mesh, p) for p in ("raise", "skip")}
        rep["joined"] = joined_faults(rank, mesh)
        rep["momentum"] = momentum_from_optimizer(rank, mesh)
        rep["clip"] = sparse_run(rank, mesh, dict(SPARSE["gtopk"], clip_norm=CLIP))
    elif (R, S) == (2, 3):
        rep["reshard"] = dcp_load(rank, mesh, os.path.join(ckdir, "2x2"), gt)
        # the same reduction on a 1-D shard mesh with the replicas given by the 2-D mesh
        from torch.distributed.fsdp import fully_shard

        torch.manual_seed(0)
        flat = Net()
        for m in (flat.a, flat.b, flat.c, flat):
            fully_shard(m, mesh=mesh["shard"])
        rep["one_d"] = sparse_run(rank, mesh, dict(gt, mesh=mesh), model=flat)
    elif (R, S) == (3, 2):
        rep["replicas changed"] = dcp_load(rank, mesh, os.path.join(ckdir, "2x2"), gt)
        rep["compiled"] = compiled(rank, mesh)
    return rep
