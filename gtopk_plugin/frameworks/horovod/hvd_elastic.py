"""Elastic training on Horovod, both kinds:

* ``hvd.elastic`` (Horovod's elastic mode): :class:`SparseOptimizerStateHandler`
  is registered for our optimizers, so ``hvd.elastic.TorchState`` commits,
  restores and syncs their residuals and step counter, and moves the
  residuals to the new world at a resize (docs/horovod.md, hvd.elastic);
* the elastic consistency scheduler (Nadiradze et al. 2020,
  :mod:`gtopk_plugin.elastic`): :class:`HorovodDenseReduction` is
  registered as the native dense reduction of :class:`HorovodTransport`, so
  ``ElasticScheduler(model, opt, transport=HorovodTransport())`` averages
  with ``hvd.allreduce_async_`` per (layer, step), polled with ``hvd.poll``.
  A sparse reducer, ``ElasticScheduler(model, opt, reducer=GradientReducer(
  "gtopk", 0.01, transport=HorovodTransport()))``, runs the core's exchange
  (the butterfly as ``hvd.alltoall`` steps) on the scheduler's background
  thread, each reduction under its own op-name scope.

Scheduler op names are ``{prefix}.u{layer}.s{step mod slots}``: the same on
every rank (Horovod's coordinator pairs ops by name, so hook order may
differ between ranks) and stable across steps (Horovod's response cache
recognises them); ``slots`` exceeds the number of reductions of one layer
that can be in flight.

Both registrations run once, when the package is imported.
"""
from __future__ import annotations

import pickle
from typing import List, Optional

import horovod.torch as hvd
import torch
from horovod.torch import mpi_ops as _ops
from horovod.torch.elastic import state as _hvd_elastic_state

from gtopk_plugin import config
from gtopk_plugin.checkpoint import exchange_live
from gtopk_plugin.reducer import GradientReducer
from gtopk_plugin.elastic.backend import (AsyncReduction, FlatHandle, agree_by_transport, flatten, poll_until_done,
                                register_transport)
from gtopk_plugin.frameworks.horovod import waiting
from gtopk_plugin.frameworks.horovod.hvd_optimizer import _STATE_KEY, _GtopkHorovodOptimizer
from gtopk_plugin.frameworks.horovod.hvd_transport import HorovodTransport

__all__ = ["SparseOptimizerStateHandler", "HorovodDenseReduction"]

Tensor = torch.Tensor


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



class HorovodDenseReduction(AsyncReduction):
    """Dense average over a Horovod process set (``op=hvd.Average``): each
    layer's gradients in one flat buffer, parameters in registration order.

    Args:
        process_set: Horovod process set (default: all ranks).
        prefix: op-name prefix.
        timeout: seconds a wait may take (default ``GTOPK_TIMEOUT`` or 300);
            Horovod's own ``synchronize`` has no timeout, so the wait polls.
    """

    kind = "horovod"

    def __init__(self, process_set=None, prefix: str = "gtopk.elastic", timeout: Optional[float] = None):
        self.process_set = hvd.global_process_set if process_set is None else process_set
        self.prefix = prefix
        self.timeout = float(timeout) if timeout is not None else config.env_timeout_seconds()
        self._slots = 2
        # The consistency check at construction rides on the Transport.
        self.transport = HorovodTransport(self.process_set, prefix=f"{prefix}.check")

    @property
    def rank(self):
        return self.process_set.rank()

    @property
    def size(self):
        return self.process_set.size()

    def setup(self, units, max_in_flight):
        self._slots = max(1, int(max_in_flight))

    def launch(self, unit, step, names, tensors, last_of_step):
        buf = flatten(tensors).to(self.transport.comm_device(tensors[0].device))
        h = _ops.allreduce_async_(buf, name=f"{self.prefix}.u{unit}.s{step % self._slots}", op=hvd.Average,
                                  process_set=self.process_set)
        return FlatHandle(h, buf, tensors, unit, step)

    def ready(self, h):
        return bool(_ops.poll(h.work))

    def wait(self, h) -> List[Tensor]:
        poll_until_done(lambda: _ops.poll(h.work), self.timeout,
                        f"Horovod allreduce of layer {h.unit} at step {h.step}", self.rank)
        return h.unflatten(_ops.synchronize(h.work))

    def agree(self, layout, bad_input):
        self.transport.set_scope("agree")
        agree_by_transport(self.transport, list(layout) + [("backend", self.kind)], bad_input)


_register_elastic_handler()
register_transport(HorovodTransport,
                   dense=lambda t: HorovodDenseReduction(t.process_set))
