"""CUDA back end: the kernels of ``csrc/cuda`` compiled at run time by CuPy.

Same signatures and results as :mod:`gtopk_plugin.kernels.reference` on
the same CUDA tensors, bit for bit (``gtopk-bench gpu-check`` and
``tests/unit/test_kernels_cuda.py`` compare them on a GPU).

:func:`load` (once, on the first kernel call on a CUDA tensor) imports
CuPy and compiles the shipped ``.cu`` files with ``cupy.RawModule``
(NVRTC), includes pasted in so CuPy's source-keyed cache is never stale.
Without CuPy, or if NVRTC fails, it warns once and returns ``None``: CUDA
tensors then use the reference kernels.  Kernels get the tensors' raw
device pointers and run on torch's current stream; temporaries are torch
tensors; selected positions are sorted with ``torch.sort`` and values
gathered with ``index_select`` (stored bits kept).  The reducer's fused
kernels have their host code in :mod:`._cuda_fused`.  Inputs the kernels
do not take (other dtypes, unsorted merge operands, non-integer divisors,
non-1-D buffers, CPU tensors) go to the reference.  See docs/kernels.md.
"""
from __future__ import annotations

import collections
import logging
import sys
import threading
import warnings
from types import ModuleType
from typing import Dict, Optional, Tuple

import torch

from gtopk_plugin.kernels import _cuda_fused, reference
from gtopk_plugin.kernels.reference import member_sorted  # noqa: F401  (torch.searchsorted runs on the device)
from gtopk_plugin.kernels._cuda_layout import (  # noqa: F401  (re-exported: tests model the kernels with them)
    _IMAX, _INDEX, _VALUES, BINS, CHUNK, DIGIT, KERNEL_RUN, KERNEL_SAMPLE, ST_N, SUPPORTED, THREADS,
    _bound_rank, _cand_capacity, _Layout, _make_layout, _passes, _threshold_params, _work,
    merge_layout)
from gtopk_plugin.kernels._cuda_source import FILES, kernel_names, sources  # noqa: F401

log = logging.getLogger("gtopk_plugin.kernels")

INSTALL_HINT = "pip install gtopk-plugin[cuda]"

_cupy = None
_lock = threading.Lock()
_failed = False
_modules: Dict[str, object] = {}          # file -> cupy.RawModule
_kernels: Dict[Tuple[str, str], object] = {}  # (file, name) -> RawKernel
_layouts: "collections.OrderedDict" = collections.OrderedDict()
_LAYOUT_CACHE = 32


# --------------------------------------------------------------------------
# Loading


def _compile(cupy) -> None:
    srcs = sources()
    log.info("gtopk_plugin: compiling the CUDA kernels with NVRTC (once; CuPy caches them)")
    names = kernel_names()
    for f, code in srcs.items():
        mod = cupy.RawModule(code=code, options=("--std=c++14",))
        # Fetching one kernel compiles (NVRTC, or CuPy's cache) and loads the
        # module on the current device, so a failure shows here, once.
        _kernels[(f, names[f][0])] = mod.get_function(names[f][0])
        _modules[f] = mod


def load() -> Optional[ModuleType]:
    """Import CuPy and compile the kernels; this module when usable, ``None``
    (after one warning) when not."""
    global _cupy, _failed
    with _lock:
        if _cupy is not None:
            return sys.modules[__name__]
        if _failed:
            return None
        try:
            import cupy  # noqa: F401
        except Exception as e:  # ImportError, or a CuPy that cannot find its CUDA libraries
            _failed = True
            warnings.warn(
                f"gtopk_plugin: CuPy is not available ({type(e).__name__}: {e}); CUDA tensors use "
                f"the pure-torch reference kernels (slower). `{INSTALL_HINT}` installs it "
                "(cupy-cuda12x; `pip install gtopk-plugin[cuda13]` for CUDA 13).",
                RuntimeWarning, stacklevel=3)
            return None
        try:
            with cupy.cuda.Device(torch.cuda.current_device()):
                _compile(cupy)
        except Exception as e:  # missing sources, NVRTC errors, no driver
            _failed = True
            reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            warnings.warn(f"gtopk_plugin: the CUDA kernels could not be compiled ({reason}); "
                          "CUDA tensors use the pure-torch reference kernels (slower).",
                          RuntimeWarning, stacklevel=3)
            return None
        _cupy = cupy
        return sys.modules[__name__]


def _kernel(f: str, name: str):
    key = (f, name)
    k = _kernels.get(key)
    if k is None:
        k = _kernels[key] = _modules[f].get_function(name)
    return k


