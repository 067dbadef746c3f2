"""The asynchronous-reduction interface the elastic scheduler talks to, and
how a user's ``transport=`` / ``reducer=`` turns into one.

Everything framework-specific (torch.distributed work handles, Horovod's
``allreduce_async_``/``poll``, BytePS's ``push_pull_async``) sits behind
:class:`AsyncReduction` in the framework layers (docs/design.md §1), which
register their native dense reduction with :func:`register_transport`; any
other Transport gets a dense allreduce on a worker thread
(:mod:`.resolution` picks one; this module imports no back end).

Contract of a back end (all ranks):
- ``launch`` is called in the same order on every rank, with the same
  shapes and dtypes;
- the result of ``wait`` is the same on every rank, bit for bit;
- at most ``max_in_flight`` reductions of one layer are outstanding, so
  per-layer op names may cycle through that many slots;
- ``wait`` raises instead of hanging (a dead peer within ``timeout``).
"""
from __future__ import annotations

import abc
import time
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

from gtopk_plugin.pipeline import input_check as consistency
from gtopk_plugin.collectives.transport import Transport

Tensor = torch.Tensor


@dataclass(frozen=True)
class UnitSpec:
    """What a back end may know of one layer before training starts."""

    index: int          # position in registration order (= forward order, usually)
    name: str
    param_names: Tuple[str, ...]
    shapes: Tuple[Tuple[int, ...], ...]
    dtypes: Tuple[torch.dtype, ...]


class AsyncReduction(abc.ABC):
    """One asynchronous reduction per (layer, step).

    ``launch`` returns a handle; ``ready`` polls it without blocking;
    ``wait`` blocks (at most ``timeout`` s) and returns the reduced tensors
    (average over ranks unless the back end says otherwise), one per input,
    same shapes and dtypes.  Subclasses implement those three plus
    ``rank``/``size`` and ``agree``.
    """

    #: A short name for logs, statistics and the cross-rank layout check.
    kind = "?"
    timeout: float = 300.0

    @property
    @abc.abstractmethod
    def rank(self) -> int: ...

    @property
    @abc.abstractmethod
    def size(self) -> int: ...

    def setup(self, units: Sequence[UnitSpec], max_in_flight: int) -> None:
        """Called once, on every rank, before the first launch."""

    @abc.abstractmethod
    def launch(self, unit: int, step: int, names: Sequence[str], tensors: Sequence[Tensor],
               last_of_step: bool) -> Any:
        """Start reducing ``tensors`` (this rank's gradients of layer ``unit``
        at ``step``; the caller may overwrite them afterwards, so copy)."""

    @abc.abstractmethod
    def ready(self, handle) -> bool: ...

    @abc.abstractmethod
    def wait(self, handle) -> List[Tensor]: ...

    def idle(self, rounds: int) -> None:
        """Nothing arrived and the scheduler must wait: sleep a little.
        Short sleeps growing to 0.5 ms, not a spin: the back end's own
        threads need the core."""
        time.sleep(min(2e-5 * (2 ** min(rounds, 10)), 5e-4))

    @abc.abstractmethod
    def agree(self, layout: Sequence[Tuple], bad_input: Optional[str]) -> None:
        """Collective check at construction: raise on every rank when any
        rank passed invalid settings (``ValueError`` there,
        ``PeerInputError`` elsewhere) or sees a different layout
        (``LayoutMismatchError``)."""

    def state_dict(self) -> Optional[dict]:
        """State of a stateful reducer (error-feedback residuals), or None."""
        return None

    def load_state_dict(self, sd: Optional[dict]) -> None:
        if sd is not None:
            raise ValueError(f"the {self.kind} back end keeps no state, but the checkpoint has reducer "
                             "state (it was saved with a GradientReducer)")

    def close(self) -> None:
        """Release threads or groups (the scheduler is done)."""


def flatten(tensors: Sequence[Tensor]) -> Tensor:
    """One layer's gradients as one flat buffer, parameters in order (a
    copy: ``p.grad`` may change while the reduction is in flight)."""
    return torch.cat([g.detach().reshape(-1) for g in tensors])


class FlatHandle:
    """One layer's dense reduction in flight: the framework's handle
    ``work``, the flat buffer it reduces (kept alive until the result is
    read; None when the framework owns it) and how to cut the result back
    into the layer's tensors."""

    __slots__ = ("work", "flat", "shapes", "dtypes", "device", "unit", "step")

    def __init__(self, work, flat: Optional[Tensor], tensors: Sequence[Tensor], unit: int, step: int):
        self.work, self.flat = work, flat
        self.shapes = [g.shape for g in tensors]
        self.dtypes = [g.dtype for g in tensors]
        self.device, self.unit, self.step = tensors[0].device, unit, step

    def unflatten(self, flat: Tensor) -> List[Tensor]:
        """The reduced flat buffer as the layer's tensors (shapes, dtypes and
        device of the launched gradients); releases the buffer in flight."""
        flat = flat.to(self.device)
        out, pos = [], 0
        for shape, dtype in zip(self.shapes, self.dtypes):
            n = shape.numel()
            out.append(flat[pos:pos + n].view(shape).to(dtype))
            pos += n
        self.flat = None
        return out


