"""The core's :class:`~gtopk_plugin.collectives.transport.Transport` for the
TensorFlow layer, called inside ``tf.numpy_function`` (:func:`.tf_step.exchange`):
:class:`ChannelTransport` (``exchange="gloo"``, the default) on a gloo side
channel made inside the job, or :class:`HorovodTFTransport`
(``exchange="horovod"``, for elastic jobs) on ``horovod.tensorflow``'s ops
run eagerly, a pairwise step being one ``alltoall`` every rank joins.
Bytes are counted as the core counts them, except size headers: int32 sizes
before an allgather of varying sizes, none for a butterfly message.
"""
from __future__ import annotations

import pickle
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from gtopk_plugin.collectives.transport import Transport
from gtopk_plugin.frameworks.gloo_channel import GlooChannel, store_host
from gtopk_plugin.frameworks.horovod_tf._guard import hvd, tf
from gtopk_plugin.frameworks.horovod_tf.tf_bridge import carrier, to_numpy, to_torch

__all__ = ["ChannelTransport", "HorovodTFTransport", "transport_for"]


class _TFTransport(Transport):
    """Byte counts of this layer; pairwise steps go through :meth:`phase`."""

    def __init__(self, process_set):
        super().__init__()
        self.ps, self._rank, self._size = process_set, process_set.rank(), process_set.size()

    rank = property(lambda self: self._rank)
    size = property(lambda self: self._size)

    def phase(self, send_to, blob, recv_from, recv_nbytes, device, headers):
        got = self._phase(send_to, blob, recv_from, None if headers else recv_nbytes, headers)
        c = self.counters
        if send_to is not None:
            c.payload_bytes_sent += blob.numel()
            c.messages_sent += 1
        if got is not None:
            c.payload_bytes_received += got.numel()
        return got

    def allgather_blobs(self, blob, nbytes=None):
        parts = self._gather(blob.contiguous(), None if nbytes is None else [int(n) for n in nbytes])
        sizes, P, r, c = [p.numel() for p in parts], self.size, self.rank, self.counters
        parts[r] = blob
        if nbytes is None:  # int32 sizes first
            c.header_bytes_sent += 4 * (P - 1)
            c.header_bytes_received += 4 * (P - 1)
        total = sum(sizes)  # the ring model, as Transport.allgather_blobs
        c.payload_bytes_sent += total - sizes[(r + 1) % P]
        c.payload_bytes_received += total - sizes[r]
        c.messages_sent += P - 1
        return parts

    def _raw_allgather_object(self, obj):
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        return [pickle.loads(b.numpy().tobytes()) for b in self._gather(data)]

    def _raw_send(self, peer, send):
        raise NotImplementedError("pairwise steps go through phase()")

    _raw_recv = _raw_send


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


class ChannelTransport(_TFTransport):
    """On a gloo side channel of ``process_set`` (collective to create; the
    store's port travels by one Horovod-TF broadcast, eager even while tracing)."""

    def __init__(self, process_set, name: str):
        super().__init__(process_set)

        def broadcast(words):
            with tf.init_scope():  # eager, also while tracing: every rank traces the step once
                return hvd.broadcast(tf.constant(np.asarray(words, np.int64)), root_rank=0,
                                     name=f"{name}.side_channel", process_set=process_set).numpy().tolist()

        self.ch = GlooChannel(process_set.rank(), process_set.size(), name,
                              store_host(hvd.local_size(), hvd.size()), broadcast)

    def tf_allreduce_max(self, t):
        """Elementwise max of ``t`` over the ranks (a stateful TF op)."""

        def run(a):
            return self.ch.allreduce_(torch.from_numpy(np.array(a)), dist.ReduceOp.MAX).numpy()

        return tf.ensure_shape(tf.numpy_function(run, [t], t.dtype, stateful=True), t.shape)

    def _phase(self, send_to, blob, recv_from, nbytes, headers):
        return self.ch.exchange(send_to, blob, recv_from, nbytes, with_size=headers)

    def _gather(self, blob, nbytes=None):
        return self.ch.allgather(blob, nbytes)

    def _raw_sendrecv(self, dst, send, src, recv):
        got = self.ch.exchange(dst, _bytes(send), src, recv.numel() * recv.element_size(), with_size=False)
        _bytes(recv).copy_(got)

    def _raw_allreduce_sum_(self, t):
        self.ch.allreduce_(t, dist.ReduceOp.SUM)

    def _raw_allreduce_max_(self, t):
        self.ch.allreduce_(t, dist.ReduceOp.MAX)


