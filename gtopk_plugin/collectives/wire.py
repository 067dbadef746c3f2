"""Wire format (docs/design.md §2): one byte blob per message holding the int32
(int64 past 2^31−1 elements) indices followed by the values in the gradient's
dtype, the fp16/bf16 wire dtype, or int8 with a per-message scale.  8 bytes
per fp32 entry; never an upcast.

int8 wire (``value_dtype=torch.int8``): a message of n values is
n int8 codes ``q`` followed by ONE int8 exponent byte ``e``: the values are
``q·2^e``.  So a sparse message is ``n·(4 + 1) + 1`` bytes.  In memory the
int8 "wire tensor" has the same layout (``n + 1`` int8 elements, the last
one the exponent), so :func:`pack`/:func:`unpack` move it as is;
:func:`values` decodes it.  See :func:`quantize` for the rounding and why
the residual can own the rounding error exactly.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

# bit masks (the butterfly's survivor mask): defined below this layer
from gtopk_plugin.compress.bits import bitmask_bytes, pack_bits, unpack_bits  # noqa: F401

Tensor = torch.Tensor


QUANTIZED = torch.int8  # the one integer wire dtype
QMAX = 127               # |q| <= 127: the code -128 is never used (symmetric)
E_MIN, E_MAX = -128, 127  # the exponent byte's range


def entry_bytes(idx_dtype: torch.dtype, val_dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=idx_dtype).element_size() + torch.empty(0, dtype=val_dtype).element_size()


def header_bytes(val_dtype: torch.dtype) -> int:
    """Bytes per message besides the entries: the int8 wire's exponent byte."""
    return 1 if val_dtype == QUANTIZED else 0


def message_bytes(n: int, idx_dtype: torch.dtype, val_dtype: torch.dtype) -> int:
    """Bytes of a message of ``n`` (index, value) entries."""
    return n * entry_bytes(idx_dtype, val_dtype) + header_bytes(val_dtype)


def count(w: Tensor) -> int:
    """Entries held by a wire tensor (an int8 one ends with its exponent)."""
    return w.numel() - header_bytes(w.dtype)


# dtypes the quantizer computes in directly (else float32 / float64 copies)
_WIDE = (torch.float32, torch.float64)
_MIN_NORMAL_EXP = {torch.float32: -126, torch.float64: -1022}


def values(w: Tensor, dtype: torch.dtype) -> Tensor:
    """The numbers a wire tensor carries, in ``dtype``: an fp16/bf16/fp32
    tensor as it is (callers widen it where they add it); an int8 one
    decoded to ``q·2^e`` -- exact in any float dtype that the sender's
    values had (see :func:`quantize`) or that is wider."""
    if w.dtype != QUANTIZED:
        return w
    q, e = w[:-1], int(w[-1])
    if dtype in _WIDE and e >= _MIN_NORMAL_EXP[dtype]:
        # one multiplication by a normal power of two: exact (7-bit products)
        return q.to(dtype) * math.ldexp(1.0, e)
    # exact in float64 (7-bit integer times a power of two), then exactly
    # representable in ``dtype`` by the choice of e
    return (q.to(torch.float64) * math.ldexp(1.0, e)).to(dtype)


