"""The Transport protocol: the only way collectives talk to other workers.

Collectives are framework-neutral (docs/design.md §1): each framework
layer implements the ``_raw_*`` primitives, and this base class adds the
exact byte / message / round accounting: ``payload`` bytes (index/value
messages), ``header`` bytes (size headers, only where the receiver cannot
know a size), ``control`` bytes (the per-call consistency check and
error-path metadata, apart so payload figures match docs/design.md §2),
and a dense allreduce counted with the ring model 2·(P−1)/P·nbytes.

Threads: a Transport is not thread-safe; every public primitive holds its
:class:`UseGuard`, so a concurrent second thread gets
:class:`ConcurrentUseError` before anything is sent; sequential use from
different threads is fine; :meth:`Transport.exclusive` holds the guard
over a sequence of calls.  Timeouts: every wait, the error path's
:meth:`Transport.allgather_object` included, is bounded by the
transport's timeout (docs/design.md §7).
"""
from __future__ import annotations

import abc
import functools
import pickle
import threading
import time
from dataclasses import dataclass, fields
from typing import List, Optional

import torch

Tensor = torch.Tensor
_HEADER = 8  # one int64 byte count


@dataclass
class TrafficCounters:
    payload_bytes_sent: int = 0
    payload_bytes_received: int = 0
    header_bytes_sent: int = 0
    header_bytes_received: int = 0
    control_bytes: int = 0
    messages_sent: int = 0

    def copy(self) -> "TrafficCounters":
        return TrafficCounters(**{f.name: getattr(self, f.name) for f in fields(self)})

    def minus(self, other: "TrafficCounters") -> "TrafficCounters":
        return TrafficCounters(**{f.name: getattr(self, f.name) - getattr(other, f.name)
                                  for f in fields(self)})


class ConcurrentUseError(RuntimeError):
    """A second thread called into a transport (or a reducer) while another
    thread was inside it.  Nothing was sent on the second thread's behalf;
    the first thread's call is unaffected."""


class UseGuard:
    """Detects concurrent use of an object that is not thread-safe.

    ``with guard(what): ...`` marks the calling thread as inside the object
    for the block; the same thread may enter again (nested calls), another
    thread entering meanwhile raises :class:`ConcurrentUseError` at once
    (it never waits: two threads taking turns on one group would still
    issue their collectives in a different order on different ranks).
    Entering from different threads one after the other is allowed.  Costs
    one uncontended lock acquire and release per block."""

    __slots__ = ("name", "_lock", "_depth", "_thread", "_what")

    def __init__(self, name: str):
        self.name = name
        self._lock = threading.RLock()
        self._depth = 0                     # written only by the holding thread
        self._thread: Optional[threading.Thread] = None  # the holder and its call, for the message
        self._what: Optional[str] = None

    def enter(self, what: str) -> None:
        if not self._lock.acquire(blocking=False):
            raise ConcurrentUseError(
                f"gtopk_plugin: {self.name} is not thread-safe: thread "
                f"{threading.current_thread().name!r} called {what} while thread {self.holder!r} is "
                f"inside {self._what}.  Use one reducer (and one transport / process group) per thread, "
                "or serialise the calls (one thread at a time, e.g. under a lock held across each whole "
                "step); collectives of one group must run in the same order on every rank.")
        if self._depth == 0:
            self._thread, self._what = threading.current_thread(), what
        self._depth += 1

    def exit(self) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._thread = self._what = None
        self._lock.release()

    def __call__(self, what: str) -> "_Held":
        return _Held(self, what)

    @property
    def holder(self) -> Optional[str]:
        """The name of the thread inside, or None (informational: it may
        change as soon as it is read)."""
        t = self._thread
        return None if t is None else t.name


class _Held:
    __slots__ = ("guard", "what")

    def __init__(self, guard: UseGuard, what: str):
        self.guard, self.what = guard, what

    def __enter__(self):
        self.guard.enter(self.what)
        return self.guard

    def __exit__(self, *exc):
        self.guard.exit()
        return False


# The public primitives: each holds the transport's guard while it runs
# (subclasses' overrides are wrapped too, by Transport.__init_subclass__).
_GUARDED = ("exchange", "send", "recv", "phase", "allgather_blobs", "allreduce_sum_",
            "control_allreduce_max", "allgather_object")


