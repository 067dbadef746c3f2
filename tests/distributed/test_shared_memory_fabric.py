"""The shared-memory node fabric of the two-level reduction (gtopk_plugin/collectives/shared_memory.py, gtopk_plugin/node_fabric.py) on
real gloo groups, P = 4: a mapping that grows with the layout, a node of 3
(uneven shards) beside a node of 1, the fall-back to the node's gloo group
when a rank cannot map the file, and the insisting mode's error on every
rank.  Oracle: :class:`gtopk_plugin.testing.Oracle` over the node sums
(gradients are multiples of 1/8: every sum is exact in any order); the
byte counts against the data-movement formulas; no file is left behind."""
import math

import pytest
import torch

from gtopk_plugin.testing import Oracle
from dist_utils import run_workers
from hierarchical_workers import DENSITY, NAMES, SHAPES, STEPS, flat, grads
from shm_fabric_workers import _layouts, fabric_cases

N = sum(math.prod(s) for s in SHAPES.values())


@pytest.fixture(scope="module")
def shm_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("shm"))


@pytest.fixture(scope="module")
def res(shm_dir):
    return run_workers(4, fabric_cases, shm_dir, timeout=300, pg_timeout=90)


def _oracle_steps(node_of_rank, make, steps):
    oracle = Oracle(max(node_of_rank) + 1, method="gtopk", density=DENSITY, op="sum", seed=3)
    out = []
    for t in range(steps):
        sums = []
        for n in range(max(node_of_rank) + 1):
            gs = [make(r, t) for r, m in enumerate(node_of_rank) if m == n]
            sums.append({k: sum(g[k] for g in gs) for k in gs[0]})
        u = oracle.step(sums)
        out.append(flat(u, sorted(u)))
    return out, oracle


def test_growing_mapping_equals_the_oracle(res):
    expect, oracle = _oracle_steps([0, 0, 1, 1], _layouts, 4)
    for q in range(4):
        for t in range(4):
            assert torch.equal(res[q]["grow"]["outs"][t], expect[t]), (q, t)
        assert all(f == "shared_memory" for f, _ in res[q]["grow"]["slots"])
    # the slot grew once, to the whole layout (page-rounded), and stayed
    sizes = [b for _, b in res[0]["grow"]["slots"]]
    assert sizes[0] < sizes[1] == sizes[2] == sizes[3] and sizes[1] >= N * 4
    for leader in (0, 2):
        got = res[leader]["grow"]["state"]["inner"]["residuals"]
        want = oracle.residuals[leader // 2]
        assert set(got) == set(want) and all(torch.equal(got[n], want[n]) for n in got)


def test_uneven_node_equals_the_oracle_and_bytes_balance(res):
    expect, _ = _oracle_steps([0, 0, 0, 1], grads, STEPS)
    for q in range(4):
        for t in range(STEPS):
            assert torch.equal(res[q]["uneven"]["outs"][t], expect[t]), (q, t)
    assert [res[q]["uneven"]["stats"][0]["fabric"] for q in range(4)] == ["shared_memory"] * 3 + ["engine"]
    shard0 = math.ceil(math.ceil(N / 3) / 16) * 16  # the leader's shard (64-byte aligned)
    for t in range(STEPS):
        st = [res[q]["uneven"]["stats"][t] for q in range(3)]
        blob = 16 + 8 * int(torch.count_nonzero(expect[t]))
        # what one rank hands over through the mapping another takes: the
        # slots' reduce-scatter ((L-1)·N·4), the shards summed for the
        # leader, the leader's blob to each of the other two
        sent = sum(s["intra_sent"] for s in st)
        assert sent == sum(s["intra_recv"] for s in st)
        assert sent == 2 * N * 4 + (N - shard0) * 4 + 2 * blob
        assert st[0]["intra_recv"] == 2 * shard0 * 4 + (N - shard0) * 4
    assert res[3]["uneven"]["stats"][0]["intra_sent"] == 0


def test_falls_back_to_the_group_and_insisting_raises_everywhere(res):
    expect, _ = _oracle_steps([0, 0, 1, 1], grads, STEPS)
    for q in range(4):
        for t in range(STEPS):
            assert torch.equal(res[q]["fallback"]["outs"][t], expect[t]), (q, t)
    fabrics = [res[q]["fallback"]["stats"][0]["fabric"] for q in range(4)]
    assert fabrics == ["engine", "engine", "shared_memory", "shared_memory"]
    for q in range(4):
        kind, msg = res[q]["insist"]
        assert kind == "ValueError" and "simulated: no shared mapping" in msg and "intra_fabric" in msg, (q, msg)


def test_fp16_average_same_bits_on_both_fabrics_and_held_updates_survive(res):
    for t in range(STEPS):
        ref = res[0][("fp16", "engine")]["snaps"][t].view(torch.int16)
        for q in range(4):
            for fabric in ("shared_memory", "engine"):
                r = res[q][("fp16", fabric)]
                assert torch.equal(r["snaps"][t].view(torch.int16), ref), (q, fabric, t)
                # the update of step t, read again after the last step
                assert torch.equal(r["held"][t].view(torch.int16), ref), (q, fabric, t)
    assert res[0][("fp16", "engine")]["snaps"][0].dtype == torch.float16


def test_no_file_is_left_behind(res):
    assert res[0]["grow_files"] == [] and res[0]["files"] == []
