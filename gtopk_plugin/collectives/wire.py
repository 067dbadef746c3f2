"""Wire format (DESIGN.md §3): one byte blob per message holding the int32
(int64 past 2^31−1 elements) indices followed by the values in the gradient's
dtype or the fp16/bf16 wire dtype.  8 bytes per fp32 entry; never an upcast."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

# bit masks (the butterfly's survivor mask): defined below this layer
from ..compress.bits import bitmask_bytes, pack_bits, unpack_bits  # noqa: F401

Tensor = torch.Tensor


def entry_bytes(idx_dtype: torch.dtype, val_dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=idx_dtype).element_size() + torch.empty(0, dtype=val_dtype).element_size()


def to_wire(vals: Tensor, dtype: torch.dtype) -> Tensor:
    """Round ``vals`` to the wire dtype without ever producing ±inf: values
    beyond the dtype's finite range are clamped to it first (the sender's
    residual keeps the remainder, since the residual is what was not sent).
    DESIGN.md §3: a value the wire cannot hold never reaches it as ±inf."""
    if vals.dtype == dtype:
        return vals
    if dtype.is_floating_point and torch.finfo(dtype).max < torch.finfo(vals.dtype).max:
        big = torch.finfo(dtype).max
        vals = vals.clamp(-big, big)
    return vals.to(dtype)


def accumulation_dtype(wire_dtype: torch.dtype, sum_dtype: torch.dtype) -> Optional[torch.dtype]:
    """The dtype in which sums of wire values are taken when the wire is
    narrower than the gradients (DESIGN.md §3, precision): the sum dtype, at
    least float32.  ``None`` when the wire carries the sum dtype itself (then
    sums are taken in it and nothing is re-rounded)."""
    if wire_dtype == sum_dtype:
        return None
    return torch.promote_types(sum_dtype, torch.float32)


def round_to_wire(vals: Tensor, dtype: torch.dtype) -> Tuple[Tensor, Tensor]:
    """``(w, err)``: ``w = to_wire(vals, dtype)`` (clamped, never ±inf) and
    ``err = vals − w`` exactly in ``vals``' dtype -- the rounding (and
    clamping) error that some rank's residual must own for the rounded value
    to conserve mass.  (The difference of a float32/float64 value and its
    fp16/bf16 rounding is exact (Sterbenz); a clamping remainder is exact
    below 2^29 and otherwise off by one rounding of ``vals``' dtype.)"""
    w = to_wire(vals, dtype)
    return w, vals - w.to(vals.dtype)


def pack(idx: Tensor, vals: Tensor, idx_dtype: torch.dtype) -> Tensor:
    """``[indices | values]`` as one uint8 tensor."""
    i = idx.to(idx_dtype).contiguous().view(torch.uint8)
    v = vals.contiguous().view(torch.uint8)
    return torch.cat([i.to(v.device), v])


def _view(blob: Tensor, start: int, stop: int, dtype: torch.dtype) -> Tensor:
    part = blob[start:stop]
    size = torch.empty(0, dtype=dtype).element_size()
    if part.storage_offset() % size:
        part = part.clone()  # realign before reinterpreting the bytes
    return part.view(dtype)


def unpack(blob: Tensor, idx_dtype: torch.dtype, val_dtype: torch.dtype,
           extra_bytes: int = 0) -> Tuple[Tensor, Tensor, Tensor]:
    """Inverse of :func:`pack`; ``extra_bytes`` trailing bytes (a survivor
    bitmask, say) are returned as the third element."""
    body = blob.numel() - extra_bytes
    eb = entry_bytes(idx_dtype, val_dtype)
    if body % eb:
        raise RuntimeError(f"corrupt message: {body} bytes is not a multiple of the {eb}-byte entry size")
    n = body // eb
    isz = eb - torch.empty(0, dtype=val_dtype).element_size()
    idx = _view(blob, 0, n * isz, idx_dtype)
    vals = _view(blob, n * isz, body, val_dtype)
    return idx, vals, blob[body:]


def unpack_values(blob: Tensor, val_dtype: torch.dtype) -> Tensor:
    """A blob of bare values (no indices) as ``val_dtype``."""
    return _view(blob, 0, blob.numel(), val_dtype)


def pack_tensors(tensors) -> Tensor:
    """A codec's payload tensors as one uint8 blob (their bytes, in order;
    receivers know the shapes and dtypes: they depend only on the layout)."""
    parts = [t.contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    if not parts:
        return torch.empty(0, dtype=torch.uint8)
    dev = parts[0].device
    return torch.cat([p.to(dev) for p in parts])


def unpack_tensors(blob: Tensor, like) -> list:
    """Inverse of :func:`pack_tensors`: tensors shaped and typed as ``like``
    (this rank's own payload, which has every rank's layout)."""
    out, pos = [], 0
    for t in like:
        nbytes = t.numel() * t.element_size()
        out.append(_view(blob, pos, pos + nbytes, t.dtype).view(t.shape))
        pos += nbytes
    if pos != blob.numel():
        raise RuntimeError(f"corrupt payload: {blob.numel()} bytes, the layout says {pos}")
    return out
