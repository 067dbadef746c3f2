"""How the ranks of one node move the two-level reduction's dense data
(used by :class:`gtopk_plugin.two_level.hierarchical_reducer.HierarchicalReducer`).

Two fabrics:

- ``"engine"``: the node's process group (gloo, NCCL, Horovod's process
  set): an allreduce for the node sum, a binomial tree for the leader's
  result.  What GPU tensors take (the engine reaches NVLink / PCIe).
- ``"shared_memory"``: CPU tensors through one mapping shared by the
  node's processes (:class:`~gtopk_plugin.two_level.shared_memory.SharedMemoryNode`):
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

from typing import Dict, Mapping, Optional, Sequence

import torch

from gtopk_plugin import kernels
from gtopk_plugin.collectives import wire
from gtopk_plugin.two_level.shared_memory import SharedMemoryNode
from gtopk_plugin.collectives.transport import Transport
from gtopk_plugin.two_level.topology import node_broadcast
from gtopk_plugin.pipeline.update_buffers import UpdateBuffers

Tensor = torch.Tensor
FABRICS = ("auto", "shared_memory", "engine")
SPARSE, DENSE, SKIP, PROPAGATE, ERROR = range(5)  # a node broadcast's status word


# One blob from the leader to its node: two int64 words (status, count),
# then the result -- its non-zeros as wire (index, value) pairs or the dense
# vector -- or, for the error status, the pickled (exception type, message).
def status_blob(status: int, payload: bytes = b"") -> Tensor:
    """A blob with no result: skip, propagate, or an error's payload."""
    head = torch.tensor([status, len(payload)], dtype=torch.int64).view(torch.uint8)
    return torch.cat([head, torch.frombuffer(bytearray(payload), dtype=torch.uint8)]) if payload else head


def encode_result(update: Tensor):
    """``(status, sparse, blob)``: the result's entries other than +0.0 (by
    their bits: -0.0 travels, so every rank gets the leader's bits) as
    (index, value) pairs when that is smaller than the dense vector
    (``SPARSE``, ``sparse`` = (int64 indices, values)), else the dense
    vector (``DENSE``, None)."""
    n, esz = update.numel(), update.element_size()
    idt = kernels.index_dtype(n)
    isz = torch.empty(0, dtype=idt).element_size()
    most = (n * esz - 1) // (isz + esz)  # past this many pairs the dense vector is smaller
    # one read; it stops collecting past `most` (torch.nonzero: ~9 reads here)
    idx = kernels.nonzero_indices(update, limit=most)
    if idx is not None:
        vals = update[idx]
        body = wire.pack(idx, vals, idt)
        head = torch.tensor([SPARSE, idx.numel()], dtype=torch.int64).view(torch.uint8)
        return SPARSE, (idx, vals), torch.cat([head.to(body.device), body])
    head = torch.tensor([DENSE, n], dtype=torch.int64).view(torch.uint8)
    return DENSE, None, torch.cat([head.to(update.device), update.contiguous().view(torch.uint8)])


def decode_result(blob: Tensor, n: int, dtype, device):
    """``(status, payload)``: SPARSE (indices, values), DENSE the vector (a
    view of the blob), ERROR the pickled bytes, SKIP / PROPAGATE None."""
    head = blob[:16].cpu().clone().view(torch.int64).tolist()
    status, body = int(head[0]), blob[16:]
    if status == ERROR:
        return status, body.cpu().numpy().tobytes()
    if status in (SKIP, PROPAGATE):
        return status, None
    if status == DENSE:
        return status, wire.unpack_values(body.to(device), dtype)
    idx, vals, _ = wire.unpack(body.to(device), kernels.index_dtype(n), dtype)
    return status, (idx, vals)


def flat_result(out: Mapping[str, Tensor], names: Sequence[str], sizes: Sequence[int]) -> Tensor:
    """The inner reducer's update as one flat vector: the buffer its views
    share when they tile it in order (no copy), else a concatenation."""
    first = out[names[0]]
    base = first if first._base is None else first._base
    ptr, esz, off = base.data_ptr(), base.element_size(), 0
    ok = base.dim() == 1 and base.is_contiguous() and base.numel() == sum(sizes)
    for n, size in zip(names, sizes):
        t = out[n]
        ok = ok and t.dtype == base.dtype and t.is_contiguous() and t.data_ptr() == ptr + off * esz
        off += size
    return base if ok else torch.cat([out[n].reshape(-1) for n in names])


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
        self._refused: Optional[str] = None  # insisting, and some node could not have it
        self._bufs: Dict[tuple, Tensor] = {}
        self._updates = UpdateBuffers()  # a non-leader's updates (ring, O(k) reset)
        self.current = "engine" if self.shm is None else "shared_memory"  # this step's fabric

    def buffer(self, names: Sequence[str], sizes: Sequence[int], dtype, device) -> Tensor:
        """Where this rank writes its flat gradient for the node sum: its
        shared slot, or a persistent buffer per layout (no
        N-sized allocation per step; free again once reduce() returns)."""
        numel, device = sum(sizes), torch.device(device)
        self.current = "engine"
        if self.mode == "shared_memory" and device.type != "cpu":
            raise ValueError(f"gtopk_plugin: intra_fabric='shared_memory' carries CPU tensors only, got "
                             f"{device.type}; pass intra_fabric='auto' (the engine then takes them)")
        if self._refused is not None:  # on every rank, every later step (agreed once)
            raise ValueError(self._refused)
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
                    self._refused = (f"gtopk_plugin: intra_fabric='shared_memory' is not available: "
                                     f"{whys[0]}; pass intra_fabric='auto' or 'engine'")
                    raise ValueError(self._refused)
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

    def broadcast(self, blob: Optional[Tensor], device=None) -> Tensor:
        """The leader's blob on every rank of the node (others pass None),
        sent and received on ``device`` (the gradients')."""
        if self.intra.size == 1:
            return blob
        if self.current == "shared_memory":
            got = self.shm.broadcast(blob)
            if got is not None:
                return got
        return node_broadcast(self.intra, blob, device)

    # -------------------------------------------------------- the result
    @staticmethod
    def publish(update: Tensor, divisor: int):
        """The leader: ``(status, update / divisor, blob)`` from its inner
        reducer's flat update (divided in place: O(k) when sparse, the true
        division of ``scatter_reset_`` -- the bits every rank computes)."""
        status, sparse, blob = encode_result(update)
        if divisor != 1:
            if sparse is None:
                update.div_(divisor)
            else:
                kernels.scatter_reset_(update, sparse[0], sparse[0], sparse[1], divisor)
        return status, update, blob

    def receive(self, blob: Tensor, key: tuple, numel: int, divisor: int):
        """Another rank: ``(status, update / divisor or payload)`` from the
        leader's blob; a sparse result lands in a persistent buffer of this
        layout (its previous entries cleared, this one's written: O(k))."""
        dtype, device = key[1], key[2]
        status, payload = decode_result(blob, numel, dtype, device)
        if status == DENSE:
            return status, payload.div_(divisor) if divisor != 1 else payload
        if status != SPARSE:
            return status, payload
        idx, vals = payload
        buf, prev = self._updates.take(key, numel, dtype, device, idx)
        kernels.scatter_reset_(buf, prev, idx, vals, divisor)
        return status, buf
