"""BytePS back end of the elastic scheduler: ``byteps.torch.push_pull_async``
per (layer, step), polled with ``poll`` and finished with ``synchronize``.

This module imports without BytePS; BytePS is imported when a
:class:`BytePSDenseReduction` is built, and a missing BytePS raises an
``ImportError`` naming the install command.  All scheduling logic is the
framework-neutral core (``gtopk_plugin.elastic``), which the
torch.distributed and Horovod tests exercise; this adapter only maps the
:class:`~gtopk_plugin.elastic.AsyncReduction` calls onto BytePS's API.

BytePS keys a push-pull by its name and assigns keys in declaration order,
which must be the same on every worker: every name is declared up front in
one fixed order (layer, slot), and names cycle through ``slots`` per layer
(more than the reductions of one layer that can be in flight), so the set
of names is fixed and reused every step as BytePS expects.
"""
from __future__ import annotations

import importlib
import time
from typing import List, Optional

import torch

from .. import config
from ..elastic.backend import AsyncReduction, agree_by_sum

Tensor = torch.Tensor

INSTALL_HINT = ("pip install byteps  (BytePS 0.2.5 builds against the installed torch and needs a CUDA GPU "
                "and its scheduler/server processes at start-up; see docs/elastic.md)")


def import_byteps():
    """``byteps.torch``, or an ImportError that says how to install it."""
    try:
        import byteps.torch as bps
    except ImportError as e:
        raise ImportError(f"the BytePS back end needs BytePS (import failed: {e}). Install it with:  "
                          f"{INSTALL_HINT}") from e
    return bps


def _push_pull_async(bps):
    """``push_pull_async`` (out of place): ``byteps.torch`` re-exports it in
    some releases; 0.2.x keeps it in ``byteps.torch.ops``."""
    f = getattr(bps, "push_pull_async", None)
    if f is None:
        f = importlib.import_module(f"{bps.__name__}.ops").push_pull_async
    return f


class _Handle:
    __slots__ = ("h", "shapes", "dtypes", "device", "unit", "step")

    def __init__(self, h, shapes, dtypes, device, unit, step):
        self.h, self.shapes, self.dtypes, self.device, self.unit, self.step = h, shapes, dtypes, device, unit, step


class BytePSDenseReduction(AsyncReduction):
    """Dense average through BytePS (``push_pull_async(average=True)``):
    each layer's gradients in one flat buffer, parameters in registration
    order.  Layers earlier in the forward pass get a higher BytePS priority
    (they are needed first at the next step).

    Args:
        prefix: name prefix of the push-pull keys.
        timeout: seconds a wait may take (default ``GTOPK_TIMEOUT`` or 300).
        bps: the ``byteps.torch`` module (default: imported here).

    Call ``bps.init()`` before building the scheduler.
    """

    kind = "byteps"

    def __init__(self, prefix: str = "gtopk.elastic", timeout: Optional[float] = None, bps=None):
        self.bps = import_byteps() if bps is None else bps
        self._push_pull_async = _push_pull_async(self.bps)
        self.prefix = prefix
        self.timeout = float(timeout) if timeout is not None else config.env_timeout_seconds()
        self._slots = 2
        self._n_units = 0

    @property
    def rank(self):
        return int(self.bps.rank())

    @property
    def size(self):
        return int(self.bps.size())

    def _name(self, unit: int, slot: int) -> str:
        return f"{self.prefix}.u{unit}.s{slot}"

    def setup(self, units, max_in_flight):
        self._slots = max(1, int(max_in_flight))
        self._n_units = len(units)
        declare = getattr(self.bps, "declare", None)
        if callable(declare):
            declare(f"{self.prefix}.agree")
            for u in units:
                for s in range(self._slots):
                    declare(self._name(u.index, s))

    def launch(self, unit, step, names, tensors, last_of_step):
        device = tensors[0].device
        buf = torch.cat([g.detach().reshape(-1) for g in tensors])  # a copy: p.grad may change
        h = self._push_pull_async(buf, average=True, name=self._name(unit, step % self._slots),
                                     priority=-unit)
        return _Handle(h, [g.shape for g in tensors], [g.dtype for g in tensors], device, unit, step)

    def ready(self, h):
        return bool(self.bps.poll(h.h))

    def wait(self, h) -> List[Tensor]:
        deadline = time.monotonic() + self.timeout
        pause = 2e-5
        while not self.bps.poll(h.h):
            if time.monotonic() > deadline:
                raise RuntimeError(f"gtopk_plugin elastic: BytePS push_pull of layer {h.unit} at step {h.step} "
                                   f"did not finish within {self.timeout:g} s on rank {self.rank}")
            time.sleep(pause)
            pause = min(pause * 2, 5e-4)
        flat = self.bps.synchronize(h.h).to(h.device)
        out, pos = [], 0
        for shape, dtype in zip(h.shapes, h.dtypes):
            n = shape.numel()
            out.append(flat[pos:pos + n].view(shape).to(dtype))
            pos += n
        return out

    def _sum(self, v: Tensor) -> Tensor:
        return self.bps.synchronize(self._push_pull_async(v, average=False, name=f"{self.prefix}.agree"))

    def agree(self, layout, bad_input):
        # BytePS can only sum: agree_by_sum detects bad input and mismatches
        # (without telling which rank differs).
        agree_by_sum(self._sum, self.size, list(layout) + [("backend", self.kind)], bad_input)
