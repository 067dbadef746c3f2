"""The Horovod back end of the elastic consistency scheduler
(:mod:`gtopk_plugin.elastic`; not Horovod's elastic mode, which is
:mod:`.hvd_resize_state`).

:class:`HorovodDenseReduction` is registered, on import, as the native
dense reduction of :class:`HorovodTransport`: ``ElasticScheduler(model, opt,
transport=HorovodTransport())`` averages with ``hvd.allreduce_async_`` per
(layer, step), polled with ``hvd.poll``.  A sparse reducer on a
``HorovodTransport`` runs the core's exchange on the scheduler's thread,
each reduction under its own op-name scope.

Op names are ``{prefix}.u{layer}.s{step mod slots}``: the same on every
rank and stable across steps; ``slots`` exceeds the reductions of one layer
that can be in flight.
"""
from __future__ import annotations

from typing import List, Optional

import horovod.torch as hvd
import torch
from horovod.torch import mpi_ops as _ops

from gtopk_plugin import config
from gtopk_plugin.elastic.backend import (AsyncReduction, FlatHandle, agree_by_transport, flatten, poll_until_done,
                                          register_transport)
from gtopk_plugin.frameworks.horovod.hvd_transport import HorovodTransport

__all__ = ["HorovodDenseReduction"]

Tensor = torch.Tensor


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


register_transport(HorovodTransport,
                   dense=lambda t: HorovodDenseReduction(t.process_set))
