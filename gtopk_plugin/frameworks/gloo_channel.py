"""The gloo side channel both Horovod layers use: a plain
``ProcessGroupGloo`` of a process set's ranks on its own ``TCPStore``, made
inside the ``horovodrun`` job.  Horovod has no send/recv and every Horovod
op waits for its background loop's negotiation, so the sparse exchange
(butterfly steps, allgathers, control allreduces) runs here; Horovod keeps
what needs its view of the job (docs/horovod.md, "What happens in a step").

The PyTorch (:mod:`.horovod.side_channel`) and TensorFlow
(:mod:`.horovod_tf.tf_transport`) layers pass in how rank 0's store address
reaches the others, so neither imports the other's Horovod module
(importing ``horovod.torch`` into a TensorFlow job rebinds the process
sets' back end).  ``torch.distributed``'s default group is never touched.
Errors are raised as ``HorovodInternalError`` (``hvd.elastic`` resets the
job; the caller makes a new channel).  Every wait is bounded by
``GTOPK_TIMEOUT``.  Not thread-safe: a second thread gets
``ConcurrentUseError`` (:mod:`gtopk_plugin.collectives.transport`).
"""
from __future__ import annotations

import datetime
import socket
from typing import Callable, List, Optional

import torch
import torch.distributed as dist
from horovod.common.exceptions import HorovodInternalError

from gtopk_plugin import config
from gtopk_plugin.collectives.transport import UseGuard

Tensor = torch.Tensor
_SIZE_TAG, _DATA_TAG = 1, 2
# rank 0's store address travels as 257 int64: [len(host), port, host bytes...]
ADDRESS_WORDS = 257


def store_host(local_size: int, size: int) -> str:
    """The address other ranks reach the store on: loopback when the job is
    on one host, else this host's name (what horovodrun resolved too)."""
    return "127.0.0.1" if local_size == size else socket.gethostname()


class GlooChannel:
    """gloo send/recv/allgather/allreduce among ``size`` ranks (numbered as
    in the process set).  ``broadcast(words)`` sends rank 0's
    ``ADDRESS_WORDS`` int64 (a list) to every rank and returns them (a list):
    the one framework op this needs.  Collective to create: every rank of
    the set constructs it at the same point of its op sequence."""

    def __init__(self, rank: int, size: int, name: str, host: str,
                 broadcast: Callable[[List[int]], List[int]]):
        self.rank, self.size = rank, size
        self.timeout = config.env_timeout_seconds()
        timeout = self._timeout = datetime.timedelta(seconds=self.timeout)
        self._use = UseGuard(f"the gtopk_plugin gloo side channel {name!r} (rank {rank})")
        own, store = host, None  # the store's address; this rank's own
        if rank == 0:
            store = dist.TCPStore(host, 0, size, is_master=True, timeout=timeout, wait_for_workers=False)
            addr = [store.port] + list(host.encode())
        else:
            addr = [0] * (ADDRESS_WORDS - 1)
        words = [len(addr) - 1] + addr + [0] * (ADDRESS_WORDS - 1 - len(addr))
        words = [int(w) for w in broadcast(words)]
        n, port = words[0], words[1]
        if store is None:
            store = dist.TCPStore(bytes(words[2:2 + n]).decode(), port, size, is_master=False,
                                  timeout=timeout)
        self._store = store  # kept alive with the group
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=own)]
        self.pg = dist.ProcessGroupGloo(dist.PrefixStore(name, store), rank, size, opts)

    def _wait(self, works):
        try:
            for w in works:
                w.wait(self._timeout)
        except RuntimeError as e:  # a lost peer: let hvd.elastic reset, as for a Horovod op
            raise HorovodInternalError(f"gtopk_plugin side channel: rank {self.rank} got no answer within "
                                       f"{self.timeout:g} s, or a peer died: {e}") from e

    # -- pairwise ------------------------------------------------------------
    def exchange(self, send_to: Optional[int], send: Optional[Tensor], recv_from: Optional[int],
                 recv_nbytes: Optional[int] = None, with_size: bool = True) -> Optional[Tensor]:
        """Send ``send`` (uint8) to ``send_to`` and receive from ``recv_from``
        (either may be None) in one step.  ``with_size`` (the same on every
        rank): the size travels first as one int64 (the header the byte
        counts charge), else the receiver knows ``recv_nbytes``."""
        with self._use("GlooChannel.exchange()"):
            return self._exchange(send_to, send, recv_from, recv_nbytes, with_size)

    def _exchange(self, send_to, send, recv_from, recv_nbytes, with_size):
        works = []
        if send_to is not None:
            if with_size:
                works.append(self.pg.send([torch.tensor([send.numel()], dtype=torch.int64)], send_to, _SIZE_TAG))
            if send.numel():
                works.append(self.pg.send([send.contiguous()], send_to, _DATA_TAG))
        out = None
        if recv_from is not None:
            if with_size:
                n = torch.empty(1, dtype=torch.int64)
                self._wait([self.pg.recv([n], recv_from, _SIZE_TAG)])
                recv_nbytes = int(n[0])
            out = torch.empty(int(recv_nbytes), dtype=torch.uint8)
            if out.numel():
                works.append(self.pg.recv([out], recv_from, _DATA_TAG))
        self._wait(works)
        return out

    # -- collectives ---------------------------------------------------------
    def allgather(self, blob: Tensor, nbytes: Optional[List[int]] = None) -> List[Tensor]:
        """Every rank's uint8 ``blob``; sizes are exchanged first unless all
        are known (``nbytes``).  Blocks travel padded to the largest."""
        with self._use("GlooChannel.allgather()"):
            return self._allgather(blob, nbytes)

    def _allgather(self, blob: Tensor, nbytes: Optional[List[int]]) -> List[Tensor]:
        if nbytes is None:
            n = torch.tensor([blob.numel()], dtype=torch.int64)
            sizes = [torch.empty(1, dtype=torch.int64) for _ in range(self.size)]
            self._wait([self.pg.allgather([sizes], [n])])
            nbytes = [int(s[0]) for s in sizes]
        m = max(nbytes)
        if m == 0:
            return [blob[:0].clone() for _ in nbytes]
        send = blob if blob.numel() == m else torch.cat([blob, blob.new_zeros(m - blob.numel())])
        outs = [torch.empty(m, dtype=torch.uint8) for _ in range(self.size)]
        self._wait([self.pg.allgather([outs], [send.contiguous()])])
        return [o[:k] for o, k in zip(outs, nbytes)]

    def allreduce_(self, t: Tensor, op) -> Tensor:
        with self._use("GlooChannel.allreduce_()"):
            self._wait([self.pg.allreduce([t], op)])
        return t
