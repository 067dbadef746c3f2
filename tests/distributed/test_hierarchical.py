"""Two-level (hierarchical) reduction (gtopk_plugin/two_level/hierarchical_reducer.py)
on real gloo groups: P = 8 split 4 x 2, 6 as 4 + 2 and as 3 x 2, 5 as 3 + 2
(subgroups of one P = 8 job: ``group=`` is split), and P = 4 as 2 x 2 for
the codecs, the compensation features, resume, errors and the DDP hook.

The oracle: :class:`gtopk_plugin.testing.Oracle` over ``nodes`` virtual
workers fed the node sums.  It is the right independent check because the
hierarchical reducer IS, by construction, the flat method run by the node
leaders on node-summed gradients (dense sums lose nothing); the oracle
simulates that flat method without the collectives (dense masks, explicit
group bookkeeping).  Gradients are multiples of 1/8, so every sum is exact
in any order and the oracle's bits are the bits to expect, on every rank.
What the oracle does not model (codecs, dense_below) is checked by rank
agreement, mass conservation and the exact dense sum.
"""
import math

import pytest
import torch

from gtopk_plugin.pipeline.layout import clip_scale
from gtopk_plugin.testing import Oracle
from dist_utils import run_workers
from hierarchical_workers import (DENSITY, NAMES, SHAPES, STEPS, TOPOLOGIES, WD, WD_PARAMS, features,
                                  flat, grads, topologies)

N = sum(math.prod(s) for s in SHAPES.values())


@pytest.fixture(scope="module")
def topo_results():
    return run_workers(8, topologies, timeout=300, pg_timeout=90)


@pytest.fixture(scope="module")
def feat_results():
    return run_workers(4, features, timeout=300, pg_timeout=90)


