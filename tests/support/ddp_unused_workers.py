"""Workers for tests/distributed/test_ddp_unused.py: the DDP hook with
parameters that DDP leaves unused (``find_unused_parameters=True``,
``static_graph=True``), recording in float64 what each rank fed and what DDP
applied, independently of the hook.

The model has a trunk and head used on every rank at every step, and three
branches: ``sometimes`` (used on every rank on some steps only), ``never``
(used on no rank) and ``local`` (used on rank 0 only: locally unused but
globally used elsewhere, so DDP zero-fills its bucket part and applies the
result).  Each step's record:

- ``fed``: this rank's local gradient of every parameter (zeros where it
  received none), from the same forward/backward on a plain copy of the
  model (no DDP, no hook);
- ``applied``: ``p.grad`` after DDP's backward (zeros where DDP left it
  unset), ``grad_none``: which it left unset;
- ``res`` / ``vel``: the hook's residuals (and DGC velocities) after the step;
- ``used``: which branches the test's schedule used on some rank.
"""
from __future__ import annotations

import copy
import gc

import torch
import torch.nn as nn

import gtopk_plugin as gp

BRANCHES = ("sometimes", "never", "local")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        # registration order differs from use order: DDP rebuilds its
        # buckets after the first iteration (dynamic mode)
        self.head = nn.Linear(12, 4)
        self.sometimes = nn.Linear(8, 4)
        self.trunk = nn.Linear(8, 12)
        self.never = nn.Linear(8, 4)
        self.local = nn.Linear(8, 4)

    def forward(self, x, use):
        y = self.head(torch.tanh(self.trunk(x)))
        for b in BRANCHES:
            if use[b]:
                y = y + getattr(self, b)(x)
        return y


def _batch(step, rank, micro=0):
    g = torch.Generator().manual_seed(10007 * step + 101 * rank + micro)
    return torch.randn(5, 8, generator=g), torch.randn(5, 4, generator=g)


def _loss(model, step, rank, use, micro=0):
    x, y = _batch(step, rank, micro)
    return ((model(x, use) - y) ** 2).mean()


def _uses(cfg, step, rank, micro):
    """Which branches this rank uses in this (micro-)batch."""
    sched = cfg.get("sometimes", ())
    return {"sometimes": step in sched if cfg.get("accumulate") is None else
            (micro == cfg["accumulate"].get(step, -1)),
            "never": cfg.get("phase1_steps", 0) > 0 and step < cfg["phase1_steps"],
            "local": rank == 0 or step < cfg.get("phase1_steps", 0)}


def _zeros_or(t, like):
    return torch.zeros_like(like, dtype=torch.float64) if t is None else t.detach().double().clone()


def _state_tensors(state, attr):
    """name -> float64 copy of the hook's residuals or velocities."""
    red = state.reducer
    red = getattr(red, "inner", None) or red  # hierarchical: the leader's
    src = red.memory.residuals if attr == "res" else red.momentum.velocities
    return {n: t.detach().double().clone().view(-1) for n, t in src.items()}


def _hook_with_log(log):
    def hook(st, bucket):
        log.append(tuple(st.name_of(p) for p in bucket.parameters()))
        return gp.torch_ddp.sparse_hook(st, bucket)
    return hook


def _ddp(model, state, mode, log, bucket_cap_mb):
    from torch.nn.parallel import DistributedDataParallel as DDP

    kw = {"static_graph": True} if mode == "static" else {"find_unused_parameters": True}
    ddp = DDP(model, bucket_cap_mb=bucket_cap_mb, **kw)
    ddp.register_comm_hook(state, _hook_with_log(log))
    return ddp


def run_config(rank, world, cfg):
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    red_kw = dict(cfg["reducer"])
    named = cfg.get("named", True)
    state = gp.torch_ddp.SparseState(named_parameters=model.named_parameters() if named else None,
                                     **red_kw)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    log = []
    rep = {"steps": [], "buckets": []}
    steps = cfg["steps"]
    phase1 = cfg.get("phase1_steps", 0)
    mode = "dynamic" if phase1 else cfg["mode"]
    # ~1 KB buckets (several per step once DDP rebuilds them), or one per parameter
    cap = cfg.get("bucket_cap_mb", 0.001)
    ddp = _ddp(model, state, mode, log, cap)
    key = None
    for step in range(steps):
        if step == phase1 and phase1:
            # phase 2: the same model and hook state under a fresh DDP (e.g.
            # static_graph=True), with the branch trained in phase 1 now unused
            del ddp
            gc.collect()
            ddp = _ddp(model, state, cfg["mode"], log, cap)
            rep["res0"] = {n: r.clone() for n, r in _state_tensors(state, "res").items()}
            rep["phase2_start_step"] = state.step
        del log[:]
        micro_n = 2 if cfg.get("accumulate") is not None else 1
        # the independent record: the same micro-batches on a plain copy
        ref.load_state_dict(model.state_dict())
        ref.zero_grad(set_to_none=True)
        for m in range(micro_n):
            _loss(ref, step, rank, _uses(cfg, step, rank, m), m).backward()
        fed = {n: _zeros_or(p.grad, p) for n, p in ref.named_parameters()}
        opt.zero_grad(set_to_none=True)
        for m in range(micro_n):
            use = _uses(cfg, step, rank, m)
            if m < micro_n - 1:
                with ddp.no_sync():
                    _loss(ddp, step, rank, use, m).backward()
            else:
                _loss(ddp, step, rank, use, m).backward()
        if key is None:  # the hook's name of each parameter (seen by now)
            key = {n: state.name_of(p) for n, p in model.named_parameters()}
            rep["key"] = key
        applied = {n: _zeros_or(p.grad, p) for n, p in model.named_parameters()}
        rec = {"fed": fed, "applied": applied,
               "grad_none": {n: p.grad is None for n, p in model.named_parameters()},
               "res": _state_tensors(state, "res"),
               "traffic": dict(state.last_step_traffic or {}), "state_step": state.step,
               "buckets": list(log)}
        if red_kw.get("momentum_correction") is not None:
            rec["vel"] = _state_tensors(state, "vel")
        rep["steps"].append(rec)
        opt.step()
    return rep


def worker(rank, world, cfgs):
    torch.set_num_threads(1)
    return [run_config(rank, world, cfg) for cfg in cfgs]
