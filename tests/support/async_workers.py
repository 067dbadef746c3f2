"""Drivers and workers of tests/distributed/test_async_*.py: the same run
through ``GradientReducer.reduce`` (synchronous, the reference) and through
``reduce_async`` (every call of a step in flight at once), and the DDP hook
with ``overlap=True`` against ``overlap=False`` on real gloo groups."""
import os
import threading
import time

import torch

import gtopk_plugin as gp
from gtopk_plugin.collectives.threads import ThreadGroup
from gtopk_plugin.pipeline.comm_worker import EarlierFailure

# three calls per step (the step advances at the last), as a framework
# layer reduces a step's buckets
PARTS = [{"a": (16, 12), "b": (40,)}, {"c": (3, 5, 7)}, {"d": (64,), "e": (8, 8)}]


def grads(rank, step, bad=None):
    """Rank ``rank``'s gradients of ``step``, per call; ``bad=(rank, step)``
    puts a NaN into that rank's second call of that step."""
    g = torch.Generator().manual_seed(1000 * step + 31 * rank)
    out = [{n: torch.randn(*s, generator=g) for n, s in part.items()} for part in PARTS]
    if bad == (rank, step):
        out[1]["c"].view(-1)[3] = float("nan")
    return out


def _record(red, upd):
    st = red.last_stats
    return ({n: u.clone() for n, u in upd.items()},
            (st.bytes_sent, st.bytes_received, st.payload_bytes_sent, st.header_bytes_sent, st.control_bytes,
             st.skipped))


def _outcome(fut_or_call):
    try:
        return ("ok", fut_or_call())
    except EarlierFailure:
        return ("skipped-by-scope", None)
    except Exception as e:  # noqa: BLE001 - compared between the two paths
        return ("error", type(e).__name__)


def run_rank(red, rank, steps, mode, bad=None, start=0):
    """Per call: ("ok", (updates, byte counts)) or ("error", type name);
    ``mode`` "sync": reduce() in turn, the rest of a step skipped after an
    error (as a training loop would: the reference); "async": every call of
    the step submitted, then waited for."""
    out = []
    for t in range(start, start + steps):
        parts = grads(rank, t, bad)
        if mode == "sync":
            failed = False
            for j, g in enumerate(parts):
                if failed:
                    out.append(("skipped-by-scope", None))
                    continue
                res = _outcome(lambda: _record(red, red.reduce(g, advance_step=j == len(parts) - 1)))
                failed = res[0] != "ok"
                out.append(res)
        else:
            futs = [red.reduce_async(g, advance_step=j == len(parts) - 1) for j, g in enumerate(parts)]
            for f in futs:
                # last_stats is the last completed call's: read it on the
                # worker, right after the call (a callback runs there)
                out.append(_outcome(lambda f=f: _record_value(f)))
    return out


def _record_value(fut):
    return fut.wait()


def record_async(red):
    """A reduce_async wrapper recording (updates, byte counts) in the job:
    ``last_stats`` belongs to the call that just ran on the worker."""
    orig = red._reduce_now

    def recording(*a, **kw):
        return _record(red, orig(*a, **kw))

    red._reduce_now = recording
    return red


def threaded_run(P, kw, steps, mode, bad=None, checkpoint_at=None):
    """P in-process ranks; returns per rank (outcomes, state_dict, counters).
    ``checkpoint_at``: after that many steps every rank's state goes
    through state_dict() into a fresh reducer, which finishes the run."""
    with ThreadGroup(P, timeout=60) as group:
        def make(r):
            red = gp.GradientReducer(transport=group.transports[r], kernels="reference", **kw)
            return record_async(red) if mode == "async" else red

        def rank_fn(r):
            red = make(r)
            if checkpoint_at is None:
                res = run_rank(red, r, steps, mode, bad)
            else:
                res = run_rank(red, r, checkpoint_at, mode, bad)
                sd = red.state_dict()
                red.close()
                red = make(r)
                red.load_state_dict(sd)
                res += run_rank(red, r, steps - checkpoint_at, mode, bad, start=checkpoint_at)
            sd = red.state_dict()
            counters = red.transport.counters.copy()
            red.close()
            return res, sd, counters

        return group.map(rank_fn)


