"""P workers in one process: a :class:`Transport` whose ranks are threads.

``ThreadGroup(P)`` holds P endpoints (``group.transports[r]``); each rank's
``GradientReducer(transport=group.transports[r], ...)`` runs on its own
thread (``group.map(fn)`` calls ``fn(rank)`` on P threads and returns the
results in rank order).  The reducers run unchanged, so a simulation of a
codec is the real algorithm (:class:`gtopk_plugin.testing.Oracle` does
not model codecs).

Exactness against gloo (tests/distributed/test_threads_vs_gloo.py):
point-to-point messages are copied bytes; max and integer sums are exact;
a float sum follows gloo's CPU ring order (:func:`gloo_ring_sum`: 2P
segments of ⌈bytes/2P⌉ bytes, segment j owned by rank j // 2, the sum for
owner o being ``x[o] + (x[o+1] + (… + x[o−1]))``, indices mod P), valid
below gloo's maximum segment size.

A rank that raises aborts the group (unusable after), so the others stop
at their next collective; every wait is bounded by ``timeout``.  Each
endpoint is used by one thread at a time (:class:`~.transport.UseGuard`).
"""
from __future__ import annotations

import pickle
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, List, Optional, Sequence

import torch

from gtopk_plugin.collectives.transport import Transport

Tensor = torch.Tensor


