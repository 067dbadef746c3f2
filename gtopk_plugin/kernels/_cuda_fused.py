"""CUDA host code of the reducer's fused and in-place kernels:
``compensate``, ``compensate_select_topk``, ``subtract_at_``,
``scatter_reset_`` and ``div_count_`` on ``csrc/cuda/compensate.cu``.

Same signatures and results as :mod:`gtopk_plugin.kernels.reference` on
the same CUDA tensors, bit for bit (one IEEE operation per element in the
opmath type; division by the worker count as torch does it on CUDA; the
non-finite flags cover the gradients, not the residual).  Every function
takes ``rt``, the launching module (:mod:`.cuda`), as its first argument,
so this module imports nothing of it and the tests' CPU executor of
``cuda``'s launching (cuda_executor/) serves these kernels too.

``compensate_select_topk`` writes ``acc`` and the flags in one pass that
also collects the candidates at or above a sampled bound; segments whose
bound held finish from the candidates, the others run the radix passes on
``acc`` (docs/design.md §9, docs/kernels.md).  ``finite`` comes back as a
CPU bool tensor, as the reference returns it.  Inputs the kernels do not
take go to the reference.
"""
from __future__ import annotations

from typing import List

import torch

from gtopk_plugin.kernels import reference
from gtopk_plugin.kernels._cuda_layout import _INDEX, _VALUES, THREADS

#: entries per block of the elementwise kernels (GTOPK_THREADS * GTOPK_COMP_ITEMS)
ELEMS = THREADS * 8


def _null():
    import numpy as np

    return np.uint64(0)


def _cblocks(n: int) -> int:
    return (int(n) + ELEMS - 1) // ELEMS


def _dense(rt, t) -> bool:
    return rt._ok(t) and t.is_contiguous()


def _like(t, ref) -> bool:
    """``t`` (a residual) is a contiguous 1-D tensor like ``ref``."""
    return (t.device == ref.device and t.dtype == ref.dtype and t.dim() == 1 and t.is_contiguous()
            and t.numel() == ref.numel())


def _cum(sizes: List[int]) -> List[int]:
    out = [0]
    for v in sizes:
        out.append(out[-1] + v)
    return out


def compensate(rt, out, grad, residual) -> bool:
    dev = out.device
    if not (_dense(rt, out) and grad.device == dev and grad.dtype == out.dtype
            and grad.numel() == out.numel() and (residual is None or _like(residual, out))):
        return reference.compensate(out, grad, residual)
    n = out.numel()
    if n == 0:
        return True
    g = grad.reshape(-1).contiguous()
    bad = torch.zeros(1, dtype=torch.int32, device=dev)
    vs, _ = _VALUES[out.dtype]
    with rt._On(dev):
        rt._launch("compensate.cu", f"gtopk_compensate_{vs}", _cblocks(n),
                   (rt._p(g), _null() if residual is None else rt._p(residual), rt._i64(n),
                    rt._p(out), rt._p(bad)))
    return not bool(bad.item())  # the one read-back


