"""Horovod transport: the core's :class:`~gtopk_plugin.collectives.transport.Transport`
on Horovod's collectives (PyTorch), so the framework-neutral collectives
(sparse allgather, the gTop-k butterfly of Shi et al. 2019, dense
allreduce) run over ``horovodrun`` unchanged, with the same byte counts as
on torch.distributed (docs/design.md §2).

Horovod has no point-to-point send/recv, so every pairwise step of the
butterfly is one collective ``alltoall`` that every rank of the process set
walks (:meth:`HorovodTransport.phase`) -- or, with ``side_channel=True``
(what the sparse optimizer uses), one gloo send/recv on a
:class:`~.side_channel.SideChannel` made inside the job.  The
byte counts are the same either way.
"""
from __future__ import annotations

import datetime
import pickle
from typing import List, Optional, Tuple

import horovod.torch as hvd
import torch
import torch.distributed as dist
from horovod.torch import mpi_ops as _ops

from gtopk_plugin.collectives.transport import Transport
from gtopk_plugin.frameworks.horovod import waiting
from gtopk_plugin.frameworks.horovod.side_channel import SideChannel

__all__ = ["HorovodTransport"]

Tensor = torch.Tensor
_HEADER = 8  # bytes of one int64 size header (as Transport counts them)


class HorovodTransport(Transport):
    """Transport on Horovod collectives over ``process_set``.

    Horovod has no send/recv: each butterfly step (:meth:`Transport.phase`) is
    one ``hvd.alltoall`` whose splits are non-zero only for the partner (idle
    ranks send nothing but take part); a sparse allgather is one
    ``hvd.allgather`` (sizes in an 8-byte prefix when not known in advance).
    Byte, message and round counts follow the base class's rules, so
    statistics equal the torch.distributed transport's for the same run.

    Op names are ``{prefix}.{scope}.{kind}.{n}`` (``scope`` set by the caller
    per bucket, ``n`` counting ops within it): the same on every rank and step.

    ``side_channel=True`` moves the data on a gloo group of the set's ranks
    (:class:`~.side_channel.SideChannel`, made at the first op; CPU tensors);
    the caller must then detect joined ranks itself before each call
    (:mod:`.hvd_sparse` does).  ``collectives`` counts the ops issued.
    """

    def __init__(self, process_set=None, prefix: str = "gtopk", side_channel: bool = False):
        super().__init__()
        self.process_set = hvd.global_process_set if process_set is None else process_set
        self.prefix = prefix
        self._scope = "main"
        self._seq = 0
        self.side_channel = bool(side_channel) and not hvd.nccl_built()
        self._side: Optional[SideChannel] = None
        self._channels = 0  # channels made so far: the same count on every rank
        self.collectives = 0

    def side(self) -> Optional[SideChannel]:
        """The gloo side channel (made on first use), or None."""
        if not self.side_channel or self.size == 1:
            return None
        if self._side is None:
            self._channels += 1
            self._side = SideChannel(self.process_set, f"{self.prefix}.side{self._channels}")
        return self._side

    def drop_side_channel(self) -> None:
        """Forget the side channel (after an elastic reset or a lost peer);
        the next op makes a new one.  Collective: every rank of the set
        drops it at the same point (the elastic state handler's sync)."""
        self._side = None

    def set_scope(self, scope: str) -> None:
        """Start a new naming scope (op counter back to 0)."""
        self._scope = scope
        self._seq = 0

    def _name(self, kind: str) -> str:
        self._seq += 1
        return f"{self.prefix}.{self._scope}.{kind}.{self._seq}"

    @property
    def rank(self) -> int:
        return self.process_set.rank()

    @property
    def size(self) -> int:
        return self.process_set.size()

    def comm_device(self, device) -> torch.device:
        # A CPU-only Horovod moves CPU tensors; CUDA tensors stay on the GPU
        # only when Horovod was built with NCCL (GPU collectives).
        device = torch.device(device)
        if device.type == "cuda" and hvd.nccl_built():
            return device
        return torch.device("cpu")

    # Errors are left as Horovod raises them (HorovodInternalError): elastic
    # training recognises a lost peer by that type.
    @staticmethod
    def _wait(handle):
        # Horovod's own wait spins on a core, which would take CPU from the
        # backward pass that this thread overlaps with (see waiting.py)
        return waiting.synchronize(handle)

    def _alltoall(self, t: Tensor, splits: Tensor, kind: str) -> Tuple[Tensor, Tensor]:
        self.collectives += 1
        h = _ops.alltoall_async(t, splits=splits, name=self._name(kind), process_set=self.process_set)
        out, got = self._wait(h)
        return out, got

    def _allgather(self, t: Tensor, kind: str) -> Tensor:
        self.collectives += 1
        return self._wait(_ops.allgather_async(t, name=self._name(kind), process_set=self.process_set))

    # -- counted operations, Horovod style --------------------------------
    def phase(self, send_to, blob, recv_from, recv_nbytes, device, headers):
        P = self.size
        dev = self.comm_device(torch.device(device) if blob is None else blob.device)
        send = blob.to(dev) if send_to is not None else torch.empty(0, dtype=torch.uint8, device=dev)
        splits = torch.zeros(P, dtype=torch.int32)
        if send_to is not None:
            splits[send_to] = send.numel()
        side = self.side()
        if side is not None:
            self.collectives += 1
            out = side.exchange(send_to, send, recv_from, recv_nbytes, headers)
            if out is None:
                out = send[:0]
            got = torch.zeros(P, dtype=torch.int64)
            if recv_from is not None:
                got[recv_from] = out.numel()
        else:
            out, got = self._alltoall(send, splits, "phase")
        c = self.counters
        if send_to is not None:
            c.payload_bytes_sent += send.numel()
            c.messages_sent += 1
            if headers:  # the sizes travel inside Horovod's alltoall; counted as the base class does
                c.header_bytes_sent += _HEADER
        if recv_from is None:
            if out.numel():
                raise RuntimeError(f"gtopk_plugin: rank {self.rank} received {out.numel()} unexpected "
                                   "bytes in a butterfly step (ranks disagree on the schedule)")
            return None
        n = int(got[recv_from])
        if n != out.numel() or (not headers and recv_nbytes is not None and n != recv_nbytes):
            raise RuntimeError(
                f"gtopk_plugin: rank {self.rank} expected {recv_nbytes} bytes from rank {recv_from} "
                f"in a butterfly step, got {n} (splits {got.tolist()})")
        c.payload_bytes_received += n
        if headers:
            c.header_bytes_received += _HEADER
        return out

    def allgather_blobs(self, blob: Tensor, nbytes: Optional[List[int]] = None) -> List[Tensor]:
        P, r = self.size, self.rank
        dev = self.comm_device(blob.device)
        blob = blob.to(dev)
        with_sizes = nbytes is None
        side = self.side()
        if side is not None:
            self.collectives += 1 + with_sizes
            parts = side.allgather(blob, nbytes)
            sizes = [p.numel() for p in parts]
        else:
            send = torch.cat([_int64_bytes(blob.numel(), dev), blob]) if with_sizes else blob
            out = self._allgather(send, "allgather")
            parts, sizes = self._split_gathered(out, nbytes, with_sizes)
        parts[r] = blob
        self._count_allgather(sizes, with_sizes)
        return parts

    def _split_gathered(self, out: Tensor, nbytes, with_sizes: bool):
        parts, sizes, pos = [], [], 0
        for q in range(self.size):
            if with_sizes:
                n = _read_int64(out, pos)
                pos += _HEADER
            else:
                n = int(nbytes[q])
            parts.append(out[pos:pos + n])
            sizes.append(n)
            pos += n
        if pos != out.numel():
            raise RuntimeError(f"gtopk_plugin: allgather returned {out.numel()} bytes on rank "
                               f"{self.rank}, expected {pos} (ranks disagree on message sizes)")
        return parts, sizes

    def _count_allgather(self, sizes, with_sizes: bool) -> None:
        P, r = self.size, self.rank
        c = self.counters
        if with_sizes:
            c.header_bytes_sent += _HEADER * (P - 1)
            c.header_bytes_received += _HEADER * (P - 1)
        # Ring model, as Transport.allgather_blobs: a worker forwards every
        # block but its right neighbour's and receives every block but its own.
        total = sum(sizes)
        c.payload_bytes_sent += total - sizes[(r + 1) % P]
        c.payload_bytes_received += total - sizes[r]
        c.messages_sent += P - 1

    # -- raw primitives ----------------------------------------------------
    def _raw_sendrecv(self, dst, send, src, recv):
        # Valid when every rank of the set calls it at once (a ring step).
        side = self.side()
        if side is not None:
            self.collectives += 1
            got = side.exchange(dst, send.view(-1).view(torch.uint8), src, recv.numel() * recv.element_size(),
                                False)
            recv.view(-1).view(torch.uint8).copy_(got)
            return
        splits = torch.zeros(self.size, dtype=torch.int32)
        splits[dst] = send.numel()
        out, got = self._alltoall(send, splits, "sendrecv")
        start = int(got[:src].sum())
        if int(got[src]) != recv.numel():
            raise RuntimeError(f"gtopk_plugin: expected {recv.numel()} bytes from rank {src}, got {int(got[src])}")
        recv.copy_(out[start:start + recv.numel()].view(recv.dtype) if recv.dtype == out.dtype
                   else out[start:start + recv.numel()])

    def _raw_send(self, peer, send):
        raise NotImplementedError(
            "Horovod has no point-to-point send; HorovodTransport runs pairwise schedules as "
            "collective steps through phase()")

    def _raw_recv(self, peer, recv):
        raise NotImplementedError(
            "Horovod has no point-to-point receive; HorovodTransport runs pairwise schedules as "
            "collective steps through phase()")

    def _raw_allreduce_sum_(self, t):
        self.collectives += 1
        side = self.side()
        if side is not None:
            side.allreduce_(t, dist.ReduceOp.SUM)
            return
        self._wait(_ops.allreduce_async_(t, name=self._name("sum"), op=hvd.Sum, process_set=self.process_set))

    def _raw_allreduce_max_(self, t):
        self.collectives += 1
        side = self.side()
        if side is not None:
            side.allreduce_(t, dist.ReduceOp.MAX)
            return
        self._wait(_ops.allreduce_async_(t, name=self._name("max"), op=hvd.Max, process_set=self.process_set))

    def _raw_allgather_object(self, obj):
        # hvd.allgather_object has no process_set argument in 0.28.1: pickle
        # into bytes with a size prefix and allgather those.
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        side = self.side()
        if side is not None:
            self.collectives += 2
            return [pickle.loads(b.numpy().tobytes()) for b in side.allgather(data)]
        out = self._allgather(torch.cat([_int64_bytes(data.numel(), data.device), data]), "object")
        objs, pos = [], 0
        for _ in range(self.size):
            n = _read_int64(out, pos)
            objs.append(pickle.loads(out[pos + _HEADER:pos + _HEADER + n].numpy().tobytes()))
            pos += _HEADER + n
        return objs


