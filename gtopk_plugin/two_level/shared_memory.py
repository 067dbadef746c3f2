"""A shared-memory fabric for the ranks of one node.

The node's dense data for the two-level reduction moves through one file
mapped ``MAP_SHARED`` by every rank of the node (tmpfs, ``/dev/shm``)
instead of TCP; the node group (a :class:`Transport`) carries only the
small synchronisation messages, so its timeouts and errors still apply.

Per step: every rank writes its vector into its own slot; after a barrier
local rank j adds shard j of every slot into slot 0 in local-rank order
(deterministic), a barrier; the leader writes its result blob into its own
region and the others copy it out (not reused before the next reduce has
passed, so a slow reader never sees it overwritten).  Bytes crossing
processes count as payload on the node group, barriers as control.

Opening is collective: the leader creates the file, the ranks map it and
check a random token (ranks on different hosts fail), and the fabric is
used only if every rank mapped it, else the caller falls back to the
engine.  The file is unlinked once all mapped it; later set-ups remove
those of a leader killed before that (:func:`sweep_stale`).
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
