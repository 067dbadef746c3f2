"""The transports' thread-safety guard, in one process: a second thread
calling into a transport (or a block held with ``exclusive``) gets a
ConcurrentUseError at once, the first thread's call is untouched, the
holding thread may re-enter, and use from different threads one after the
other is allowed.  Threads wait on events, never on sleeps; every test has
a timeout."""
import pickle
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import gtopk_plugin as gp
from gtopk_plugin.collectives.threads import ThreadGroup
from gtopk_plugin.collectives.transport import ConcurrentUseError, UseGuard

pytestmark = pytest.mark.timeout(60)


def _raises_concurrent(fn):
    with pytest.raises(ConcurrentUseError, match="not thread-safe") as info:
        fn()
    return str(info.value)


def test_guard_is_reentrant_and_refuses_a_second_thread_while_held():
    g = UseGuard("thing")
    with g("outer()"):
        with g("inner()"):  # the same thread: nested calls are fine
            with ThreadPoolExecutor(1, thread_name_prefix="second") as pool:
                msg = pool.submit(_raises_concurrent, lambda: g.enter("x()")).result(30)
        assert g.holder == threading.current_thread().name
    assert "thing" in msg and "x()" in msg and "outer()" in msg and repr(threading.current_thread().name) in msg
    assert g.holder is None
    # released: another thread may now enter, one after the other
    with ThreadPoolExecutor(1) as pool:
        pool.submit(lambda: g("later()").__enter__().exit()).result(30)
    with g("again()"):
        pass


def test_guard_is_released_when_the_block_raises():
    g = UseGuard("thing")
    with pytest.raises(KeyError):
        with g("fails()"):
            raise KeyError("x")
    with ThreadPoolExecutor(1) as pool:
        pool.submit(lambda: g("after()").__enter__().exit()).result(30)


class _Blocking(gp.SingleProcessTransport):
    """P = 1, but its allgather stops (inside the public primitive) until
    told to go on; ``phase`` is overridden to check that subclasses'
    overrides of public primitives are guarded too."""

    def __init__(self):
        super().__init__()
        self.inside, self.go = threading.Event(), threading.Event()

    def _raw_allgather_object(self, obj):
        self.inside.set()
        assert self.go.wait(30)
        return [obj]

    def phase(self, *args, **kwargs):
        return "overridden"


def test_a_second_thread_calling_a_busy_transport_raises_and_the_first_call_is_intact():
    t = _Blocking()
    with ThreadPoolExecutor(1, thread_name_prefix="first") as pool:
        fut = pool.submit(t.allgather_object, {"a": 1})
        assert t.inside.wait(30)
        for call in (lambda: t.allgather_object(2), lambda: t.allreduce_sum_(torch.ones(2)),
                     lambda: t.control_allreduce_max(torch.ones(2, dtype=torch.int64)),
                     lambda: t.phase(None, None, None, None, "cpu", False),
                     lambda: t.allgather_blobs(torch.zeros(1, dtype=torch.uint8), [1])):
            msg = _raises_concurrent(call)
            assert "'first" in msg and "allgather_object()" in msg
        with pytest.raises(ConcurrentUseError):
            with t.exclusive("a whole step"):
                pass
        t.go.set()
        assert fut.result(30) == [{"a": 1}]
    # sequential use from other threads, and the override, still work
    assert t.phase(None, None, None, None, "cpu", False) == "overridden"
    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(t.allgather_object, 3).result(30) == [3]


def test_exclusive_holds_the_transport_over_several_calls():
    t = gp.SingleProcessTransport()
    with t.exclusive("GradientReducer.reduce()"):
        assert t.allgather_object("mine") == ["mine"]  # re-entrant on the holder
        with ThreadPoolExecutor(1) as pool:
            msg = pool.submit(_raises_concurrent, lambda: t.allreduce_sum_(torch.ones(3))).result(30)
        assert "GradientReducer.reduce()" in msg
    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(t.allgather_object, 1).result(30) == [1]


def test_a_transport_pickles_with_its_guard_dropped():
    t = gp.SingleProcessTransport()
    with t.exclusive("held while pickled"):
        copy = pickle.loads(pickle.dumps(t))
    # the copy has a guard of its own: usable from another thread at once
    with t.exclusive("held again"), ThreadPoolExecutor(1) as pool:
        assert pool.submit(copy.allgather_object, 5).result(30) == [5]


def test_thread_group_endpoints_refuse_a_second_thread_and_honour_the_timeout():
    with ThreadGroup(2, timeout=2.0) as group:
        t0, t1 = group.transports
        with ThreadPoolExecutor(1, thread_name_prefix="rank0") as pool:
            fut = pool.submit(t0.recv, 1, 4, "cpu")  # waits for rank 1's message
            for _ in range(10_000):  # until the worker is inside the receive
                if t0._use_guard().holder is not None:
                    break
                threading.Event().wait(0.01)
            _raises_concurrent(lambda: t0.allgather_object(0))
            t1.send(0, torch.arange(4, dtype=torch.uint8), with_header=False)
            assert fut.result(30).tolist() == [0, 1, 2, 3]
        # the error path's allgather waits no longer than the group's timeout
        with pytest.raises(RuntimeError, match="within 2 s"):
            t0.allgather_object("alone")
