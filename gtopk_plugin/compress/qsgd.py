"""QSGD: s-level stochastic quantization with bucket norms (Alistarh et al.
2017, "QSGD: Communication-Efficient SGD via Gradient Quantization and
Encoding", NeurIPS, arXiv 1610.02132, §3.1 and the bucketed variant of §5),
here with error feedback.

Each segment is cut into buckets of ``bucket_size`` entries (the last one
shorter).  With ``s = levels``, bucket L2 norm ``‖b‖`` (float32) and ``x =
|v|/‖b‖·s``, an entry is sent as ``sign(v)·⌊x⌋`` or ``sign(v)·(⌊x⌋+1)``,
the latter with probability ``x − ⌊x⌋`` (unbiased), and decodes to
``level·‖b‖/s``.  Draws: one float32 uniform per entry keyed by (seed,
step, segment name, rank), so a resume is bit-exact.

Wire format: the codes ``level + s`` as ``bits = ⌈log2(2s+1)⌉``-bit
unsigned integers packed LSB first into one bit stream (bit t is bit
``t mod 8`` of byte ``t div 8``; zero padded): ``⌈N·bits/8⌉`` bytes; then
one float32 norm per bucket.  Payloads are allgathered and summed in rank order.

Error feedback needs a contractive compressor: keep ``levels² >
bucket_size`` (else use ``error_feedback=False``); see docs/compressors.md.
"""
from __future__ import annotations

import math
from typing import List, Sequence

import torch

from gtopk_plugin.compress.compressor import START_ITER, Codec, HyperParam, seeded_generator
from gtopk_plugin.compress.bits import pack_bits, unpack_bits
from gtopk_plugin.registry import register

Tensor = torch.Tensor


def code_bits(levels: int) -> int:
    """Bits per entry: ⌈log2(2s+1)⌉ (codes 0..2s)."""
    return max(1, math.ceil(math.log2(2 * levels + 1)))


def buckets(sizes: Sequence[int], bucket_size: int) -> List[int]:
    """Bucket lengths, segments in order (each segment cut separately)."""
    out: List[int] = []
    for n in sizes:
        full, rest = divmod(int(n), bucket_size)
        out += [bucket_size] * full + ([rest] if rest else [])
    return out


class _Layout:
    """A call's buckets as a padded ``(buckets, bucket_size)`` matrix: every
    segment padded with zeros to whole buckets, so the per-bucket work is one
    tensor op over the call (cached per (sizes, bucket_size)).  ``idx``: the
    padded position of each real entry (``None`` when nothing is padded);
    ``bid``: each real entry's bucket (for the decoder's scales)."""

    def __init__(self, sizes: Sequence[int], bucket_size: int, device):
        self.sizes = [int(n) for n in sizes]
        self.blen = buckets(self.sizes, bucket_size)
        self.nb = len(self.blen)
        self.width = bucket_size
        self.idx = None
        if any(n % bucket_size for n in self.sizes):
            parts, start = [], 0
            for n in self.sizes:
                parts.append(torch.arange(start, start + n, device=device))
                start += -(-n // bucket_size) * bucket_size
            self.idx = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64, device=device)
        self.bid = torch.repeat_interleave(torch.arange(self.nb, device=device),
                                           torch.tensor(self.blen, dtype=torch.int64, device=device))

    def pad(self, flat: Tensor) -> Tensor:
        """Real entries -> the padded (buckets, width) matrix (zeros in the padding)."""
        if self.idx is None:
            return flat.view(self.nb, self.width)
        out = flat.new_zeros(self.nb * self.width)
        out[self.idx] = flat
        return out.view(self.nb, self.width)

    def unpad(self, padded: Tensor) -> Tensor:
        flat = padded.reshape(-1)
        return flat if self.idx is None else flat[self.idx]


def bucket_norms(a32: Tensor, lay: _Layout) -> Tensor:
    """float32 L2 norm per bucket: the squares summed in entry order within a
    bucket (one column of the padded matrix at a time: the same float32
    rounding as a sequential sum, and zeros of the padding add nothing), then
    the square root."""
    sq = lay.pad(a32 * a32)
    if lay.width > 4096:  # few buckets: a serial scatter-add in entry order costs no more
        acc = torch.zeros(lay.nb, dtype=torch.float32, device=a32.device)
        acc.index_add_(0, lay.bid, a32 * a32)
        return acc.sqrt_()
    cols = sq.t().contiguous()
    acc = cols[0].clone()
    for j in range(1, lay.width):
        acc += cols[j]
    return acc.sqrt_()


