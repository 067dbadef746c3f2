"""How the ranks of one node move the two-level reduction's dense data
(issue #18; used by :class:`gtopk_plugin.hierarchical.HierarchicalReducer`).

Two fabrics:

- ``"engine"``: the node's process group (gloo, NCCL, Horovod's process
  set): an allreduce for the node sum, a binomial tree for the leader's
  result.  What GPU tensors take (the engine reaches NVLink / PCIe).
- ``"shared_memory"``: CPU tensors through one mapping shared by the
  node's processes (:class:`~gtopk_plugin.collectives.shared_memory.SharedMemoryNode`):
  each rank concatenates its gradients straight into its slot, the ranks
  sum one shard each into the leader's slot, the leader's result is copied
  out of a shared region.  The group carries only barriers.

``"auto"`` (the default) takes shared memory for CPU tensors when every
rank of the node can map the same file (they run on one host), the engine
otherwise; ``"shared_memory"`` insists (a ``ValueError`` on every rank of
the job when a node cannot have it).  The choice is agreed per node when
the mapping is made or grown: no rank decides alone.
"""
from __future__ import annotations

from typing import Dict, Optional, Sequence

import torch

from .collectives.shared_memory import SharedMemoryNode
from .collectives.transport import Transport
from .topology import node_broadcast

Tensor = torch.Tensor
FABRICS = ("auto", "shared_memory", "engine")


def check_fabric(mode) -> str:
    if mode not in FABRICS:
        raise ValueError(f"intra_fabric must be one of {FABRICS}, got {mode!r}")
    return mode


class NodeFabric:
    """The node sum and the node broadcast over the chosen fabric.  Every
    method is collective on the node group, called in the same order."""

    def __init__(self, intra: Transport, world: Transport, mode: str = "auto"):
        self.intra, self.world, self.mode = intra, world, check_fabric(mode)
        self.shm = SharedMemoryNode(intra) if intra.size > 1 and mode != "engine" else None
        self._largest = 0  # bytes of the largest CPU vector yet (the same on every rank)
        self._bufs: Dict[tuple, Tensor] = {}
        self.current = "engine" if self.shm is None else "shared_memory"  # this step's fabric

    def buffer(self, names: Sequence[str], sizes: Sequence[int], dtype, device) -> Tensor:
        """Where this rank writes its flat gradient for the node sum: its
        shared slot, or a persistent buffer per layout (issue #15: no
        N-sized allocation per step; free again once reduce() returns)."""
        numel, device = sum(sizes), torch.device(device)
        self.current = "engine"
        if self.mode == "shared_memory" and device.type != "cpu":
            raise ValueError(f"gtopk_plugin: intra_fabric='shared_memory' carries CPU tensors only, got "
                             f"{device.type}; pass intra_fabric='auto' (the engine then takes them)")
        if self.mode != "engine" and device.type == "cpu":
            need = numel * torch.empty(0, dtype=dtype).element_size()
            grows, self._largest = need > self._largest, max(need, self._largest)
            ok = self.shm is not None and self.shm.ensure(need)
            if grows and self.mode == "shared_memory":
                # nodes decide apart; insisting, one node's failure must
                # raise on every rank, or the others would wait for it
                whys = self.world.allgather_object(None if ok or self.shm is None else self.shm.failed)
                whys = [w for w in whys if w]
                if whys:
                    raise ValueError(f"gtopk_plugin: intra_fabric='shared_memory' is not available: "
                                     f"{whys[0]}; pass intra_fabric='auto' or 'engine'")
            if ok:
                self.current = "shared_memory"
                return self.shm.slot(numel, dtype)
        key = (tuple(names), dtype, device)
        buf = self._bufs.get(key)
        if buf is None:
            if len(self._bufs) >= 64:
                self._bufs.clear()
            buf = self._bufs[key] = torch.empty(numel, dtype=dtype, device=device)
        return buf

    def node_sum(self, flat: Tensor) -> Tensor:
        """The sum of the node's buffers; read it on the leader only (with
        shared memory the other ranks' buffers are not summed in place)."""
        if self.intra.size == 1:
            return flat
        if self.current == "shared_memory":
            return self.shm.reduce_to_leader(flat.numel(), flat.dtype)
        self.intra.allreduce_sum_(flat)
        return flat

    def broadcast(self, blob: Optional[Tensor]) -> Tensor:
        """The leader's blob on every rank of the node (others pass None)."""
        if self.intra.size == 1:
            return blob
        if self.current == "shared_memory":
            got = self.shm.broadcast(blob)
            if got is not None:
                return got
        return node_broadcast(self.intra, blob)
