"""Workers for tests/distributed/test_momentum.py, run inside real gloo process groups."""
import torch

import gtopk_plugin as gp
from workers import grads_for


def reducer_runs(rank, world_size, configs, steps):
    """GradientReducer with momentum correction: outputs and final state."""
    results = []
    for kw in configs:
        kw = dict(kw)
        seed = kw.pop("grad_seed", 0)
        red = gp.GradientReducer(transport=gp.TorchDistributedTransport(timeout=60), **kw)
        outs = [red.reduce(grads_for(rank, s, seed)) for s in range(steps)]
        results.append({"outs": outs, "state": red.state_dict()})
    return results


def split_call_clipping(rank, world_size, steps):
    """One step reduced in two calls (two "buckets") with clip_norm: the
    caller passes the whole step's norm, so the result equals one call."""
    kw = dict(method="topk", density=0.2, op="sum", momentum_correction=0.9, clip_norm=1.0)
    one = gp.GradientReducer(transport=gp.TorchDistributedTransport(timeout=60), **kw)
    two = gp.GradientReducer(transport=gp.TorchDistributedTransport(timeout=60), **kw)
    same = True
    for s in range(steps):
        g = grads_for(rank, s)
        a = one.reduce(g)
        norm = gp.reducer.local_grad_norm(list(g.values()))
        b = two.reduce({"conv.weight": g["conv.weight"]}, advance_step=False, grad_norm=norm)
        b.update(two.reduce({"fc.weight": g["fc.weight"], "fc.bias": g["fc.bias"]}, grad_norm=norm))
        same &= all(torch.equal(a[n], b[n]) for n in a)
    return same


# ------------------------------------------------------------------ DDP
def _ddp_net():
    import torch.nn as nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 4))


def _batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)


