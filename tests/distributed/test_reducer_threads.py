"""One GradientReducer used from two threads at once: the second thread gets
a clear ConcurrentUseError at once (the process lives, the first thread's
step completes); using it from different threads one after the other works."""
import pytest

from dist_utils import run_workers
from reducer_thread_workers import two_threads_one_reducer

pytestmark = pytest.mark.distributed


def test_a_second_thread_inside_one_reducer_gets_a_clear_error():
    r0, _ = run_workers(2, two_threads_one_reducer, timeout=120)
    assert r0["second"] is not None and "not thread-safe" in r0["second"]
    assert "GradientReducer.reduce()" in r0["second"]
    assert r0["a_ok"] and r0["b_ok"] and r0["step"] == 2