# ------------------------------------------------------------------ DDP
def _net():
    import torch.nn as nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 48), nn.Tanh(), nn.Linear(48, 16),
                         nn.Tanh(), nn.Linear(16, 4))


def _unused_net():
    import torch.nn as nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.a, self.b, self.c = nn.Linear(8, 32), nn.Linear(32, 4), nn.Linear(32, 4)

        def forward(self, x, step):
            h = torch.tanh(self.a(x))
            return self.b(h) if step % 2 == 0 else self.c(h)  # every other step leaves one out

    return Net()


def _digest(model):
    return [p.detach().clone() for p in model.parameters()]


def ddp_run(rank, world, kw, steps=4, unused=False, checkpoint_at=None):
    """A small DDP model trained with the sparse hook; returns the
    parameters after every step, the step's traffic and whether the
    state's worker thread is gone after close()."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = _unused_net() if unused else _net()

    def build(model):
        ddp = DDP(model, bucket_cap_mb=0.004, find_unused_parameters=unused)
        state = gp.torch_ddp.SparseState(named_parameters=model.named_parameters(), timeout=30, **kw)
        ddp.register_comm_hook(state, gp.torch_ddp.sparse_hook)
        return ddp, state

    ddp, state = build(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    params, traffic = [], []
    for t in range(steps):
        if checkpoint_at is not None and t == checkpoint_at:
            sd = state.state_dict()
            state.close()
            model2 = _unused_net() if unused else _net()
            model2.load_state_dict(model.state_dict())
            model, (ddp, state) = model2, build(model2)
            state.load_state_dict(sd)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(100 * t + rank)
        x, y = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
        opt.zero_grad()
        out = ddp(x, t) if unused else ddp(x)
        ((out - y) ** 2).mean().backward()
        opt.step()
        params.append(_digest(model))
        traffic.append(dict(state.last_step_traffic or {}))
    state.close()
    gone = not [th for th in threading.enumerate() if th.name.startswith("gtopk-comm")]
    return {"params": params, "traffic": traffic, "threads_gone": gone, "step": state.step}


def ddp_cases(rank, world, cases):
    """Every (name, kwargs, run options) case in one process."""
    return {name: ddp_run(rank, world, kw, **opts) for name, kw, opts in cases}


def ddp_fault(rank, world, overlap):
    """Rank ``world-1`` dies in step 2's backward, after its first bucket's
    hook; the survivors' backward must raise within the timeout and leave
    no thread behind after close()."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = _net()
    ddp = DDP(model, bucket_cap_mb=0.004)
    state = gp.torch_ddp.SparseState(named_parameters=model.named_parameters(), timeout=3, overlap=overlap,
                                     coalesce_buckets=False)
    calls = [0]

    def hook(st, bucket):
        calls[0] += 1
        if rank == world - 1 and step[0] == 2 and bucket.index() == 1:
            os._exit(3)  # killed with a bucket of this step in flight
        return gp.torch_ddp.sparse_hook(st, bucket)

    ddp.register_comm_hook(state, hook)
    step = [0]
    error, took = None, None
    for t in range(4):
        step[0] = t
        g = torch.Generator().manual_seed(100 * t + rank)
        x, y = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
        t0 = time.monotonic()
        try:
            ((ddp(x) - y) ** 2).mean().backward()
        except Exception as e:  # noqa: BLE001 - reported
            error, took = f"{type(e).__name__}: {e}", time.monotonic() - t0
            break
    closed = state.close(timeout=10)
    gone = not [th for th in threading.enumerate() if th.name.startswith("gtopk-comm")]
    return {"error": error, "seconds": took, "closed": closed, "threads_gone": gone, "step": t}
