"""Hierarchical rows of the convergence study: flat vs two-level
(:class:`gtopk_plugin.HierarchicalReducer`) top-k and gTop-k with the
library's momentum recipe, at equal k per node.

``python -m lab convergence-hier [--seeds 2] [--quick] [--no-gloo]``

**Simulation.**  A hierarchical run of P workers in ``nodes`` nodes of
L = P/nodes (rank r on node r // L) is, by construction, the flat method
over ``nodes`` virtual workers fed the node sums of the workers' gradients,
with ``op="sum"`` and the final division by the whole world size P: the
leader's inner ``GradientReducer`` is an ordinary flat reducer on node sums
(gtopk_plugin/hierarchical.py).  :class:`HierReduction` simulates exactly
that with :class:`gtopk_plugin.testing.Oracle`; momentum correction,
masking and warm-up are the inner reducer's, so the velocity and residual
live on the (virtual) leader, one per node.

**Equal k per node.**  The leader selects k = ⌈density·n⌉ entries per
tensor of its node's sum, with the same density as a flat worker selects
of its own gradient.  Flat gTop-k over P workers keeps k entries in all;
hierarchical keeps k of the node sums' merge -- the same global k.

**Exactness** (:func:`gloo_check`, tests/distributed/test_convergence_hier.py):
the same run on P real gloo processes with ``HierarchicalReducer``
(``local_size=L``) gives bit-identical final weights.  Bit for bit, not only
to rounding, because every node here has L = 2 workers: the node sum is one
IEEE addition a + b, commutative, so gloo's allreduce and the simulation's
rank-order sum give the same bits (for L > 2 the summation order could
differ: then agreement is to the float rounding of the node sum).

Bytes per step: hierarchical, inter-node bytes a node leader sends
(gTop-k: log2(nodes)·8k; top-k: (nodes−1)·8k), from :func:`sim.bytes_per_worker`
over ``nodes`` workers; flat, what one worker sends, log2(P)·8k resp.
(P−1)·8k (the comparison asked for).  The gloo check holds the formula to
the leaders' ``inter_bytes_sent`` counters.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from gtopk_plugin.config import ReducerConfig
from gtopk_plugin.reducer import k_for
from gtopk_plugin.testing import Oracle

from lab.convergence import gloo, momentum, sim

TASKS = ("digits", "glyphs")
METHODS = ("topk", "gtopk")
LAYOUTS = ((4, 2), (8, 4))   # (P, nodes): 2 x 2 and 4 x 2
DENSITY = 0.01
GLOO_STEPS = 40


def node_sums(grads, nodes: int) -> List[dict]:
    """The node sums of the workers' gradients (rank r on node r // L), in
    rank order -- what the node's dense allreduce computes."""
    L = len(grads) // nodes
    out = []
    for n in range(nodes):
        part = grads[n * L:(n + 1) * L]
        out.append({k: _sum([g[k] for g in part]) for k in part[0]})
    return out


def _sum(ts):
    acc = ts[0]
    for t in ts[1:]:
        acc = acc + t
    return acc


class HierReduction:
    """The hierarchical reducer of P workers in ``nodes`` nodes: the flat
    method (``Oracle``, ``op="sum"``) over the node sums, divided by P.
    Bytes: what a node leader sends between nodes."""

    def __init__(self, P: int, nodes: int, kw: dict, names, sizes):
        if P % nodes:
            raise ValueError(f"{nodes} nodes do not divide P = {P}")
        self.P, self.nodes, self.names, self.sizes = P, nodes, names, sizes
        kw = dict(kw, op="sum")
        self.cfg = ReducerConfig(**kw)
        self.oracle = Oracle(nodes, kernels="reference", **kw)

    def __call__(self, grads, step):
        cfg = self.cfg
        summed = self.oracle.step(node_sums(grads, self.nodes))
        upd = {n: u / self.P for n, u in summed.items()}
        k_total = sum(k_for(cfg.density_at(step), self.sizes[n]) for n in self.names)
        numel = sum(self.sizes.values())
        return upd, sim.bytes_per_worker(cfg.aggregation, self.nodes, numel, k_total)

    def info(self) -> dict:
        return {}

    def close(self):
        pass


def run(task, spec: sim.RunSpec, nodes: int, keep_params: bool = False) -> dict:
    """Train one hierarchical configuration (``spec.workers`` workers in
    ``nodes`` nodes): :func:`sim.run` with :class:`HierReduction` (the same
    batches, shards, optimizer, schedule and evaluation)."""
    out = sim.run(task, spec, keep_params=keep_params,
                  reduction=lambda P, kw, names, sizes: HierReduction(P, nodes, kw, names, sizes))
    out["nodes"] = nodes
    return out