class _On:
    """Runs launches on ``device`` and on torch's current stream there."""

    def __init__(self, device: torch.device):
        self.dev = device.index if device.index is not None else torch.cuda.current_device()

    def __enter__(self):
        cp = _cupy
        self._d = cp.cuda.Device(self.dev)
        self._d.__enter__()
        self._s = cp.cuda.ExternalStream(torch.cuda.current_stream(self.dev).cuda_stream)
        self._s.__enter__()
        return self

    def __exit__(self, *exc):
        self._s.__exit__(*exc)
        self._d.__exit__(*exc)
        return False


def _p(t: torch.Tensor):
    """A tensor as a kernel argument: its device pointer."""
    import numpy as np

    return np.uint64(t.data_ptr())


def _i64(v: int):
    import numpy as np

    return np.int64(v)


def _i32(v: int):
    import numpy as np

    return np.int32(v)


def _launch(f: str, name: str, blocks: int, args) -> None:
    _kernel(f, name)((max(1, int(blocks)),), (THREADS,), tuple(args))


def _blocks(n: int) -> int:
    return (int(n) + THREADS - 1) // THREADS


# --------------------------------------------------------------------------
# Segment layouts (host arithmetic in _cuda_layout.py, once per (offsets, k)
# pattern: cached here)


def _layout(device, offsets, k, kind: str, numel: int) -> _Layout:
    offs = [int(v) for v in offsets.tolist()]
    ks = [int(v) for v in k.tolist()]
    if len(offs) != len(ks) + 1:
        raise ValueError(f"offsets must have len(k) + 1 = {len(ks) + 1} entries, got {len(offs)}")
    if ks and (offs[0] < 0 or offs[-1] > numel):
        raise ValueError("offsets must lie within [0, x.numel()]")
    key = (str(device), kind, tuple(offs), tuple(ks))
    L = _layouts.get(key)
    if L is None:
        if any(offs[s] > offs[s + 1] for s in range(len(ks))):
            raise ValueError("offsets must be non-decreasing")
        L = _make_layout(device, offs, ks, kind)
        _layouts[key] = L
        if len(_layouts) > _LAYOUT_CACHE:
            _layouts.popitem(last=False)
    else:
        _layouts.move_to_end(key)
    return L


# --------------------------------------------------------------------------
# Kernels (reference signatures)


#: The device type these kernels serve (a name, so that the tests can run
#: the host side and the real kernels on CPU tensors: cuda_executor/).
_DEVICE_TYPE = "cuda"


def _ok(x: torch.Tensor) -> bool:
    return x.device.type == _DEVICE_TYPE and x.dtype in _VALUES and x.dim() == 1


def _radix(x, L, out, kind_out, st, hist, ctr, cand, init: bool):
    """The radix passes of select.cu over the dense segments of ``x``; with
    ``init``, the state is initialised first (and segments with a sampled
    bound try to start from its candidates)."""
    vs, kbits = _VALUES[x.dtype]
    S = L.S
    half = max(1, L.ncand)
    cand0, cand1 = cand[:half], cand[half:]
    if init:
        _launch("select.cu", "gtopk_radix_init", _blocks(S),
                (_p(L.seg), _p(L.k), _i32(S), _p(st)))
        if L.has_bound:
            thr = torch.empty(S, dtype=torch.int64, device=x.device)
            _launch("select.cu", f"gtopk_thr_sample_{vs}", S,
                    (_p(x), _p(L.seg), _p(L.bpar), _p(thr)))
            _launch("select.cu", f"gtopk_bound_collect_{vs}", L.nblocks,
                    (_p(x), _p(L.lay), _i32(S), _p(thr), _p(ctr), _p(cand0)))
            _launch("select.cu", "gtopk_bound_decide", _blocks(S),
                    (_p(L.lay), _i32(S), _p(ctr), _p(st)))
    name = f"gtopk_topk_pass_{vs}_{kind_out}"
    for j in range(_passes(kbits, L.wbits) + 1):
        _launch("select.cu", name, L.nblocks,
                (_p(x), _p(L.lay), _i32(S), _i32(j), _i32(kbits), _i32(L.wbits), _p(st),
                 _p(hist), _p(ctr), _p(cand0), _p(cand1), _p(out)))


def select_topk(x, offsets, k):
    if not _ok(x):
        return reference.select_topk(x, offsets, k)
    x = x.contiguous()
    itype = reference.index_dtype(x.numel())
    L = _layout(x.device, offsets, k, "topk", x.numel())
    if L.nslots == 0:
        idx = torch.empty(0, dtype=itype, device=x.device)
        return idx, x[:0]
    out = torch.empty(L.nslots, dtype=itype, device=x.device)
    st, hist, ctr, cand = _work(L, x.device)
    with _On(x.device):
        _radix(x, L, out, _INDEX[itype], st, hist, ctr, cand, init=True)
    idx = torch.sort(out).values
    return idx, x.index_select(0, idx)


