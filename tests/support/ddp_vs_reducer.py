"""The DDP hook against the plain GradientReducer on the same inputs, in a
real gloo group: one worker body shared by the codec and small-tensor tests
(tests/distributed/test_{powersgd,qsgd,small_tensors}.py, and
tests/support/hierarchical_workers.py).  The reducer,
fed the gradients of an identical undistributed copy of the model, is the
reference the hook's bucket-by-bucket path must reproduce bit for bit."""
import copy

import torch

import gtopk_plugin as gp


def hook_vs_reducer(rank, steps=4, *, hidden=(40, 30), reducer_cls=None, state_kw=None, **kw):
    """``(state, reducer, diffs)``: per step, the largest |hook − reducer|
    over the parameters for SparseState(**kw, **state_kw) vs
    ``reducer_cls(**kw)`` (default GradientReducer; the hierarchical test
    passes HierarchicalReducer and SparseState's hierarchical keywords) on an
    MLP 12 → hidden… → 3."""
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    layers, width = [], 12
    for h in hidden:
        layers += [nn.Linear(width, h), nn.Tanh()]
        width = h
    model = nn.Sequential(*layers, nn.Linear(width, 3))
    ref = copy.deepcopy(model)
    state = gp.torch_ddp.SparseState(named_parameters=model.named_parameters(), **kw, **(state_kw or {}))
    ddp = DDP(model, bucket_cap_mb=0.002)
    ddp.register_comm_hook(state, gp.torch_ddp.sparse_hook)
    reducer = (reducer_cls or gp.GradientReducer)(**kw)
    diffs = []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(8, 12, generator=g), torch.randn(8, 3, generator=g)
        ddp.zero_grad()
        ((ddp(x) - y) ** 2).mean().backward()
        got = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        ref.zero_grad()
        ((ref(x) - y) ** 2).mean().backward()
        want = reducer.reduce({n: p.grad.detach().clone() for n, p in ref.named_parameters()})
        diffs.append(max(float((got[n] - want[n]).abs().max()) for n in got))
    return state, reducer, diffs
