"""The in-process thread transport (gtopk_plugin/collectives/threads.py),
without processes: P GradientReducer ranks on threads equal the
single-process oracle (gtopk_plugin.testing.Oracle) bit for bit for the
selector methods (gTop-k's butterfly at P = 3 and 4, top-k's allgather,
threshold's variable counts, momentum correction; not
random-k at P >= 3: its value allreduce sums in gloo's ring order, which
the threads reproduce and the oracle's rank-order sum does not), and a rank that
raises stops the others instead of hanging them.  Exactness against real
gloo: tests/distributed/test_threads_vs_gloo.py."""
import pytest
import torch

import gtopk_plugin as gp
from gtopk_plugin.collectives.threads import ThreadGroup, gloo_ring_sum
from gtopk_plugin.testing import Oracle

SHAPES = {"a": (16, 12), "b": (40,), "c": (3, 5, 7)}
STEPS = 5


def _grads(rank, step):
    g = torch.Generator().manual_seed(31 * rank + step)
    return {n: torch.randn(*s, generator=g) for n, s in SHAPES.items()}


@pytest.mark.parametrize("P,kw", [
    (3, dict(method="gtopk", density=0.1)),
    (4, dict(method="gtopk", density=0.05, momentum_correction=0.9)),
    (3, dict(method="topk", density=0.1)),
    (4, dict(method="threshold", density=0.1)),
])
def test_threads_equal_the_oracle(P, kw):
    oracle = Oracle(P, kernels="reference", **kw)
    with ThreadGroup(P) as group:
        reds = [gp.GradientReducer(transport=group.transports[r], kernels="reference", **kw) for r in range(P)]
        for t in range(STEPS):
            grads = [_grads(r, t) for r in range(P)]
            expect = oracle.step(grads)
            got = group.map(lambda r: {n: u.clone() for n, u in reds[r].reduce(grads[r]).items()})
            for r in range(P):
                for n in SHAPES:
                    assert torch.equal(got[r][n], expect[n]), f"step {t} rank {r} {n}"
        for r in range(P):
            res = reds[r].memory.state_dict()
            assert res, "residuals kept"
        sent = [reds[r].last_stats.bytes_sent for r in range(P)]
        assert all(s > 0 for s in sent)


def test_a_failing_rank_stops_the_others():
    group = ThreadGroup(3, timeout=30)

    def fn(r):
        if r == 1:
            raise ValueError("boom")
        t = torch.ones(4)
        group.transports[r].allreduce_sum_(t)  # rank 1 never arrives
        return t

    with pytest.raises(ValueError, match="boom"):
        group.map(fn)
    group.close()


def test_ring_sum_order():
    """Two operands: commutative, any order; three: gloo's grouping per
    segment (segment j of 2P belongs to rank j // 2 and starts at its left
    neighbour)."""
    xs = [torch.tensor([1.0, 1e8, -1e8, 3.0, 0.5, 2.0]), torch.tensor([1e8, 1.0, 1.0, 1e8, 1e8, 1e8]),
          torch.tensor([-1e8, -1e8, 1e8, -1e8, -1e8, -1e8])]
    out = gloo_ring_sum(xs)
    # 6 entries, 6 segments of one entry; entry j is owned by rank j // 2
    for j in range(6):
        o = j // 2
        acc = xs[(o - 1) % 3][j]
        acc = xs[(o - 2) % 3][j] + acc
        acc = xs[o][j] + acc
        assert out[j] == acc
    assert torch.equal(gloo_ring_sum(xs[:2]), xs[0] + xs[1])
