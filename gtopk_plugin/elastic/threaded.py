"""Back ends that run each layer's reduction on one background thread.

Used for any :class:`~gtopk_plugin.GradientReducer` (dense, Top-k, gTop-k,
rTop-k, ...) and for Transports without a native asynchronous allreduce.
One thread, first in first out -- the reducer's communication worker
(:class:`~gtopk_plugin.pipeline.comm_worker.CommWorker`), or one of the
back end's own for a bare Transport: the scheduler launches layers in the
same order on every rank, so every rank runs the same sequence of
collectives on the Transport — what a Transport requires (docs/design.md
§1) — while the main thread goes on with backward and the next forward pass.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from gtopk_plugin.collectives.transport import Transport
from gtopk_plugin.elastic.backend import AsyncReduction, UnitSpec, agree_by_transport, refill
from gtopk_plugin.pipeline.comm_worker import CommWorker, wait_for

Tensor = torch.Tensor


class _ThreadedBase(AsyncReduction):
    """Shared: thread, futures, timeouts; subclasses define ``_reduce``."""

    def __init__(self, transport: Transport, timeout: Optional[float] = None):
        self.transport = transport
        self.timeout = float(timeout if timeout is not None else getattr(transport, "timeout", 300.0))
        self._worker: Optional[CommWorker] = None
        self._slots = 2
        self._units: List[UnitSpec] = []
        # (layer, slot) -> (copies of the gradients, the future that read them)
        self._inputs: Dict[Tuple[int, int], Tuple[List[Tensor], torch.futures.Future]] = {}

    @property
    def rank(self):
        return self.transport.rank

    @property
    def size(self):
        return self.transport.size

    def setup(self, units, max_in_flight):
        self._units = list(units)
        self._slots = max(1, int(max_in_flight))

    def launch(self, unit, step, names, tensors, last_of_step):
        grads = self._copies(unit, step, tensors)
        # fresh: each layer's reduction runs and raises on its own
        # the worker on the gradients' device: on CUDA its thread runs there,
        # on a side stream ordered after the submitting one (comm_worker)
        device = tensors[0].device if tensors else None
        fut = self._comm_worker(device).submit(self._run, unit, step, list(names), grads, last_of_step,
                                               fresh=True)
        self._inputs[(unit, step % self._slots)] = (grads, fut)
        return fut

    def _comm_worker(self, device=None) -> CommWorker:
        if self._worker is None or self._worker.closed:
            self._worker = CommWorker(f"gtopk-comm-elastic-{self.kind}", device=device)
        return self._worker

    def _copies(self, unit, step, tensors) -> List[Tensor]:
        """Copies of the gradients (the training loop may zero or overwrite
        ``p.grad`` while the thread still reads them), in persistent buffers
        per (layer, in-flight slot): no layer-sized allocation per step in
        steady state.  A slot's buffers are reused once the
        reduction that read them has finished (the reducer never hands its
        input back as a result); else, or when the layer's shapes changed,
        fresh copies."""
        held = self._inputs.get((unit, step % self._slots))
        return refill(held[0] if held is not None and held[1].done() else None, tensors)

    def _run(self, unit, step, names, grads, last_of_step):
        scope = getattr(self.transport, "set_scope", None)
        if callable(scope):
            # Transports that name their ops (Horovod) get the same names on
            # every rank and step: layer and in-flight slot.
            scope(f"elastic.u{unit}.s{step % self._slots}")
        return self._reduce(names, grads, last_of_step)

    def _reduce(self, names, grads, last_of_step) -> List[Tensor]:
        raise NotImplementedError

    def ready(self, handle):
        return handle.done()

    def wait(self, handle):
        try:
            return wait_for(handle, self.timeout)
        except TimeoutError:
            raise RuntimeError(f"gtopk_plugin elastic: a {self.kind} reduction did not finish within "
                               f"{self.timeout:g} s on rank {self.rank} (a peer died or stopped "
                               "training)") from None

    def agree(self, layout, bad_input):
        agree_by_transport(self.transport, list(layout) + [("backend", self.kind)], bad_input)

    def close(self):
        self._inputs.clear()
        if self._worker is not None:
            self._worker.close()
            self._worker = None


class TransportDenseReduction(_ThreadedBase):
    """Dense allreduce through any Transport: the layer's gradients in one
    flat buffer (parameters in registration order), summed, divided by P."""

    kind = "transport-dense"

    def _reduce(self, names, grads, last_of_step):
        flat = torch.cat([g.reshape(-1) for g in grads])
        if self.transport.size > 1:
            self.transport.allreduce_sum_(flat)
            flat.div_(self.transport.size)
        return [part.view_as(g).to(g.dtype) for part, g in zip(torch.split(flat, [g.numel() for g in grads]),
                                                            grads)]


class ThreadedReduction(_ThreadedBase):
    """A :class:`~gtopk_plugin.GradientReducer` per layer: ``reduce`` on the
    layer's gradients (named as in the model), with the reducer's step counter
    advanced by the last layer of each step only (so warm-up densities,
    random draws and the cross-rank layout check see one step per training
    step, as in the DDP hook).  Error feedback, selection and aggregation are
    the reducer's own: composing the scheduler with gTop-k, rTop-k or Top-k
    keeps their semantics and mass conservation (docs/design.md §2)."""

    kind = "reducer"

    def __init__(self, reducer, timeout: Optional[float] = None):
        super().__init__(reducer.transport, timeout)
        self.reducer = reducer
        self.kind = f"reducer:{reducer.config.method}"

    def _comm_worker(self, device=None) -> CommWorker:
        return self.reducer.worker(device)  # one thread per reducer, whoever submits

    def _reduce(self, names, grads, last_of_step):
        out = self.reducer.reduce(dict(zip(names, grads)), advance_step=last_of_step)
        return [out[n] for n in names]

    def close(self):
        super().close()
        self.reducer.close()

    def agree(self, layout, bad_input):
        agree_by_transport(self.reducer.transport, list(layout) + [("backend", self.kind)], bad_input)

    def state_dict(self):
        return self.reducer.state_dict()

    def load_state_dict(self, sd):
        if sd is None:
            raise ValueError("the checkpoint has no reducer state, but this scheduler runs a GradientReducer")
        self.reducer.load_state_dict(sd)
