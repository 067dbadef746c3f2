"""A point-to-point side channel for the Horovod transport: a gloo process
group of the process set's ranks, created inside the ``horovodrun`` job
(issue #15).

Why: Horovod has no send/recv, so each butterfly round of gTop-k (Shi et al.
2019) is a collective ``alltoall`` that goes through Horovod's background
loop -- a negotiation among all ranks, then the data, each op one cycle or
more.  On a loaded 4-rank loopback job that was ~40-60 ms per op against
~0.2 ms for a gloo send/recv of the same 85 kB, so the fixed cost per step
was Horovod's op latency, not bytes.  The side channel moves only the data
of the sparse exchange (butterfly steps, allgathers, the tiny control
allreduces); Horovod itself keeps everything that needs its view of the
job: the rendezvous of this channel (one ``broadcast`` of the store's
port) and the per-step join detection (:mod:`.sparse`; a rank inside
``hvd.join()`` answers only Horovod ops).

The group is a plain ``ProcessGroupGloo`` on its own ``TCPStore`` hosted by
the set's rank 0; it never touches ``torch.distributed``'s default group,
so a user's own ``init_process_group`` is unaffected.  Errors are raised
as Horovod's ``HorovodInternalError`` so ``hvd.elastic`` resets the job as
it does for a failed Horovod op; the caller then drops the channel and a
new one is made at the next step.
"""
from __future__ import annotations

import datetime
import socket
from typing import List

import horovod.torch as hvd
import torch
import torch.distributed as dist
from horovod.common.exceptions import HorovodInternalError

from ... import config

Tensor = torch.Tensor
_SIZE_TAG, _DATA_TAG = 1, 2


def _host_for_peers(process_set) -> str:
    """The address other ranks reach the store on: loopback when the job is
    on one host, else this host's name (what horovodrun resolved too)."""
    return "127.0.0.1" if hvd.local_size() == hvd.size() else socket.gethostname()


class SideChannel:
    """gloo send/recv/allgather/allreduce among the ranks of ``process_set``
    (ranks numbered as in the set).  Collective to create: every rank of the
    set constructs it at the same point of its op sequence."""

    def __init__(self, process_set, name: str):
        self.rank, self.size = process_set.rank(), process_set.size()
        timeout = datetime.timedelta(seconds=config.env_timeout_seconds())
        host = own = _host_for_peers(process_set)  # the store's address; this rank's own
        store = None
        if self.rank == 0:
            store = dist.TCPStore(host, 0, self.size, is_master=True, timeout=timeout,
                                  wait_for_workers=False)
            addr = [store.port] + list(host.encode())
        else:
            addr = [0] * 256
        # rank 0's port and host to the others: one Horovod broadcast
        buf = torch.zeros(257, dtype=torch.int64)
        buf[0] = len(addr) - 1
        buf[1:1 + len(addr)] = torch.tensor(addr, dtype=torch.int64)
        buf = hvd.broadcast(buf, root_rank=0, name=f"{name}.side_channel", process_set=process_set)
        n, port = int(buf[0]), int(buf[1])
        if store is None:
            host = bytes(buf[2:2 + n].tolist()).decode()
            store = dist.TCPStore(host, port, self.size, is_master=False, timeout=timeout)
        self._store = store  # kept alive with the group
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=own)]
        self.pg = dist.ProcessGroupGloo(dist.PrefixStore(name, store), self.rank, self.size, opts)

    @staticmethod
    def _wait(works):
        try:
            for w in works:
                w.wait()
        except RuntimeError as e:  # a lost peer: let hvd.elastic reset, as for a Horovod op
            raise HorovodInternalError(f"gtopk_plugin side channel: {e}") from e

    # -- pairwise ------------------------------------------------------------
    def exchange(self, send_to, send: Tensor, recv_from, recv_nbytes, with_size: bool) -> Tensor:
        """Send ``send`` (uint8) to ``send_to`` and receive from ``recv_from``
        (either may be None) in one step.  ``with_size`` (the same on every
        rank): the size travels first as one int64 (the header the byte
        counts charge), else the receiver knows ``recv_nbytes``."""
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
    def allgather(self, blob: Tensor, nbytes=None) -> List[Tensor]:
        """Every rank's uint8 ``blob``; sizes are exchanged first unless all
        are known (``nbytes``).  Blocks travel padded to the largest."""
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
        self._wait([self.pg.allreduce([t], op)])
        return t
