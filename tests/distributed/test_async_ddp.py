"""The DDP hook with its reductions on the communication worker
(``SparseState(overlap=True)``) against the synchronous hook
(``overlap=False``, the reference) on real gloo groups (P = 3): parameters after
every step and each step's bytes bit for bit, per bucket and fused, with
clipping, unused parameters and a checkpoint resume mid-run; a rank killed
with a bucket in flight makes every survivor's backward raise, and no
thread is left behind.  One spawn per world size runs every case."""
import pytest
import torch

from async_workers import ddp_cases, ddp_fault
from dist_utils import run_workers

BASE = dict(method="gtopk", density=0.1)
CASES = [  # (name, SparseState kwargs without overlap, run options)
    ("per bucket", dict(BASE, coalesce_buckets=False), {}),
    ("fused", dict(BASE, coalesce_buckets=2000), {}),
    ("coalesced", dict(BASE, coalesce_buckets=True), {}),
    ("topk clipped", dict(method="topk", density=0.1, clip_norm=0.5, coalesce_buckets=False), {}),
    ("unused", dict(BASE, coalesce_buckets=False), {"unused": True}),
    ("resume", dict(BASE, coalesce_buckets=False, momentum_correction=0.9), {"checkpoint_at": 2}),
]


def _cases():
    out = []
    for name, kw, opts in CASES:
        out.append((f"{name} sync", dict(kw, overlap=False), opts))
        out.append((f"{name} async", dict(kw, overlap=True), opts))
    return out


@pytest.fixture(scope="module")
def reports():
    return run_workers(3, ddp_cases, _cases(), timeout=240)


def test_async_hook_equals_sync_hook(reports):
    for rank, rep in enumerate(reports):
        for name, _, _ in CASES:
            s, a = rep[f"{name} sync"], rep[f"{name} async"]
            for t, (ps, pa) in enumerate(zip(s["params"], a["params"])):
                assert all(torch.equal(x, y) for x, y in zip(ps, pa)), f"{name}: rank {rank} step {t}"
            assert a["traffic"] == s["traffic"], name
            assert a["step"] == s["step"] == 4, name
            assert a["threads_gone"], f"{name}: a worker thread outlived close()"


def test_parameters_equal_on_every_rank(reports):
    for name, _, _ in CASES:
        first = reports[0][f"{name} async"]["params"][-1]
        for rep in reports[1:]:
            assert all(torch.equal(x, y) for x, y in zip(first, rep[f"{name} async"]["params"][-1])), name


def test_a_killed_rank_makes_every_survivor_raise():
    # (a killed rank under the synchronous reduction: tests/distributed/test_faults.py)
    res = run_workers(3, ddp_fault, True, timeout=120, raise_errors=False)
    assert res[2][0] != "ok"  # the killed rank
    for kind, rep in res[:2]:
        assert kind == "ok", rep
        assert rep["error"] is not None and rep["step"] == 2, rep
        assert rep["seconds"] < 60, rep  # one transport timeout (3 s), not a hang
        assert rep["closed"] and rep["threads_gone"], rep