def refill(held: Optional[List[Tensor]], tensors: Sequence[Tensor]) -> List[Tensor]:
    """Copies of ``tensors``: into ``held`` (persistent buffers of an earlier
    step, free to reuse) when they still match in number, shapes, dtypes and
    devices, else fresh clones (no layer-sized allocation per step in steady
    state)."""
    if held is not None and len(held) == len(tensors) and all(
            b.shape == t.shape and b.dtype == t.dtype and b.device == t.device for b, t in zip(held, tensors)):
        for b, t in zip(held, tensors):
            b.copy_(t.detach())
        return held
    return [t.detach().clone() for t in tensors]


def poll_until_done(poll: Callable[[], bool], timeout: Optional[float], what: str = "",
                    rank: int = -1) -> None:
    """Wait for ``poll()`` with short, growing sleeps (a framework's own
    synchronize may spin on a core with no bound); raise after ``timeout``
    seconds (``None``: no bound), naming ``what`` and the rank."""
    deadline = None if timeout is None else time.monotonic() + timeout
    pause = 2e-5
    while not poll():
        if deadline is not None and time.monotonic() > deadline:
            raise RuntimeError(f"gtopk_plugin elastic: {what} did not finish within {timeout:g} s on rank {rank}")
        time.sleep(pause)
        pause = min(pause * 2, 5e-4)


def agree_by_transport(transport: Transport, layout, bad_input) -> None:
    """:meth:`AsyncReduction.agree` for back ends that have a Transport."""
    consistency.check(transport, list(layout), bad_input, [])


def agree_by_sum(sum_: Callable[[Tensor], Tensor], size: int, layout, bad_input) -> None:
    """:meth:`AsyncReduction.agree` for engines that can only sum (BytePS).

    One float64 vector [bad, fp0, fp1, fp2] is summed over ranks; the
    fingerprint is cut into 21-bit parts so that sums of up to 2^31 ranks
    stay exact in float64.  A mismatch is detected, but which rank differs
    cannot be told (no gather)."""
    fp = consistency.fingerprint(list(layout)) if bad_input is None else 0
    parts = [(fp >> (21 * i)) & ((1 << 21) - 1) for i in range(3)]
    v = torch.tensor([float(bad_input is not None)] + [float(p) for p in parts], dtype=torch.float64)
    s = sum_(v.clone()) if size > 1 else v
    nbad = int(round(float(s[0])))
    if nbad:
        if bad_input is not None:
            raise ValueError(bad_input)
        raise consistency.PeerInputError(
            f"{nbad} other rank(s) passed invalid settings to the elastic scheduler (see the "
            "ValueError on those ranks)")
    if any(int(round(float(s[i + 1]))) != size * parts[i] for i in range(3)):
        raise consistency.LayoutMismatchError(
            "ranks built the elastic scheduler over different models or settings (layer names, "
            "shapes, dtypes or max_staleness differ)")


# ---------------------------------------------------------------------------
# Registration of framework back ends (looked up by .resolution.resolve)
# ---------------------------------------------------------------------------
_NATIVE: List[Tuple[type, Callable[[Transport], AsyncReduction]]] = []
_ISOLATE: List[Tuple[type, Callable[[Transport], Transport]]] = []
_DEFAULT: List[Callable[[], AsyncReduction]] = []


def register_transport(cls: type, dense: Callable[[Transport], AsyncReduction],
                       isolate: Optional[Callable[[Transport], Transport]] = None) -> None:
    """Framework layers call this at import: ``dense(transport)`` builds the
    native asynchronous dense allreduce for a Transport of class ``cls``;
    ``isolate(transport)`` (optional) returns a Transport on which a
    background thread may run collectives without interleaving with the
    training loop's own (a dedicated process group)."""
    _NATIVE[:] = [(c, f) for c, f in _NATIVE if c is not cls] + [(cls, dense)]
    if isolate is not None:
        _ISOLATE[:] = [(c, f) for c, f in _ISOLATE if c is not cls] + [(cls, isolate)]


def register_default(factory: Callable[[], AsyncReduction]) -> None:
    """The back end used when neither ``transport`` nor ``reducer`` is given
    (torch.distributed's layer registers itself)."""
    _DEFAULT[:] = [factory]


def lookup(table, obj):
    """The entry of ``table`` registered for ``type(obj)`` or its nearest base."""
    for cls in type(obj).__mro__:
        for c, f in table:
            if c is cls:
                return f
    return None