def select_threshold(x, offsets, k):
    if not _ok(x) or (reference.THRESHOLD_SAMPLE, reference.THRESHOLD_RUN) != (KERNEL_SAMPLE,
                                                                              KERNEL_RUN):
        return reference.select_threshold(x, offsets, k)
    x = x.contiguous()
    itype = reference.index_dtype(x.numel())
    L = _layout(x.device, offsets, k, "threshold", x.numel())
    if L.nslots == 0:
        idx = torch.empty(0, dtype=itype, device=x.device)
        return idx, x[:0]
    vs, _ = _VALUES[x.dtype]
    ks = _INDEX[itype]
    S = L.S
    out = torch.full((L.nslots,), _IMAX[itype], dtype=itype, device=x.device)
    thr = torch.empty(S, dtype=torch.int64, device=x.device)
    st, hist, ctr, cand = _work(L, x.device)
    with _On(x.device):
        _launch("select.cu", f"gtopk_thr_sample_{vs}", S,
                (_p(x), _p(L.seg), _p(L.tpar), _p(thr)))
        _launch("select.cu", f"gtopk_thr_count_{vs}_{ks}", L.nblocks,
                (_p(x), _p(L.lay), _i32(S), _p(thr), _p(ctr), _p(out)))
        _launch("select.cu", "gtopk_thr_decide", _blocks(S),
                (_p(L.seg), _p(L.k), _p(L.cpar), _i32(S), _p(ctr), _p(st)))
        _launch("select.cu", f"gtopk_thr_clear_{ks}", _blocks(L.nslots),
                (_p(L.outo), _i32(S), _p(st), _p(out)))
        _radix(x, L, out, ks, st, hist, ctr, cand, init=False)
    total = int(ctr[S:2 * S].sum())  # the one read-back: the result's size
    idx = torch.sort(out).values[:total]
    return idx, x.index_select(0, idx)


