"""The gloo side channel of the Horovod-TensorFlow layer (issue #15): the
sparse step's exchanges as ``tf.numpy_function`` calls on a torch gloo
group of the process set's ranks made inside the job -- the TF twin of
``frameworks/horovod/side_channel.py`` -- instead of Horovod ops.

Not that module itself: it imports ``horovod.torch``, and importing
Horovod's PyTorch layer into a TensorFlow job rebinds the process sets'
shared back end (``horovod.common.process_sets``) to the uninitialised
torch one, so ``process_set.size()`` fails afterwards.

Why: every Horovod op goes through Horovod's background loop -- a
negotiation among all ranks, then the data -- and on a loaded loopback job
that is tens of milliseconds per op, while a gloo send/recv of the same
bytes is a fraction of one.  A gTop-k step at P = 4 issues three Horovod ops
one after the other (the consistency check, two butterfly rounds), so its
fixed cost was several Horovod cycles against one for ``Compression.none``.
On the side channel the same bytes move in the same pattern (the byte
counts of :class:`.ops.Ops` do not change) and Horovod is used once, at the
first step, to tell the other ranks the store's port (one ``broadcast``).

Ordering: every call here is a *stateful* ``tf.numpy_function``, so inside
``tf.function`` TensorFlow's automatic control dependencies run them in
program order (the same on every rank: the sequence gloo pairs its messages
by) and never prune one whose output nobody reads.
"""
from __future__ import annotations

import datetime
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from horovod.common.exceptions import HorovodInternalError

from ... import config
from ._guard import hvd, tf

__all__ = ["TFSideChannel", "channel_for"]


_SIZE_TAG, _DATA_TAG = 1, 2


