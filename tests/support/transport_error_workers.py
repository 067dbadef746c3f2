"""Workers for tests/distributed/test_transport_errors.py: the transport's
timeout on every wait of the error path, two threads on one transport or
one process group, and a rank outside a subgroup -- on real gloo groups.

Ranks coordinate through the job's store (``dist.distributed_c10d``'s
default store), never through sleeps: a rank that must stay away from a
collective waits for a key the others set once they are done."""
import datetime
import threading
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _get_default_store

import gtopk_plugin as gp
from gtopk_plugin.pipeline import input_check as consistency
from gtopk_plugin.collectives.transport import ConcurrentUseError

_LONG = datetime.timedelta(seconds=110)  # a bound on store waits; the tests' own timeouts are shorter


def _outcome(fn):
    """``("ok", value)`` or ``("error", type name, message, names of its classes)``."""
    try:
        return ("ok", fn())
    except Exception as e:  # noqa: BLE001 - the test looks at it
        return ("error", type(e).__name__, str(e), [c.__name__ for c in type(e).__mro__])


# -- group 5: every wait of the error path is bounded by the transport's timeout
PRIMITIVES = ("control_max_dissemination", "control_max_allreduce", "allgather_object", "allreduce_sum",
              "exchange")


def _call(t: gp.TorchDistributedTransport, case: str, rank: int):
    if case == "control_max_dissemination":
        return t.control_allreduce_max(torch.tensor([rank, -rank], dtype=torch.int64)).tolist()
    if case == "control_max_allreduce":
        t.max_by_dissemination = False  # the engine's allreduce, the other path of the check
        return t.control_allreduce_max(torch.tensor([rank, -rank], dtype=torch.int64)).tolist()
    if case == "allgather_object":
        return t.allgather_object({"rank": rank, "why": "details"})
    if case == "allreduce_sum":
        return t.allreduce_sum_(torch.full((4,), float(rank + 1))).tolist()
    if case == "exchange":
        return t.exchange(1 - rank, torch.full((8,), rank, dtype=torch.uint8), 8).tolist()
    raise ValueError(case)


def stalled_peer_primitives(rank, world, stall_timeout, timeout):
    """P = 2: rank 1 stays away from every collective until rank 0 is done;
    rank 0 calls each primitive once with ``stall_timeout``, each on a group
    of its own (a gloo group whose collective timed out still has it
    queued).  Rank 0 returns the outcome per primitive; then, as a control,
    both ranks run every primitive together on fresh groups (``timeout``)
    and return the results."""
    assert world == 2
    stalled = {c: dist.new_group() for c in PRIMITIVES}  # collective: every rank makes every group
    fresh = {c: dist.new_group() for c in PRIMITIVES}
    store = _get_default_store()
    out = {}
    if rank == 0:
        for case in PRIMITIVES:
            t = gp.TorchDistributedTransport(stalled[case], timeout=stall_timeout)
            out[case] = _outcome(lambda: _call(t, case, rank))
        store.set("rank0-done", "1")
    else:
        store.wait(["rank0-done"], _LONG)
    out["together"] = {c: _call(gp.TorchDistributedTransport(fresh[c], timeout=timeout), c, rank)
                       for c in PRIMITIVES}
    return out


class _SlowDetails(gp.TorchDistributedTransport):
    """A rank that announced its failure through the control collective and
    then stalls before the details' allgather (a slow or stuck rank): it
    enters the allgather only once every other rank has given up on it."""

    def __init__(self, group, timeout, others):
        super().__init__(group, timeout=timeout)
        self.others = others

    def allgather_object(self, obj):
        _get_default_store().wait([f"gave-up-{r}" for r in self.others], _LONG)
        return super().allgather_object(obj)


def announced_failure(rank, world, failing, timeout):
    """Two rounds of the consistency check in which rank ``failing`` fails
    locally before any exchange and announces it (``bad_input``):

    - ``prompt``: every rank takes part; the peers must raise the failing
      rank's own error (``PeerInputError`` naming it and its message);
    - ``stalled``: the failing rank stalls between the control collective
      and the details' allgather; the peers must raise within the
      transport's timeout (the process group's is far longer).
    """
    layout = [("w", (4,), "torch.float32"), ("settings", "gtopk", 0.1)]
    why = f"rank {failing}: out= has the wrong shape (3,) for 'w' (4,)"
    bad = why if rank == failing else None
    g1, g2 = dist.new_group(), dist.new_group()
    out = {"prompt": _outcome(lambda: consistency.check(
        gp.TorchDistributedTransport(g1, timeout=timeout), layout, bad, []))}
    others = [r for r in range(world) if r != failing]
    t = (_SlowDetails(g2, timeout, others) if rank == failing
         else gp.TorchDistributedTransport(g2, timeout=timeout))
    out["stalled"] = _outcome(lambda: consistency.check(t, layout, bad, []))
    if rank != failing:
        _get_default_store().set(f"gave-up-{rank}", "1")
    return out


