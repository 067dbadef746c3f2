"""GradientReducer.reduce_async against reduce() (the synchronous path, the
reference): every registered method, P = 1..5 ranks (in-process, the
thread transport), three calls per step all in flight at once -- the
updates, the byte counts of every call, the residuals and the transport's
counters bit for bit; checkpoint resume mid-run; ``nonfinite=`` policies;
a dead rank (every survivor's future raises, nothing hangs, no thread
left).  DDP on real gloo: tests/distributed/test_async_ddp.py."""
import threading

import pytest
import torch

import gtopk_plugin as gp
from async_workers import grads, threaded_run
from gtopk_plugin.collectives.threads import ThreadGroup
from gtopk_plugin.pipeline.comm_worker import EarlierFailure

METHODS = {
    "dense": {},
    "topk": {"density": 0.1},
    "gtopk": {"density": 0.1},
    "rtopk": {"density": 0.1},
    "randomk": {"density": 0.1},
    "threshold": {"density": 0.1},
    "onebit": {},
    "powersgd": {"start_iter": 1, "min_compression_rate": 1.0},
    "qsgd": {},
}
STEPS = 3


def _equal_state(a, b, where=""):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _equal_state(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _equal_state(x, y, f"{where}[{i}]")
    else:
        assert a == b or (a != a and b != b), f"{where}: {a!r} != {b!r}"


def _same_runs(sync, asyn):
    for r, ((out_s, sd_s, c_s), (out_a, sd_a, c_a)) in enumerate(zip(sync, asyn)):
        assert [o[0] for o in out_a] == [o[0] for o in out_s], f"rank {r} outcomes"
        for i, (s, a) in enumerate(zip(out_s, out_a)):
            _equal_state(a[1], s[1], f"rank {r} call {i}")
        _equal_state(sd_a, sd_s, f"rank {r} state")
        assert c_a == c_s, f"rank {r} transport counters"


@pytest.mark.parametrize("method", sorted(METHODS))
def test_reduce_async_equals_reduce(method):
    for P in (1, 2, 3, 4, 5):
        kw = dict(method=method, op="average", **METHODS[method])
        sync = threaded_run(P, kw, STEPS, "sync")
        asyn = threaded_run(P, kw, STEPS, "async")
        assert all(o[0] == "ok" for run in asyn for o in run[0])
        _same_runs(sync, asyn)


@pytest.mark.parametrize("kw", [dict(method="gtopk", density=0.1, momentum_correction=0.9),
                                dict(method="randomk", density=0.2), dict(method="powersgd", start_iter=1)])
def test_checkpoint_resume_mid_run(kw):
    ref = threaded_run(3, kw, 4, "sync")
    resumed = threaded_run(3, kw, 4, "async", checkpoint_at=2)
    _same_runs(ref, resumed)


@pytest.mark.parametrize("nonfinite", ["raise", "skip", "propagate"])
def test_nonfinite_policies(nonfinite):
    # a NaN in rank 1's second call of step 1: "raise" fails that call on
    # every rank and (asynchronously) the step's last call with it, the
    # next step runs; "skip" and "propagate" complete every call
    kw = dict(method="gtopk", density=0.1, nonfinite=nonfinite)
    sync = threaded_run(3, kw, 3, "sync", bad=(1, 1))
    asyn = threaded_run(3, kw, 3, "async", bad=(1, 1))
    _same_runs(sync, asyn)
    kinds = [o[0] for o in asyn[0][0]]
    if nonfinite == "raise":
        assert kinds[3:6] == ["ok", "error", "skipped-by-scope"]
        assert kinds[6:] == ["ok"] * 3
    else:
        assert kinds == ["ok"] * 9


def test_reduce_waits_for_the_calls_submitted_before_it():
    P = 3

    def rank_fn(group, r, mixed):
        red = gp.GradientReducer(method="gtopk", density=0.1, transport=group.transports[r])
        out = []
        for t in range(2):
            parts = grads(r, t)
            if mixed:
                futs = [red.reduce_async(parts[0], advance_step=False),
                        red.reduce_async(parts[1], advance_step=False)]
                last = red.reduce(parts[2])  # runs after the two, on this thread
                got = [f.wait() for f in futs] + [last]
            else:
                got = [red.reduce(p, advance_step=j == 2) for j, p in enumerate(parts)]
            out.append([{n: u.clone() for n, u in g.items()} for g in got])
        sd = red.state_dict()
        red.close()
        return out, sd

    with ThreadGroup(P) as g1, ThreadGroup(P) as g2:
        ref = g1.map(lambda r: rank_fn(g1, r, False))
        mixed = g2.map(lambda r: rank_fn(g2, r, True))
    _equal_state(mixed, ref)


def test_a_dead_rank_fails_every_survivor_future_and_leaves_no_thread():
    P = 3
    group = ThreadGroup(P, timeout=1.0)
    reds = [gp.GradientReducer(method="gtopk", density=0.1, transport=group.transports[r]) for r in range(P)]
    futs = {}
    for r in range(P):
        futs[r] = [reds[r].reduce_async(g, advance_step=j == 2) for j, g in enumerate(grads(r, 0))]
        if r < P - 1:  # rank 2 dies after step 0
            futs[r] += [reds[r].reduce_async(g, advance_step=j == 2) for j, g in enumerate(grads(r, 1))]
    for r in range(P):
        assert all(isinstance(f.wait(), dict) for f in futs[r][:3])
    for r in range(P - 1):
        with pytest.raises(RuntimeError, match="did not arrive|failed"):
            futs[r][3].wait()
        for f in futs[r][4:]:
            with pytest.raises(EarlierFailure):
                f.wait()
    for red in reds:
        assert red.close(timeout=10)
    assert not [t for t in threading.enumerate() if t.name.startswith("gtopk-comm")]
