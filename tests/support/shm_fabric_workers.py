"""Worker bodies of tests/distributed/test_shared_memory_fabric.py (issue
#18): the two-level reduction's shared-memory node fabric on real gloo
groups (P = 4), against the oracle the parent computes."""
import os

import torch
import torch.distributed as dist

from gtopk_plugin.two_level import shared_memory
from gtopk_plugin.two_level.hierarchical_reducer import HierarchicalReducer
from hierarchical_workers import DENSITY, STEPS, _attempt, _run, flat, grads


def _layouts(rank, t):
    """Steps alternate a small layout and the whole one: the mapping grows."""
    g = grads(rank, t)
    return {"b": g["b"]} if t % 2 == 0 else g


def _listing(shm_dir):
    dist.barrier()
    return sorted(os.listdir(shm_dir))


def fabric_cases(rank, P, shm_dir):
    os.environ["GTOPK_SHM_DIR"] = shm_dir
    kw = dict(method="gtopk", density=DENSITY, op="sum", seed=3, timeout=60)
    out = {}
    red = HierarchicalReducer(local_size=2, intra_fabric="shared_memory", **kw)
    outs, slots = [], []
    for t in range(4):
        u = red.reduce(_layouts(rank, t))
        outs.append(flat(u, sorted(u)).clone())
        slots.append((red.fabric.current, red.fabric.shm.slot_bytes))
    out["grow"] = dict(outs=outs, slots=slots, state=red.state_dict())
    out["grow_files"] = _listing(shm_dir)
    out["uneven"] = _run(HierarchicalReducer(node_of_rank=[0, 0, 0, 1], **kw), rank)
    # fp16 gradients, op="average", both fabrics: the same bits; and updates
    # held across steps are not overwritten by later steps (the ring)
    for fabric in ("shared_memory", "engine"):
        red = HierarchicalReducer(local_size=2, intra_fabric=fabric, **dict(kw, op="average"))
        held, snaps = [], []
        for t in range(STEPS):
            u = red.reduce(grads(rank, t, torch.float16))
            held.append(u)
            snaps.append(flat(u).clone())
        out[("fp16", fabric)] = dict(snaps=snaps, held=[flat(u).clone() for u in held])
    # rank 1 cannot map the node's file (as on a node whose "ranks" live on
    # different hosts): its node falls back to gloo, the other keeps memory
    real = torch.from_file
    if rank == 1:
        def refuse(*a, **k):
            raise RuntimeError("simulated: no shared mapping")
        shared_memory.torch.from_file = refuse
    try:
        out["fallback"] = _run(HierarchicalReducer(local_size=2, **kw), rank)
        out["insist"] = _attempt(lambda: HierarchicalReducer(local_size=2, intra_fabric="shared_memory",
                                                             **kw).reduce(grads(rank, 0)))
    finally:
        shared_memory.torch.from_file = real
    out["files"] = _listing(shm_dir)
    return out
