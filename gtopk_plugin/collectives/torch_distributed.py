"""Transport over ``torch.distributed`` (gloo on CPU, NCCL on CUDA).

Constructed lazily: building a ``TorchDistributedTransport()`` before
``init_process_group`` is fine; rank and size are read on first use.
"""
from __future__ import annotations

import datetime
from typing import Optional

import torch
import torch.distributed as dist

from .. import config
from .transport import Transport


class TorchDistributedTransport(Transport):
    """Transport on a torch.distributed process group.

    Args:
        group: the process group (``None``: the default group).
        timeout: seconds any single exchange may take before this rank raises
            (a dead peer raises on the survivors within it).  Default: the
            ``GTOPK_TIMEOUT`` environment variable, else 300 s.
    """

    # isend/irecv pairs are cheap here: the check takes log2(P) link
    # latencies instead of the ring allreduce's 2(P-1)
    max_by_dissemination = True

    def __init__(self, group=None, timeout: Optional[float] = None):
        super().__init__()
        if timeout is not None and not (float(timeout) > 0):
            raise ValueError(f"timeout must be a positive number of seconds; got {timeout!r}")
        self.group = group
        self.timeout = float(timeout) if timeout is not None else config.env_timeout_seconds()

    # Process groups cannot be pickled; a pickled transport re-binds to the
    # default group in the new process (DDP comm-hook state convention).
    def __getstate__(self):
        d = self.__dict__.copy()
        d["group"] = None
        return d

    def _require_init(self):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised: call "
                "torch.distributed.init_process_group('gloo' or 'nccl', ...) before reducing")

    @property
    def rank(self) -> int:
        self._require_init()
        return dist.get_rank(self.group)

    @property
    def size(self) -> int:
        self._require_init()
        return dist.get_world_size(self.group)

    @property
    def backend(self) -> str:
        self._require_init()
        return str(dist.get_backend(self.group))

    def comm_device(self, device):
        # gloo moves bytes between CPU tensors; NCCL needs CUDA tensors.
        return torch.device("cpu") if self.backend == "gloo" else torch.device(device)

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
        works = [dist.irecv(recv, self._global(src), group=self.group),
                 dist.isend(send, self._global(dst), group=self.group)]
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
        out = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out
