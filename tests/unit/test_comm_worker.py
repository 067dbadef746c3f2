"""The communication worker alone (gtopk_plugin/pipeline/comm_worker.py):
order, results and errors through futures, the failure scope, shutdown
without leaked threads, and -- with in-process ranks (ThreadGroup) -- the
same collectives in the same order on every rank, a dead rank making every
survivor's future raise.  Also: the compiled CPU kernels let other threads
run while they compute (they are called with the GIL released)."""
import gc
import subprocess
import sys
import threading

import pytest
import torch

from gtopk_plugin.collectives.threads import ThreadGroup
from gtopk_plugin.pipeline.comm_worker import CommWorker, EarlierFailure, WorkerClosed, wait_for


def _threads(name):
    return [t for t in threading.enumerate() if t.name == name]


def test_jobs_run_in_submission_order_on_one_thread():
    w = CommWorker("gtopk-test-order")
    seen = []

    def job(i):
        seen.append((i, threading.current_thread().name))
        return i * i

    futs = [w.submit(job, i) for i in range(50)]
    assert [f.wait() for f in futs] == [i * i for i in range(50)]
    assert [i for i, _ in seen] == list(range(50))
    assert {n for _, n in seen} == {"gtopk-test-order"}
    assert w.close(timeout=10)
    assert not _threads("gtopk-test-order")


def test_an_error_reaches_its_future_and_fails_the_rest_of_the_scope():
    w = CommWorker("gtopk-test-errors")
    ran = []

    def ok(i):
        ran.append(i)
        return i

    def bad():
        raise ValueError("the bucket's input was bad")

    futs = [w.submit(ok, 0, fresh=True), w.submit(bad), w.submit(ok, 2), w.submit(ok, 3),
            w.submit(ok, 4, fresh=True), w.submit(ok, 5)]
    assert futs[0].wait() == 0
    with pytest.raises(ValueError, match="input was bad"):
        futs[1].wait()
    for f in futs[2:4]:  # behind the failure, same scope: never run
        with pytest.raises(EarlierFailure) as ei:
            f.wait()
        assert isinstance(ei.value.__cause__, ValueError)
    assert [futs[4].wait(), futs[5].wait()] == [4, 5]  # a fresh job starts a new scope
    assert ran == [0, 4, 5]
    assert w.close(timeout=10)


def test_close_runs_what_was_submitted_then_refuses_more():
    w = CommWorker("gtopk-test-close")
    futs = [w.submit(lambda i=i: i) for i in range(5)]
    assert w.close(timeout=10)
    assert [f.wait() for f in futs] == list(range(5))
    with pytest.raises(WorkerClosed):
        w.submit(lambda: 0)
    assert w.close(timeout=1)  # idempotent
    assert not _threads("gtopk-test-close")


def test_close_with_cancel_fails_the_queued_jobs_and_no_future_stays_pending():
    w = CommWorker("gtopk-test-cancel")
    gate = threading.Event()
    running = threading.Event()

    def blocked():
        running.set()
        gate.wait(30)
        return "first"

    first = w.submit(blocked)
    rest = [w.submit(lambda: "never") for _ in range(3)]
    assert running.wait(30)
    assert not w.close(cancel=True, timeout=0.01)  # the running job is not interrupted
    gate.set()
    assert first.wait() == "first"
    for f in rest:
        with pytest.raises(WorkerClosed):
            f.wait()
    assert w.close(timeout=10)
    assert not _threads("gtopk-test-cancel")


def test_a_dropped_worker_ends_its_thread():
    w = CommWorker("gtopk-test-dropped")
    fut = w.submit(lambda: 7)
    t = _threads("gtopk-test-dropped")[0]
    del w
    gc.collect()
    t.join(10)
    assert not t.is_alive()
    assert fut.wait() == 7


def test_dropping_a_worker_whose_job_is_stuck_does_not_block_the_collector():
    # what runs when a worker is collected also runs at interpreter exit: it
    # must stop the thread without waiting for a job stuck on a dead peer
    gate = threading.Event()
    w = CommWorker("gtopk-test-stuck-drop")
    w.submit(gate.wait)
    t = _threads("gtopk-test-stuck-drop")[0]
    dropped = threading.Event()
    box = [w]
    del w

    def drop():
        box.clear()
        gc.collect()
        dropped.set()

    threading.Thread(target=drop, daemon=True).start()
    try:
        assert dropped.wait(10), "collecting the worker waited for its stuck job"
    finally:
        gate.set()
    t.join(10)
    assert not t.is_alive()


