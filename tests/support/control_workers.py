"""Worker for tests/distributed/test_control_max.py: the consistency
check's max over ranks on real gloo groups of every size 1..P (subgroups
of one job: one process start instead of one per size), with its rounds
counted."""
import time

import torch
import torch.distributed as dist

from gtopk_plugin import TorchDistributedTransport
from gtopk_plugin.collectives.transport import Transport


class DelayedTransport(Transport):
    """Forwards to ``inner`` and sleeps one link latency per round it waits
    for a peer (pairwise send/receive, receive; 2(P-1) per allreduce, a
    ring's rounds), counting them in ``waits``: an emulated link's latency,
    as the lab's elastic benchmark injects it."""

    def __init__(self, inner: Transport, latency_s: float, jitter_s: float = 0.0, seed: int = 0):
        super().__init__()
        self.inner, self.latency_s = inner, float(latency_s)
        self.max_by_dissemination = getattr(inner, "max_by_dissemination", False)
        self.timeout = getattr(inner, "timeout", 300.0)
        self.waits = 0

    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def size(self) -> int:
        return self.inner.size

    def _lag(self, rounds: int = 1) -> None:
        time.sleep(self.latency_s * rounds)
        self.waits += rounds

    def _raw_sendrecv(self, dst, send, src, recv):
        self.inner._raw_sendrecv(dst, send, src, recv)
        self._lag()

    def _raw_send(self, peer, send):
        self.inner._raw_send(peer, send)

    def _raw_recv(self, peer, recv):
        self.inner._raw_recv(peer, recv)
        self._lag()

    def _raw_allreduce_sum_(self, t):
        self.inner._raw_allreduce_sum_(t)
        self._lag(2 * (self.size - 1))

    def _raw_allreduce_max_(self, t):
        self.inner._raw_allreduce_max_(t)
        self._lag(2 * (self.size - 1))

    def _raw_allgather_object(self, obj):
        out = self.inner._raw_allgather_object(obj)
        self._lag(2 * (self.size - 1))
        return out

    def comm_device(self, device):
        return self.inner.comm_device(device)


def vector_of(rank: int, P: int) -> list:
    """Rank-dependent int64 values whose max comes from different ranks per entry."""
    return [(rank * 7) % P, (P - rank) * 3, ((rank + 3) * 2654435761) % 1000003, -rank, 1 << 40 if rank == P - 1 else 0]


class CountingTransport(TorchDistributedTransport):
    def __init__(self, group):
        super().__init__(group)
        self.sendrecvs = 0
        self.allreduces = 0

    def _raw_sendrecv(self, dst, send, src, recv):
        self.sendrecvs += 1
        super()._raw_sendrecv(dst, send, src, recv)

    def _raw_allreduce_max_(self, t):
        self.allreduces += 1
        super()._raw_allreduce_max_(t)


def control_max(rank: int, world: int) -> dict:
    out = {}
    for P in range(1, world + 1):
        group = dist.new_group(list(range(P)))  # collective: every rank of the job calls it
        if rank >= P:
            continue
        t = CountingTransport(group)
        v = torch.tensor(vector_of(rank, P), dtype=torch.int64)
        got = t.control_allreduce_max(v)
        delayed = DelayedTransport(TorchDistributedTransport(group), latency_s=1e-3, jitter_s=0.0, seed=rank)
        got2 = delayed.control_allreduce_max(v)
        out[P] = {"max": got.tolist(), "input_unchanged": v.tolist() == vector_of(rank, P),
                  "sendrecvs": t.sendrecvs, "allreduces": t.allreduces,
                  "control_bytes": t.counters.control_bytes,
                  "delayed_max": got2.tolist(), "delayed_waits": delayed.waits}
    return out
