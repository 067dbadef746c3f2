"""Horovod's elastic mode (``hvd.elastic``, workers joining and leaving)
with our optimizers: :class:`SparseOptimizerStateHandler` is registered for
them, so ``hvd.elastic.TorchState`` commits, restores and syncs their
residuals and step counter, and moves the residuals to the new world at a
resize (docs/horovod.md).  The registration runs once, on import.

Not to be confused with the elastic consistency *scheduler*, whose Horovod
back end is :mod:`gtopk_plugin.frameworks.horovod.hvd_scheduler_backend`.
"""
from __future__ import annotations

import pickle

import torch
from horovod.torch import mpi_ops as _ops
from horovod.torch.elastic import state as _hvd_elastic_state

from gtopk_plugin.checkpoint import exchange_live
from gtopk_plugin.frameworks.horovod import waiting
from gtopk_plugin.reducer import GradientReducer
from gtopk_plugin.frameworks.horovod.hvd_optimizer import _STATE_KEY, _GtopkHorovodOptimizer

__all__ = ["SparseOptimizerStateHandler"]


class SparseOptimizerStateHandler(_hvd_elastic_state.OptimizerStateHandler):
    """``hvd.elastic.TorchState`` handler for our optimizers.

    Commit saves ``state_dict()`` (the wrapped optimizer's state and this
    rank's reducer state: residuals, velocities, step).  Restore loads this
    process's own commit back as it was taken (the job may have just lost a
    peer: the transport is not asked for a rank).  ``sync()`` broadcasts the
    optimizer state as Horovod does, then rank 0's step counter, and then
    moves the reducers' states to the new world with the rule of
    :func:`gtopk_plugin.checkpoint.exchange_live`: new rank j holds the sum
    of the states made on old ranks i with i mod P' == j, so Σ_ranks
    residual over the workers still there is kept (exactly where no two
    states are added), whatever ranks Horovod hands out.  A worker that left
    took its residual with it; a new worker brings none."""

    def __init__(self, value):
        super().__init__(value)
        # the (rank, world size) the live reducer state belongs to
        self._home = _where(value)

    def save(self):
        super().save()
        self._home = _where(self.value)

    def restore(self):
        saved = dict(self._saved_optimizer_state)
        ours = saved.pop(_STATE_KEY, None)
        self.value.load_state_dict(saved)  # the wrapped optimizer's state; abandons a half-done step
        red = self.value.reducer
        if ours is None or red is None:
            return
        if isinstance(red, GradientReducer):
            red._load_own_state(ours)
            self._home = None if ours.get("rank") is None else (ours["rank"], ours["world_size"])
        else:
            red.load_state_dict(ours)

    def sync(self):
        super().sync()
        self.value._elastic_sync()
        red = self.value.reducer
        if isinstance(red, GradientReducer):
            ps = self.value.process_set
            exchange_live(red, self._home, lambda obj: _allgather_object(obj, ps))
            self._home = _where(self.value)


def _where(opt):
    red = opt.reducer
    if not isinstance(red, GradientReducer):
        return None
    return red.transport.rank, red.transport.size


def _allgather_object(obj, process_set) -> list:
    """Every rank's picklable ``obj``, in rank order, by Horovod allgathers
    with fixed names (every rank of the set calls it at the same point of
    ``sync()``; the transport's side channel may not exist yet there)."""
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    n = torch.tensor([data.numel()], dtype=torch.int64)
    sizes = waiting.synchronize(_ops.allgather_async(n, name="gtopk.elastic.sync.sizes",
                                                     process_set=process_set)).tolist()
    blob = waiting.synchronize(_ops.allgather_async(data, name="gtopk.elastic.sync.objects",
                                                    process_set=process_set))
    out, pos = [], 0
    for k in sizes:
        out.append(pickle.loads(blob[pos:pos + k].numpy().tobytes()))
        pos += k
    return out


def _register_elastic_handler():
    reg = list(_hvd_elastic_state.get_handler_registry())
    if not any(h is SparseOptimizerStateHandler for _, h in reg):
        # Before Horovod's generic optimizer entry: the first isinstance match wins.
        _hvd_elastic_state.set_handler_registry([(_GtopkHorovodOptimizer, SparseOptimizerStateHandler)] + reg)


_register_elastic_handler()