def _to_tf(t: torch.Tensor):
    x = tf.constant(to_numpy(t))
    return tf.bitcast(x, tf.bfloat16) if t.dtype == torch.bfloat16 else x


def _from_tf(x) -> torch.Tensor:
    return to_torch(np.array(carrier(x).numpy()), x.dtype == tf.bfloat16)


class HorovodTFTransport(_TFTransport):
    """On ``horovod.tensorflow`` ops, run eagerly; op ``n`` of a call
    (counted from :meth:`begin`) is ``{prefix}.{kind}.{n}`` on every rank."""

    def __init__(self, process_set, prefix: str):
        super().__init__(process_set)
        self.prefix, self.n = prefix, 0

    def begin(self) -> None:
        self.n = 0

    def _name(self, kind: str) -> str:
        self.n += 1
        return f"{self.prefix}.{kind}.{self.n}"

    def _alltoall(self, send: torch.Tensor, dst: Optional[int], kind: str):
        """``send`` to ``dst`` (None: nothing), every rank taking part:
        ``(what arrived, sizes per source rank)``."""
        splits = np.zeros(self.size, np.int32)
        if dst is not None:
            splits[dst] = send.numel()
        out, got = hvd.alltoall(_to_tf(send), splits=tf.constant(splits), name=self._name(kind),
                                process_set=self.ps)
        return _from_tf(out), got.numpy()

    def _phase(self, send_to, blob, recv_from, nbytes, headers):
        send = blob if send_to is not None else torch.empty(0, dtype=torch.uint8)
        out, _ = self._alltoall(send, send_to, "phase")
        return out if recv_from is not None else None

    def _gather(self, blob, nbytes=None):
        sizes = nbytes if nbytes is not None else hvd.allgather(
            tf.constant([blob.numel()], tf.int32), name=self._name("sizes"), process_set=self.ps).numpy().tolist()
        out = _from_tf(hvd.allgather(_to_tf(blob), name=self._name("allgather"), process_set=self.ps))
        return list(torch.split(out, [int(s) for s in sizes]))

    def _raw_sendrecv(self, dst, send, src, recv):
        out, got = self._alltoall(_bytes(send), dst, "sendrecv")
        start = int(got[:src].sum())
        _bytes(recv).copy_(out[start:start + int(got[src])])

    def _allreduce_(self, t, op, kind):
        t.copy_(_from_tf(hvd.allreduce(_to_tf(t), op=op, name=self._name(kind), process_set=self.ps)))

    def _raw_allreduce_sum_(self, t):
        self._allreduce_(t, hvd.Sum, "sum")

    def _raw_allreduce_max_(self, t):
        self._allreduce_(t, hvd.Max, "max")


def transport_for(comp, process_set) -> Optional[Transport]:
    """``comp``'s transport over ``process_set`` (None: one rank); a side
    channel is made at first use."""
    if process_set.size() == 1:
        return None
    if comp.exchange != "gloo":
        return HorovodTFTransport(process_set, comp.prefix)
    chans = comp.__dict__.setdefault("_side_channels", {})
    if id(process_set) not in chans:
        chans[id(process_set)] = ChannelTransport(process_set, f"{comp.prefix}.side{len(chans) + 1}")
    return chans[id(process_set)]
