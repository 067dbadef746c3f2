"""Persistent dense update buffers of :class:`gtopk_plugin.GradientReducer`
(no N-sized allocation per step in steady state), a small ring
per layout; see :class:`UpdateBuffers` for the lifetime contract of the
tensors ``reduce()`` returns."""
from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Tuple

import torch

from gtopk_plugin import kernels

from gtopk_plugin.pipeline import huge_pages
from gtopk_plugin.collectives import wire

Tensor = torch.Tensor


def _storage_refs(t: Tensor) -> Optional[int]:
    """How many tensors share ``t``'s storage (``None`` where this torch
    does not say)."""
    f = getattr(torch._C, "_storage_Use_Count", None)
    if f is None:
        return None
    try:
        return int(f(t.untyped_storage()._cdata))
    except Exception:  # pragma: no cover - a torch without it
        return None


def _owned(vals: Tensor, dtype, numel: int, layout_bufs) -> bool:
    """Whether a dense aggregation result can be divided in place and
    returned: right dtype and shape, contiguous, and not sharing storage
    with the layout's residual or accumulator."""
    if vals.dtype != dtype or vals.dim() != 1 or vals.numel() != numel or not vals.is_contiguous():
        return False
    ptr = vals.untyped_storage().data_ptr()
    return all(b is None or b.untyped_storage().data_ptr() != ptr for b in layout_bufs)


