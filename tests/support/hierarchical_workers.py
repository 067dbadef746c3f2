"""Worker bodies of tests/distributed/test_hierarchical.py: the
two-level HierarchicalReducer on real gloo groups.  Each body runs many
configurations in one job (process start-up dominates the cost) and returns
plain tensors; the parent checks them against the single-process oracle.

Gradients are multiples of 1/8 in [-8, 8]: every sum over ranks and steps is
exact in float32 whatever the order, so the engine's allreduce order inside
a node cannot change a bit and the oracle's results are the bits to expect.
"""
import functools
import io

import torch
import torch.distributed as dist

import gtopk_plugin as gp
from gtopk_plugin.two_level.hierarchical_reducer import HierarchicalReducer

SHAPES = {"w": (40, 30), "v": (300,), "b": (13,)}
NAMES = sorted(SHAPES)
STEPS = 3
# (name, ranks of the group, topology keywords, methods): one P = 8 job
TOPOLOGIES = [
    ("4x2", list(range(8)), dict(local_size=2), ["gtopk", "topk", "rtopk", "randomk", "threshold"]),
    ("4+2", list(range(6)), dict(node_of_rank=[0, 0, 0, 0, 1, 1]), ["gtopk", "topk"]),
    ("3+2", list(range(5)), dict(node_of_rank=[0, 0, 0, 1, 1]), ["gtopk", "rtopk"]),
    ("3x2", list(range(6)), dict(local_size=2), ["gtopk"]),
    # the node's dense data through the node group (gloo) instead of shared memory
    ("4x2 engine", list(range(8)), dict(local_size=2, intra_fabric="engine"), ["gtopk", "topk"]),
]
DENSITY = 0.05