def specs(seeds=(0, 1), tasks=TASKS, steps: Optional[int] = None) -> List[Tuple[sim.RunSpec, int]]:
    """(spec, nodes) of every run, nodes = P for the flat ones (L = 1),
    in priority order (seed 0 of everything first)."""
    out = []
    for sd in seeds:
        for t in tasks:
            for P, nodes in LAYOUTS:
                for m in METHODS:
                    s = momentum.spec(t, m, P, DENSITY, sd, "recipe", steps)
                    out += [(s, P), (s, nodes)]
    return out


def run_one(spec: sim.RunSpec, nodes: int, keep_params: bool = False) -> dict:
    """Flat (nodes = P): :func:`sim.run` itself, the momentum group's run;
    hierarchical: :func:`run`."""
    from lab.convergence import study

    task = study._task(spec.task)
    if nodes == spec.workers:
        r = sim.run(task, spec, keep_params=keep_params)
        r["nodes"] = nodes
        return r
    return run(task, spec, nodes, keep_params=keep_params)


# ------------------------------------------------------------------ gloo
def worker(ctx, spec_d: dict, local_size: int) -> dict:
    """Launcher target: train ``spec_d`` with a real ``HierarchicalReducer``
    (``local_size`` ranks per node); rank 0 returns the final weights and
    the leaders' inter-node bytes sent per step (mean over leaders)."""
    import torch.distributed as dist

    import gtopk_plugin as gp

    from lab.convergence import tasks

    spec = sim.RunSpec(**spec_d)
    task = tasks.get(spec.task)
    steps, lr, batch_size = sim.resolved(task, spec)
    model = sim.initial_model(task, spec.seed)
    names = [n for n, _ in model.named_parameters()]
    params = [p for _, p in model.named_parameters()]
    red = gp.HierarchicalReducer(local_size=local_size,
                                 **sim.reducer_kwargs(spec, steps, sim.steps_per_epoch(task, batch_size)))
    opt = sim.make_optimizer(spec, params, lr)
    inter = []
    for step in range(steps):
        batch = task.batch_indices(spec.seed, step, batch_size)
        _, g = sim.worker_gradients(task, model, params, batch, ctx.rank, ctx.size)
        upd = red.reduce(dict(zip(names, g)))
        for n, p in zip(names, params):
            p.grad = upd[n]
        for grp in opt.param_groups:
            grp["lr"] = sim.lr_at(spec, lr, step, steps)
        opt.step()
        inter.append(float(red.last_stats.inter_bytes_sent) if red.topology.is_leader else 0.0)
    tot = torch.tensor(inter, dtype=torch.float64)
    dist.all_reduce(tot)
    nodes = red.topology.nodes
    return {"params": torch.cat([p.detach().reshape(-1) for p in params]),
            "inter_bytes_per_step": (tot / nodes).tolist()} if ctx.rank == 0 else None


def gloo_run(spec: sim.RunSpec, nodes: int, timeout: float = 300.0) -> dict:
    from gtopk_plugin._launch import launcher as launch

    return launch.run(spec.workers, worker, spec.as_dict(), spec.workers // nodes, timeout=timeout)[0]


def gloo_specs(steps: int = GLOO_STEPS) -> List[Tuple[sim.RunSpec, int]]:
    return [(momentum.spec("digits", "gtopk", 4, DENSITY, 0, "recipe", steps), 2),
            (momentum.spec("digits", "topk", 4, DENSITY, 0, "recipe", steps), 2),
            (momentum.spec("digits", "gtopk", 8, DENSITY, 0, "recipe", steps), 4)]


def gloo_check(cases=None) -> List[dict]:
    """Simulation (:class:`HierReduction`) vs real ``HierarchicalReducer``
    on gloo: final weights bit for bit, byte formula vs the counters."""
    out = []
    for s, nodes in cases or gloo_specs():
        simulated = gloo.simulated(run_one, s, nodes, keep_params=True)  # one thread, as the workers
        real = gloo_run(s, nodes)
        ps, pr = simulated["params"], real["params"]
        db = max(abs(a - b) for a, b in zip(simulated["bytes_per_step_curve"], real["inter_bytes_per_step"]))
        out.append({"config": f"{s.task} {s.label} P={s.workers} = {nodes}x{s.workers // nodes}, recipe, "
                              f"{s.steps} steps",
                    "params_bitwise_equal": bool(torch.equal(ps, pr)),
                    "params_max_abs_diff": float((ps - pr).abs().max()),
                    "bytes_formula_max_abs_diff": float(db)})
    return out


def quick_specs(steps: int = 12) -> List[Tuple[sim.RunSpec, int]]:
    s = momentum.spec("digits", "gtopk", 4, DENSITY, 0, "recipe", steps)
    t = momentum.spec("digits", "topk", 4, DENSITY, 0, "recipe", steps)
    return [(s, 4), (s, 2), (t, 2)]
