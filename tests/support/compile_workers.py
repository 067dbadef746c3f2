"""Workers for tests/distributed/test_ddp_compile.py: the DDP hook with
``torch.compile`` on real gloo groups, every configuration in one spawn
(each compile costs seconds; a spawn costs more).

Each training run records, per step, what DDP handed the hook (every
bucket's local gradients and parameter names, through a pass-through
wrapper) and what it applied (``p.grad`` after backward).  The checks that
need all ranks (the single-process Oracle of gtopk_plugin.testing on the
gathered local gradients, mass conservation, identical ranks) run here and
come back as numbers; the bit-identity with the eager run compares two
runs of this same process.
"""
from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import gtopk_plugin as gp
from gtopk_plugin.testing import Oracle

STEPS = 3
KW = dict(method="gtopk", density=0.05)
# Dynamo's DDPOptimizer requires DDP's bucket cap to be at least its first
# bucket's (1 MiB): the model has ~2 MiB of parameters so that a step still
# runs on several buckets (after DDP rebuilds them at step 1).
BUCKET_CAP_MB = 1


class Net(nn.Module):
    # act "tanh": Inductor's own tanh kernel differs from ATen's in the last
    # bits; "relu": Inductor computes the model with ATen's bits (its
    # matrix products are ATen's, ReLU and the bias gradients' row sums exact
    # or in ATen's order)
    def __init__(self, act="tanh"):
        super().__init__()
        self.act = {"tanh": torch.tanh, "relu": torch.relu}[act]
        self.inp = nn.Linear(8, 256)
        self.mid = nn.Linear(256, 1024)
        self.mid2 = nn.Linear(1024, 256)
        self.head = nn.Linear(256, 4)

    def forward(self, x):
        return self.head(self.act(self.mid2(self.act(self.mid(self.act(self.inp(x)))))))


def _net(act="tanh"):
    torch.manual_seed(0)
    return Net(act)


def _batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)


def _wrap(model, backend, where):
    """(DDP module, callable the loop runs) for one way of compiling."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    if where == "eager":
        d = DDP(model, bucket_cap_mb=BUCKET_CAP_MB)
        return d, d
    if where == "model":  # DDP(torch.compile(model))
        d = DDP(torch.compile(model, backend=backend), bucket_cap_mb=BUCKET_CAP_MB)
        return d, d
    d = DDP(model, bucket_cap_mb=BUCKET_CAP_MB)  # torch.compile(DDP(model))
    return d, torch.compile(d, backend=backend)


class _SplitLog(logging.Handler):
    """Records DDPOptimizer's "created N buckets" (its graph split) message."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.splits = []

    def emit(self, record):
        if "DDPOptimizer used bucket cap" in record.msg:
            self.splits.append(record.args[1])


def _train(act, where, backend, optimize_ddp=True):
    """``optimize_ddp``: Dynamo's DDPOptimizer (True, its default: graph
    split at DDP's bucket boundaries) or one graph (False)."""
    log = logging.getLogger("torch._dynamo.backends.distributed")
    split, level = _SplitLog(), log.level
    log.addHandler(split)
    log.setLevel(logging.INFO)
    log.propagate = False  # to this handler only, not to the console
    torch._dynamo.reset()
    torch._dynamo.config.optimize_ddp = optimize_ddp  # read when Dynamo compiles
    try:
        rec = _steps(act, where, backend)
    finally:
        torch._dynamo.config.optimize_ddp = True
        log.removeHandler(split)
        log.setLevel(level)
        log.propagate = True
    rec["graph_splits"] = split.splits
    return rec


