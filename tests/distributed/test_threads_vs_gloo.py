"""The in-process thread transport (gtopk_plugin/collectives/threads.py) is
exact with respect to real gloo: P = 3 GradientReducer ranks on threads give,
bit for bit, what the same reducers give on a torch.distributed gloo group --
updates every step, final residuals and every counter -- for the codecs the
convergence study simulates with it (onebit: payload allgather; powersgd
rank 4 with momentum correction: float allreduce rounds, where the order of
gloo's ring sum matters; qsgd), and a float allreduce equals
``gloo_ring_sum`` at several sizes.  One gloo launch for all of it."""
import math

import torch

import gtopk_plugin as gp
from gtopk_plugin.collectives.threads import ThreadGroup, gloo_ring_sum
from dist_utils import run_workers

P = 3
STEPS = 4
SHAPES = {"conv.weight": (8, 3, 3, 3), "conv.bias": (8,), "fc.weight": (10, 24), "fc.bias": (10,)}
SIZES = [1, 5, 100, 1001, 40000]
CONFIGS = {
    "onebit": dict(method="onebit"),
    "powersgd": dict(method="powersgd", rank=4, momentum_correction=0.9),
    "qsgd": dict(method="qsgd"),
}


def _grads(rank, step):
    g = torch.Generator().manual_seed(100 * rank + step)
    return {n: torch.randn(*s, generator=g) for n, s in SHAPES.items()}


def _vector(rank, n):
    g = torch.Generator().manual_seed(7 * n + rank)
    return torch.randn(n, generator=g) * torch.exp(3 * torch.randn(n, generator=g))


def _run(red, rank):
    """STEPS reductions: (updates per step, final residuals, counters)."""
    ups = []
    for t in range(STEPS):
        u = red.reduce(_grads(rank, t))
        ups.append({n: v.clone() for n, v in u.items()})
    res = red.state_dict()
    return ups, res, red.transport.counters.copy()


def _worker(rank, world):
    import torch.distributed as dist

    sums = []
    for n in SIZES:
        x = _vector(rank, n)
        dist.all_reduce(x)
        sums.append(x)
    return sums, {name: _run(gp.GradientReducer(**kw), rank) for name, kw in CONFIGS.items()}


def _equal_tree(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and \
            bool(torch.equal(a, b) or (a.isnan().any() and torch.equal(a.nan_to_num(), b.nan_to_num())))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal_tree(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal_tree(x, y) for x, y in zip(a, b))
    return a == b


def test_threads_equal_gloo_bit_for_bit():
    real = run_workers(P, _worker, timeout=240)
    # the float allreduce: gloo's ring order
    for k, n in enumerate(SIZES):
        expect = gloo_ring_sum([_vector(r, n) for r in range(P)])
        for r in range(P):
            assert torch.equal(real[r][0][k], expect), f"gloo sum of {n} entries"
    # the order matters (so the check above can fail): a rank-order sum differs
    xs = [_vector(r, SIZES[-1]) for r in range(P)]
    assert not torch.equal((xs[0] + xs[1]) + xs[2], real[0][0][-1])
    for name, kw in CONFIGS.items():
        with ThreadGroup(P) as group:  # fresh counters per configuration, as each gloo reducer's
            reds = [gp.GradientReducer(transport=group.transports[r], **kw) for r in range(P)]
            sim = group.map(lambda r: _run(reds[r], r))
            for r in range(P):
                ups, res, counters = real[r][1][name]
                s_ups, s_res, s_counters = sim[r]
                assert all(_equal_tree(a, b) for a, b in zip(ups, s_ups)), f"{name} rank {r}: updates"
                assert _equal_tree(res, s_res), f"{name} rank {r}: state (residuals, velocities, Q)"
                assert counters == s_counters, f"{name} rank {r}: {counters} vs {s_counters}"
                assert counters.payload_bytes_sent > 0
            # the updates are the same bits on every rank, and not trivially zero
            assert all(_equal_tree(sim[0][0], sim[r][0]) for r in range(P))
            assert math.isfinite(float(sim[0][0][-1]["fc.weight"].abs().sum())) and \
                float(sim[0][0][-1]["fc.weight"].abs().sum()) > 0
