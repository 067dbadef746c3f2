"""A shared-memory fabric for the ranks of one node.

The two-level reduction (:mod:`gtopk_plugin.two_level.hierarchical_reducer`) sums the
workers' gradients densely inside a node.  On a real cluster that sum runs
on the node's fast fabric (NVLink, PCIe); CPU workers of one host have one
too -- their common memory -- but a gloo group reaches a node-mate through
TCP (loopback, or a veth pair when the workers sit in network namespaces),
copying every byte through the kernel several times.  This module moves the
node's dense data through one file mapped by every rank of the node
(``MAP_SHARED`` on tmpfs, ``/dev/shm``), as NCCL's and Gloo's shared-memory
transports do; the node group (a :class:`Transport`) only carries the small
synchronisation messages, so its timeouts and error reporting still apply.

Data movement per step (L ranks, N entries):

- every rank writes its vector into its own slot (the caller concatenates
  its gradients straight into it: no extra copy);
- **reduce to the leader**: a barrier, then local rank j sums shard j of
  all slots into slot 0 (``slot0 += slot1 + ... + slot(L-1)``, in local
  rank order, so the sum is deterministic and the same whichever rank adds
  a shard), a barrier; slot 0 is then the node sum.  Each rank reads
  (L-1)/L of the others' data and the work is spread over the node's cores;
- **broadcast from the leader**: the leader writes the blob into a region
  of its own, and a barrier carries its size; the others copy it out.  The
  region is not reused before every rank has passed the next step's reduce,
  so a slow reader never sees it overwritten.

Accounting (the node group's counters): bytes that cross from one process
to another through the mapping count as payload -- a reduce-scatter of the
slots ((L-1)/L of the vector sent and received per rank), the shards summed
for the leader (1/L sent by each other rank, (L-1)/L received by the
leader) and the blob (sent once per receiver by the leader); barriers are
control bytes.

Opening is collective: the leader creates a file (unlinked once every rank
has mapped it, so a crash during training leaves nothing behind), the
ranks open it without creating it and check a random token -- ranks on
different hosts (a topology that is not really one host per node) fail
that -- and all agree: the fabric
is used only when every rank of the node mapped it, otherwise the caller
falls back to the engine's group.  A leader killed outright (SIGKILL, an
out-of-memory kill) between the creation and the unlink -- during the
set-up's two agreements -- leaves its file behind, memory that tmpfs holds
until someone deletes it; the file's name carries the creator's pid
(``gtopk-node-<pid>-*``), and every later set-up on the host removes such
files whose creator is gone once they are older than any set-up
(:func:`sweep_stale`).
"""
from __future__ import annotations

import logging
import os
import tempfile
import time
from typing import List, Optional

import torch

from gtopk_plugin import config
from gtopk_plugin.collectives.transport import Transport

Tensor = torch.Tensor
__all__ = ["SharedMemoryNode", "shared_memory_dir"]

_ALIGN = 4096          # slot offsets: page-aligned views of any dtype
_HEAD = 64             # the token, then padding
_SHARD_ALIGN = 64      # shard bounds, in bytes (whole cache lines per rank)
_PREFIX = "gtopk-node-"  # then the creator's pid, "-", mkstemp's random part
# A set-up holds its file for two agreements (seconds); one this old whose
# creator is gone was left by a killed leader.
STALE_AGE_S = 600.0
log = logging.getLogger(__name__)


def shared_memory_dir() -> str:
    """Where the node's file lives: ``GTOPK_SHM_DIR``, else ``/dev/shm``
    when it exists (tmpfs: memory, never a disk), else the temp directory."""
    d = config.env_shm_dir()
    if d:
        return d
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else \
        tempfile.gettempdir()