class TFSideChannel:
    """gloo send/recv/allgather/allreduce among the ranks of ``process_set``
    (a plain ``ProcessGroupGloo`` on its own ``TCPStore`` hosted by the
    set's rank 0; ``torch.distributed``'s default group is never touched).
    The store's port reaches the other ranks by one Horovod-TF broadcast,
    run eagerly even while a ``tf.function`` is traced.  Collective to
    create: every rank of the set at the same point of its op sequence."""

    def __init__(self, process_set, name: str):
        self.rank, self.size = process_set.rank(), process_set.size()
        timeout = datetime.timedelta(seconds=config.env_timeout_seconds())
        host = "127.0.0.1" if hvd.local_size() == hvd.size() else __import__("socket").gethostname()
        own, store = host, None
        if self.rank == 0:
            store = dist.TCPStore(host, 0, self.size, is_master=True, timeout=timeout, wait_for_workers=False)
            addr = [store.port] + list(host.encode())
        else:
            addr = [0] * 256
        buf = np.zeros(257, np.int64)
        buf[0] = len(addr) - 1
        buf[1:1 + len(addr)] = addr
        with tf.init_scope():  # eager, also while tracing: every rank traces the step once
            buf = hvd.broadcast(tf.constant(buf), root_rank=0, name=f"{name}.side_channel",
                                process_set=process_set).numpy()
        n, port = int(buf[0]), int(buf[1])
        if store is None:
            host = bytes(buf[2:2 + n].tolist()).decode()
            store = dist.TCPStore(host, port, self.size, is_master=False, timeout=timeout)
        self._store = store
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=own)]
        self.pg = dist.ProcessGroupGloo(dist.PrefixStore(name, store), self.rank, self.size, opts)

    # -- torch tensors ---------------------------------------------------------
    @staticmethod
    def _wait(works):
        try:
            for w in works:
                w.wait()
        except RuntimeError as e:  # a lost peer: Horovod's error type, as the PyTorch layer's channel
            raise HorovodInternalError(f"gtopk_plugin side channel: {e}") from e

    def exchange(self, send_to, send, recv_from):
        """``send`` (uint8) to ``send_to``, a blob from ``recv_from`` (its
        size travels first as one int64); either may be None."""
        works = []
        if send_to is not None:
            works.append(self.pg.send([torch.tensor([send.numel()], dtype=torch.int64)], send_to, _SIZE_TAG))
            if send.numel():
                works.append(self.pg.send([send.contiguous()], send_to, _DATA_TAG))
        out = None
        if recv_from is not None:
            n = torch.empty(1, dtype=torch.int64)
            self._wait([self.pg.recv([n], recv_from, _SIZE_TAG)])
            out = torch.empty(int(n[0]), dtype=torch.uint8)
            if out.numel():
                works.append(self.pg.recv([out], recv_from, _DATA_TAG))
        self._wait(works)
        return out

    def allgather(self, blob, nbytes=None):
        """Every rank's uint8 ``blob`` (sizes exchanged first unless
        ``nbytes`` lists them); blocks travel padded to the largest."""
        if nbytes is None:
            sizes = [torch.empty(1, dtype=torch.int64) for _ in range(self.size)]
            self._wait([self.pg.allgather([sizes], [torch.tensor([blob.numel()], dtype=torch.int64)])])
            nbytes = [int(s[0]) for s in sizes]
        m = max(nbytes)
        if m == 0:
            return [blob[:0].clone() for _ in nbytes]
        send = blob if blob.numel() == m else torch.cat([blob, blob.new_zeros(m - blob.numel())])
        outs = [torch.empty(m, dtype=torch.uint8) for _ in range(self.size)]
        self._wait([self.pg.allgather([outs], [send.contiguous()])])
        return [o[:k] for o, k in zip(outs, nbytes)]

    def allreduce_(self, t, op):
        self._wait([self.pg.allreduce([t], op)])
        return t

    # -- TensorFlow ops (stateful numpy functions) ---------------------------
    def tf_allreduce(self, t, op: str):
        """Elementwise ``op`` ("max" or "sum") of ``t`` over the ranks."""
        red = {"max": dist.ReduceOp.MAX, "sum": dist.ReduceOp.SUM}[op]

        def run(a):
            x = torch.from_numpy(np.array(a))  # a private copy: gloo reduces in place
            return self.allreduce_(x, red).numpy()

        out = tf.numpy_function(run, [t], t.dtype, stateful=True)
        return tf.ensure_shape(out, t.shape)

    def tf_allgather(self, blob, static_size: bool):
        """Every rank's uint8 ``blob`` concatenated in rank order, and the
        sizes (int32, one per rank)."""
        def run(b):
            x = torch.from_numpy(b)
            outs = self.allgather(x, [x.numel()] * self.size if static_size else None)
            return (torch.cat(outs).numpy(),
                    np.asarray([o.numel() for o in outs], np.int32))

        out, sizes = tf.numpy_function(run, [blob], [tf.uint8, tf.int32], stateful=True)
        return tf.ensure_shape(out, [None]), tf.ensure_shape(sizes, [self.size])

    def tf_phase(self, send_to: Optional[int], blob, recv_from: Optional[int]):
        """One butterfly step: ``blob`` to ``send_to``, a blob (size sent
        first) from ``recv_from``; either may be None (empty result)."""
        def run(b):
            got = self.exchange(send_to, torch.from_numpy(b), recv_from)
            return np.zeros(0, np.uint8) if got is None else got.numpy()

        return tf.ensure_shape(tf.numpy_function(run, [blob], tf.uint8, stateful=True), [None])

    def tf_alltoall(self, t, splits):
        """``hvd.alltoall`` of ``t`` with ``splits`` (int32 per rank): pieces
        received concatenated in source-rank order.  Pairwise: step ``d``
        sends to ``r + d`` and receives from ``r - d`` (sizes first)."""
        def run(a, sp):
            x = torch.from_numpy(np.ascontiguousarray(a)).reshape(-1).view(torch.uint8)
            esz = a.dtype.itemsize
            b = np.concatenate([[0], np.cumsum(sp)]) * esz
            r, P = self.rank, self.size
            pieces = [None] * P
            pieces[r] = x[b[r]:b[r + 1]]
            for d in range(1, P):
                dst, src = (r + d) % P, (r - d) % P
                pieces[src] = self.exchange(dst, x[b[dst]:b[dst + 1]], src)
            return torch.cat(pieces).view(torch.from_numpy(a[:0]).dtype).numpy()

        out = tf.numpy_function(run, [t, splits], t.dtype, stateful=True)
        return tf.ensure_shape(out, [None])


def channel_for(holder, process_set, prefix: str) -> Optional[TFSideChannel]:
    """The side channel of ``holder`` (a compression) for ``process_set``,
    made at first use (collective: every rank reaches it at the same step),
    or None when the set has one rank."""
    if process_set.size() == 1:
        return None
    chans = holder.__dict__.setdefault("_side_channels", {})
    key = id(process_set)
    if key not in chans:
        chans[key] = TFSideChannel(process_set, f"{prefix}.side{len(chans) + 1}")
    return chans[key]