def grads(rank, step, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return {n: (torch.randint(-64, 65, s, generator=g).float() / 8).to(dtype) for n, s in SHAPES.items()}


def flat(d, names=NAMES):
    return torch.cat([d[n].reshape(-1) for n in names])


def _run(red, rank, steps=STEPS, make=grads):
    outs, stats = [], []
    for t in range(steps):
        u = red.reduce(make(rank, t))
        outs.append(flat(u).clone())
        st = red.last_stats
        stats.append(dict(k=st.k, inter_sent=st.inter_bytes_sent, inter_recv=st.inter_bytes_received,
                          intra_sent=st.intra_bytes_sent, intra_recv=st.intra_bytes_received,
                          bytes_sent=st.bytes_sent, nodes=st.nodes, seconds=sorted(st.seconds),
                          fabric=st.intra_fabric))
    return dict(outs=outs, stats=stats, state=red.state_dict(), step=red.step)


def topologies(rank, P):
    """Every case of TOPOLOGIES on its group (WORLD or a subgroup), each of
    its methods with op='sum' (gtopk also 'average'); plus a flat gTop-k step
    on the world for the byte comparison."""
    flat_red = gp.GradientReducer(method="gtopk", density=DENSITY, op="sum")
    flat_red.reduce(grads(rank, 0))
    out = {"flat_bytes_sent": flat_red.last_stats.bytes_sent}
    groups = [None if len(ranks) == P else dist.new_group(ranks) for _, ranks, _, _ in TOPOLOGIES]
    for (name, ranks, topo, methods), group in zip(TOPOLOGIES, groups):
        if rank not in ranks:
            continue
        r = ranks.index(rank)
        for m in methods:
            for op in (("sum", "average") if m == "gtopk" and name == "4x2" else ("sum",)):
                red = HierarchicalReducer(method=m, density=DENSITY, op=op, seed=3, group=group,
                                          timeout=60, **topo)
                out[(name, m, op)] = _run(red, r)
    dist.barrier()
    return out


def _attempt(fn):
    try:
        fn()
        return ("no error", "")
    except Exception as e:  # noqa: BLE001
        return (type(e).__name__, str(e))


def features(rank, P):
    """P = 4 as 2 nodes of 2: codecs, compensation features, resume, errors,
    bad topologies and the DDP hook (one job)."""
    L = dict(local_size=2, timeout=60)
    out = {}
    for m in ("onebit", "qsgd", "powersgd"):
        out[("codec", m)] = _run(HierarchicalReducer(method=m, op="sum", **L), rank)
    cases = {
        "clip": dict(method="gtopk", density=DENSITY, op="sum", clip_norm=5.0),
        "momentum": dict(method="gtopk", density=DENSITY, op="sum", momentum_correction=0.9,
                         warmup=(0.3, 0.1)),
        "fp16wire": dict(method="gtopk", density=DENSITY, op="sum", value_dtype=torch.float16),
        "dense_below": dict(method="gtopk", density=DENSITY, op="sum", dense_below=100),
    }
    for c, kw in cases.items():
        out[c] = _run(HierarchicalReducer(**kw, **L), rank)
    out["wd"] = _weight_decay(rank, L)
    out["resume"] = _resume(rank, L)
    out["errors"] = _errors(rank, L)
    out["topology_errors"] = _topology_errors(rank)
    out["ddp"] = _ddp(rank)
    return out


WD_PARAMS = {n: torch.full(s, 0.5) for n, s in SHAPES.items()}
WD = 0.125  # 0.125 · 0.5 = 1/16: g + wd·p stays exact


def _weight_decay(rank, L):
    """Momentum and weight decay taken from an SGD optimizer on every rank."""
    params = {n: torch.nn.Parameter(p.clone()) for n, p in WD_PARAMS.items()}
    opt = torch.optim.SGD(list(params.values()), lr=0.1, momentum=0.9, weight_decay=WD)
    red = HierarchicalReducer(method="gtopk", density=DENSITY, op="sum", **L)
    red.bind_optimizer(opt, list(params.items()))
    res = _run(red, rank)
    res["groups"] = [(g["momentum"], g["weight_decay"]) for g in opt.param_groups]
    return res


def _resume(rank, L):
    """Two steps, save (through torch.save), a fresh reducer loads and takes
    the third: the same bits as three steps without a break."""
    kw = dict(method="gtopk", density=DENSITY, op="sum", momentum_correction=0.9, **L)
    whole = _run(HierarchicalReducer(**kw), rank)["outs"][-1]
    red = HierarchicalReducer(**kw)
    for t in range(STEPS - 1):
        red.reduce(grads(rank, t))
    buf = io.BytesIO()
    torch.save(red.state_dict(), buf)
    buf.seek(0)
    again = HierarchicalReducer(**kw)
    again.load_state_dict(torch.load(buf))
    resumed = flat(again.reduce(grads(rank, STEPS - 1)))
    return dict(whole=whole, resumed=resumed.clone(), step=again.step)


def _errors(rank, L):
    out = {}
    # a NaN on a non-leader (rank 3): every rank raises, naming rank 3
    red = HierarchicalReducer(method="gtopk", density=DENSITY, **L)
    g = grads(rank, 0)
    if rank == 3:
        g["v"][7] = float("nan")
    out["nan_raise"] = _attempt(lambda: red.reduce(g))
    skip = HierarchicalReducer(method="gtopk", density=DENSITY, nonfinite="skip", **L)
    u = skip.reduce(g)
    out["nan_skip"] = (all(bool((x == 0).all()) for x in u.values()), skip.step,
                       None if skip.inner is None else skip.inner.step, skip.last_stats.skipped)
    # node 0's fp16 sum overflows (40000 + 40000 > 65504) though every rank is finite
    h = grads(rank, 0, torch.float16)
    if rank in (0, 1):
        h["w"][0, 0] = 40000.0
    red = HierarchicalReducer(method="gtopk", density=DENSITY, **L)
    out["overflow_raise"] = _attempt(lambda: red.reduce(h))
    prop = HierarchicalReducer(method="gtopk", density=DENSITY, nonfinite="propagate", **L)
    u = prop.reduce(h)
    out["overflow_propagate"] = all(bool(torch.isinf(x).all()) for x in u.values())
    # bad input on rank 1: ValueError there, PeerInputError elsewhere
    red = HierarchicalReducer(method="gtopk", density=DENSITY, **L)
    bad = grads(rank, 0) if rank != 1 else {"w": torch.tensor(1.0)}
    out["bad_input"] = _attempt(lambda: red.reduce(bad))
    # still usable after every failure above
    out["after"] = flat(red.reduce(grads(rank, 1))).clone()
    return out


def _topology_errors(rank):
    cases = {
        "disagree": dict(local_size=4 if rank == 1 else 2),
        "gap": dict(node_of_rank=[0, 0, 2, 2]),
        "order": dict(node_of_rank=[1, 1, 0, 0]),
        "indivisible": dict(local_size=3),
        "missing": dict(),
        "both": dict(local_size=2, node_of_rank=[0, 0, 1, 1]),
    }
    return {c: _attempt(lambda kw=kw: HierarchicalReducer(method="gtopk", timeout=60, **kw).reduce(grads(rank, 0)))
            for c, kw in cases.items()}


def _ddp(rank, steps=3):
    """SparseState(hierarchical=True) against HierarchicalReducer on an
    undistributed copy of the model: the same bits (bucket by bucket vs
    one call; granularity 'layer')."""
    from ddp_vs_reducer import hook_vs_reducer

    state, _, diffs = hook_vs_reducer(
        rank, steps, hidden=(40,), reducer_cls=functools.partial(HierarchicalReducer, local_size=2),
        state_kw=dict(hierarchical=True, local_size=2), method="gtopk", density=0.1)
    # intra_fabric= through the hook: the node sum over gloo instead of
    # shared memory, the same bits as the reducer given the same keyword
    eng, _, eng_diffs = hook_vs_reducer(
        rank, 2, hidden=(40,),
        reducer_cls=functools.partial(HierarchicalReducer, local_size=2, intra_fabric="engine"),
        state_kw=dict(hierarchical=True, local_size=2, intra_fabric="engine"), method="gtopk", density=0.1)
    return dict(diffs=diffs, traffic=state.last_step_traffic, step=state.step,
                fabric=state.last_stats.intra_fabric, engine_diffs=eng_diffs,
                engine_fabric=eng.last_stats.intra_fabric, engine_mode=eng.reducer._fabric_mode)
