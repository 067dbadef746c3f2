"""Worker of tests/distributed/test_reducer_threads.py."""
import threading
import time

import torch

import gtopk_plugin as gp
from gtopk_plugin.collectives.transport import ConcurrentUseError


def two_threads_one_reducer(rank, world):
    """Rank 0 calls reduce() on thread A; while A waits inside for rank 1
    (which comes late), thread B calls reduce() on the same reducer and must
    get ConcurrentUseError at once.  Then A's call completes normally, and
    one more step from thread B alone (sequential use) works."""
    red = gp.GradientReducer(method="gtopk", density=0.1, transport=gp.TorchDistributedTransport(timeout=30))
    g = {"w": torch.arange(100, dtype=torch.float32) * (rank + 1)}
    if rank == 1:
        time.sleep(3.0)  # rank 0's first call waits for this one meanwhile
        red.reduce(g)
        red.reduce(g)
        return None
    out = {}

    def first():
        out["a"] = red.reduce(g)

    ta = threading.Thread(target=first, name="thread-A")
    ta.start()
    guard = red.transport._use_guard()
    while guard.holder is None:  # A is inside reduce()
        time.sleep(0.01)
    try:
        red.reduce(g)
        second = None
    except ConcurrentUseError as e:
        second = str(e)
    ta.join(timeout=60)
    tb = threading.Thread(target=lambda: out.setdefault("b", red.reduce(g)), name="thread-B")
    tb.start()
    tb.join(timeout=60)
    return {"second": second, "a_ok": "a" in out, "b_ok": "b" in out, "step": red.step}