def test_wait_for_bounds_the_wait_and_drain_waits_for_everything():
    w = CommWorker("gtopk-test-wait")
    gate = threading.Event()
    fut = w.submit(gate.wait, 30)
    with pytest.raises(TimeoutError, match="did not finish"):
        wait_for(fut, 0.05, what="the stuck job")
    after = w.submit(lambda: "after")
    gate.set()
    w.drain(timeout=30)
    assert fut.done() and after.done() and after.wait() == "after"
    assert wait_for(after, 1.0) == "after"
    assert w.close(timeout=10)


def test_interpreter_exit_does_not_wait_for_a_stuck_job():
    # a job stuck forever (a collective on a dead peer) and more queued
    # behind it: the process still exits, and cleanly
    code = ("import threading, torch\n"
            "from gtopk_plugin.pipeline.comm_worker import CommWorker\n"
            "w = CommWorker('stuck')\n"
            "w.submit(threading.Event().wait)\n"
            "futs = [w.submit(lambda: 1) for _ in range(3)]\n"
            "print('submitted', flush=True)\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "submitted" in p.stdout


def _rank_jobs(group, r, steps, die_at=None):
    """Rank ``r``: per step, 3 jobs on its worker (the first fresh), each an
    allreduce of the rank's values; rank ``die_at[0]`` stops submitting at
    step ``die_at[1]`` (a killed process)."""
    w = CommWorker(f"gtopk-test-rank{r}")
    tr = group.transports[r]
    futs = []

    def job(step, j):
        t = torch.tensor([float(r + 1) * (10 * step + j)], dtype=torch.float64)
        tr.allreduce_sum_(t)
        return float(t)

    for step in range(steps):
        if die_at is not None and (r, step) == die_at:
            break
        for j in range(3):
            futs.append(w.submit(job, step, j, fresh=j == 0))
    return w, futs


def test_ranks_issue_the_same_collectives_in_the_same_order():
    P, steps = 3, 4
    g = ThreadGroup(P, timeout=60)
    work = [_rank_jobs(g, r, steps) for r in range(P)]
    scale = sum(r + 1 for r in range(P))
    for w, futs in work:
        assert [f.wait() for f in futs] == [scale * (10 * s + j) for s in range(steps) for j in range(3)]
        assert w.close(timeout=10)


def test_a_dead_rank_makes_every_survivor_future_raise():
    # rank 2 dies before its step 1: the survivors' first job of step 1
    # raises within the group's timeout, the two behind it at once (never
    # run: one timeout per fault, not one per queued job); step 0 was fine
    P = 3
    g = ThreadGroup(P, timeout=1.0)
    work = [_rank_jobs(g, r, 2, die_at=(2, 1)) for r in range(P)]
    for r, (w, futs) in enumerate(work):
        assert [f.wait() for f in futs[:3]] == [6.0 * j for j in range(3)]
        if r == 2:
            assert len(futs) == 3
        else:
            with pytest.raises(RuntimeError, match="did not arrive"):
                futs[3].wait()
            for f in futs[4:]:
                with pytest.raises(EarlierFailure):
                    f.wait()
        assert w.close(timeout=10)
    assert not [t for t in threading.enumerate() if t.name.startswith("gtopk-test-rank")]


def test_compiled_cpu_kernels_release_the_gil():
    # While a kernel runs on another thread, this thread runs Python: with
    # switching between threads that hold the GIL practically off, the only
    # way in is the kernel releasing it.  The kernel's thread signals just
    # before the call and just after; this thread must get in between.
    from gtopk_plugin.kernels import cpu

    if cpu.load() is None:
        pytest.skip("the CPU kernels are not compiled here")
    x = torch.randn(4_000_000)
    off, k = torch.tensor([0, x.numel()]), torch.tensor([x.numel() // 100])
    op = cpu._ext.select_topk  # the operator itself: no tensor method around it releases the GIL
    state = {"before": threading.Event(), "after": False, "seen_after": None}

    def kernel():
        for _ in range(20):
            state["before"].set()
            op(x, off, k)
            if state["seen_after"] is not None:
                break
        state["after"] = True

    old = sys.getswitchinterval()
    sys.setswitchinterval(100.0)
    try:
        t = threading.Thread(target=kernel)
        t.start()
        state["before"].wait(60)
        state["seen_after"] = state["after"]  # read here, while the kernel holds no GIL
        t.join(60)
    finally:
        sys.setswitchinterval(old)
    assert state["seen_after"] is False
