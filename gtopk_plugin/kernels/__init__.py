"""Selection / merge / scatter kernels behind one interface.

``reference`` (pure torch) is the oracle and the last fallback; fast back
ends (``csrc/cpu`` as a torch C++ extension, ``csrc/cuda`` through CuPy)
register here with the same signatures.  Callers call the functions below
(``select_topk``, ``select_threshold``, ``merge_select``,
``scatter_update``, ``compensate``, ``compensate_select_topk``,
``div_count_``, ``prescale_copy``, ``subtract_at_``, ``scatter_reset_``,
``backend(device)``), which dispatch on the tensor's device and the
``kernels`` setting (``GTOPK_KERNELS``, read in :mod:`gtopk_plugin.config`).
A back end that does not load leaves the reference serving (CUDA: after
one warning naming ``pip install gtopk-plugin[cuda]``).  What each kernel
computes: docs/design.md §9; building and loading: docs/kernels.md.
"""
from __future__ import annotations

import threading
from types import ModuleType
from typing import Callable, Dict, Optional

import torch

from gtopk_plugin import config
from gtopk_plugin.kernels import reference
from gtopk_plugin.kernels.reference import index_dtype, INT32_LIMIT  # noqa: F401  (re-exported)

# device type -> back-end module with the reference signatures.  Fast back
# ends add themselves here once they load; until then the reference serves.
_FAST_BACKENDS: Dict[str, ModuleType] = {}
# device type -> loader run once, on first use: returns the back-end module,
# or None when it is unavailable (it has then warned once).
_LOADERS: Dict[str, Callable[[], Optional[ModuleType]]] = {}
_LOAD_LOCK = threading.Lock()


def register_backend(device_type: str, module: Optional[ModuleType] = None, *,
                     loader: Optional[Callable[[], Optional[ModuleType]]] = None) -> None:
    """Register a fast back end for ``device_type`` ("cpu" or "cuda"): a
    module with the reference signatures, or a ``loader`` called on first use
    (compiling is slow, and not every program needs the kernels)."""
    if (module is None) == (loader is None):
        raise ValueError("register_backend: pass exactly one of module or loader")
    if module is not None:
        _FAST_BACKENDS[device_type] = module
        _LOADERS.pop(device_type, None)
    else:
        _FAST_BACKENDS.pop(device_type, None)
        _LOADERS[device_type] = loader


def _fast(dev_type: str) -> Optional[ModuleType]:
    mod = _FAST_BACKENDS.get(dev_type)
    if mod is None and dev_type in _LOADERS:
        with _LOAD_LOCK:
            loader = _LOADERS.pop(dev_type, None)
            if loader is not None:
                mod = loader()
                if mod is not None:
                    _FAST_BACKENDS[dev_type] = mod
        mod = _FAST_BACKENDS.get(dev_type)
    return mod


def _module(device: torch.device, choice: Optional[str] = None) -> ModuleType:
    choice = choice or config.env_kernels()
    if choice == "reference":
        return reference
    dev_type = torch.device(device).type
    if choice in ("cpu", "cuda") and choice != dev_type:
        raise ValueError(f"GTOPK_KERNELS={choice!r} cannot run tensors on device {dev_type!r}")
    mod = _fast(dev_type)
    if mod is None and choice in ("cpu", "cuda"):
        raise RuntimeError(
            f"kernels back end {choice!r} was forced but is not available in this build; "
            "unset GTOPK_KERNELS to fall back to the reference kernels")
    return mod or reference


def backend(device) -> str:
    """Name of the back end used for tensors on ``device``."""
    mod = _module(torch.device(device))
    return "reference" if mod is reference else torch.device(device).type


def select_topk(x, offsets, k, *, kernels: Optional[str] = None):
    return _module(x.device, kernels).select_topk(x, offsets, k)


def select_threshold(x, offsets, k, *, kernels: Optional[str] = None):
    return _module(x.device, kernels).select_threshold(x, offsets, k)


def merge_select(idx_a, val_a, idx_b, val_b, offsets, k, *, kernels: Optional[str] = None):
    return _module(val_a.device, kernels).merge_select(idx_a, val_a, idx_b, val_b, offsets, k)


def member_sorted(values, ascending, *, kernels: Optional[str] = None):
    """``torch.isin(values, ascending)`` for strictly ascending ``ascending``
    (and, for the CPU kernel's one walk, ascending ``values``): bool per value."""
    return _module(values.device, kernels).member_sorted(values, ascending)


