"""gtopk_plugin.kernels.cuda served by the executor: its own host code, the
real kernels of csrc/cuda, CPU tensors.

:func:`install` compiles the sources through ``cuda._compile`` (the code
path ``cuda.load`` takes, with the executor in CuPy's place) and redirects
the few things that need a GPU: the device type the back end accepts
("cpu"), the launch context (no CUDA device or stream), and ``_p``, which
now registers each tensor as global memory.  The host code's
``torch.empty`` buffers start as 0xFF bytes (NaN, -1), as the GPU check
poisons its allocator, so an output a kernel fails to write shows.
"""
from __future__ import annotations

import collections
import contextlib
import types
from typing import Callable, Dict, Optional

from cuda_executor import Executor


class _NoDevice:
    """cuda._On without a GPU: nothing to enter."""

    def __init__(self, device):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _PoisonedTorch:
    """The torch module, but ``empty``/``empty_like`` fill with 0xFF bytes."""

    def __init__(self, torch):
        self._torch = torch

    def __getattr__(self, name):
        return getattr(self._torch, name)

    def empty(self, *a, **kw):
        t = self._torch.empty(*a, **kw)
        if t.numel():
            t.untyped_storage().fill_(0xFF)
        return t

    def empty_like(self, *a, **kw):
        t = self._torch.empty_like(*a, **kw)
        if t.numel():
            t.untyped_storage().fill_(0xFF)
        return t


def cupy_module(ex: Executor):
    """A stand-in for the ``cupy`` module as cuda.load() uses it: the
    executor's RawModule, and device/stream contexts that do nothing."""
    return types.SimpleNamespace(RawModule=ex.cupy.RawModule,
                                 cuda=types.SimpleNamespace(Device=_NoDevice,
                                                            ExternalStream=_NoDevice))


def install(ex: Executor, setattr_: Callable, sources: Optional[Dict[str, str]] = None):
    """Point gtopk_plugin.kernels.cuda at the executor ``ex`` (``setattr_``:
    pytest's monkeypatch.setattr, or a recording one); ``sources`` replaces
    the csrc/cuda texts (the mutation check).  Returns the cuda module."""
    import torch

    from gtopk_plugin.kernels import _cuda_fused, _cuda_layout, _cuda_source, cuda

    if sources is not None:
        setattr_(_cuda_source, "_sources", dict(sources))
    setattr_(cuda, "_DEVICE_TYPE", "cpu")
    setattr_(cuda, "_On", _NoDevice)
    setattr_(cuda, "_p", ex.ptr)
    setattr_(cuda, "_modules", {})
    setattr_(cuda, "_kernels", {})
    setattr_(cuda, "_layouts", collections.OrderedDict())
    poisoned = _PoisonedTorch(torch)
    for m in (cuda, _cuda_fused, _cuda_layout):
        setattr_(m, "torch", poisoned)
    cuda._compile(ex.cupy)
    setattr_(cuda, "_cupy", ex.cupy)
    return cuda


@contextlib.contextmanager
def serving(ex: Executor, sources: Optional[Dict[str, str]] = None):
    """:func:`install` for the duration of a ``with`` block."""
    saved = []

    def set_(obj, name, value):
        saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    try:
        yield install(ex, set_, sources)
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)