def _alive(pid: int) -> bool:
    """Whether a process with this pid exists (one we may not signal
    exists)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: someone else's, alive
        return True
    return True


def sweep_stale(directory: str, now: Optional[float] = None) -> List[str]:
    """Removes the node files in ``directory`` that killed leaders left:
    ``gtopk-node-<pid>-*`` whose creator no longer exists and that were
    last written more than :data:`STALE_AGE_S` ago (so a set-up in progress
    elsewhere -- a creator in another pid namespace looks gone -- keeps
    its file).  Names without a pid (older versions) are left alone.
    Returns the paths removed; never raises."""
    now = time.time() if now is None else now
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    removed = []
    for name in names:
        pid, sep, _ = name[len(_PREFIX):].partition("-")
        if not name.startswith(_PREFIX) or not sep or not pid.isdigit():
            continue
        path = os.path.join(directory, name)
        try:
            if now - os.stat(path).st_mtime < STALE_AGE_S or _alive(int(pid)):
                continue
            os.unlink(path)
        except OSError:  # gone meanwhile, or not ours to remove
            continue
        removed.append(path)
    if removed:
        log.info("gtopk_plugin: removed %d node file(s) left by killed processes in %s", len(removed), directory)
    return removed


def _round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _map_existing(path: str, total: int, token: bytes):
    """``(mapping, "")`` of the leader's file, or ``(None, why)``.  The file
    is opened without creating it (``torch.from_file`` would create one, and
    a rank on another host would leave it behind) and its size and token are
    checked before it is mapped; any failure is a reason, never an
    exception, so that every rank reaches the agreement that follows."""
    other = "the ranks of a node do not share one host's memory"
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError as e:
        return None, f"{other} (cannot open {path}: {e.strerror})"
    try:
        if os.fstat(fd).st_size < total or os.pread(fd, 16, 0) != token:
            return None, f"{other} (another file at {path})"
        return torch.from_file(path, shared=True, size=total, dtype=torch.uint8), ""
    except Exception as e:  # noqa: BLE001 - a reason for the agreement
        return None, f"cannot map {path}: {e}"
    finally:
        os.close(fd)


class SharedMemoryNode:
    """The shared mapping of one node group (see the module docstring).

    ``node`` is the node's group (local rank 0 is the leader).  The mapping
    is made by :meth:`ensure` (collective, every rank of the node with the
    same size) and grown when a larger vector arrives."""

    def __init__(self, node: Transport):
        self.node = node
        self.L, self.r = node.size, node.rank
        self.slot_bytes = 0          # capacity of one slot
        self.failed: Optional[str] = None   # why the fabric cannot be used here
        self._map: Optional[Tensor] = None  # uint8 view of the whole file

    # ---------------------------------------------------------------- set-up
    def ensure(self, nbytes: int) -> bool:
        """Makes the mapping hold ``nbytes`` per slot (collective when it
        must grow; every rank calls it with the same ``nbytes``).  False when
        the fabric cannot be used on this node (``failed`` says why)."""
        if self.failed is not None:
            return False
        if nbytes <= self.slot_bytes:
            return True
        self._open(_round_up(max(nbytes, 1), _ALIGN))
        return self.failed is None

    def _open(self, slot_bytes: int) -> None:
        with self.node.exclusive("SharedMemoryNode.ensure()"):
            self._open_held(slot_bytes)

    def _open_held(self, slot_bytes: int) -> None:
        total = _HEAD + (self.L + 1) * (slot_bytes + _ALIGN)
        path = token = None
        err = ""
        if self.r == 0:
            try:
                where = shared_memory_dir()
                sweep_stale(where)
                fd, path = tempfile.mkstemp(prefix=f"{_PREFIX}{os.getpid()}-", dir=where)
                try:
                    # reserve the pages now: a full tmpfs then fails here, with
                    # an error, instead of killing a rank (SIGBUS) at a write
                    os.posix_fallocate(fd, 0, total)
                    token = os.urandom(16)
                    os.pwrite(fd, token, 0)
                finally:
                    os.close(fd)
            except OSError as e:
                err = f"cannot create the node's file in {shared_memory_dir()}: {e}"
        try:
            info = self.node.allgather_object((path, token, err))
            path, token, err = info[0]
            mapped, why = (None, err) if err else _map_existing(path, total, token)
            whys = [w for w in self.node.allgather_object(why) if w]
        finally:
            if self.r == 0 and path is not None:
                try:
                    os.unlink(path)  # every rank has mapped it, or given up
                except OSError:
                    pass
        self._map = None
        if whys:
            self.failed, self.slot_bytes = whys[0], 0
            return
        self._map, self.slot_bytes = mapped, slot_bytes

    def close(self) -> None:
        """Drops this rank's mapping (the memory goes when every rank has)."""
        self._map, self.slot_bytes = None, 0

    # ------------------------------------------------------------------ views
    def _region(self, i: int, nbytes: int) -> Tensor:
        off = _HEAD + i * (self.slot_bytes + _ALIGN)
        return self._map[off:off + nbytes]

    def slot(self, numel: int, dtype: torch.dtype, local_rank: Optional[int] = None) -> Tensor:
        """A rank's slot as ``numel`` entries of ``dtype`` (this rank's by
        default): the caller writes its vector here before :meth:`reduce_to_leader`."""
        esz = torch.empty(0, dtype=dtype).element_size()
        i = self.r if local_rank is None else local_rank
        return self._region(i, numel * esz).view(dtype)

    # ------------------------------------------------------------- operations
    def _barrier(self, value: int = 0) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        return int(self.node.control_allreduce_max(t)[0])

    def reduce_to_leader(self, numel: int, dtype: torch.dtype) -> Tensor:
        """Sums every rank's slot into the leader's (slot 0), each rank one
        shard; returns slot 0 (the node sum, to be read by the leader).
        Holds the node group for the whole operation: its two barriers and
        the shared slots between them belong to one thread at a time."""
        with self.node.exclusive("SharedMemoryNode.reduce_to_leader()"):
            return self._reduce_to_leader(numel, dtype)

    def _reduce_to_leader(self, numel: int, dtype: torch.dtype) -> Tensor:
        esz = torch.empty(0, dtype=dtype).element_size()
        step = _SHARD_ALIGN // esz if _SHARD_ALIGN % esz == 0 else 1
        per = _round_up((numel + self.L - 1) // self.L, step)
        lo, hi = min(self.r * per, numel), min((self.r + 1) * per, numel)
        self._barrier()  # every slot written
        if hi > lo:
            dst = self.slot(numel, dtype, 0)[lo:hi]
            for j in range(1, self.L):
                dst.add_(self.slot(numel, dtype, j)[lo:hi])
        self._barrier()  # every shard summed
        c, nbytes, mine = self.node.counters, numel * esz, (hi - lo) * esz
        # reduce-scatter: this rank read the others' shard j, they read its other shards
        c.payload_bytes_received += (self.L - 1) * mine
        c.payload_bytes_sent += nbytes - mine
        c.messages_sent += self.L - 1
        if self.r:  # its summed shard, for the leader
            c.payload_bytes_sent += mine
            c.messages_sent += 1
        else:
            c.payload_bytes_received += nbytes - mine
        return self.slot(numel, dtype, 0)

    def broadcast(self, blob: Optional[Tensor]) -> Optional[Tensor]:
        """The leader's byte blob to every rank of the node (others pass
        None); every rank gets its own copy.  None on every rank when the
        blob does not fit the region (the caller then uses the engine)."""
        with self.node.exclusive("SharedMemoryNode.broadcast()"):
            return self._broadcast(blob)

    def _broadcast(self, blob: Optional[Tensor]) -> Optional[Tensor]:
        cap = self.slot_bytes + _ALIGN
        n = 0
        if self.r == 0:
            n = blob.numel()
            if n <= cap:
                self._region(self.L, n).copy_(blob.reshape(-1).to("cpu", torch.uint8))
            else:
                n = -1 - n
        n = self._barrier(n) if self.r == 0 else self._barrier_follow()
        if n < 0:
            return None
        c = self.node.counters
        if self.r == 0:
            c.payload_bytes_sent += n * (self.L - 1)
            c.messages_sent += self.L - 1
            return blob
        c.payload_bytes_received += n
        return self._region(self.L, n).clone()

    def _barrier_follow(self) -> int:
        # the max over ranks of (leader: its blob size or -1 - size, others:
        # the smallest int64) is the leader's value
        return self._barrier(-(2 ** 63))