def _group(bits: int):
    """Codes per group and bytes per group: the fewest whole codes that fill
    whole bytes (``None`` when such a group does not fit an int64 word)."""
    g = 8 // math.gcd(bits, 8)
    return (g, g * bits // 8) if g * bits <= 64 else None


def pack_codes(codes: Tensor, bits: int) -> Tensor:
    """Integer codes < 2**bits -> the LSB-first bit stream (see the module
    docstring): groups of codes OR-ed into int64 words at their bit offsets,
    the words cut into little-endian bytes -- the same bytes as packing the
    bit planes one bit at a time."""
    n = codes.numel()
    nbytes = (n * bits + 7) // 8
    grp = _group(bits)
    if grp is None:  # 9..15 odd/even bits whose groups exceed 64 bits: bit planes
        planes = (codes.reshape(-1, 1).to(torch.int64) >> torch.arange(bits, device=codes.device)) & 1
        return pack_bits(planes.view(-1).bool())
    g, gb = grp
    pad = (-n) % g
    # one byte per group (1, 2, 4, 8 bits): the whole packing in uint8
    c = codes.reshape(-1).to(torch.uint8 if gb == 1 else torch.int64)
    if pad:
        c = torch.cat([c, c.new_zeros(pad)])
    c = c.view(-1, g)
    word = c[:, 0].clone()
    for j in range(1, g):
        word |= c[:, j] << (bits * j)
    if gb == 1:
        out = word.to(torch.uint8)
    else:
        shifts = 8 * torch.arange(gb, device=codes.device)
        out = ((word.view(-1, 1) >> shifts) & 0xFF).to(torch.uint8).view(-1)
    return out[:nbytes]


def unpack_codes(packed: Tensor, n: int, bits: int) -> Tensor:
    """The inverse of :func:`pack_codes`: the first ``n`` codes (uint8 for
    codes of 1, 2, 4 or 8 bits, else int64)."""
    grp = _group(bits)
    if grp is None:
        planes = unpack_bits(packed, n * bits).view(n, bits).to(torch.int64)
        return (planes << torch.arange(bits, device=packed.device)).sum(1)
    g, gb = grp
    groups = -(-n // g)
    if gb == 1:  # 1, 2, 4, 8 bits: unpack in uint8 (codes < 256)
        shifts = bits * torch.arange(g, dtype=torch.uint8, device=packed.device)
        return ((packed.reshape(-1)[:groups].view(-1, 1) >> shifts) & ((1 << bits) - 1)).view(-1)[:n]
    b = packed.reshape(-1).to(torch.int64)
    short = groups * gb - b.numel()
    if short > 0:
        b = torch.cat([b, b.new_zeros(short)])
    b = b[:groups * gb].view(groups, gb)
    word = b[:, 0].clone()
    for j in range(1, gb):
        word |= b[:, j] << (8 * j)
    shifts = bits * torch.arange(g, device=packed.device)
    return ((word.view(-1, 1) >> shifts) & ((1 << bits) - 1)).view(-1)[:n]


@register("qsgd")
class QSGDCodec(Codec):
    """s-level stochastic quantization with one L2 norm per bucket, levels bit-packed, with error feedback (QSGD, Alistarh et al. 2017)."""

    hyperparams = (
        HyperParam("levels", 7, "quantization levels s per sign (codes -s..s in ceil(log2(2s+1)) bits)",
                   int, low=1, high=32767),
        HyperParam("bucket_size", 32, "entries per bucket (one float32 norm each)", int, low=1),
        START_ITER,
    )

    def _layout(self, offsets: Tensor, device) -> _Layout:
        sizes = tuple((offsets[1:] - offsets[:-1]).tolist())
        cache = self.__dict__.setdefault("_layouts", {})
        key = (sizes, self.bucket_size, str(device))
        lay = cache.get(key)
        if lay is None:
            if len(cache) >= 8:  # a few layouts per model (DDP buckets): bounded
                cache.clear()
            lay = cache[key] = _Layout(sizes, self.bucket_size, device)
        return lay

    def encode(self, acc: Tensor, offsets: Tensor, ctx) -> List[Tensor]:
        lay = self._layout(offsets, acc.device)
        a32 = acc.detach().reshape(-1).to(torch.float32)
        norms = bucket_norms(a32, lay)
        s = self.levels
        # x = |v| / ‖b‖ · s in float64 from the float32 norm that travels
        # (0 in buckets whose norm is 0), on the padded matrix, then unpadded
        nrm = norms.to(torch.float64)
        x = lay.pad(a32).abs().to(torch.float64)
        x.div_(nrm.clamp_min(1e-300).view(-1, 1)).mul_(s)
        x.masked_fill_((nrm == 0).view(-1, 1), 0.0)
        x = lay.unpad(x)
        # one uniform per entry, each segment from its own keyed generator
        u = torch.empty(a32.numel(), dtype=torch.float32)
        start = 0
        for n, name in zip(lay.sizes, ctx.segment_names):
            torch.rand(n, generator=seeded_generator(ctx.seed, ctx.step, name, ctx.rank), out=u[start:start + n])
            start += n
        u = u.to(acc.device)
        low = x.floor()
        up = torch.lt(u, x.sub_(low))  # x is now the fraction x - l (compared in float64)
        level = low.add_(up).clamp_(max=s).to(torch.int32)
        code = torch.where(a32 < 0, s - level, s + level)
        return [pack_codes(code, code_bits(s)), norms]

    def decode(self, payload: Sequence[Tensor], offsets: Tensor, numel: int,
               dtype: torch.dtype) -> Tensor:
        packed, norms = payload
        s = self.levels
        lay = self._layout(offsets, norms.device)
        level = unpack_codes(packed, numel, code_bits(s)).to(torch.int32) - s
        return level.to(dtype) * (norms / s).to(dtype)[lay.bid]