def _nodes(ranks, topo):
    return topo.get("node_of_rank") or [r // topo["local_size"] for r in range(len(ranks))]


def _node_sums(node_of_rank, t, make=None):
    make = make or (lambda r, t: grads(r, t))
    nodes = max(node_of_rank) + 1
    out = []
    for n in range(nodes):
        gs = [make(r, t) for r, m in enumerate(node_of_rank) if m == n]
        out.append({k: sum(g[k] for g in gs) for k in gs[0]})
    return out


def _check_oracle(results, ranks, node_of_rank, oracle, make=None, divide=1, names=NAMES):
    """Every rank's update is the oracle's at every step; leaders hold the
    oracle's residuals, other ranks none."""
    expect = []
    for t in range(STEPS):
        e = flat(oracle.step(_node_sums(node_of_rank, t, make)), names) / divide
        expect.append(e)
        for i, q in enumerate(ranks):
            got = results[q]["outs"][t]
            assert torch.equal(got, e), f"rank {q} step {t}: max diff {(got - e).abs().max()}"
            # the same bits on every rank (torch.equal cannot tell -0.0 from +0.0)
            assert torch.equal(got.view(torch.int32), results[ranks[0]]["outs"][t].view(torch.int32)), q
    for i, q in enumerate(ranks):
        inner = results[q]["state"]["inner"]
        n = node_of_rank[i]
        if i == node_of_rank.index(n):  # the node's leader
            assert torch.equal(flat(inner["residuals"], names), flat(oracle.residuals[n], names))
        else:
            assert inner is None, "only node leaders hold residuals"
    return expect


def _mass(results, ranks, node_of_rank, names=NAMES, make=None, atol=0.0):
    """op=sum: Σ_ranks Σ_steps g = Σ_steps result + Σ_leaders residual."""
    make = make or (lambda r, t: grads(r, t))
    total = sum(flat(make(r, t), names) for r in range(len(ranks)) for t in range(STEPS))
    applied = sum(results[ranks[0]]["outs"])
    leaders = [ranks[node_of_rank.index(n)] for n in range(max(node_of_rank) + 1)]
    res = sum(flat(results[q]["state"]["inner"]["residuals"], names) for q in leaders)
    if atol:
        assert torch.allclose(applied + res, total, atol=atol, rtol=1e-5)
    else:
        assert torch.equal(applied + res, total)


@pytest.mark.parametrize("case", [c[0] for c in TOPOLOGIES])
def test_equals_the_oracle_over_node_sums(topo_results, case):
    name, ranks, topo, methods = next(c for c in TOPOLOGIES if c[0] == case)
    node_of_rank = _nodes(ranks, topo)
    nodes = max(node_of_rank) + 1
    keys = [k for k in topo_results[ranks[0]] if isinstance(k, tuple) and k[0] == name]
    assert len(keys) >= len(methods)
    for _, m, op in keys:
        res = {q: topo_results[q][(name, m, op)] for q in ranks}
        oracle = Oracle(nodes, method=m, density=DENSITY, op="sum", seed=3)
        expect = _check_oracle(res, ranks, node_of_rank, oracle, divide=len(ranks) if op == "average" else 1)
        if op == "sum":
            _mass(res, ranks, node_of_rank)
        for i, q in enumerate(ranks):
            st = res[q]["stats"][-1]
            leader = i == node_of_rank.index(node_of_rank[i])
            assert st["nodes"] == nodes and {"intra", "inter"} <= set(st["seconds"])
            if not leader:
                assert st["inter_sent"] == 0 and st["inter_recv"] == 0
            elif m == "gtopk" and nodes & (nodes - 1) == 0:
                # the goal: log2(nodes)·k·8 inter-node bytes per node per step
                for s in res[q]["stats"]:
                    assert s["inter_sent"] == int(math.log2(nodes)) * s["k"] * 8
        fabric = topo.get("intra_fabric", "auto")
        assert all(res[q]["stats"][-1]["fabric"] == ("engine" if fabric == "engine" else "shared_memory")
                   for q in ranks)
        if name.startswith("4x2") and m == "gtopk" and op == "sum":
            # what a non-leader of a 2-rank node receives: over the engine,
            # the node's ring allreduce (N·4 bytes at L = 2) and one broadcast
            # message (8 B size + 16 B status/count + 8 B per non-zero of the
            # result); through shared memory, the leader's part of its shard
            # (the upper half, 64-byte aligned) and the same blob without the
            # size (it rides the barrier)
            shard = N - math.ceil(math.ceil(N / 2) / 16) * 16
            for t in range(STEPS):
                nnz = int(torch.count_nonzero(expect[t]))
                want = N * 4 + 8 if fabric == "engine" else shard * 4
                assert res[1]["stats"][t]["intra_recv"] == want + 16 + 8 * nnz


def test_inter_node_bytes_against_flat(topo_results):
    """P = 8 as 4 nodes x 2: hierarchical gTop-k sends log2(4)·k·8 per node,
    flat gTop-k log2(8)·k·8 per worker (2/3 of it, on the slow links)."""
    k = topo_results[0][("4x2", "gtopk", "sum")]["stats"][0]["k"]
    assert topo_results[0]["flat_bytes_sent"] == 3 * k * 8
    assert topo_results[0][("4x2", "gtopk", "sum")]["stats"][0]["inter_sent"] == 2 * k * 8


L2 = [0, 0, 1, 1]  # P = 4 as 2 nodes of 2
RANKS4 = [0, 1, 2, 3]


@pytest.mark.parametrize("method", ["onebit", "qsgd", "powersgd"])
def test_codecs_compose(feat_results, method):
    res = {q: feat_results[q][("codec", method)] for q in RANKS4}
    for t in range(STEPS):
        for q in RANKS4[1:]:
            assert torch.equal(res[q]["outs"][t], res[0]["outs"][t])
    assert res[1]["state"]["inner"] is None and res[3]["state"]["inner"] is None
    _mass(res, RANKS4, L2, atol=1e-3)


def test_clipping_is_per_worker_before_the_node_sum(feat_results):
    """clip_norm: each worker clips to clip_norm·P^-1/2 (P = 4, the world)
    before the intra-node sum; the oracle is fed the sums of clipped grads."""
    def clipped(r, t):
        g = grads(r, t)
        s = clip_scale(5.0, [g[n].reshape(-1) for n in NAMES], None, None, 4)
        assert s < 1.0
        return {n: v * s for n, v in g.items()}

    res = {q: feat_results[q]["clip"] for q in RANKS4}
    _check_oracle(res, RANKS4, L2, Oracle(2, method="gtopk", density=DENSITY, op="sum"), make=clipped)


@pytest.mark.parametrize("case,kw", [
    ("momentum", dict(momentum_correction=0.9, warmup=(0.3, 0.1))),
    ("fp16wire", dict(value_dtype=torch.float16)),
])
def test_leader_features_equal_the_oracle(feat_results, case, kw):
    res = {q: feat_results[q][case] for q in RANKS4}
    _check_oracle(res, RANKS4, L2, Oracle(2, method="gtopk", density=DENSITY, op="sum", **kw))
    if case == "fp16wire":
        _mass(res, RANKS4, L2, atol=1e-5)


def test_weight_decay_is_added_per_worker(feat_results):
    """bind_optimizer(SGD(momentum=0.9, weight_decay=wd)): every worker adds
    wd·p before the node sum (the sum holds L copies, as L flat workers
    send), the leader keeps the velocity."""
    def decayed(r, t):
        return {n: v + WD * WD_PARAMS[n] for n, v in grads(r, t).items()}

    res = {q: feat_results[q]["wd"] for q in RANKS4}
    _check_oracle(res, RANKS4, L2, Oracle(2, method="gtopk", density=DENSITY, op="sum", momentum_correction=0.9),
                  make=decayed)


def test_dense_below_sums_small_tensors_exactly(feat_results):
    res = {q: feat_results[q]["dense_below"] for q in RANKS4}
    big = ["v", "w"]
    oracle = Oracle(2, method="gtopk", density=DENSITY, op="sum")
    for t in range(STEPS):
        e = flat(oracle.step([{n: s[n] for n in big} for s in _node_sums(L2, t)]), big)
        b = sum(grads(r, t)["b"] for r in RANKS4)
        for q in RANKS4:
            out = res[q]["outs"][t]
            # NAMES = [b, v, w]: b first
            assert torch.equal(out[:13], b) and torch.equal(out[13:], e)
    assert "b" not in res[0]["state"]["inner"]["residuals"]


def test_resume_is_bit_exact(feat_results):
    for q in RANKS4:
        r = feat_results[q]["resume"]
        assert torch.equal(r["whole"], r["resumed"]) and r["step"] == STEPS


def test_errors_raise_or_skip_on_every_rank(feat_results):
    for q in RANKS4:
        e = feat_results[q]["errors"]
        assert e["nan_raise"][0] == "NonFiniteGradientError" and "rank 3" in e["nan_raise"][1]
        zeros, step, inner_step, skipped = e["nan_skip"]
        assert zeros and skipped and step == 1 and inner_step in ((1,) if q in (0, 2) else (None,))
        # a node sum that overflows fp16: caught by the leaders, carried to their nodes
        assert e["overflow_raise"][0] == "NonFiniteGradientError", e["overflow_raise"]
        assert e["overflow_propagate"]
        assert e["bad_input"][0] == ("ValueError" if q == 1 else "PeerInputError"), e["bad_input"]
        assert torch.equal(e["after"], feat_results[0]["errors"]["after"])


def test_bad_topologies_raise_on_every_rank(feat_results):
    want = {"disagree": "disagree", "gap": "first appearance", "order": "first appearance",
            "indivisible": "does not divide", "missing": "local_size", "both": "not both"}
    for q in RANKS4:
        got = feat_results[q]["topology_errors"]
        for case, text in want.items():
            assert got[case][0] == "ValueError" and text in got[case][1], (q, case, got[case])


def test_ddp_hook_hierarchical(feat_results):
    for q in RANKS4:
        d = feat_results[q]["ddp"]
        assert d["diffs"] == [0.0] * 3 and d["step"] == 3
        # SparseState(intra_fabric=...) reaches the node level
        assert d["fabric"] in ("shared_memory", "engine") and d["engine_fabric"] == "engine", d
        assert d["engine_mode"] == "engine"
        assert d["engine_diffs"] == [0.0] * 2
        assert {"intra_bytes_sent", "inter_bytes_sent"} <= set(d["traffic"])
    assert feat_results[1]["ddp"]["traffic"]["inter_bytes_sent"] == 0
    assert feat_results[0]["ddp"]["traffic"]["inter_bytes_sent"] > 0
