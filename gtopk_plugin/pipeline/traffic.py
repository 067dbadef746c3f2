"""One record of what a worker moved in one training step.

Every framework layer reports its last step's bytes the same way
(``last_step_traffic`` of the Horovod optimizers and the DDP hook's state):
a :class:`StepTraffic` summed over the step's buckets, as a dict via
:meth:`StepTraffic.as_dict`.  Transport fields come from
:class:`~gtopk_plugin.collectives.transport.TrafficCounters` or each
bucket's :class:`~gtopk_plugin.pipeline.reduce_stats.ReduceStats`;
``bytes_sent``/``bytes_received`` are payload + headers, the consistency
check stays apart in ``control_bytes``; selection fields come from the
``ReduceStats``; a dense allreduce whose engine is not observable (Horovod's,
DDP's) is counted with the ring model, 2·(P−1)/P·bytes
(:meth:`StepTraffic.ring_allreduce`).  Formulas: docs/design.md §4.

Framework-neutral: imports no framework and no torch.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Iterable, Union

__all__ = ["StepTraffic", "TRANSPORT_FIELDS", "STATS_FIELDS", "WIRE_FORMATS", "sparse_message_bytes",
           "gtopk_bytes", "allgather_bytes", "sharded_allreduce_bytes",
           "onebit_payload_bytes", "onebit_reduce_scatter_bytes", "onebit_scales"]

# Values on the wire (docs/design.md §3): (bytes per value, bytes per message).
# int8: one code per value plus one exponent byte per message (the
# per-message power-of-two scale of collectives/wire.py).
WIRE_FORMATS = {"fp32": (4, 0), "fp16": (2, 0), "bf16": (2, 0), "int8": (1, 1)}

# Fields a transport counts (as TrafficCounters names them).
TRANSPORT_FIELDS = ("payload_bytes_sent", "payload_bytes_received", "header_bytes_sent",
                    "header_bytes_received", "control_bytes", "messages_sent")
# Fields only a reduction's statistics know.
STATS_FIELDS = ("dense_bytes", "numel", "k", "sent_entries", "rounds")


@dataclass
class StepTraffic:
    """Bytes, messages and selection sizes of one step on this worker,
    summed over the buckets (reductions) of the step.

    ``bytes_sent``/``bytes_received`` are derived (payload + headers), so a
    record can never disagree with its parts.
    """

    payload_bytes_sent: int = 0
    payload_bytes_received: int = 0
    header_bytes_sent: int = 0
    header_bytes_received: int = 0
    control_bytes: int = 0
    messages_sent: int = 0
    dense_bytes: int = 0     # what a ring allreduce of the same gradients would send
    numel: int = 0           # gradient entries reduced
    k: int = 0               # entries selected per worker (sum over tensors)
    sent_entries: int = 0
    rounds: int = 0
    buckets: int = 0         # reductions summed into this record
    skipped: bool = False    # some bucket applied nothing (non-finite policy "skip")

    @property
    def bytes_sent(self) -> int:
        return self.payload_bytes_sent + self.header_bytes_sent

    @property
    def bytes_received(self) -> int:
        return self.payload_bytes_received + self.header_bytes_received

    # -- building --------------------------------------------------------
    def add(self, other: Union["StepTraffic", object]) -> "StepTraffic":
        """Add another record, or one reduction's ``ReduceStats`` (counted as
        one bucket), in place; returns ``self``."""
        if isinstance(other, StepTraffic):
            for f in fields(self):
                if f.name == "skipped":
                    self.skipped = self.skipped or other.skipped
                else:
                    setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
            return self
        for name in TRANSPORT_FIELDS + STATS_FIELDS:
            setattr(self, name, getattr(self, name) + int(getattr(other, name)))
        self.buckets += 1
        self.skipped = self.skipped or bool(getattr(other, "skipped", False))
        return self

    @classmethod
    def from_stats(cls, stats: Iterable, counters=None) -> "StepTraffic":
        """Sum of the ``ReduceStats`` of a step's buckets.  ``counters``: a
        ``TrafficCounters`` delta of the transport over the whole step; when
        given, the transport fields are taken from it (it also sees traffic
        between reductions, e.g. a step-counter agreement)."""
        out = cls()
        for st in stats:
            out.add(st)
        if counters is not None:
            for name in TRANSPORT_FIELDS:
                setattr(out, name, int(getattr(counters, name)))
        return out

    @classmethod
    def ring_allreduce(cls, world_size: int, wire_bytes: int, grad_bytes: int) -> "StepTraffic":
        """A dense allreduce under the ring model: ``wire_bytes`` on the wire
        (after any cast), ``grad_bytes`` of gradients (for ``dense_bytes``)."""
        P = int(world_size)
        ring = 2 * (P - 1) * int(wire_bytes) // P
        return cls(payload_bytes_sent=ring, payload_bytes_received=ring,
                   dense_bytes=2 * (P - 1) * int(grad_bytes) // P)

    # -- reading ---------------------------------------------------------
    def as_dict(self) -> dict:
        """Plain dict with every field plus ``bytes_sent``/``bytes_received``
        (the ``last_step_traffic`` format)."""
        d = asdict(self)
        d["bytes_sent"] = self.bytes_sent
        d["bytes_received"] = self.bytes_received
        return d


# -- exact byte predictions (the collectives' counters equal these) ---------
def sparse_message_bytes(entries: int, wire: str = "fp32", index_bytes: int = 4) -> int:
    """One (index, value) message: ``entries·(index + value bytes) + header``
    (int8: ``5·k + 1`` with int32 indices)."""
    vb, hb = WIRE_FORMATS[wire]
    return int(entries) * (index_bytes + vb) + hb


def gtopk_bytes(P: int, rank: int, K: int, wire: str = "fp32", index_bytes: int = 4) -> tuple:
    """``(sent, received)`` payload bytes of ``rank`` in one gTop-k butterfly
    of exact top-k sets (K entries per message, every message the same size):
    log2 P' exchanges among ranks < P' = 2^⌊log2 P⌋; with P > P', ranks
    r >= P' send one message (fold-in) and receive the result plus a
    ⌈K/8⌉-byte survivor bitmask (fold-out) from r − P'."""
    P, r = int(P), int(rank)
    if P == 1:
        return 0, 0
    Pp = 1 << (P.bit_length() - 1)
    m = sparse_message_bytes(K, wire, index_bytes)
    mask = -(-int(K) // 8)
    if r >= Pp:
        return m, m + mask
    core = (Pp.bit_length() - 1) * m
    folded = r < P - Pp
    return core + (m + mask if folded else 0), core + (m if folded else 0)


def allgather_bytes(P: int, K: int, wire: str = "fp32", index_bytes: int = 4) -> int:
    """Sparse allgather of exact top-k sets: (P−1) messages sent and as many
    received per rank (a ring), each :func:`sparse_message_bytes`."""
    return (int(P) - 1) * sparse_message_bytes(K, wire, index_bytes)


def sharded_allreduce_bytes(P: int, rank: int, n: int, wire: str) -> tuple:
    """``(sent, received)`` of the reduce-scatter + allgather that sums ``n``
    values on a wire narrower than the gradients (dense, random-k;
    collectives/dense.py): shard q is ``[n·q//P, n·(q+1)//P)``; each of the
    2·(P−1) messages a rank sends (and receives) carries its own header."""
    P, r, n = int(P), int(rank), int(n)
    if P == 1:
        return 0, 0
    vb, hb = WIRE_FORMATS[wire]
    size = [n * (q + 1) // P - n * q // P for q in range(P)]
    own, right = size[r], size[(r + 1) % P]
    sent = vb * (2 * n - own - right) + 2 * (P - 1) * hb
    received = vb * ((P - 1) * own + n - own) + 2 * (P - 1) * hb
    return sent, received


def onebit_scales(offsets, chunk: int = 0) -> list:
    """Boundaries of onebit's scale pieces: the segments (``chunk`` 0), or
    each segment cut into ``chunk``-entry chunks from its start, the last
    one shorter (an empty segment has none): ``Σ_s ⌈n_s/chunk⌉`` pieces."""
    o = [int(x) for x in offsets]
    if not chunk:
        return o
    out = [b for s in range(len(o) - 1) for b in range(o[s], o[s + 1], int(chunk))]
    return out + [o[-1]]


def onebit_payload_bytes(offsets, chunk: int = 0) -> int:
    """One whole onebit payload: ⌈N/8⌉ sign bytes and a float32 scale per
    segment, or per chunk with ``chunk`` > 0 (``offsets``: the S + 1
    segment boundaries): ``⌈N/8⌉ + 4·Σ_s ⌈n_s/chunk⌉``; the allgather
    moves (P−1) of these each way per rank."""
    o = [int(x) for x in offsets]
    return (o[-1] + 7) // 8 + 4 * (len(onebit_scales(o, chunk)) - 1)


def onebit_shard_bytes(offsets, P: int, chunk: int = 0) -> list:
    """Message size of each shard j of the two-phase onebit aggregation
    (compress/onebit.py, ``shard_plan``): sign bytes ``[⌊j·B/P⌋,
    ⌊(j+1)·B/P⌋)`` of B = ⌈N/8⌉, plus 4 bytes per scale piece (segment,
    or chunk with ``chunk`` > 0) the shard's entries overlap; None when
    B < P (the allgather runs instead)."""
    o = [int(x) for x in offsets]
    N, P = o[-1], int(P)
    q = onebit_scales(o, chunk)
    B = (N + 7) // 8
    if B < P:
        return None
    out = []
    for j in range(P):
        b0, b1 = j * B // P, (j + 1) * B // P
        lo, hi = 8 * b0, min(N, 8 * b1)
        segs = sum(1 for s in range(len(q) - 1) if q[s] < hi and q[s + 1] > lo)
        out.append(b1 - b0 + 4 * segs)
    return out


def onebit_reduce_scatter_bytes(offsets, P: int, rank: int, chunk: int = 0) -> tuple:
    """``(sent, received)`` payload bytes of ``rank`` in one two-phase onebit
    aggregation (``merge="reduce_scatter_payloads"``): phase 1 sends shard j
    to each rank j ≠ rank and receives P−1 messages of its own shard;
    phase 2, a ring allgather of the compressed shards (the same sizes m_j),
    sends Σm − m_(rank+1) and receives Σm − m_rank.  About 2·(P−1)/P of a
    payload each way, against (P−1) payloads for the allgather."""
    P, r = int(P), int(rank)
    if P == 1:
        return 0, 0
    m = onebit_shard_bytes(offsets, P, chunk)
    if m is None:
        n = (int(P) - 1) * onebit_payload_bytes(offsets, chunk)
        return n, n
    total = sum(m)
    return (total - m[r]) + (total - m[(r + 1) % P]), (P - 1) * m[r] + (total - m[r])