_MAKE_GUARD = threading.Lock()


def _guarded(fn):
    what = f"Transport.{fn.__name__}()"

    @functools.wraps(fn)
    def call(self, *args, **kwargs):
        guard = self._use_guard()
        guard.enter(what)
        try:
            return fn(self, *args, **kwargs)
        finally:
            guard.exit()

    call._gtopk_guarded = True
    return call


class Transport(abc.ABC):
    """Point-to-point and collective primitives over byte tensors.

    Subclasses implement ``rank``, ``size`` and the ``_raw_*`` methods; the
    public methods below count traffic and must be called identically (same
    order) on all ranks, like any collective.  Not thread-safe: a call from
    a second thread while one is in progress raises
    :class:`ConcurrentUseError` (module docstring).  The ``_raw_*``
    primitives must bound every wait by the transport's timeout.
    """

    #: seconds spent inside the engine's primitives (waiting on peers and
    #: the link), cumulative; GradientReducer reports a call's share as
    #: ``last_stats.seconds["wait"]``
    wait_seconds: float = 0.0

    #: run the consistency check's max over ranks as ceil(log2 P) pairwise
    #: rounds (:meth:`control_allreduce_max`): for engines with cheap
    #: point-to-point sends (torch.distributed); engines whose pairwise step
    #: is itself a collective (Horovod's alltoall) keep their allreduce
    max_by_dissemination: bool = False

    def __init__(self):
        self.counters = TrafficCounters()
        self._use: Optional[UseGuard] = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for name in _GUARDED:
            fn = cls.__dict__.get(name)
            if callable(fn) and not getattr(fn, "_gtopk_guarded", False):
                setattr(cls, name, _guarded(fn))

    # -- thread-safety guard ------------------------------------------------
    def _use_guard(self) -> UseGuard:
        """The guard the public primitives hold (one per transport; engines
        whose transports can share a group override this to share one)."""
        guard = self.__dict__.get("_use")
        if guard is None:  # made lazily: subclasses may skip __init__, unpickling drops it
            with _MAKE_GUARD:  # two threads' first calls must get the same guard
                guard = self.__dict__.get("_use")
                if guard is None:
                    guard = self._use = UseGuard(f"{type(self).__name__} (rank {self.rank})")
        return guard

    def exclusive(self, what: str) -> _Held:
        """``with transport.exclusive("GradientReducer.reduce()"): ...`` holds
        this transport for the calling thread over a whole sequence of
        primitives (one reduce(): its consistency check, exchange and error
        path): another thread calling in meanwhile -- directly, or through
        another transport on the same process group -- gets
        :class:`ConcurrentUseError`, and so does a thread entering this
        block while another is inside.  Re-entrant on the holding thread."""
        return _Held(self._use_guard(), what)

    def __getstate__(self):
        d = self.__dict__.copy()
        d["_use"] = None  # holds a lock; the copy makes its own guard
        return d

    def _wait_for(self, primitive, *args):
        """Runs one of the ``_raw_*`` primitives, timing it (wait_seconds)."""
        t0 = time.perf_counter()
        try:
            return primitive(*args)
        finally:
            self.wait_seconds += time.perf_counter() - t0

    # -- identity ---------------------------------------------------------
    @property
    @abc.abstractmethod
    def rank(self) -> int: ...

    @property
    @abc.abstractmethod
    def size(self) -> int: ...

    # -- primitives a framework layer provides ------------------------------
    @abc.abstractmethod
    def _raw_sendrecv(self, dst: int, send: Tensor, src: int, recv: Tensor) -> None:
        """Send ``send`` to ``dst`` while receiving ``recv`` from ``src``
        (concurrently: both sides of a pairwise exchange call this at once)."""

    @abc.abstractmethod
    def _raw_send(self, peer: int, send: Tensor) -> None: ...

    @abc.abstractmethod
    def _raw_recv(self, peer: int, recv: Tensor) -> None: ...

    @abc.abstractmethod
    def _raw_allreduce_sum_(self, t: Tensor) -> None: ...

    @abc.abstractmethod
    def _raw_allreduce_max_(self, t: Tensor) -> None: ...

    @abc.abstractmethod
    def _raw_allgather_object(self, obj) -> list: ...

    def comm_device(self, device: torch.device) -> torch.device:
        """Device on which tensors must be handed to the engine."""
        return torch.device(device)

    # -- counted operations -------------------------------------------------
    @_guarded
    def exchange(self, peer: int, send: Tensor, recv_nbytes: Optional[int] = None) -> Tensor:
        """Swap byte blobs with ``peer``.  When ``recv_nbytes`` is None the
        sizes are swapped first (an 8-byte header each way)."""
        dev = self.comm_device(send.device)
        send = send.to(dev)
        if recv_nbytes is None:
            hs = torch.tensor([send.numel()], dtype=torch.int64, device=dev)
            hr = torch.empty(1, dtype=torch.int64, device=dev)
            self._wait_for(self._raw_sendrecv, peer, hs, peer, hr)
            self.counters.header_bytes_sent += _HEADER
            self.counters.header_bytes_received += _HEADER
            recv_nbytes = int(hr.item())
        recv = torch.empty(recv_nbytes, dtype=torch.uint8, device=dev)
        self._wait_for(self._raw_sendrecv, peer, send, peer, recv)
        self.counters.payload_bytes_sent += send.numel()
        self.counters.payload_bytes_received += recv_nbytes
        self.counters.messages_sent += 1
        return recv

    @_guarded
    def send(self, peer: int, blob: Tensor, with_header: bool) -> None:
        dev = self.comm_device(blob.device)
        blob = blob.to(dev)
        if with_header:
            self._wait_for(self._raw_send, peer, torch.tensor([blob.numel()], dtype=torch.int64, device=dev))
            self.counters.header_bytes_sent += _HEADER
        self._wait_for(self._raw_send, peer, blob)
        self.counters.payload_bytes_sent += blob.numel()
        self.counters.messages_sent += 1

    @_guarded
    def recv(self, peer: int, nbytes: Optional[int], device) -> Tensor:
        dev = self.comm_device(torch.device(device))
        if nbytes is None:
            h = torch.empty(1, dtype=torch.int64, device=dev)
            self._wait_for(self._raw_recv, peer, h)
            self.counters.header_bytes_received += _HEADER
            nbytes = int(h.item())
        blob = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        self._wait_for(self._raw_recv, peer, blob)
        self.counters.payload_bytes_received += nbytes
        return blob

    @_guarded
    def phase(self, send_to: Optional[int], blob: Optional[Tensor], recv_from: Optional[int],
              recv_nbytes: Optional[int], device, headers: bool) -> Optional[Tensor]:
        """One step of a pairwise schedule (the butterfly) that EVERY rank
        calls, with ``None`` for a direction it does not use this step.

        Point-to-point engines ignore idle ranks; engines with only
        collectives (Horovod's alltoall with splits) need every rank in every
        step, which is why the schedule is written this way.  ``headers``:
        sizes are not known to receivers and travel first (8 bytes).
        Returns the received blob, or None.
        """
        if send_to is not None and send_to == recv_from:
            return self.exchange(send_to, blob, None if headers else recv_nbytes)
        if send_to is not None:
            self.send(send_to, blob, with_header=headers)
        if recv_from is not None:
            return self.recv(recv_from, None if headers else recv_nbytes, device)
        return None

    @_guarded
    def allgather_blobs(self, blob: Tensor, nbytes: Optional[List[int]] = None) -> List[Tensor]:
        """Every rank's blob, in rank order (own included), by a ring of P−1
        neighbour exchanges, so each worker receives exactly the other
        workers' bytes (the (P−1)·k·b of sparse allgather).  ``nbytes``: the
        sizes when every rank knows them; else they are gathered first (an
        8-byte header per rank)."""
        P, r = self.size, self.rank
        if nbytes is None:
            sizes = torch.zeros(P, dtype=torch.int64, device=self.comm_device(blob.device))
            sizes[r] = blob.numel()
            # a sum of one-hot vectors is an allgather of the sizes
            self._wait_for(self._raw_allreduce_sum_, sizes)
            self.counters.header_bytes_sent += _HEADER * (P - 1)
            self.counters.header_bytes_received += _HEADER * (P - 1)
            nbytes = sizes.tolist()
        out: List[Optional[Tensor]] = [None] * P
        out[r] = blob
        right, left = (r + 1) % P, (r - 1) % P
        for s in range(P - 1):
            send_from = (r - s) % P
            recv_from = (r - s - 1) % P
            out[recv_from] = self._ring_step(right, left, out[send_from], nbytes[recv_from])
        return out  # type: ignore[return-value]

    def _ring_step(self, right: int, left: int, send: Tensor, recv_nbytes: int) -> Tensor:
        dev = self.comm_device(send.device)
        send = send.to(dev)
        recv = torch.empty(recv_nbytes, dtype=torch.uint8, device=dev)
        self._wait_for(self._raw_sendrecv, right, send, left, recv)
        self.counters.payload_bytes_sent += send.numel()
        self.counters.payload_bytes_received += recv_nbytes
        self.counters.messages_sent += 1
        return recv

    @_guarded
    def allreduce_sum_(self, t: Tensor) -> Tensor:
        """In-place sum over ranks; counted with the ring model."""
        dev = self.comm_device(t.device)
        buf = t if t.device == dev else t.to(dev)
        self._wait_for(self._raw_allreduce_sum_, buf)
        if buf is not t:
            t.copy_(buf)
        P = self.size
        nbytes = t.numel() * t.element_size()
        ring = (2 * (P - 1) * nbytes) // P
        self.counters.payload_bytes_sent += ring
        self.counters.payload_bytes_received += ring
        self.counters.messages_sent += 2 * (P - 1)
        return t

    @_guarded
    def control_allreduce_max(self, t: Tensor) -> Tensor:
        """Small int64 consistency vector, max over ranks (control traffic,
        counted once per call as the vector's bytes, whatever the algorithm).

        Where ``max_by_dissemination`` is set, by ceil(log2 P) pairwise
        rounds instead of the engine's allreduce: a ring allreduce pays
        2(P−1) link latencies for these few bytes (14 at P = 8, where every
        sparse ``reduce()`` runs the check), the dissemination pattern pays
        one per round.  In round j rank r sends to r + 2^j and receives from
        r − 2^j (mod P) and keeps the elementwise max; after the rounds
        every rank has seen a contiguous run of at least P ranks, i.e. all
        of them, and since max is idempotent seeing a rank twice changes
        nothing -- so the result is the exact max for any P, powers of two
        or not."""
        dev = self.comm_device(t.device)
        buf = t.to(dev, copy=True)  # the caller's vector is left as it was, whichever path
        P, r = self.size, self.rank
        if P > 1 and self.max_by_dissemination:
            other = torch.empty_like(buf)
            d = 1
            while d < P:
                self._wait_for(self._raw_sendrecv, (r + d) % P, buf, (r - d) % P, other)
                buf = torch.maximum(buf, other)
                d *= 2
        elif P > 1:
            self._wait_for(self._raw_allreduce_max_, buf)
        self.counters.control_bytes += buf.numel() * buf.element_size()
        return buf.to(t.device)

    @_guarded
    def allgather_object(self, obj) -> list:
        """Picklable object from every rank, in rank order (error paths:
        the details behind a failed consistency check).  Bounded by the
        transport's timeout like every other primitive: a peer that does
        not take part is reported, never waited for indefinitely."""
        self.counters.control_bytes += len(pickle.dumps(obj)) * self.size
        return self._wait_for(self._raw_allgather_object, obj)


class SingleProcessTransport(Transport):
    """P = 1: a reducer on one worker (no communication at all).  Lets the
    same training script run unchanged on one device, and unit tests run
    selection, error feedback and scatter without a process group."""

    @property
    def rank(self) -> int:
        return 0

    @property
    def size(self) -> int:
        return 1

    def _raw_sendrecv(self, dst, send, src, recv):
        raise RuntimeError("SingleProcessTransport has no peers")

    def _raw_send(self, peer, send):
        raise RuntimeError("SingleProcessTransport has no peers")

    def _raw_recv(self, peer, recv):
        raise RuntimeError("SingleProcessTransport has no peers")

    def _raw_allreduce_sum_(self, t):
        pass

    def _raw_allreduce_max_(self, t):
        pass

    def _raw_allgather_object(self, obj):
        return [obj]
