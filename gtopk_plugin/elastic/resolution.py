"""How ``ElasticScheduler(transport=..., reducer=...)`` turns into an
:class:`~.backend.AsyncReduction` back end.

A :class:`~gtopk_plugin.GradientReducer` runs on a worker thread
(:class:`~.threaded.ThreadedReduction`, on an isolated transport where its
framework layer registered one); a Transport uses the native asynchronous
dense reduction its framework layer registered
(:func:`~.backend.register_transport`), else a dense allreduce through the
Transport on a worker thread; no argument: the registered default
(torch.distributed's layer).  Kept apart from :mod:`.backend` so that the
interface module imports no back end: :mod:`.threaded` builds on
:mod:`.backend`, and this module on both (no import cycle).
"""
from __future__ import annotations

from gtopk_plugin.collectives.transport import Transport
from gtopk_plugin.reducer import GradientReducer
from gtopk_plugin.elastic.backend import _DEFAULT, _ISOLATE, _NATIVE, AsyncReduction, lookup
from gtopk_plugin.elastic.threaded import ThreadedReduction, TransportDenseReduction


def resolve(transport, reducer) -> AsyncReduction:
    """The back end for ``ElasticScheduler(transport=..., reducer=...)``."""
    if reducer is not None:
        if not isinstance(reducer, GradientReducer):
            raise ValueError(f"reducer must be None (dense allreduce) or a gtopk_plugin.GradientReducer; "
                             f"got {type(reducer).__name__}")
        if transport is not None and transport is not reducer.transport:
            raise ValueError("pass either transport= or a reducer built on its transport, not both: a "
                             "GradientReducer communicates through its own transport "
                             "(GradientReducer(..., transport=...))")
        isolate = lookup(_ISOLATE, reducer.transport)
        if isolate is not None:
            reducer.transport = isolate(reducer.transport)
        return ThreadedReduction(reducer)
    if transport is None:
        if not _DEFAULT:
            raise ValueError("no default back end registered; pass transport=")
        return _DEFAULT[0]()
    if isinstance(transport, AsyncReduction):
        return transport
    if isinstance(transport, Transport):
        native = lookup(_NATIVE, transport)
        if native is not None:
            return native(transport)
        return TransportDenseReduction(transport)
    raise ValueError(f"transport must be None, a gtopk_plugin Transport (TorchDistributedTransport, "
                     f"HorovodTransport, ...) or an elastic AsyncReduction back end; got "
                     f"{type(transport).__name__}")
