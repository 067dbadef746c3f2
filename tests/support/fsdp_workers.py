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


def record(state):
    """Wrap the state's reducer: per step, the local shards it was given and
    the updates it returned (clones)."""
    log = []
    reduce = state.reducer.reduce

    def recorded(grads, **kw):
        inp = {n: g.detach().clone() for n, g in grads.items()}
        out = reduce(grads, **kw)
        log.append((inp, {n: u.detach().clone() for n, u in out.items()}))
        return out

    state.reducer.reduce = recorded
    return log