def _int64_bytes(n: int, device) -> Tensor:
    return torch.tensor([n], dtype=torch.int64).view(torch.uint8).to(device)


def _read_int64(buf: Tensor, pos: int) -> int:
    return int(buf[pos:pos + _HEADER].cpu().clone().view(torch.int64)[0])



class HorovodNodeEngine:
    """The two levels of a hierarchical reduction (:class:`gtopk_plugin.HierarchicalReducer`) inside a ``horovodrun`` job:
    the node groups and the group of node leaders are plain gloo groups on
    the store of ``transport``'s side channel (made by their members only,
    under a name derived from the channel and the node), so no Horovod
    process set has to be declared at ``hvd.init()``.  The cross-rank
    consistency check and the topology agreement stay on ``transport``.
    Needs the side channel (CPU Horovod, ``exchange="gloo"``)."""

    def __init__(self, transport: HorovodTransport):
        if not transport.side_channel and transport.size > 1:
            raise ValueError("hierarchical=True runs the node levels on the gloo side channel: it needs "
                             "Horovod without NCCL and exchange='gloo' (the default); for NCCL Horovod "
                             "use Horovod's own HOROVOD_HIERARCHICAL_ALLREDUCE=1 with dense compression")
        self._world = transport

    def world(self) -> Transport:
        return self._world

    def split(self, topo):
        from gtopk_plugin.collectives.transport import SingleProcessTransport
        from gtopk_plugin.config import env_timeout_seconds
        from gtopk_plugin.two_level.topology import GlooGroupTransport
        from gtopk_plugin.frameworks.gloo_channel import store_host

        side = self._world.side()
        timeout = env_timeout_seconds()

        def make(name, members):
            if len(members) == 1 or side is None:
                return SingleProcessTransport()
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = datetime.timedelta(seconds=timeout)
            opts._devices = [dist.ProcessGroupGloo.create_device(
                hostname=store_host(hvd.local_size(), hvd.size()))]
            i = members.index(topo.rank)
            store = dist.PrefixStore(f"{self._world.prefix}.hier{self._world._channels}.{name}", side._store)
            return GlooGroupTransport(dist.ProcessGroupGloo(store, i, len(members), opts), i, len(members),
                                      timeout)

        intra = make(f"node{topo.node}", topo.members())
        inter = make("leaders", topo.leaders) if topo.is_leader else None
        return intra, inter
