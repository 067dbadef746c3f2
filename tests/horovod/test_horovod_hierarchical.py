"""Hierarchical reduction in the PyTorch Horovod layer:
``DistributedOptimizer(..., hierarchical=True)`` under real ``horovodrun
-np 4 -H localhost:4 --gloo``, with the nodes faked (``local_size=2`` /
``node_of_rank``: 2 nodes of 2, all on one host) and Horovod's own topology
(cross_rank: one node of 4).

Checked against :class:`gtopk_plugin.testing.Oracle` over the node sums
(2 nodes: every sum is one IEEE addition of two operands, so the engine's
order cannot change a bit; the one node of 4 to float rounding, its sum
taken in gloo's ring order): identical updates on every rank, residuals
only on the node leaders (the oracle's), the inter-node bytes
log2(nodes)·k·8 on leaders and 0 elsewhere, and a bad topology raising
on every rank.
"""
import os

import pytest
import torch

from hvd_launch import require_horovod  # noqa: E402

require_horovod()

from hvd_launch import job_results, ok  # noqa: E402
from gtopk_plugin.testing import Oracle  # noqa: E402

P = 4
NODES = [0, 0, 1, 1]
_RES = []


def results():
    if not _RES:
        _RES.extend(job_results(P, "hvd_hierarchical_job.py",
                                lambda d, r: torch.load(os.path.join(d, f"rank{r}.pt"), weights_only=False)))
    return _RES


def _flat(d):
    return torch.cat([d[n].reshape(-1) for n in sorted(d)])


def _check(key, method, node_of_rank, exact=True):
    runs = [ok(res, key) for res in results()]
    nodes = max(node_of_rank) + 1
    oracle = Oracle(nodes, method=method, density=0.1, op="sum")
    for s in range(len(runs[0]["out"])):
        sums = []
        for n in range(nodes):
            members = [runs[r]["raw"][s] for r in range(P) if node_of_rank[r] == n]
            sums.append({k: sum(m[k] for m in members) for k in members[0]})
        want = _flat(oracle.step(sums))
        for r in range(P):
            got = _flat(runs[r]["out"][s])
            assert torch.equal(got, _flat(runs[0]["out"][s])), f"{key} step {s}: rank {r} differs"
            assert torch.equal(got, want) if exact else torch.allclose(got, want, atol=1e-6), \
                f"{key} step {s} rank {r}"
    for r in range(P):
        inner = runs[r]["state"]["inner"]
        n = node_of_rank[r]
        if r == node_of_rank.index(n):
            mine, theirs = _flat(inner["residuals"]), _flat(oracle.residuals[n])
            assert torch.equal(mine, theirs) if exact else torch.allclose(mine, theirs, atol=1e-6)
        else:
            assert inner is None
    return runs


@pytest.mark.timeout(400)
def test_fake_nodes_equal_the_oracle():
    runs = _check("gtopk_2x2", "gtopk", NODES)
    for r, run in enumerate(runs):
        assert run["nodes"] == 2
        for t in run["traffic"]:
            if r in (0, 2):  # leaders: log2(nodes)·k·8 = k·8 between the 2 nodes
                assert t["inter_bytes_sent"] == run["k"] * 8 and t["intra_bytes_sent"] > 0
            else:
                assert t["inter_bytes_sent"] == 0 and t["intra_bytes_received"] > 0


@pytest.mark.timeout(400)
def test_intra_fabric_keyword_reaches_the_node_level():
    # intra_fabric="engine": the node sum through Horovod's side channel
    # (never shared memory, which "auto" takes where the host allows), the
    # same bits as the oracle
    assert all(ok(res, "gtopk_2x2")["fabric_mode"] == "auto" for res in results())
    runs = _check("gtopk_2x2_engine", "gtopk", NODES)
    assert all(run["fabric_mode"] == "engine" and run["fabric"] == "engine" for run in runs)


@pytest.mark.timeout(400)
def test_horovod_topology_one_host_is_one_node():
    # a sum of 4 floats in gloo's ring order, not the oracle's: to rounding
    runs = _check("gtopk_default", "gtopk", [0, 0, 0, 0], exact=False)
    assert all(run["nodes"] == 1 for run in runs)
    assert all(t["inter_bytes_sent"] == 0 for run in runs for t in run["traffic"])


@pytest.mark.timeout(400)
def test_bad_topology_raises_on_every_rank():
    for res in results():
        status, (kind, msg, _) = res["bad_local_size"]
        assert status == "error" and kind == "ValueError" and "does not divide" in msg, msg
        status, (kind, msg, _) = res["fabric_but_flat"]
        assert status == "error" and kind == "ValueError" and "intra_fabric=" in msg, msg
