"""Transport over ``torch.distributed`` (gloo on CPU, NCCL on CUDA).

Constructed lazily: building a ``TorchDistributedTransport()`` before
``init_process_group`` is fine; rank and size are read on first use.
"""
from __future__ import annotations

import datetime
import pickle
import threading
import weakref
from typing import Optional

import torch
import torch.distributed as dist

from gtopk_plugin import config
from gtopk_plugin.collectives.transport import Transport, UseGuard

# One guard per process group, shared by every transport on it: two
# transports on one group, used from two threads at once, interleave their
# collectives on that group as surely as one transport would.  Weak keys: a
# destroyed group takes its guard with it.
_GROUP_GUARDS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_GROUP_GUARDS_LOCK = threading.Lock()
# backends (or parts of a "cpu:gloo,cuda:nccl" pair) that take CPU tensors
_CPU_BACKENDS = ("gloo", "mpi", "ucc", "cpu:")


def _not_a_member(group) -> ValueError:
    where = f"global rank {dist.get_rank()}" if dist.is_available() and dist.is_initialized() else "this process"
    return ValueError(
        f"gtopk_plugin: {where} is not a member of the process group given to TorchDistributedTransport "
        "(torch.distributed.new_group returns GroupMember.NON_GROUP_MEMBER on the ranks it leaves out).  "
        "A reducer on a subgroup must be built and called only on the group's own ranks; the others "
        "have no rank or size in it, and reducing there would return meaningless values.")


def _is_non_member(group) -> bool:
    # GroupMember.NON_GROUP_MEMBER is a plain int sentinel in current torch
    # (an object in older ones): compare by identity or value, never call
    # into the group
    sentinel = getattr(dist.GroupMember, "NON_GROUP_MEMBER", None) if dist.is_available() else None
    if sentinel is None or group is None:
        return False
    return group is sentinel or (isinstance(group, int) and group == sentinel)


