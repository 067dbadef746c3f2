"""Waiting on a Horovod handle without burning the waiting thread's core.

Horovod 0.28's ``synchronize()`` waits in ``WaitAndClear``, a loop of
poll + ``std::this_thread::yield()``: the calling thread stays runnable
and is charged CPU for the whole wait.  Measured here (horovodrun --gloo,
P = 2, one rank 1 s late): 0.84 s of the training thread's CPU per 1 s of
wait with Horovod's own ``synchronize``, 0.06 s with :func:`synchronize`
below.  On a CPU-bound job (training on CPU, or data-loader workers
beside a GPU job) the spinning threads take cores from the backward
passes, Horovod's background threads and the other workers on the node.

:func:`synchronize` polls with short sleeps that grow from 20 µs to
0.5 ms, below Horovod's 1 ms default cycle time, so the added latency is
at most one such sleep per wait, then calls Horovod's ``synchronize``
(which returns at once).  Errors are left as Horovod raises them
(``HorovodInternalError``), so elastic training still sees a lost peer.
"""
from __future__ import annotations

import types

import torch
from horovod.torch import mpi_ops as _ops

from gtopk_plugin.elastic.backend import poll_until_done

__all__ = ["wait", "synchronize", "barrier", "quiet_synchronize"]


def wait(handle) -> None:
    """Return once ``handle``'s operation has completed (``hvd.poll`` is
    true), sleeping between polls; the handle stays valid."""
    # no deadline: Horovod's own stall checks bound a lost peer
    poll_until_done(lambda: _ops.poll(handle), None)


def synchronize(handle):
    """Horovod's ``synchronize(handle)`` after :func:`wait`."""
    wait(handle)
    return _ops.synchronize(handle)


def barrier(process_set=None) -> None:
    """``hvd.barrier()`` without the spin: returns once every rank of
    ``process_set`` (default: all) has called it.  A one-element allreduce
    (public API, unlike the barrier op's handle) waited with sleeps.  Why:
    a job's ranks that finish at different times wait here for seconds,
    and on a shared node a spinning wait slows the ranks it waits for (a
    horovodrun job of four ranks on two cores: Horovod's barrier took 76 s
    where the ranks were 0.6 s apart)."""
    kw = {} if process_set is None else {"process_set": process_set}
    synchronize(_ops.allreduce_async(torch.zeros(1), name="gtopk.barrier", **kw))


def quiet_synchronize(opt) -> None:
    """Make Horovod's own ``DistributedOptimizer`` ``opt`` wait without
    spinning: its ``synchronize()`` (which ``step()`` calls) first waits
    for every handle already in flight with :func:`wait`, then runs as
    Horovod wrote it, finding them done.  Handles that are not plain ints
    (the callables of Horovod's sparse-gradient allgather) and parameters
    whose allreduce starts inside ``synchronize()`` are left to Horovod."""
    own = type(opt).synchronize

    def synchronize_quietly(self):
        if self.process_set.included():
            for handle, _ in list(self._handles.values()):
                if isinstance(handle, int):
                    wait(handle)
        return own(self)

    opt.synchronize = types.MethodType(synchronize_quietly, opt)
