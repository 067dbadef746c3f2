"""CPU back end: the kernels of ``csrc/cpu`` as a torch C++ extension.

Same signatures and results as :mod:`gtopk_plugin.kernels.reference` (bit for
bit: tests compare the two).  The compiled module comes from, in order:

1. ``gtopk_plugin/_cpu_kernels_<source hash>.so``, built by
   ``pip install --no-build-isolation`` when a C++ compiler was present (the
   hash in the name: only a library built from the current sources is used);
2. a module compiled on first use with ``torch.utils.cpp_extension.load``
   and cached under ``~/.cache/gtopk_plugin/cpu_kernels/`` (one log line
   announces the one-time compile);
3. nothing: without a compiler (or if compiling fails) :func:`load` returns
   ``None`` after one warning and the dispatcher keeps the reference kernels.

The library registers the operators ``torch.ops.gtopk_cpu.*``.  Inputs the
compiled kernels do not take (other dtypes, unsorted merge
operands, non-1-D residuals) are passed to the reference.
"""
from __future__ import annotations

import logging
import shutil
import sys
import threading
import warnings
from types import ModuleType
from typing import Optional

import torch

from gtopk_plugin import config
from gtopk_plugin.kernels import _build, reference

log = logging.getLogger("gtopk_plugin.kernels")

#: Value dtypes the compiled kernels handle (everything else: reference).
SUPPORTED = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_INDEX = (torch.int32, torch.int64)
#: compensate: one IEEE addition in the value type; fp16/bf16 go to the
#: reference (torch adds them in float32 and rounds once).
_COMPENSATE = (torch.float32, torch.float64)

_ext = None               # the compiled module once loaded
_origin: Optional[str] = None   # "installed" | "jit" (where _ext came from)
_lock = threading.Lock()
_failed = False


def _load_library(path) -> None:
    torch.ops.load_library(str(path))


def _compiler() -> Optional[str]:
    return shutil.which(config.env_compiler())


def _jit(src_dir, files, src_hash: str) -> None:
    from torch.utils import cpp_extension

    name = f"gtopk_cpu_kernels_{src_hash}"
    build_dir = _build.cache_root(config.env_cache_home()) / _build.build_tag(torch) / src_hash
    so = build_dir / f"{name}.so"
    if so.exists():
        try:
            _load_library(so)
            return
        except Exception:  # a broken cache entry: rebuild it below
            pass
    if _compiler() is None:
        raise RuntimeError("no C++ compiler found (set CXX or install g++/clang)")
    build_dir.mkdir(parents=True, exist_ok=True)
    log.warning("gtopk_plugin: compiling the CPU kernels once (about a minute); cached in %s", build_dir)
    cpp_extension.load(
        name=name,
        sources=[str(f) for f in files if f.suffix == ".cpp"],
        extra_cflags=_build.cflags(torch, src_hash),
        extra_ldflags=_build.ldflags(torch),
        extra_include_paths=[str(src_dir)],
        build_directory=str(build_dir),
        is_python_module=False,  # loads the library: registers torch.ops.gtopk_cpu
        verbose=False,
    )


def load() -> Optional[ModuleType]:
    """Load (compiling once if needed) the CPU kernels; this module when they
    are usable, ``None`` (after one warning) when they are not."""
    global _ext, _origin, _failed
    with _lock:
        if _ext is not None:
            return sys.modules[__name__]
        if _failed:
            return None
        src_dir = _build.source_dir("cpu")
        files = _build.source_files(src_dir) if src_dir is not None else []
        if not files:
            warnings.warn("gtopk_plugin: the csrc/cpu sources are missing from this installation; "
                          "using the pure-torch reference kernels", RuntimeWarning, stacklevel=3)
            _failed = True
            return None
        src_hash = _build.source_hash(files)
        origin = None
        lib = _build.installed_library(src_hash)
        if lib is not None:
            try:
                _load_library(lib)
                origin = "installed"
            except Exception as e:  # e.g. built against another torch
                log.debug("gtopk_plugin: cannot load %s (%s); compiling instead", lib, e)
        if origin is None:
            try:
                _jit(src_dir, files, src_hash)
                origin = "jit"
            except Exception as e:  # no compiler, no ninja, a compile error
                reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
                warnings.warn(
                    "gtopk_plugin: the CPU kernels could not be compiled "
                    f"({reason}); using the pure-torch reference kernels (slower). "
                    "Install a C++ compiler and ninja, or reinstall with "
                    "`pip install --no-build-isolation .`", RuntimeWarning, stacklevel=3)
                _failed = True
                return None
        ops = torch.ops.gtopk_cpu
        if ops.source_hash() != src_hash:  # pragma: no cover - another build already loaded
            warnings.warn("gtopk_plugin: a CPU kernels library from other sources is already "
                          "loaded in this process; using it", RuntimeWarning, stacklevel=3)
        _ext, _origin = ops, origin
        return sys.modules[__name__]


def origin() -> Optional[str]:
    """``"installed"`` or ``"jit"`` once loaded, else ``None``."""
    return _origin


# --------------------------------------------------------------------------
# Kernels (reference signatures)


def _cpu_float(*ts) -> bool:
    return all(t.device.type == "cpu" and t.dtype in SUPPORTED for t in ts)


def _seg(offsets, k):
    return (offsets.to(device="cpu", dtype=torch.int64).contiguous(),
            k.to(device="cpu", dtype=torch.int64).contiguous())


