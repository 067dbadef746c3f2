"""The Transport protocol: the only way collectives talk to other workers.

Collectives are framework-neutral (DESIGN.md §2): they receive a Transport
and call its few primitives.  Each framework layer (torch.distributed,
Horovod, BytePS) implements the ``_raw_*`` primitives; this base class adds
the exact byte / message / round accounting that benchmarks and tests read.

Accounting rules:
- ``payload`` bytes are the bytes of index/value messages;
- ``header`` bytes are size headers, sent only when a message's size cannot
  be known in advance by the receiver (variable-count selectors);
- ``control`` bytes are the per-call consistency check (layout hash and
  non-finite flag) and error-path metadata; they are reported apart so that
  payload figures match the formulas of DESIGN.md §3 exactly;
- a dense allreduce is counted with the ring model, 2·(P−1)/P·nbytes sent
  and received per worker (the engine's internals are not observable).
"""
from __future__ import annotations

import abc
import pickle
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


class Transport(abc.ABC):
    """Point-to-point and collective primitives over byte tensors.

    Subclasses implement ``rank``, ``size`` and the ``_raw_*`` methods; the
    public methods below count traffic and must be called identically (same
    order) on all ranks, like any collective.
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

    def send(self, peer: int, blob: Tensor, with_header: bool) -> None:
        dev = self.comm_device(blob.device)
        blob = blob.to(dev)
        if with_header:
            self._wait_for(self._raw_send, peer, torch.tensor([blob.numel()], dtype=torch.int64, device=dev))
            self.counters.header_bytes_sent += _HEADER
        self._wait_for(self._raw_send, peer, blob)
        self.counters.payload_bytes_sent += blob.numel()
        self.counters.messages_sent += 1

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

    def allgather_object(self, obj) -> list:
        """Picklable object from every rank (error paths only)."""
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