def merge_select(idx_a, val_a, idx_b, val_b, offsets, k):
    dev = val_a.device
    if (not _ok(val_a) or val_b.device != dev or idx_a.device != dev or idx_b.device != dev
            or idx_a.dtype not in _INDEX or idx_b.dtype not in _INDEX or idx_a.dim() != 1
            or idx_b.dim() != 1 or val_b.dim() != 1 or idx_a.numel() != val_a.numel()
            or idx_b.numel() != val_b.numel()):
        return reference.merge_select(idx_a, val_a, idx_b, val_b, offsets, k)
    itype = idx_a.dtype
    ia, ib = idx_a.contiguous(), idx_b.to(itype).contiguous()
    va, vb = val_a.contiguous(), val_b.to(val_a.dtype).contiguous()
    na, nb = ia.numel(), ib.numel()
    offs = [int(v) for v in offsets.tolist()]
    ks = [int(v) for v in k.tolist()]
    S = len(ks)
    if len(offs) != S + 1:
        raise ValueError(f"offsets must have len(k) + 1 = {S + 1} entries, got {len(offs)}")
    if na + nb == 0:
        e = torch.empty(0, dtype=torch.bool, device=dev)
        return ia[:0], va[:0], e, e.clone()
    vs, kbits = _VALUES[va.dtype]
    isuf = _INDEX[itype]
    off_d = torch.tensor(offs, dtype=torch.int64).to(dev)
    bnd = torch.empty(2 * (S + 1), dtype=torch.int64, device=dev)
    with _On(dev):
        _launch("merge.cu", f"gtopk_merge_bounds_{isuf}", _blocks(2 * (S + 1)),
                (_p(ia), _i64(na), _p(ib), _i64(nb), _p(off_d), _i32(S), _p(bnd)))
    inc = torch.stack([(ia[1:] > ia[:-1]).all(), (ib[1:] > ib[:-1]).all()]).to(torch.int64)
    host = torch.cat([bnd, inc]).tolist()  # one read-back: ranges and the sortedness check
    if not (host[-2] and host[-1]):
        return reference.merge_select(idx_a, val_a, idx_b, val_b, offsets, k)
    ab, bb = host[: S + 1], host[S + 1: 2 * (S + 1)]
    if not (S > 0 and ab[0] == 0 and ab[S] == na and bb[0] == 0 and bb[S] == nb):
        raise RuntimeError("merge_select: indices must lie within [offsets[0], offsets[-1])")
    L = merge_layout(dev, offs, ks, ab, bb)
    nslots = L.nslots
    n = na + nb
    uidx = torch.empty(n, dtype=torch.int64, device=dev)
    uval = torch.empty(n, dtype=va.dtype, device=dev)
    uvalid = torch.empty(n, dtype=torch.uint8, device=dev)
    posa = torch.empty(max(1, na), dtype=torch.int64, device=dev)
    posb = torch.empty(max(1, nb), dtype=torch.int64, device=dev)
    sel = torch.zeros(n, dtype=torch.uint8, device=dev)
    keep_a = torch.empty(na, dtype=torch.uint8, device=dev)
    keep_b = torch.empty(nb, dtype=torch.uint8, device=dev)
    slots = torch.full((max(1, nslots),), _IMAX[torch.int64], dtype=torch.int64, device=dev)
    oidx = torch.empty(max(1, nslots), dtype=itype, device=dev)
    oval = torch.empty(max(1, nslots), dtype=va.dtype, device=dev)
    st, hist, ctr, cand = _work(L, dev)
    half = max(1, L.ncand)
    with _On(dev):
        _launch("merge.cu", f"gtopk_merge_union_{vs}_{isuf}", _blocks(n),
                (_p(ia), _p(va), _i64(na), _p(ib), _p(vb), _i64(nb), _p(bnd), _i32(S),
                 _p(uidx), _p(uval), _p(uvalid), _p(posa), _p(posb)))
        if nslots:
            _launch("merge.cu", "gtopk_radix_init", _blocks(S),
                    (_p(L.seg), _p(L.k), _i32(S), _p(st)))
            for j in range(_passes(kbits, L.wbits) + 1):
                _launch("merge.cu", f"gtopk_merge_pass_{vs}", L.nblocks,
                        (_p(uval), _p(uidx), _p(uvalid), _p(L.lay), _p(off_d), _i32(S), _i32(j),
                         _i32(kbits), _i32(L.wbits), _p(st), _p(hist), _p(ctr), _p(cand[:half]),
                         _p(cand[half:]), _p(slots)))
            _launch("merge.cu", f"gtopk_merge_finish_{vs}_{isuf}", _blocks(nslots),
                    (_p(slots), _i64(nslots), _p(uidx), _p(uval), _p(sel), _p(oidx), _p(oval)))
        _launch("merge.cu", "gtopk_merge_keep", _blocks(n),
                (_p(posa), _i64(na), _p(posb), _i64(nb), _p(sel), _p(keep_a), _p(keep_b)))
    if nslots == 0:
        return ia[:0], va[:0], keep_a.view(torch.bool), keep_b.view(torch.bool)
    total = int(ctr[S:2 * S].sum())
    sorted_idx, perm = torch.sort(oidx)
    return (sorted_idx[:total], oval.index_select(0, perm[:total]), keep_a.view(torch.bool),
            keep_b.view(torch.bool))


def _sparse_ok(idx, vals, dev) -> bool:
    return (idx.dtype in _INDEX and idx.device == dev and vals.device == dev and idx.dim() == 1
            and vals.dim() == 1 and idx.numel() == vals.numel())


def scatter_update(numel, idx, vals, divisor, dtype):
    dev = vals.device
    if (dtype not in _VALUES or dev.type != _DEVICE_TYPE or not _sparse_ok(idx, vals, dev)
            or not isinstance(divisor, int) or divisor == 0):
        return reference.scatter_update(numel, idx, vals, divisor, dtype)
    out = torch.zeros(int(numel), dtype=dtype, device=dev)
    n = idx.numel()
    if n:
        v = vals.to(dtype).contiguous()
        i = idx.contiguous()
        vs, _ = _VALUES[dtype]
        with _On(dev):
            _launch("scatter.cu", f"gtopk_scatter_{vs}_{_INDEX[i.dtype]}", _blocks(n),
                    (_p(i), _p(v), _i64(n), _i64(divisor), _p(out), _i64(numel)))
    return out


# The reducer's fused and in-place kernels (csrc/cuda/compensate.cu): host
# code in _cuda_fused.py, which launches through this module.
_rt = sys.modules[__name__]


def compensate(out, grad, residual):
    return _cuda_fused.compensate(_rt, out, grad, residual)


def compensate_select_topk(acc, grads, residual, offsets, k):
    return _cuda_fused.compensate_select_topk(_rt, acc, grads, residual, offsets, k)


def subtract_at_(acc, idx, sent, mask=None):
    return _cuda_fused.subtract_at_(_rt, acc, idx, sent, mask)


def scatter_reset_(out, prev, idx, vals, divisor):
    return _cuda_fused.scatter_reset_(_rt, out, prev, idx, vals, divisor)


def div_count_(x, divisor, out=None):
    return _cuda_fused.div_count_(_rt, x, divisor, out)
