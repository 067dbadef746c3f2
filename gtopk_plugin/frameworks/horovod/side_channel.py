"""A point-to-point side channel for the Horovod transport: a gloo process
group of the process set's ranks, created inside the ``horovodrun`` job
.

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

The group (:class:`..gloo_channel.GlooChannel`, shared with the TensorFlow
layer) is a plain ``ProcessGroupGloo`` on its own ``TCPStore`` hosted by
the set's rank 0; it never touches ``torch.distributed``'s default group,
so a user's own ``init_process_group`` is unaffected.  Errors are raised
as Horovod's ``HorovodInternalError`` so ``hvd.elastic`` resets the job as
it does for a failed Horovod op; the caller then drops the channel and a
new one is made at the next step.
"""

from __future__ import annotations

import horovod.torch as hvd
import torch
from horovod.torch import mpi_ops as _ops

from gtopk_plugin.frameworks.gloo_channel import GlooChannel, store_host
from gtopk_plugin.frameworks.horovod import waiting


class SideChannel(GlooChannel):
    """gloo send/recv/allgather/allreduce among the ranks of ``process_set``
    (ranks numbered as in the set); rank 0's store address reaches the
    others by one ``horovod.torch`` broadcast.  Collective to create: every
    rank of the set constructs it at the same point of its op sequence."""

    def __init__(self, process_set, name: str):
        def broadcast(words):
            t = torch.tensor(words, dtype=torch.int64)
            # waited with sleeps, not hvd.broadcast's spinning synchronize:
            # rank 0 may wait here for seconds on a loaded node, and a
            # spinning wait takes a core from the ranks it waits for
            h = _ops.broadcast_async(t, root_rank=0, name=f"{name}.side_channel", process_set=process_set)
            return waiting.synchronize(h).tolist()

        super().__init__(process_set.rank(), process_set.size(), name,
                         store_host(hvd.local_size(), hvd.size()), broadcast)