def scatter_update(numel, idx, vals, divisor, dtype, *, kernels: Optional[str] = None):
    return _module(vals.device, kernels).scatter_update(numel, idx, vals, divisor, dtype)


def compensate(out, grad, residual, *, kernels: Optional[str] = None) -> bool:
    """``out = grad + residual`` (or ``grad``; in ``out``'s dtype) and whether
    every entry of ``grad`` is finite, in one pass where the back end can.
    ``out``: a 1-D buffer of ``grad.numel()`` entries (the caller's scratch
    accumulator); ``residual``: ``None`` or 1-D like ``out``."""
    return _module(out.device, kernels).compensate(out, grad, residual)


def compensate_select_topk(acc, grads, residual, offsets, k, *, kernels: Optional[str] = None):
    """:func:`compensate` of ``grads`` (concatenated: ``acc``'s length) into
    ``acc`` and :func:`select_topk` of it, fused into one pass over the
    gradients and the residual where the back end can.  Returns ``(idx,
    vals, finite)`` with ``finite[t]``: gradient t is all finite."""
    return _module(acc.device, kernels).compensate_select_topk(acc, grads, residual, offsets, k)


def nonzero_indices(x, *, limit: Optional[int] = None, kernels: Optional[str] = None):
    """The positions of the entries of 1-D ``x`` whose bits are not all
    zero (every value but +0.0), ascending, int64, in one read where the
    back end can; ``None`` when there are more than ``limit``."""
    return getattr(_module(x.device, kernels), "nonzero_indices", reference.nonzero_indices)(x, limit)


def div_count_(x, divisor, *, out=None, kernels: Optional[str] = None) -> int:
    """``out = x / divisor`` (a copy when 1; in place when ``out`` is None
    or ``x``; ``out`` like ``x``, not partly overlapping it); returns the
    number of nonzero entries of the result, in one pass where the back end
    can."""
    if out is None:
        return _module(x.device, kernels).div_count_(x, divisor)
    return _module(x.device, kernels).div_count_(x, divisor, out)


def prescale_copy(out, grad, shift: int, *, kernels: Optional[str] = None):
    """``out = grad * 2**-shift`` with the finiteness check, the exactness
    flag of a prescaled sum and the count of nonzeros, in one pass where the
    back end can: ``(finite, exact, nnz)``; see ``reference.prescale_copy``.
    The dense step of the CPU back ends (``gtopk_plugin.pipeline.dense_direct``); a
    back end without its own kernel (CUDA) serves it with the reference's
    torch ops."""
    mod = _module(out.device, kernels)
    return getattr(mod, "prescale_copy", reference.prescale_copy)(out, grad, shift)


def subtract_at_(acc, idx, sent, *, mask=None, kernels: Optional[str] = None):
    """In place ``acc[idx] -= sent`` (unique ``idx``), where ``mask`` (bool,
    like ``idx``; default: everywhere) is true; returns ``acc``."""
    if mask is None:
        return _module(acc.device, kernels).subtract_at_(acc, idx, sent)
    return _module(acc.device, kernels).subtract_at_(acc, idx, sent, mask)


def scatter_reset_(out, prev, idx, vals, divisor, *, kernels: Optional[str] = None):
    """In place ``out[prev] = 0; out[idx] = vals / divisor``; returns ``out``."""
    return _module(out.device, kernels).scatter_reset_(out, prev, idx, vals, divisor)


# The CPU back end compiles (or loads) csrc/cpu on first use; see kernels/cpu.py.
from gtopk_plugin.kernels import cpu as _cpu  # noqa: E402

register_backend("cpu", loader=_cpu.load)

# The CUDA back end compiles csrc/cuda with CuPy (NVRTC) on the first kernel
# call on a CUDA tensor; without CuPy it warns once and the reference serves.
# See kernels/cuda.py (it imports CuPy only inside its loader).
from gtopk_plugin.kernels import cuda as _cuda  # noqa: E402

register_backend("cuda", loader=_cuda.load)


__all__ = ["select_topk", "select_threshold", "merge_select", "member_sorted", "scatter_update",
           "compensate", "compensate_select_topk", "div_count_", "subtract_at_", "scatter_reset_", "nonzero_indices", "backend", "register_backend",
           "reference", "index_dtype"]