def _steps(act, where, backend):
    rank = dist.get_rank()
    t0 = time.perf_counter()
    model = _net(act)
    state = gp.torch_ddp.SparseState(named_parameters=model.named_parameters(), **KW)
    ddp, fwd = _wrap(model, backend, where)
    calls = []

    def recording_hook(st, bucket):
        names = tuple(st.name_of(p) for p in bucket.parameters())
        calls.append((names, bucket.is_last(), [g.detach().clone() for g in bucket.gradients()]))
        return gp.torch_ddp.sparse_hook(st, bucket)

    ddp.register_comm_hook(state, recording_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    rec = {"calls": [], "local": [], "applied": [], "params": [], "state_step": [], "numel": []}
    for step in range(STEPS):
        del calls[:]
        opt.zero_grad()
        x, y = _batch(step, rank)
        ((fwd(x) - y) ** 2).mean().backward()
        rec["calls"].append([(names, last) for names, last, _ in calls])
        rec["local"].append({n: g for names, _, grads in calls for n, g in zip(names, grads)})
        rec["applied"].append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        opt.step()
        rec["params"].append({n: p.detach().clone() for n, p in model.named_parameters()})
        rec["state_step"].append(state.step)
        rec["numel"].append((state.last_step_traffic or {}).get("numel"))
    rec["residuals"] = {n: r.clone() for n, r in state.reducer.state_dict()["residuals"].items()}
    rec["seconds"], rec["act"] = time.perf_counter() - t0, act
    return rec


def _gather(obj):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _equal(a, b):
    return set(a) == set(b) and all(torch.equal(a[n], b[n]) for n in a)


def _max_diff(a, b):
    return max(float((a[n].double() - b[n].double()).abs().max()) for n in a)


def _checks(rec):
    """What the test asserts on, from one run's record on every rank."""
    P, rank = dist.get_world_size(), dist.get_rank()
    names = list(rec["params"][0])
    rep = {k: rec[k] for k in ("seconds", "graph_splits", "state_step", "numel")}
    rep["buckets"] = [len(c) for c in rec["calls"]]
    # the hook saw every parameter exactly once per step, the last bucket last
    rep["covered"] = [sorted(n for names_, _ in c for n in names_) == sorted(names)
                      and [last for _, last in c] == [False] * (len(c) - 1) + [True]
                      for c in rec["calls"]]
    oracle = Oracle(P, **KW)
    oracle_diff, ranks_equal, fed_sum, applied_sum, scale = [], [], {}, {}, {}
    for step in range(STEPS):
        local = _gather(rec["local"][step])
        applied = _gather(rec["applied"][step])
        expect = oracle.step(local)
        oracle_diff.append(_max_diff(rec["applied"][step], expect))
        ranks_equal.append(all(_equal(applied[0], a) for a in applied[1:])
                           and all(_equal(rec["params"][step], p) for p in _gather(rec["params"][step])))
        for n in names:  # float64 sums for mass conservation
            fed_sum[n] = fed_sum.get(n, 0) + sum(g[n].double() for g in local)
            applied_sum[n] = applied_sum.get(n, 0) + applied[0][n].double()
            # rounding scales with the magnitudes summed, not with the sum
            scale[n] = (scale.get(n, 0) + sum(g[n].double().abs() for g in local)
                        + P * applied[0][n].double().abs())
    rep["oracle_diff"] = oracle_diff
    rep["ranks_equal"] = ranks_equal
    rep["residual_diff"] = _max_diff(rec["residuals"], oracle.residuals[rank])
    # Σ_ranks Σ_steps fed = P · Σ_steps applied + Σ_ranks residual (op="average")
    residuals = _gather(rec["residuals"])
    worst = 0.0
    for n in names:
        rhs = P * applied_sum[n] + sum(r[n].double().view_as(applied_sum[n]) for r in residuals)
        worst = max(worst, float(((fed_sum[n] - rhs).abs() / scale[n].clamp_min(1e-30)).max()))
    rep["mass_rel_err"] = worst
    start = {n: p.detach() for n, p in _net(rec["act"]).named_parameters()}
    rep["moved"] = not _equal(rec["params"][-1], start)
    return rep


def _refused(variant):
    """Compiled autograd: train one step and report the error (or none)."""
    rank = dist.get_rank()
    torch._dynamo.reset()
    config = torch._dynamo.config
    saved = config.optimize_ddp, config.compiled_autograd
    t0 = time.perf_counter()
    rep = {"variant": variant, "error": None, "hook_calls": 0}
    state = None
    try:
        model = _net()
        state = gp.torch_ddp.SparseState(named_parameters=model.named_parameters(), **KW)
        if variant == "python_reducer":
            # DDP reads this when it is built; the state exists already, so
            # the refusal must come from the hook itself
            config.optimize_ddp = "python_reducer"
        from torch.nn.parallel import DistributedDataParallel as DDP

        ddp = DDP(model, bucket_cap_mb=BUCKET_CAP_MB)

        def counting_hook(st, bucket):
            rep["hook_calls"] += 1
            return gp.torch_ddp.sparse_hook(st, bucket)

        ddp.register_comm_hook(state, counting_hook)
        config.compiled_autograd = True

        @torch.compile(backend="aot_eager")
        def train_step(x, y):
            loss = ((ddp(x) - y) ** 2).mean()
            loss.backward()  # under compiled autograd (the config above)
            return loss

        train_step(*_batch(0, rank))
        rep["state_step"] = state.step
        rep["ranks_equal"] = all(_equal({n: p.grad for n, p in model.named_parameters()}, g)
                                 for g in _gather({n: p.grad for n, p in model.named_parameters()}))
    except Exception as exc:  # reported to the test, which asserts on it
        rep["error"] = (type(exc).__name__, str(exc))
        rep["state_step"] = None if state is None else state.step
    finally:
        config.optimize_ddp, config.compiled_autograd = saved
        torch._dynamo.reset()
    rep["seconds"] = time.perf_counter() - t0
    return rep


def _mode_refused():
    """``SparseState`` built while Dynamo is set to DDP's Python reducer."""
    config = torch._dynamo.config
    saved = config.optimize_ddp
    config.optimize_ddp = "python_reducer"
    try:
        gp.torch_ddp.SparseState(**KW)
        return None
    except Exception as exc:
        return (type(exc).__name__, str(exc))
    finally:
        config.optimize_ddp = saved


def worker(rank, world, compiled, refused):
    """``compiled``: (act, where, backend, optimize_ddp) runs, each compared
    with an eager run of the same model; ``refused``: compiled-autograd variants."""
    torch.set_num_threads(1)
    eager_recs = {act: _train(act, "eager", None) for act in sorted({c[0] for c in compiled})}
    out = {"eager": {act: _checks(rec) for act, rec in eager_recs.items()}, "compiled": []}
    for act, where, backend, optimize_ddp in compiled:
        eager = eager_recs[act]
        rec = _train(act, where, backend, optimize_ddp)
        rep = _checks(rec)
        rep["same_as_eager"] = {
            "applied": [_equal(a, b) for a, b in zip(rec["applied"], eager["applied"])],
            "params": [_equal(a, b) for a, b in zip(rec["params"], eager["params"])],
            "residuals": _equal(rec["residuals"], eager["residuals"])}
        rep["max_diff_vs_eager"] = _max_diff(rec["params"][-1], eager["params"][-1])
        out["compiled"].append(rep)
    out["refused"] = [_refused(v) for v in refused]
    out["mode_refused"] = _mode_refused()
    return out