def select_topk(x, offsets, k):
    if not _cpu_float(x) or x.dim() != 1:
        return reference.select_topk(x, offsets, k)
    return _ext.select_topk(x.contiguous(), *_seg(offsets, k))


def select_threshold(x, offsets, k):
    if not _cpu_float(x) or x.dim() != 1:
        return reference.select_threshold(x, offsets, k)
    return _ext.select_threshold(x.contiguous(), *_seg(offsets, k))


def merge_select(idx_a, val_a, idx_b, val_b, offsets, k):
    if (not _cpu_float(val_a) or val_b.device.type != "cpu" or idx_a.dtype not in _INDEX
            or idx_b.dtype not in _INDEX):
        return reference.merge_select(idx_a, val_a, idx_b, val_b, offsets, k)
    idx_b = idx_b.to(idx_a.dtype)
    val_b = val_b.to(val_a.dtype)
    if not (_ext.strictly_increasing(idx_a) and _ext.strictly_increasing(idx_b)):
        return reference.merge_select(idx_a, val_a, idx_b, val_b, offsets, k)
    return _ext.merge_select(idx_a, val_a, idx_b, val_b, *_seg(offsets, k))


def member_sorted(values, ascending):
    if (values.device.type != "cpu" or ascending.device.type != "cpu" or values.dtype not in _INDEX
            or ascending.dtype != values.dtype or values.dim() != 1 or ascending.dim() != 1
            or not (_ext.strictly_increasing(values) and _ext.strictly_increasing(ascending))):
        return reference.member_sorted(values, ascending)
    return _ext.member_sorted(values, ascending)


def scatter_update(numel, idx, vals, divisor, dtype):
    if (dtype not in SUPPORTED or vals.device.type != "cpu" or idx.dtype not in _INDEX
            or not isinstance(divisor, int)):
        return reference.scatter_update(numel, idx, vals, divisor, dtype)
    return _ext.scatter_update(int(numel), idx, vals.to(dtype), int(divisor))


def compensate(out, grad, residual):
    if (not _cpu_float(out, grad) or out.dtype != grad.dtype or grad.dtype not in _COMPENSATE
            or out.dim() != 1 or not out.is_contiguous()
            or (residual is not None and (residual.dtype != out.dtype or residual.device != out.device
                                          or residual.dim() != 1 or not residual.is_contiguous()))):
        return reference.compensate(out, grad, residual)
    return bool(_ext.compensate(out, grad.reshape(-1).contiguous(), residual))


def prescale_copy(out, grad, shift):
    if (not _cpu_float(out, grad) or out.dtype != grad.dtype or out.dim() != 1
            or not out.is_contiguous() or not isinstance(shift, int)):
        return reference.prescale_copy(out, grad, shift)
    finite, exact, nnz = _ext.prescale_copy(out, grad.reshape(-1).contiguous(), int(shift))
    return bool(finite), bool(exact), int(nnz)


def subtract_at_(acc, idx, sent, mask=None):
    if (not _cpu_float(acc) or acc.dim() != 1 or not acc.is_contiguous() or idx.dtype not in _INDEX
            or (mask is not None and (mask.dtype != torch.bool or mask.device.type != "cpu"
                                      or mask.shape != idx.shape))):
        return reference.subtract_at_(acc, idx, sent, mask)
    _ext.subtract_at_(acc, idx, sent.to(acc.dtype), mask)
    return acc


def scatter_reset_(out, prev, idx, vals, divisor):
    if (not _cpu_float(out) or out.dim() != 1 or not out.is_contiguous() or idx.dtype not in _INDEX
            or prev.dtype not in _INDEX or not isinstance(divisor, int) or divisor < 1):
        return reference.scatter_reset_(out, prev, idx, vals, divisor)
    _ext.scatter_reset_(out, prev, idx, vals.to(out.dtype), int(divisor))
    return out


def compensate_select_topk(acc, grads, residual, offsets, k):
    dt = acc.dtype
    if (dt not in _COMPENSATE or acc.device.type != "cpu" or acc.dim() != 1 or not acc.is_contiguous()
            or any(g.dtype != dt or g.device.type != "cpu" for g in grads)
            or (residual is not None and (residual.dtype != dt or residual.device.type != "cpu"
                                          or residual.dim() != 1 or not residual.is_contiguous()))):
        return reference.compensate_select_topk(acc, grads, residual, offsets, k)
    return _ext.compensate_select_topk(acc, [g.reshape(-1).contiguous() for g in grads], residual,
                                       *_seg(offsets, k))


def nonzero_indices(x, limit=None):
    if not _cpu_float(x) or x.dim() != 1 or not x.is_contiguous():
        return reference.nonzero_indices(x, limit)
    idx, complete = _ext.nonzero_indices(x, -1 if limit is None else int(limit))
    return idx if complete else None


def div_count_(x, divisor, out=None):
    y = x if out is None else out
    if (not _cpu_float(x, y) or x.dim() != 1 or y.shape != x.shape or y.dtype != x.dtype
            or not x.is_contiguous() or not y.is_contiguous() or not isinstance(divisor, int) or divisor < 1):
        return reference.div_count_(x, divisor, out)
    if y is x or y.data_ptr() == x.data_ptr():
        return int(_ext.div_count_(x, int(divisor)))
    return int(_ext.div_count_into(x, int(divisor), y))