def compensate_select_topk(rt, acc, grads, residual, offsets, k):
    dev, dt = acc.device, acc.dtype
    if not (_dense(rt, acc) and all(g.device == dev and g.dtype == dt for g in grads)
            and (residual is None or _like(residual, acc))):
        return reference.compensate_select_topk(acc, grads, residual, offsets, k)
    flat = [g.reshape(-1).contiguous() for g in grads]
    sizes = [g.numel() for g in flat]
    N = acc.numel()
    if sum(sizes) != N:
        raise ValueError(f"compensate_select_topk: the gradients hold {sum(sizes)} entries, acc {N}")
    offs = [int(v) for v in offsets.tolist()]
    if N == 0 or len(offs) < 2 or offs[0] != 0 or offs[-1] != N:
        # the segments do not cover acc: compensate every gradient, then select
        finite, o = [], 0
        for g in flat:
            n = g.numel()
            finite.append(compensate(rt, acc[o:o + n], g,
                                     None if residual is None else residual[o:o + n]))
            o += n
        idx, vals = rt.select_topk(acc, offsets, k)
        return idx, vals, torch.tensor(finite, dtype=torch.bool)
    L = rt._layout(dev, offsets, k, "topk", N)
    S, T = L.S, len(flat)
    vs, _ = _VALUES[dt]
    itype = reference.index_dtype(N)
    # gradient addresses and their offsets in acc: one small copy per call
    table = torch.tensor([int(rt._p(g)) for g in flat] + _cum(sizes), dtype=torch.int64).to(dev)
    gptr, goff = table[:T], table[T:]
    res = _null() if residual is None else rt._p(residual)
    bad = torch.zeros(T, dtype=torch.int32, device=dev)
    out = torch.empty(max(1, L.nslots), dtype=itype, device=dev)
    st, hist, ctr, cand = rt._work(L, dev)
    thr = None
    with rt._On(dev):
        if L.nslots:
            rt._launch("select.cu", "gtopk_radix_init", rt._blocks(S),
                       (rt._p(L.seg), rt._p(L.k), rt._i32(S), rt._p(st)))
            if L.has_bound:
                thr = torch.empty(S, dtype=torch.int64, device=dev)
                rt._launch("compensate.cu", f"gtopk_comp_sample_{vs}", S,
                           (rt._p(gptr), rt._p(goff), rt._i32(T), res, rt._p(L.seg),
                            rt._p(L.bpar), rt._p(thr)))
        rt._launch("compensate.cu", f"gtopk_comp_collect_{vs}", L.nblocks,
                   (rt._p(gptr), rt._p(goff), rt._i32(T), res, rt._p(acc), rt._p(L.lay),
                    rt._i32(S), _null() if thr is None else rt._p(thr), rt._p(ctr),
                    rt._p(cand[:max(1, L.ncand)]), rt._p(bad)))
        if thr is not None:
            rt._launch("select.cu", "gtopk_bound_decide", rt._blocks(S),
                       (rt._p(L.lay), rt._i32(S), rt._p(ctr), rt._p(st)))
        if L.nslots:
            rt._radix(acc, L, out, _INDEX[itype], st, hist, ctr, cand, init=False)
    finite = (bad == 0).cpu()  # the one read-back
    if not L.nslots:
        return torch.empty(0, dtype=itype, device=dev), acc[:0], finite
    idx = torch.sort(out).values
    return idx, acc.index_select(0, idx), finite


def subtract_at_(rt, acc, idx, sent, mask=None):
    if mask is not None:  # the reached entries gathered on the device, then the kernel
        idx, sent = idx[mask], sent[mask]
    dev = acc.device
    if not (_dense(rt, acc) and rt._sparse_ok(idx, sent, dev)):
        return reference.subtract_at_(acc, idx, sent)
    n = idx.numel()
    if n:
        i, v = idx.contiguous(), sent.to(acc.dtype).contiguous()
        vs, _ = _VALUES[acc.dtype]
        with rt._On(dev):
            rt._launch("compensate.cu", f"gtopk_subtract_at_{vs}_{_INDEX[i.dtype]}", rt._blocks(n),
                       (rt._p(acc), rt._p(i), rt._p(v), rt._i64(n), rt._i64(acc.numel())))
    return acc


def scatter_reset_(rt, out, prev, idx, vals, divisor):
    dev = out.device
    if not (_dense(rt, out) and prev.dtype in _INDEX and prev.device == dev and prev.dim() == 1
            and rt._sparse_ok(idx, vals, dev) and isinstance(divisor, int) and divisor >= 1):
        return reference.scatter_reset_(out, prev, idx, vals, divisor)
    vs, _ = _VALUES[out.dtype]
    numel = out.numel()
    with rt._On(dev):
        # two launches: an index in both prev and idx must end up written
        if prev.numel():
            p = prev.contiguous()
            rt._launch("compensate.cu", f"gtopk_zero_at_{vs}_{_INDEX[p.dtype]}",
                       rt._blocks(p.numel()), (rt._p(p), rt._i64(p.numel()), rt._p(out),
                                               rt._i64(numel)))
        n = idx.numel()
        if n:
            i, v = idx.contiguous(), vals.to(out.dtype).contiguous()
            rt._launch("scatter.cu", f"gtopk_scatter_{vs}_{_INDEX[i.dtype]}", rt._blocks(n),
                       (rt._p(i), rt._p(v), rt._i64(n), rt._i64(divisor), rt._p(out),
                        rt._i64(numel)))
    return out


def div_count_(rt, x, divisor, out=None) -> int:
    y = x if out is None else out
    if not (_dense(rt, x) and isinstance(divisor, int) and divisor >= 1 and x.dim() == 1
            and (y is x or (_dense(rt, y) and _like(y, x)))):
        return reference.div_count_(x, divisor, out)
    n = x.numel()
    if n == 0:
        return 0
    count = torch.zeros(1, dtype=torch.int64, device=x.device)
    vs, _ = _VALUES[x.dtype]
    with rt._On(x.device):
        rt._launch("compensate.cu", f"gtopk_div_count_{vs}", _cblocks(n),
                   (rt._p(x), rt._p(y), rt._i64(n), rt._i64(divisor), rt._p(count)))
    return int(count.item())  # the one read-back