def _mul32(x: Tensor, c: int) -> Tensor:
    """``x·c mod 2^32`` for int64 ``x`` in [0, 2^32): two 16-bit halves of
    ``c``, so no int64 product overflows."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & 0xFFFFFFFF


def _mix32(x: Tensor) -> Tensor:
    """A 32-bit integer hash (xorshift-multiply, constants of C. Wellons'
    "lowbias32"), bijective on [0, 2^32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniform(key: str, idx: Tensor) -> Tensor:
    """float64 uniforms in [0, 1) (multiples of 2^-32), one per entry of
    ``idx`` (int, >= 0), a pure function of (key, index): counter-based like
    the library's other draws (the step counter is the whole RNG state, so
    a resumed run is bit-exact), and independent of the order of the
    entries -- every member of a butterfly group, which holds the same set,
    draws the same numbers for it, and so does the single-process oracle."""
    h = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
    i = idx.long()
    x = _mix32((i & 0xFFFFFFFF) ^ (h & 0xFFFFFFFF))
    x = _mix32(x ^ ((i >> 32) & 0xFFFFFFFF) ^ (h >> 32))
    return x.to(torch.float64) * 2.0 ** -32


@dataclass(frozen=True)
class Draws:
    """The int8 wire's stochastic-rounding key for one reducer call:
    ``draws(stream, idx)`` are :func:`uniform` draws keyed by
    ``f"{seed}:{step}:{salt}:{stream}"`` at the entries' indices.  ``salt``
    tells apart the calls of one step (the DDP hook's buckets: their first
    segment name); ``stream`` the roundings of the call (``rank{r}``: a
    rank's own message; ``round{j}:group{g}``: butterfly group g's merged
    set before round j; ``final``: the result; ``shard{q}``: a dense
    shard's sum, at positions in the value vector)."""

    seed: int
    step: int
    salt: str

    def __call__(self, stream: str, idx: Tensor) -> Tensor:
        return uniform(f"{self.seed}:{self.step}:{self.salt}:{stream}", idx)


def exponent(m: float, dtype: torch.dtype) -> int:
    """The message exponent for largest magnitude ``m``: the smallest e with
    ``m <= 127·2^e``, clamped to [E_MIN, 127] and to the smallest e whose
    steps ``2^e`` ``dtype`` can hold (fp16: 2^-24)."""
    fi = torch.finfo(dtype)  # its smallest subnormal is smallest_normal·eps
    e_min = max(E_MIN, math.frexp(fi.smallest_normal)[1] + math.frexp(fi.eps)[1] - 2)
    if not m > 0.0:
        return e_min
    E = math.frexp(m)[1]  # 2^(E-1) <= m < 2^E
    e = E - 7 if m <= math.ldexp(QMAX, E - 7) else E - 6
    return min(max(e, e_min), E_MAX)


def quantize(v: Tensor, draws: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """``(w, err)``: ``v`` as an int8 wire tensor ``[q_0 .. q_{n-1}, e]`` and
    the rounding error ``err = v − q·2^e``, exactly, in ``v``'s dtype.

    The scale is ``2^e`` with e from :func:`exponent` (max|v| <= 127·2^e).
    ``q`` rounds ``v·2^-e`` to nearest (ties to even), or with ``draws`` (one
    uniform in [0, 1) per entry) stochastically, with a dead zone |x| < 1/2
    → 0 that keeps ``err`` exact (Sterbenz; docs/design.md §3).  |q| <= 127
    and ``q·2^e`` never overflows ``v``'s dtype, so nothing decodes to ±inf;
    float64 values beyond 127·2^127 saturate, the remainder staying in
    ``err``.
    """
    n = v.numel()
    e = exponent(float(v.abs().max()) if n else 0.0, v.dtype)
    # x in v's own dtype (float32/64; fp16/bf16 via an exact float32 copy):
    # a power-of-two scaling is exact except where x underflows to a
    # subnormal, |x| < 2^-126, which rounds to q = 0 either way
    x = (v if v.dtype in _WIDE else v.float()) * math.ldexp(1.0, -e)
    if draws is None:
        q = torch.round(x)
    else:
        # x − ⌊x⌋ is exact (Sterbenz for |x| >= 1; x + 1 for x in [−1, −1/2])
        # outside the dead zone; compared with the float64 draw exactly
        f = torch.floor(x)
        q = f + (draws.to(x.device) < x - f).to(x.dtype)
        q = torch.where(x.abs() < 0.5, torch.zeros_like(q), q)
    lim = torch.finfo(v.dtype).max * math.ldexp(1.0, -e)  # may be inf (float64)
    cap = QMAX if lim >= QMAX else math.floor(lim)
    q = q.clamp_(-cap, cap)
    w = torch.cat([q.to(torch.int8), torch.tensor([e], dtype=torch.int8, device=v.device)])
    return w, v - values(w, v.dtype)


def to_wire(vals: Tensor, dtype: torch.dtype) -> Tensor:
    """Round ``vals`` to the wire dtype without ever producing ±inf: values
    beyond the dtype's finite range are clamped to it first (the sender's
    residual keeps the remainder, since the residual is what was not sent).
    docs/design.md §2: a value the wire cannot hold never reaches it as ±inf.
    int8: :func:`quantize` to nearest (one message, one exponent)."""
    if vals.dtype == dtype:
        return vals
    if dtype == QUANTIZED:
        return quantize(vals)[0]
    if dtype.is_floating_point and torch.finfo(dtype).max < torch.finfo(vals.dtype).max:
        big = torch.finfo(dtype).max
        vals = vals.clamp(-big, big)
    return vals.to(dtype)


def accumulation_dtype(wire_dtype: torch.dtype, sum_dtype: torch.dtype) -> Optional[torch.dtype]:
    """The dtype in which sums of wire values are taken when the wire is
    narrower than the gradients (docs/design.md §3, precision): the sum dtype, at
    least float32.  ``None`` when the wire carries the sum dtype itself (then
    sums are taken in it and nothing is re-rounded)."""
    if wire_dtype == sum_dtype:
        return None
    return torch.promote_types(sum_dtype, torch.float32)


def round_to_wire(vals: Tensor, dtype: torch.dtype, draws: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """``(w, err)``: ``w = to_wire(vals, dtype)`` (clamped, never ±inf) and
    ``err = vals − w`` exactly in ``vals``' dtype -- the rounding (and
    clamping) error that some rank's residual must own for the rounded value
    to conserve mass.  (The difference of a float32/float64 value and its
    fp16/bf16 rounding is exact (Sterbenz); a clamping remainder is exact
    below 2^29 and otherwise off by one rounding of ``vals``' dtype.)
    int8: :func:`quantize` (``draws``: stochastic rounding)."""
    if dtype == QUANTIZED:
        return quantize(vals, draws)
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
    hb = header_bytes(val_dtype)  # int8: the values end with their exponent byte
    if body < hb or (body - hb) % eb:
        raise RuntimeError(f"corrupt message: {body} bytes is not {hb} + a multiple of the {eb}-byte "
                           "entry size")
    n = (body - hb) // eb
    isz = eb - torch.empty(0, dtype=val_dtype).element_size()
    idx = _view(blob, 0, n * isz, idx_dtype)
    vals = _view(blob, n * isz, body, val_dtype)
    return idx, vals, blob[body:]


def unpack_values(blob: Tensor, val_dtype: torch.dtype) -> Tensor:
    """A blob of bare values (no indices) as ``val_dtype``."""
    return _view(blob, 0, blob.numel(), val_dtype)


def _flat_unit_stride(t: Tensor) -> Tensor:
    """``t`` as a 1-D tensor of stride 1: ``contiguous()`` leaves a tensor
    of size-1 dimensions with any stride (a (1, 1) slice of a larger
    matrix), which a byte view refuses."""
    x = t.contiguous().reshape(-1)
    if x.numel() and x.stride(0) != 1:
        x = torch.empty(x.shape, dtype=x.dtype, device=x.device).copy_(x)
    return x


def pack_tensors(tensors) -> Tensor:
    """A codec's payload tensors as one uint8 blob (their bytes, in order;
    receivers know the shapes and dtypes: they depend only on the layout)."""
    parts = [_flat_unit_stride(t).view(torch.uint8) for t in tensors]
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
