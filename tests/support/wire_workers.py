"""Worker functions for tests/distributed/test_wire_precision.py (run inside real gloo
process groups by tests/dist_utils.run_workers)."""
import torch

import gtopk_plugin as gp

SHAPES = {"a": (150,), "b": (6, 9)}  # N = 204: P = 3, 4 divide it, P = 7 does not


def wire_grads(rank: int, step: int, kind: str):
    """Deterministic per-rank gradients.

    "wide": magnitudes from ~1e-3 to ~1e3 (most values are not fp16/bf16
    numbers, so every rounding matters).  "big": the same plus values up to
    1e6 and 40000 at entries 0..3 of "a" on every rank (so any two ranks'
    sum exceeds fp16's 65504)."""
    g = torch.Generator().manual_seed(step * 7919 + rank * 104_729 + (0 if kind == "wide" else 1))
    out = {}
    for n, s in SHAPES.items():
        out[n] = torch.randn(s, generator=g) * torch.exp(1.5 * torch.randn(s, generator=g))
    if kind == "big":
        a = out["a"]
        a[:4] = 40000.0
        a[4:12] = (torch.rand(8, generator=g) * 2 - 1) * 1e6
        out["b"][0, :3] = -1e6 * torch.rand(3, generator=g)
    return out


def flat(d):
    return torch.cat([d[n].reshape(-1) for n in sorted(d)])


def wire_run(rank, world_size, configs, steps, kind):
    """For each config: ``steps`` reduce() calls; returns the flat update of
    every step, the final residuals and the last step's traffic."""
    results = []
    for kw in configs:
        red = gp.GradientReducer(transport=gp.TorchDistributedTransport(timeout=60), **kw)
        outs = []
        for s in range(steps):
            outs.append(flat(red.reduce(wire_grads(rank, s, kind))))
        st = red.last_stats
        results.append({"outs": torch.stack(outs), "residuals": flat(red.state_dict()["residuals"]),
                        "sent": st.payload_bytes_sent, "received": st.payload_bytes_received,
                        "headers": st.header_bytes_sent})
    return results


def elastic_int8(rank, world_size, steps):
    """The elastic scheduler (norm policy, β = 0.5) composed with a gTop-k
    reducer on the int8 wire with stochastic rounding (op=sum): every
    reduction's input and output, the final residuals and parameters."""
    import torch.distributed as dist
    from gtopk_plugin.elastic import ElasticScheduler, ThreadedReduction
    from elastic_helpers import Recorder, make_model, train_elastic

    m = make_model()
    red = gp.GradientReducer(method="gtopk", density=0.3, op="sum", value_dtype=torch.int8,
                             wire_rounding="stochastic", seed=9,
                             transport=gp.TorchDistributedTransport(dist.new_group(), timeout=60))
    rec = Recorder(ThreadedReduction(red))
    sched = ElasticScheduler(m, torch.optim.SGD(m.parameters(), lr=0.02, momentum=0.9), transport=rec,
                             policy="norm", beta=0.5)
    params = train_elastic(sched, m, steps, rank)
    out = {"params": params, "local": rec.local, "reduced": rec.reduced,
           "residuals": sched.state_dict()["reducer"]["residuals"]}
    sched.close()
    out["ddp"] = ddp_int8(rank, steps)
    return out


def ddp_int8(rank, steps):
    """The DDP hook (one bucket) with the int8 wire, stochastic rounding,
    against a GradientReducer fed an undistributed copy's gradients: per
    step the hook's and the reducer's updates, and the hook's last traffic."""
    import copy

    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 40), torch.nn.Tanh(), torch.nn.Linear(40, 3))
    ref = copy.deepcopy(model)
    kw = dict(method="gtopk", density=0.1, value_dtype=torch.int8, wire_rounding="stochastic", seed=3)
    state = gp.torch_ddp.SparseState(named_parameters=model.named_parameters(), **kw)
    ddp = DDP(model)
    ddp.register_comm_hook(state, gp.torch_ddp.sparse_hook)
    reducer = gp.GradientReducer(**kw)
    hook, want = [], []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(8, 12, generator=g), torch.randn(8, 3, generator=g)
        ddp.zero_grad()
        ((ddp(x) - y) ** 2).mean().backward()
        hook.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        ref.zero_grad()
        ((ref(x) - y) ** 2).mean().backward()
        want.append(reducer.reduce({n: p.grad.detach().clone() for n, p in ref.named_parameters()}))
    return {"hook": hook, "reducer": want, "traffic": dict(state.last_step_traffic)}