# -- group 6: two threads on one transport or one process group
class _Held(gp.TorchDistributedTransport):
    """Stops inside its allreduce (before the engine is called) until told
    to go on: the deterministic stand-in for a thread that is inside a
    collective when another thread calls in."""

    def __init__(self, group, timeout):
        super().__init__(group, timeout=timeout)
        self.inside, self.go = threading.Event(), threading.Event()

    def _raw_allreduce_sum_(self, t):
        self.inside.set()
        if not self.go.wait(100):
            raise RuntimeError("test: never told to go on")
        super()._raw_allreduce_sum_(t)


def _second_thread_calls(t, rank):
    """Every public primitive, each expected to raise ConcurrentUseError."""
    calls = {
        "allreduce_sum_": lambda: t.allreduce_sum_(torch.ones(3)),
        "control_allreduce_max": lambda: t.control_allreduce_max(torch.tensor([rank], dtype=torch.int64)),
        "allgather_object": lambda: t.allgather_object(rank),
        "exchange": lambda: t.exchange(1 - rank, torch.zeros(2, dtype=torch.uint8), 2),
        "allgather_blobs": lambda: t.allgather_blobs(torch.zeros(2, dtype=torch.uint8), [2, 2]),
        "phase": lambda: t.phase(1 - rank, torch.zeros(2, dtype=torch.uint8), 1 - rank, 2, "cpu", False),
    }
    return {name: _outcome(fn) for name, fn in calls.items()}


def two_threads(rank, world, timeout):
    """P = 2.  A worker thread is inside an allreduce of one transport; the
    main thread then calls (a) the same transport, (b) another transport on
    the same group -- both must raise ConcurrentUseError at once, sending
    nothing -- and (c) a transport on another group, which must work.  The
    worker's allreduce then completes with the right sum, and the transport
    keeps working when used from other threads one after the other."""
    assert world == 2
    g1, g2 = dist.new_group(), dist.new_group()
    held = _Held(g1, timeout)
    other_on_g1 = gp.TorchDistributedTransport(g1, timeout=timeout)
    on_g2 = gp.TorchDistributedTransport(g2, timeout=timeout)
    x = torch.full((5,), float(rank + 1))
    with ThreadPoolExecutor(1, thread_name_prefix="reducer-a") as pool:
        fut = pool.submit(held.allreduce_sum_, x)
        if not held.inside.wait(100):
            raise RuntimeError("test: the worker never entered the allreduce")
        out = {"same": _second_thread_calls(held, rank),
               "same_group": _second_thread_calls(other_on_g1, rank),
               "other_group": _outcome(lambda: on_g2.allreduce_sum_(torch.full((3,), 10.0 * (rank + 1))).tolist())}
        held.go.set()
        out["first"] = fut.result(timeout=100).tolist()
        # one after the other, from a pool thread and from the main thread
        out["sequential"] = [
            pool.submit(held.control_allreduce_max, torch.tensor([rank, 7 - rank])).result(100).tolist(),
            other_on_g1.allgather_object(("from", rank)),
            pool.submit(other_on_g1.allreduce_sum_, torch.full((2,), float(rank))).result(100).tolist(),
        ]
    return out


def two_reducers_one_group(rank, world, timeout):
    """P = 2: two reducers on transports of one group; a worker thread's
    reduce() is held inside the exchange while the main thread calls the
    other reducer: ConcurrentUseError on the main thread, the worker's
    reduce completes (oracle: the dense sum of both ranks' gradients)."""
    g = dist.new_group()
    held = _Held(g, timeout)
    a = gp.GradientReducer(method="dense", transport=held, op="sum")
    b = gp.GradientReducer(method="dense", transport=gp.TorchDistributedTransport(g, timeout=timeout), op="sum")
    grads = {"w": torch.arange(6, dtype=torch.float32) * (rank + 1)}
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(a.reduce, grads)
        if not held.inside.wait(100):
            raise RuntimeError("test: the worker never entered the exchange")
        out = {"second": _outcome(lambda: b.reduce({"w": torch.ones(6)}))}
        held.go.set()
        out["first"] = fut.result(timeout=100)["w"].tolist()
    out["after"] = b.reduce({"w": torch.full((6,), float(rank))})["w"].tolist()
    return out


# -- group 7: a rank outside a subgroup
def non_member(rank, world, timeout):
    """P = 3, a subgroup of ranks 0 and 1: rank 2 building a transport (or a
    reducer) on it gets a clear error; the members reduce as usual."""
    g = dist.new_group([0, 1])
    grads = {"w": torch.arange(8, dtype=torch.float32) + 10 * rank}
    if rank == 2:
        return {"transport": _outcome(lambda: gp.TorchDistributedTransport(g, timeout=timeout)),
                "reducer": _outcome(lambda: gp.GradientReducer(
                    method="topk", density=0.25, transport=gp.TorchDistributedTransport(g, timeout=timeout))),
                "onebit": _outcome(lambda: gp.GradientReducer(
                    method="onebit", transport=gp.TorchDistributedTransport(g, timeout=timeout)))}
    red = gp.GradientReducer(method="dense", op="sum", transport=gp.TorchDistributedTransport(g, timeout=timeout))
    t = red.transport
    return {"rank": t.rank, "size": t.size, "sum": red.reduce(grads)["w"].tolist()}