def ddp_momentum(rank, world_size, kw, steps, nesterov=False, weight_decay=0.0, scaler_scales=None):
    """DDP + sparse_hook with momentum_correction from the optimizer.
    Returns every rank's local gradients per step (for the oracle), the
    final weights, and the optimizer's momentum after training."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = _ddp_net()
    ddp = DDP(model, bucket_cap_mb=0.0015)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=nesterov,
                          weight_decay=weight_decay)
    scaler = _FixedScaler(scaler_scales) if scaler_scales else None
    state = gp.torch_ddp.SparseState(named_parameters=model.named_parameters(), momentum_correction=True,
                                     optimizer=opt, grad_scaler=scaler, **kw)
    calls = []  # DDP buckets (hook calls) per step: the hook may reduce them in one call

    def hook(st, bucket):
        calls.append(bucket.index())
        return gp.torch_ddp.sparse_hook(st, bucket)

    ddp.register_comm_hook(state, hook)
    local, params_before = [], []
    for s in range(steps):
        params_before.append({n: p.detach().clone() for n, p in model.named_parameters()})
        x, y = _batch(s, rank)
        opt.zero_grad()
        del calls[:]
        loss = ((ddp(x) - y) ** 2).mean()
        if scaler is not None:
            scaler.current = scaler_scales[s]
            loss = loss * scaler.current
        loss.backward()
        if scaler is not None:
            for p in model.parameters():
                p.grad.div_(scaler.current)
        opt.step()
        if scaler is not None:
            scaler.step_done()
    return {"params": [{n: p.detach().clone() for n, p in model.named_parameters()}],
            "before": params_before, "momentum": opt.param_groups[0]["momentum"],
            "wd": opt.param_groups[0]["weight_decay"], "buckets": len(calls),
            "state": state.state_dict()}


class _FixedScaler:
    """The part of torch.amp.GradScaler the hook reads (get_scale), with a
    scripted scale per step, so a test can change the scale at will."""

    def __init__(self, scales):
        self.scales, self.current = scales, scales[0]

    def get_scale(self):
        return float(self.current)

    def step_done(self):
        pass


def local_model_grads(rank, steps_params, steps):
    """Plain (non-DDP) local gradients of the same model at given weights,
    for the single-process oracle."""
    model = _ddp_net()
    out = []
    for s in range(steps):
        model.load_state_dict(steps_params[s])
        x, y = _batch(s, rank)
        model.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        out.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
    return out


# ------------------------------------------------------------ elastic
def elastic_momentum(rank, world_size, steps):
    """ElasticScheduler(policy="barrier", reducer=gtopk, momentum_correction=True)
    against the synchronous loop with GradientReducer(momentum_correction=True): under
    the barrier policy both apply the same updates (docs/design.md §2)."""
    import torch.distributed as dist

    from elastic_helpers import loss_of, make_model, params_of, train_elastic

    def opt_for(m):
        return torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3)

    m = make_model()
    opt = opt_for(m)
    red = gp.GradientReducer("gtopk", 0.3, transport=gp.TorchDistributedTransport(dist.new_group(), timeout=60))
    red.bind_optimizer(opt, m.named_parameters())
    for s in range(steps):
        opt.zero_grad()
        loss_of(m, s, rank).backward()
        up = red.reduce({n: p.grad for n, p in m.named_parameters()})
        for n, p in m.named_parameters():
            p.grad.copy_(up[n])
        opt.step()
    sync = params_of(m)
    m = make_model()
    opt = opt_for(m)
    red = gp.GradientReducer("gtopk", 0.3, transport=gp.TorchDistributedTransport(dist.new_group(), timeout=60))
    sched = gp.ElasticScheduler(m, opt, reducer=red, policy="barrier", momentum_correction=True)
    elastic = train_elastic(sched, m, steps, rank)
    out = {"sync": sync, "elastic": elastic, "momentum": opt.param_groups[0]["momentum"],
           "velocity_names": sorted(sched.state_dict()["reducer"]["velocities"])}
    sched.close()
    return out


def ddp_resume(rank, world_size, steps, split):
    """Train `steps` with momentum correction in one go, and again with a
    pickle round trip of the SparseState after `split` steps (rebinding
    the optimizer): the weights must be bit-identical."""
    import pickle

    from torch.nn.parallel import DistributedDataParallel as DDP

    def build(state=None):
        model = _ddp_net()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        ddp = DDP(model, bucket_cap_mb=0.0015)
        if state is None:
            state = gp.torch_ddp.SparseState("gtopk", 0.2, named_parameters=model.named_parameters(),
                                             momentum_correction=True, optimizer=opt)
        else:
            state.set_named_parameters(model.named_parameters())
        ddp.register_comm_hook(state, gp.torch_ddp.sparse_hook)
        return model, ddp, opt, state

    def train(model, ddp, opt, lo, hi):
        for s in range(lo, hi):
            x, y = _batch(s, rank)
            opt.zero_grad()
            ((ddp(x) - y) ** 2).mean().backward()
            opt.step()

    model, ddp, opt, state = build()
    train(model, ddp, opt, 0, steps)
    straight = {n: p.detach().clone() for n, p in model.named_parameters()}

    model, ddp, opt, state = build()
    train(model, ddp, opt, 0, split)
    blob = pickle.dumps(state)
    weights, opt_sd = model.state_dict(), opt.state_dict()
    restored = pickle.loads(blob)
    # without rebinding the optimizer the hook refuses to run (a throwaway
    # model: a DDP whose backward raised is not used again)
    refused = False
    junk, junk_ddp, _, _ = build(pickle.loads(blob))
    try:
        x, y = _batch(split, rank)
        ((junk_ddp(x) - y) ** 2).mean().backward()
    except RuntimeError as e:
        refused = "bind_optimizer" in str(e)
    m2, ddp2, opt2, _ = build(restored)
    m2.load_state_dict(weights)
    opt2.load_state_dict(opt_sd)
    restored.bind_optimizer(opt2, m2.named_parameters())
    train(m2, ddp2, opt2, split, steps)
    resumed = {n: p.detach().clone() for n, p in m2.named_parameters()}
    return {"same": all(torch.equal(straight[n], resumed[n]) for n in straight), "refused": refused}
