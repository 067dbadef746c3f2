"""A point-to-point side channel for the Horovod transport: a gloo process
group of the process set's ranks, created inside the ``horovodrun`` job.

Horovod has no send/recv, so each butterfly round would be an ``alltoall``
through Horovod's background loop (a negotiation, then the data); the side
channel moves only the sparse exchange's data (butterfly steps,
allgathers, control allreduces).  Horovod keeps what needs its view of the
job: this channel's rendezvous (one ``broadcast`` of the store's port) and
the per-step join detection (:mod:`.hvd_sparse`).

The group is :class:`gtopk_plugin.frameworks.gloo_channel.GlooChannel`
(shared with the TensorFlow layer): it never touches ``torch.distributed``'s
default group, and raises ``HorovodInternalError`` so ``hvd.elastic``
resets the job; a new channel is made at the next step.
See docs/horovod.md, "What happens in a step".
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