class TorchDistributedTransport(Transport):
    """Transport on a torch.distributed process group.

    Args:
        group: the process group (``None``: the default group).  This rank
            must be a member: a group ``dist.new_group`` left this rank out
            of raises ``ValueError`` here (and at first use, when the
            transport was built before ``init_process_group``).
        timeout: seconds any single wait may take before this rank raises
            (a dead or stalled peer raises on the survivors within it) --
            every wait, the error path's included, whatever the process
            group's own timeout.  Default: the ``GTOPK_TIMEOUT``
            environment variable, else 300 s.

    Not thread-safe (see :mod:`.transport`); every transport on one process
    group shares one guard, so two threads on one group -- through one
    transport or two -- get a ``ConcurrentUseError`` instead of crossed
    collectives.
    """

    # isend/irecv pairs are cheap here: the check takes log2(P) link
    # latencies instead of the ring allreduce's 2(P-1)
    max_by_dissemination = True

    def __init__(self, group=None, timeout: Optional[float] = None):
        super().__init__()
        if timeout is not None and not (float(timeout) > 0):
            raise ValueError(f"timeout must be a positive number of seconds; got {timeout!r}")
        if _is_non_member(group):
            raise _not_a_member(group)
        self.group = group
        self.timeout = float(timeout) if timeout is not None else config.env_timeout_seconds()
        self._guard_of = None  # weak reference to the group the cached guard belongs to

    # Process groups cannot be pickled; a pickled transport re-binds to the
    # default group in the new process (DDP comm-hook state convention).
    def __getstate__(self):
        d = super().__getstate__()
        d["group"] = None
        d["_guard_of"] = None
        return d

    def _require_init(self):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised: call "
                "torch.distributed.init_process_group('gloo' or 'nccl', ...) before reducing")

    @property
    def rank(self) -> int:
        self._require_init()
        r = dist.get_rank(self.group)
        if r < 0:
            raise _not_a_member(self.group)
        return r

    @property
    def size(self) -> int:
        self._require_init()
        if _is_non_member(self.group):
            raise _not_a_member(self.group)
        return dist.get_world_size(self.group)

    @property
    def backend(self) -> str:
        self._require_init()
        return str(dist.get_backend(self.group))

    def comm_device(self, device):
        # gloo moves bytes between CPU tensors; NCCL (alone: "nccl", not
        # "cpu:gloo,cuda:nccl") takes only accelerator tensors, so the
        # check's and the error path's small CPU vectors go there
        backend, device = self.backend, torch.device(device)
        if backend == "gloo":
            return torch.device("cpu")
        if device.type != "cpu":
            self._accelerator = device  # this rank's device on the group, for CPU vectors later
        elif not any(b in backend for b in _CPU_BACKENDS):
            return self._accelerator_device()
        return device

    def _accelerator_device(self) -> torch.device:
        """Where an NCCL-only group takes this rank's CPU vectors: the
        device of the last tensors it carried, the group's bound device, or
        the current accelerator device (a rank that never called
        ``torch.cuda.set_device`` has cuda:0 there, which may not be its)."""
        dev = self.__dict__.get("_accelerator")
        if dev is None:
            pg = self.group if self.group is not None else dist.group.WORLD
            dev = getattr(pg, "bound_device_id", None)
        if dev is None:
            acc = torch.accelerator.current_accelerator()
            if acc is None:
                return torch.device("cpu")
            dev = torch.device(acc.type, torch.accelerator.current_device_index())
        return torch.device(dev)

    def _use_guard(self) -> UseGuard:
        self._require_init()
        pg = self.group if self.group is not None else dist.group.WORLD
        guard = self.__dict__.get("_use")
        of = self.__dict__.get("_guard_of")
        if guard is not None and of is not None and of() is pg:
            return guard
        # first use, or the default group was re-created since
        self.rank  # a non-member raises here, before anything is sent
        with _GROUP_GUARDS_LOCK:
            guard = _GROUP_GUARDS.get(pg)
            if guard is None:
                what = ("the default process group" if self.group is None
                        else f"process group {dist.get_process_group_ranks(pg)}")
                guard = _GROUP_GUARDS[pg] = UseGuard(
                    f"TorchDistributedTransport on {what} (global rank {dist.get_rank()})")
        self._use, self._guard_of = guard, weakref.ref(pg)  # weak: never keeps a destroyed group alive
        return guard

    def _global(self, peer: int) -> int:
        return peer if self.group is None else dist.get_global_rank(self.group, peer)

    def _wait(self, works, what: str):
        td = datetime.timedelta(seconds=self.timeout)
        for w in works:
            try:
                w.wait(timeout=td)
            except RuntimeError as e:
                raise RuntimeError(
                    f"gtopk_plugin: {what} failed on rank {self.rank} (a peer died, or did not "
                    f"answer within {self.timeout:g} s): {e}") from e

    def _raw_sendrecv(self, dst, send, src, recv):
        if send.device.type == "cpu":
            works = [dist.irecv(recv, self._global(src), group=self.group),
                     dist.isend(send, self._global(dst), group=self.group)]
        else:
            # NCCL: a receive and a send issued apart share one stream, and
            # the receive blocks it until its data comes -- both ranks of a
            # pair would wait forever; one batch runs them together
            works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, recv, self._global(src), self.group),
                                            dist.P2POp(dist.isend, send, self._global(dst), self.group)])
        self._wait(works, f"exchange with ranks {dst}/{src}")

    def _raw_send(self, peer, send):
        self._wait([dist.isend(send, self._global(peer), group=self.group)], f"send to rank {peer}")

    def _raw_recv(self, peer, recv):
        self._wait([dist.irecv(recv, self._global(peer), group=self.group)], f"receive from rank {peer}")

    def _raw_allreduce_sum_(self, t):
        self._wait([dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group, async_op=True)],
                   "allreduce")

    def _raw_allreduce_max_(self, t):
        self._wait([dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group, async_op=True)],
                   "consistency check")

    def _raw_allgather_object(self, obj):
        # Not dist.all_gather_object: it waits with the process group's
        # timeout (30 minutes by default for gloo), and this runs on the
        # error path, where a peer may be the one that failed.  Two
        # asynchronous all_gathers (sizes, then the pickles padded to the
        # largest), each waited for with this transport's timeout.
        dev = self.comm_device(torch.device("cpu"))
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(dev)
        P = self.size
        n = torch.tensor([data.numel()], dtype=torch.int64, device=dev)
        sizes = [torch.empty_like(n) for _ in range(P)]
        self._wait([dist.all_gather(sizes, n, group=self.group, async_op=True)], "allgather of sizes")
        nbytes = [int(s.item()) for s in sizes]
        pad = torch.zeros(max(nbytes), dtype=torch.uint8, device=dev)
        pad[:data.numel()] = data
        outs = [torch.empty_like(pad) for _ in range(P)]
        self._wait([dist.all_gather(outs, pad, group=self.group, async_op=True)], "allgather of objects")
        return [pickle.loads(o[:k].cpu().numpy().tobytes()) for o, k in zip(outs, nbytes)]