class UpdateBuffers:
    """Persistent dense update buffers, a small ring per layout.

    Lifetime contract of the tensors ``reduce()`` returns: they are views
    into one of these buffers and stay valid while the caller holds any of
    them (or any view of them); once every returned tensor of a call has
    been dropped, the buffer is reused by a later ``reduce()`` on the same
    layout (same names, dtype, device).  A buffer is reused only when no
    tensor outside the reducer refers to its storage (torch's storage use
    count), so a caller that keeps updates across steps -- the elastic
    scheduler holds several steps of one layer in flight -- gets a second
    buffer instead of a clobbered one (up to :attr:`RING` per layout, then
    fresh allocations).  Callers that copy the update right away (DDP's
    bucket, Horovod's ``p.grad``) cycle through one buffer.

    Reset cost: a sparse update rewrites only the entries the buffer's
    previous sparse result set (O(k)); after a dense result it is zeroed once.
    A dense result that is the aggregation's own fresh sum is divided in
    place and returned, so that update belongs to the caller outright (the
    sparse allgather's union is a sparse result like the butterfly's).
    """

    RING = 4

    def __init__(self):
        self._rings: Dict[tuple, list] = {}
        # out= tensors a sparse result was last written into, per layout:
        # (their data_ptrs, the result's sorted indices); see write_into
        self._outs: Dict[tuple, tuple] = {}

    def result(self, agg, key, numel: int, divisor: int, layout_bufs, kernels_backend=None,
               outs: Optional[List[Tensor]] = None, out_reuse: bool = False):
        """``(update, nnz)``: the aggregated result ``agg`` (an
        ``Aggregated``) divided by ``divisor`` (P for op="average", else 1)
        as the dense update of layout ``key`` = (names, dtype, device).

        A dense result that is the aggregation's own fresh sum (allreduce,
        allgather-and-add; not sharing storage with ``layout_bufs``, the
        layout's residual/accumulator) is divided in place and handed out
        as is, no further N-sized buffer touched; any other dense result is
        copied into a ring buffer; a sparse one is written in O(k) (the
        previous result's entries zeroed, this one's set).  With ``outs``
        (the caller's tensors, in layout order) the update goes there
        instead: ``(None, nnz)``; with ``out_reuse`` and the same tensors
        as this layout's last sparse result, only that result's entries are
        cleared first (O(k) instead of a zero fill)."""
        dtype, device = key[1], key[2]
        if outs:
            ptrs = tuple(t.data_ptr() for t in outs)
            last = self._outs.pop(key, None)
            prev = last[1] if out_reuse and last is not None and last[0] == ptrs else None
            nnz, idx = write_into(agg, outs, divisor, prev, kernels_backend)
            if out_reuse and idx is not None:
                self._outs[key] = (ptrs, idx)
            return None, nnz
        if agg.idx is None and _owned(agg.vals, dtype, numel, layout_bufs):
            return agg.vals, kernels.div_count_(agg.vals, divisor, kernels=kernels_backend)
        if agg.idx is None:  # e.g. the sum taken in the accumulator: one division out of it
            update, _ = self.take(key, numel, dtype, device, None)
            if agg.vals.dtype == dtype and agg.vals.is_contiguous():
                return update, kernels.div_count_(agg.vals.view(-1), divisor, out=update, kernels=kernels_backend)
            # widened first, then divided in the update's dtype: a division in
            # a narrower wire dtype (bf16/fp16) would round the average a
            # second time, into nobody's residual
            update.copy_(agg.vals)
            if divisor != 1:
                update.div_(divisor)
            return update, torch.count_nonzero(update)
        update, prev = self.take(key, numel, dtype, device, agg.idx)
        # the reference scatter_update's arithmetic: vals / divisor
        kernels.scatter_reset_(update, prev, agg.idx, agg.vals, divisor, kernels=kernels_backend)
        # nonzeros of the update: only the aggregated entries can be nonzero,
        # and those hold vals / divisor (computed on the k values, not
        # gathered back from the N-sized buffer)
        v = agg.vals.to(dtype)
        return update, torch.count_nonzero(v / divisor if divisor != 1 else v)

    def clear(self) -> None:
        self._rings.clear()
        self._outs.clear()

    def forget_outs(self) -> None:
        """Every out= tensor was overwritten (a skipped step's fill): the
        next sparse result into them zero-fills them first."""
        self._outs.clear()

    def take(self, key, numel: int, dtype, device, idx: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
        """``(buf, prev)``: a buffer of ``numel`` for this step's result at
        ``idx`` (``idx is None``: a dense result, which overwrites the whole
        buffer) and the indices of its previous sparse result, which the
        caller zeroes (everything else in ``buf`` is zero for a sparse
        result).  The buffer remembers ``idx`` for its next reset."""
        ring = self._rings.get(key)
        if ring is None:
            names = set(key[0])
            for other in [k for k in self._rings if names.intersection(k[0])]:
                del self._rings[other]  # a name moved to another layout (DDP rebuild)
            ring = self._rings[key] = []
        none = torch.empty(0, dtype=torch.int64, device=device)
        entry = None
        for e in ring:
            refs = _storage_refs(e["buf"])
            if e["base"] is not None and refs is not None and refs <= e["base"]:
                entry = e
                break
        if entry is None:
            buf = huge_pages.zeros(numel, dtype, device)  # k scattered writes a step
            if len(ring) >= self.RING:
                return buf, none  # untracked, fresh: every ring buffer is still held
            entry = {"buf": buf, "prev": None, "base": _storage_refs(buf)}
            ring.append(entry)
        buf, prev = entry["buf"], entry["prev"]
        if prev is None:
            prev = none
        elif isinstance(prev, str):  # "dense": every entry was written
            if idx is not None:
                buf.zero_()
            prev = none
        entry["prev"] = "dense" if idx is None else idx.clone()
        return buf, prev


def check_out(out, names, tensors) -> Optional[str]:
    """Local checks of ``reduce(..., out=)``: an error message (the
    consistency check makes every rank raise it) or ``None``."""
    if out is None:
        return None
    if not isinstance(out, Mapping):
        return f"out must be a dict name -> tensor; got {type(out).__name__}"
    for n, t in zip(names, tensors):
        o = out.get(n)
        if not isinstance(o, torch.Tensor):
            return f"out has no tensor for gradient {n!r}"
        if o.shape != t.shape or o.dtype != t.dtype or o.device != t.device or not o.is_contiguous():
            return (f"out[{n!r}] must be a contiguous tensor of the gradient's shape, dtype and device "
                    f"({tuple(t.shape)}, {t.dtype}, {t.device}); got {tuple(o.shape)}, {o.dtype}, "
                    f"{o.device}{'' if o.is_contiguous() else ', not contiguous'}")
    return None


def write_into(agg, outs: List[Tensor], divisor: int, prev: Optional[Tensor] = None,
               kernels_backend: Optional[str] = None):
    """The aggregated result ``agg`` divided by ``divisor``, written into
    the caller's tensors ``outs`` (the layout's tensors in order; each may
    have its own dtype).  Returns ``(nnz, idx)``: the number of nonzero
    entries and, for a sparse result, its sorted indices.  Bit for bit what
    :meth:`UpdateBuffers.result` hands out (the same true division in the
    value dtype, then the tensor's dtype): a dense result divided straight
    into them, a sparse one as a zero fill -- or, given ``prev`` (the sorted
    indices of the sparse result the tensors hold), zeros at ``prev`` only
    -- plus O(k) writes: no update buffer, and no copy of one."""
    vals = agg.vals
    if agg.idx is None:
        off, nnz = 0, 0
        for t in outs:
            v = vals[off:off + t.numel()]
            if t.dtype == v.dtype:  # one pass: divide into t and count
                nnz += kernels.div_count_(v, divisor, out=t.view(-1), kernels=kernels_backend)
            else:  # divided in the wider of the two dtypes, then rounded once into t
                wide = torch.promote_types(torch.promote_types(v.dtype, t.dtype), torch.float32)
                w = v.view(t.shape).to(wide)
                t.copy_(wire.to_wire(w / divisor if divisor != 1 else w, t.dtype))  # clamped, never ±inf
                nnz += int(torch.count_nonzero(t))
            off += t.numel()
        return torch.tensor(nnz), None
    idx = agg.idx
    if divisor != 1:  # in the widest dtype written (a wire dtype would round twice)
        wide = torch.promote_types(vals.dtype, torch.float32)  # as the update buffer's division
        for t in outs:
            wide = torch.promote_types(wide, t.dtype)
        vals = vals.to(wide) / divisor
    if idx.numel() > 1 and not bool((idx[1:] > idx[:-1]).all()):
        idx, order = torch.sort(idx)
        vals = vals[order]
    starts = torch.tensor([0] + [t.numel() for t in outs], device=idx.device).cumsum(0)
    cuts = torch.searchsorted(idx, starts.to(idx.dtype)).tolist()
    pcuts = None if prev is None else torch.searchsorted(prev, starts.to(prev.dtype)).tolist()
    for j, t in enumerate(outs):
        flat, s = t.view(-1), int(starts[j])
        if pcuts is None:
            t.zero_()
        elif pcuts[j + 1] > pcuts[j]:
            flat.index_fill_(0, (prev[pcuts[j]:pcuts[j + 1]] - s).long(), 0)
        a, b = cuts[j], cuts[j + 1]
        if b > a:
            flat.index_copy_(0, (idx[a:b] - s).long(), wire.to_wire(vals[a:b], t.dtype))
    return torch.count_nonzero(vals), idx.clone()
