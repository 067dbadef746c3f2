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
from typing import List, Optional

import torch

from gtopk_plugin import config
from gtopk_plugin.elastic.backend import AsyncReduction, FlatHandle, agree_by_sum, flatten, poll_until_done

Tensor = torch.Tensor

INSTALL_HINT = ("pip install byteps  (BytePS 0.2.5 builds against the installed torch and needs a CUDA GPU "
                "and its scheduler/server processes at start-up; see docs/byteps.md)")


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
        h = self._push_pull_async(flatten(tensors), average=True, name=self._name(unit, step % self._slots),
                                  priority=-unit)
        return FlatHandle(h, None, tensors, unit, step)

    def ready(self, h):
        return bool(self.bps.poll(h.work))

    def wait(self, h) -> List[Tensor]:
        poll_until_done(lambda: self.bps.poll(h.work), self.timeout,
                        f"BytePS push_pull of layer {h.unit} at step {h.step}", self.rank)
        return h.unflatten(self.bps.synchronize(h.work))

    def _sum(self, v: Tensor) -> Tensor:
        return self.bps.synchronize(self._push_pull_async(v, average=False, name=f"{self.prefix}.agree"))

    def agree(self, layout, bad_input):
        # BytePS can only sum: agree_by_sum detects bad input and mismatches
        # (without telling which rank differs).
        agree_by_sum(self._sum, self.size, list(layout) + [("backend", self.kind)], bad_input)
