"""torch.distributed back end of the elastic scheduler: one asynchronous
``all_reduce`` work handle per (layer, step), polled with
``Work.is_completed()`` and waited for with ``Work.wait(timeout)``.

Registered at ``import gtopk_plugin`` as the scheduler's default back end
and as the native dense reduction of
:class:`~gtopk_plugin.TorchDistributedTransport`.
"""
from __future__ import annotations

import datetime
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from gtopk_plugin import config
from gtopk_plugin.elastic.backend import (AsyncReduction, FlatHandle, agree_by_transport, flatten, register_default,
                               register_transport)
from gtopk_plugin.pipeline.update_buffers import _storage_refs
from gtopk_plugin.collectives.torch_distributed import TorchDistributedTransport

Tensor = torch.Tensor


def _dedicated_group(group):
    """A new group of the same ranks and backend: our asynchronous
    collectives then never interleave with the training loop's own
    collectives on ``group`` (collectives of one group must be issued in the
    same order on every rank; ours are issued from backward hooks).
    ``dist.new_group`` is itself collective: every rank builds the scheduler."""
    ranks = None if group is None else dist.get_process_group_ranks(group)
    return dist.new_group(ranks=ranks, backend=dist.get_backend(group))


class TorchDenseReduction(AsyncReduction):
    """Dense average over a torch.distributed group.

    Each layer's gradients are copied into one flat buffer (parameters in
    registration order), summed by ``dist.all_reduce(async_op=True)`` and
    divided by P on arrival — on every rank the same bits (gloo and NCCL
    return one result to all ranks).

    Args:
        group: the ranks to average over (``None``: the default group).
        timeout: seconds a wait may take before raising (default
            ``GTOPK_TIMEOUT`` or 300).
        dedicated_group: run on a new group of the same ranks (default), so
            that reductions in flight cannot be confused with the training
            loop's own collectives on ``group``.
    """

    kind = "torch.distributed"

    def __init__(self, group=None, timeout: Optional[float] = None, dedicated_group: bool = True):
        if timeout is not None and not (float(timeout) > 0):
            raise ValueError(f"timeout must be a positive number of seconds; got {timeout!r}")
        self.timeout = float(timeout) if timeout is not None else config.env_timeout_seconds()
        self._user_group = group
        self._dedicated = bool(dedicated_group)
        self.group = None
        self.transport: Optional[TorchDistributedTransport] = None
        self._slots = 2
        # (layer, in-flight slot) -> (flat buffer, its storage use count when
        # only we held it, the handle that reduced it last)
        self._flats: Dict[Tuple[int, int], tuple] = {}

    def _require(self):
        if self.transport is None:
            if not dist.is_available() or not dist.is_initialized():
                raise RuntimeError("torch.distributed is not initialised: call "
                                   "torch.distributed.init_process_group(...) before building the elastic "
                                   "scheduler, or pass transport= (e.g. gtopk_plugin.SingleProcessTransport() "
                                   "for one process)")
            self.group = _dedicated_group(self._user_group) if self._dedicated else self._user_group
            self.transport = TorchDistributedTransport(self.group, timeout=self.timeout)
        return self.transport

    @property
    def rank(self):
        return self._require().rank

    @property
    def size(self):
        return self._require().size

    def setup(self, units, max_in_flight):
        self._require()
        self._slots = max(1, int(max_in_flight))

    def launch(self, unit, step, names, tensors, last_of_step):
        t = self._require()
        flat = self._flat(unit, step, tensors, t.comm_device(tensors[0].device))
        work = None
        if t.size > 1:
            work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        h = FlatHandle(work, flat, tensors, unit, step)
        held = self._flats.get((unit, step % self._slots))
        if held is not None and held[0] is flat:
            self._flats[(unit, step % self._slots)] = (flat, held[1], h)
        return h

    def _flat(self, unit, step, tensors, comm_device) -> Tensor:
        """The layer's gradients copied into one flat buffer (``p.grad`` may
        change while the reduction is in flight), persistent per (layer,
        in-flight slot): no layer-sized allocation per step in steady state
       .  A slot's buffer is reused only when nothing outside
        this back end refers to its storage any more -- neither the
        collective in flight nor the reduced gradients handed out by
        ``wait``, which the scheduler holds until it has applied them -- else
        a fresh one is made (mixed dtypes or another comm device: always)."""
        dtype, device = tensors[0].dtype, tensors[0].device
        if any(g.dtype != dtype for g in tensors) or torch.device(comm_device) != device:
            return flatten(tensors).to(comm_device)
        n = sum(g.numel() for g in tensors)
        key = (unit, step % self._slots)
        held = self._flats.get(key)
        if held is not None:
            buf, base, h = held
            refs = _storage_refs(buf)
            # h.flat is None once wait() has read the result (the collective is over)
            if (buf.numel() == n and buf.dtype == dtype and buf.device == device and h is not None
                    and h.flat is None and base is not None and refs is not None and refs <= base):
                return torch.cat([g.detach().reshape(-1) for g in tensors], out=buf)
        buf = flatten(tensors)
        self._flats[key] = (buf, _storage_refs(buf), None)
        return buf

    def ready(self, h):
        return h.work is None or h.work.is_completed()

    def wait(self, h) -> List[Tensor]:
        if h.work is not None:
            try:
                h.work.wait(timeout=datetime.timedelta(seconds=self.timeout))
            except RuntimeError as e:
                raise RuntimeError(
                    f"gtopk_plugin elastic: the allreduce of layer {h.unit} at step {h.step} failed on "
                    f"rank {self.rank} (a peer died, or did not answer within {self.timeout:g} s): {e}") from e
            h.flat.div_(self.size)
        return h.unflatten(h.flat)

    def agree(self, layout, bad_input):
        agree_by_transport(self._require(), list(layout) + [("backend", self.kind)], bad_input)


def _isolate(transport: TorchDistributedTransport) -> TorchDistributedTransport:
    # A GradientReducer on the default group would run its collectives on the
    # scheduler's thread while the training loop may run its own on the same
    # group: give it a dedicated group of the same ranks.
    if transport.group is not None:
        return transport
    if not dist.is_available() or not dist.is_initialized():
        return transport  # its first use raises the usual "not initialised" error
    return TorchDistributedTransport(_dedicated_group(None), timeout=transport.timeout)


register_default(lambda: TorchDenseReduction())
register_transport(TorchDistributedTransport,
                   dense=lambda t: TorchDenseReduction(t.group, timeout=t.timeout),
                   isolate=_isolate)