def gloo_ring_sum(xs: Sequence[Tensor]) -> Tensor:
    """The elementwise sum of ``xs`` (one flat tensor per rank) in the order
    of gloo's ring allreduce (module docstring): segment ``j`` of ``2P``
    belongs to rank ``o = j // 2``; start from ``x[o−1]`` and add
    ``x[o−2]``, …, ``x[o]`` in turn (IEEE addition is commutative, so
    ``a + b`` and ``b + a`` give the same bits; only the grouping matters)."""
    P = len(xs)
    if P == 1:
        return xs[0].clone()
    n, es = xs[0].numel(), xs[0].element_size()
    nseg = 2 * P
    seg = -(-(-(-n * es // nseg)) // es)  # ⌈⌈bytes / nseg⌉ / es⌉ elements
    out = torch.empty_like(xs[0])
    for j in range(nseg):
        lo, hi = j * seg, min(n, (j + 1) * seg)
        if lo >= hi:
            break
        o = j // 2
        acc = xs[(o - 1) % P][lo:hi].clone()
        for t in range(2, P + 1):
            acc = xs[(o - t) % P][lo:hi] + acc
        out[lo:hi] = acc
    return out


class ThreadGroup:
    """``world_size`` in-process ranks: mailboxes, a barrier, and a thread
    pool with one thread per rank.  ``timeout``: seconds any single wait may
    take before the waiting rank raises."""

    def __init__(self, world_size: int, timeout: float = 120.0):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1; got {world_size!r}")
        self.size = int(world_size)
        self.timeout = float(timeout)
        P = self.size
        self._boxes = {(s, d): queue.Queue() for s in range(P) for d in range(P) if s != d}
        self._barrier = threading.Barrier(P, timeout=self.timeout)
        self._slots: List[object] = [None] * P
        self.transports = [ThreadTransport(self, r) for r in range(P)]
        self._pool: Optional[ThreadPoolExecutor] = None
        self._lock = threading.Lock()
        self._error: Optional[BaseException] = None

    def map(self, fn: Callable[[int], object]) -> list:
        """``[fn(0), …, fn(P−1)]``, each call on its own thread, all at once
        (collectives inside ``fn`` meet).  The first exception raised (in
        time: the root cause) is re-raised after every rank has stopped."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self.size, thread_name_prefix="gtopk-rank")
        self._error = None
        futs = [self._pool.submit(self._guard, fn, r) for r in range(self.size)]
        results = [f.result() if f.exception() is None else None for f in futs]
        if self._error is not None:
            raise self._error  # the root cause, not the others' aborted waits
        return results

    def _guard(self, fn, rank):
        try:
            return fn(rank)
        except BaseException as e:
            with self._lock:
                if self._error is None:
                    self._error = e
            self._barrier.abort()  # the other ranks leave their collectives
            raise

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- shared by the endpoints -------------------------------------------
    def _wait(self, rank: int, what: str) -> None:
        try:
            self._barrier.wait()
        except threading.BrokenBarrierError:
            raise RuntimeError(f"gtopk_plugin: {what} on thread rank {rank} failed: another rank "
                               f"raised, or one did not arrive within {self.timeout:g} s") from None

    def _collective(self, rank: int, value, combine: Callable[[list], object], what: str):
        """Every rank deposits ``value``; every rank gets ``combine(values)``
        (rank order; the same deterministic computation on every rank)."""
        self._slots[rank] = value
        self._wait(rank, what)
        out = combine(list(self._slots))
        self._wait(rank, what)  # nobody overwrites a slot before all have read
        return out


class ThreadTransport(Transport):
    """One rank of a :class:`ThreadGroup` (build the group, not this).

    ``transport_cpu_s``: this rank's thread CPU seconds spent inside the
    primitives (copies, the emulated sums), so that a benchmark can tell
    the compressor's own work from the stand-in for the network."""

    def __init__(self, group: ThreadGroup, rank: int):
        super().__init__()
        self._group = group
        self._rank = rank
        self.transport_cpu_s = 0.0

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._group.size

    def _send(self, peer, send):
        self._group._boxes[(self._rank, peer)].put(send.detach().reshape(-1).clone())

    def _recv(self, peer, recv):
        try:
            msg = self._group._boxes[(peer, self._rank)].get(timeout=self._group.timeout)
        except queue.Empty:
            raise RuntimeError(f"gtopk_plugin: rank {self._rank} received nothing from rank {peer} "
                               f"within {self._group.timeout:g} s") from None
        if msg.numel() != recv.numel() or msg.dtype != recv.dtype:
            raise RuntimeError(f"gtopk_plugin: rank {self._rank} expected {recv.numel()} x {recv.dtype} "
                               f"from rank {peer}, got {msg.numel()} x {msg.dtype}")
        recv.view(-1).copy_(msg)

    def _timed(self, fn, *args):
        t0 = time.thread_time()
        try:
            return fn(*args)
        finally:
            self.transport_cpu_s += time.thread_time() - t0

    def _raw_send(self, peer, send):
        self._timed(self._send, peer, send)

    def _raw_recv(self, peer, recv):
        self._timed(self._recv, peer, recv)

    def _raw_sendrecv(self, dst, send, src, recv):
        self._raw_send(dst, send)  # mailboxes never block a sender
        self._raw_recv(src, recv)

    def _raw_allreduce_sum_(self, t):
        self._timed(self._allreduce_sum_, t)

    def _raw_allreduce_max_(self, t):
        self._timed(self._allreduce_max_, t)

    def _raw_allgather_object(self, obj):
        return self._timed(self._allgather_object, obj)

    def _allreduce_sum_(self, t):
        flat = t.detach().reshape(-1).clone()
        exact = not (flat.is_floating_point() or flat.is_complex())
        total = self._group._collective(
            self._rank, flat,
            (lambda xs: torch.stack(xs).sum(0)) if exact else gloo_ring_sum, "allreduce")
        t.copy_(total.view_as(t))

    def _allreduce_max_(self, t):
        total = self._group._collective(self._rank, t.detach().reshape(-1).clone(),
                                        lambda xs: torch.stack(xs).amax(0), "allreduce (max)")
        t.copy_(total.view_as(t))

    def _allgather_object(self, obj):
        blob = pickle.dumps(obj)  # a copy per rank, as a real allgather gives
        return [pickle.loads(b) for b in self._group._collective(self._rank, blob, lambda xs: xs,
                                                                   "allgather_object")]
