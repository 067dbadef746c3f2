"""1-bit quantization with error feedback: 1-bit SGD (Seide et al. 2014,
"1-Bit Stochastic Gradient Descent and its Application to Data-Parallel
Distributed Training of Speech DNNs") in the scaled-sign form of EF-signSGD
(Karimireddy et al. 2019, arXiv 1901.09847, Algorithm 1).

Per segment (or per ``chunk`` entries from the segment's start when
``chunk`` > 0) the worker sends the sign of every entry of ``acc`` (bit 1
for ``acc >= 0``, 8 per byte, little-endian within a byte) and one float32
scale ``‖acc‖₁ / n``; it decodes to ``scale · sign(acc)`` (sign(0) = +1)
and error feedback keeps ``acc − scale · sign(acc)``.

``merge=``: ``"allgather_payloads"`` (default; every rank decodes and adds
the P payloads in rank order) or ``"reduce_scatter_payloads"``, the
two-phase compressed allreduce of 1-bit Adam (Tang et al. 2021, arXiv
2102.02888): rank j owns shard j of the sign bytes, sums the P pieces plus
its *server residual*, re-compresses (e_j ← t_j − decode) and the shards
are allgathered.  Mass is conserved counting server residuals; they are
codec state (``state_dict``), keyed by segment names and P.  Buckets of
< 8·P entries take the allgather (docs/compressors.md).
"""
from __future__ import annotations

from bisect import bisect_left, bisect_right
from typing import Dict, List, NamedTuple, Optional, Sequence

import torch

from gtopk_plugin.compress.bits import pack_bits
from gtopk_plugin.compress.compressor import START_ITER, Codec, HyperParam
from gtopk_plugin.registry import register

Tensor = torch.Tensor


class Shard(NamedTuple):
    """Shard j of the two-phase aggregation: sign bytes ``[b0, b1)``, entries
    ``[lo, hi)`` (``lo = 8·b0``), and the segments ``[s0, s1)`` it overlaps
    (whose scales travel with it)."""

    b0: int
    b1: int
    lo: int
    hi: int
    s0: int
    s1: int


_SIGNS: Dict[tuple, Tensor] = {}
_BOUNDS: Dict[tuple, List[int]] = {}


def scale_bounds(offsets: Sequence[int], chunk: int) -> List[int]:
    """Boundaries of the pieces that get one scale each: the segments
    (``chunk`` 0), or every segment cut into ``chunk``-entry chunks from its
    start, the last one shorter (empty segments have none).  Strictly
    increasing for ``chunk`` > 0; cached per layout."""
    o = [int(x) for x in offsets]
    if not chunk:
        return o
    key = (tuple(o), int(chunk))
    b = _BOUNDS.get(key)
    if b is None:
        b = []
        for s in range(len(o) - 1):
            b.extend(range(o[s], o[s + 1], chunk))
        b.append(o[-1])
        if len(_BOUNDS) > 256:  # DDP buckets are few; bound the cache anyway
            _BOUNDS.clear()
        _BOUNDS[key] = b
    return b


def _runs(sizes: Sequence[int]) -> List[tuple]:
    """``(start, width, count)``: consecutive pieces of equal width grouped,
    so a chunked reduction or scaling is a few 2-D views, not a Python loop
    over chunks."""
    out, at = [], 0
    for n in sizes:
        if out and out[-1][1] == n and out[-1][0] + out[-1][1] * out[-1][2] == at:
            a, w, m = out[-1]
            out[-1] = (a, w, m + 1)
        else:
            out.append((at, n, 1))
        at += n
    return out


def _scale_pieces(out: Tensor, sizes: Sequence[int], scales: Tensor) -> Tensor:
    """``out`` (±1) times each piece's scale, in place (entry by entry the
    same product whatever the grouping)."""
    i = 0
    for a, w, m in _runs(sizes):
        out[a:a + w * m].view(m, w).mul_(scales[i:i + m].view(m, 1))
        i += m
    return out


def _signs(bits: Tensor, n: int, dtype: torch.dtype) -> Tensor:
    """±1 (bit 1 -> +1) for the first ``n`` entries of a packed bitmask, in
    ``dtype``: one gather from a 256 × 8 table (every byte's eight signs),
    the same values as ``unpack_bits(...)·2 − 1`` in a fifth of the time."""
    key = (dtype, bits.device)
    lut = _SIGNS.get(key)
    if lut is None:
        lut = _SIGNS[key] = ((torch.arange(256, device=bits.device).view(-1, 1)
                              >> torch.arange(8, device=bits.device)) & 1).to(dtype).mul_(2).sub_(1)
    return lut.index_select(0, bits.reshape(-1).to(torch.int32)).view(-1)[:n]


@register("onebit")
class OneBitCodec(Codec):
    """Sign bits (8 per byte) and one mean-|acc| scale per segment or per chunk, with error feedback (1-bit SGD / EF-signSGD)."""

    merges = ("allgather_payloads", "reduce_scatter_payloads")
    hyperparams = (
        HyperParam("chunk", 0, "entries per scale: each segment cut into chunks of this many entries "
                   "from its start (the last shorter), one float32 scale each; 0: one per segment",
                   int, low=0),
        START_ITER,
    )

    def __init__(self, **hyper):
        super().__init__(**hyper)
        # two-phase aggregation: this rank's server residual per layout key
        self._server: Dict[str, Tensor] = {}

    def encode(self, acc: Tensor, offsets: Tensor, ctx) -> List[Tensor]:
        if self.chunk:
            b = scale_bounds(offsets.tolist(), self.chunk)
            sizes = [y - x for x, y in zip(b, b[1:])]
            # one float32 mean |acc| per chunk: full chunks of a segment as one 2-D view
            scales = torch.cat([acc[a:a + w * m].view(m, w).abs().mean(1, dtype=torch.float32)
                                for a, w, m in _runs(sizes)]) if sizes else \
                torch.empty(0, dtype=torch.float32, device=acc.device)
            return [pack_bits(acc >= 0), scales]
        sizes = (offsets[1:] - offsets[:-1]).tolist()
        # the scale in float32 whatever the gradient dtype: 4 bytes per segment
        scales = torch.stack([part.abs().mean(dtype=torch.float32)
                              for part in torch.split(acc, sizes)]) if sizes else \
            torch.empty(0, dtype=torch.float32, device=acc.device)
        return [pack_bits(acc >= 0), scales]

    def decode(self, payload: Sequence[Tensor], offsets: Tensor, numel: int,
               dtype: torch.dtype) -> Tensor:
        bits, scales = payload
        # ±1 from the bits, then each segment (chunk) times its scale (in place)
        out = _signs(bits, numel, dtype)
        if self.chunk:
            b = scale_bounds(offsets.tolist(), self.chunk)
            return _scale_pieces(out, [y - x for x, y in zip(b, b[1:])], scales.to(dtype))
        sizes = (offsets[1:] - offsets[:-1]).tolist()
        for part, s in zip(torch.split(out, sizes), scales.to(dtype)):
            part.mul_(s)
        return out

    # ------------------------------------------------ two-phase aggregation
    # (collectives/two_phase.py drives these; none of them communicates)
    def shard_plan(self, offsets: Sequence[int], numel: int, P: int) -> Optional[List[Shard]]:
        """The P shards: sign bytes split evenly, ``[⌊j·B/P⌋, ⌊(j+1)·B/P⌋)``
        of B = ⌈N/8⌉ (byte-aligned, so a shard's bits are a slice of the
        packed payload); None when B < P (some shard would be empty).
        ``s0, s1`` index the scale pieces (segments, or chunks with
        ``chunk`` > 0) the shard overlaps: their scales travel with it."""
        o = scale_bounds(offsets, self.chunk)
        B = (int(numel) + 7) // 8
        if B < P:
            return None
        plan = []
        for j in range(P):
            b0, b1 = j * B // P, (j + 1) * B // P
            lo, hi = 8 * b0, min(int(numel), 8 * b1)
            plan.append(Shard(b0, b1, lo, hi, bisect_right(o, lo) - 1, bisect_left(o, hi)))
        return plan

    @staticmethod
    def shard_payload(payload: Sequence[Tensor], sh: Shard) -> List[Tensor]:
        """The part of a payload that shard ``sh``'s owner needs."""
        bits, scales = payload
        return [bits[sh.b0:sh.b1], scales[sh.s0:sh.s1]]

    def _piece_sizes(self, offsets: Sequence[int], sh: Shard) -> List[int]:
        """Entries of each piece (scale piece ∩ shard) of shard ``sh``."""
        o = scale_bounds(offsets, self.chunk)
        return [max(0, min(o[s + 1], sh.hi) - max(o[s], sh.lo)) for s in range(sh.s0, sh.s1)]

    def decode_shard(self, part: Sequence[Tensor], offsets: Sequence[int], sh: Shard,
                     dtype: torch.dtype) -> Tensor:
        """A shard payload (:meth:`shard_payload` or :meth:`encode_shard`)
        decoded: ``scale · (±1)`` for entries ``[lo, hi)``, the same bits as
        :meth:`decode` gives there."""
        bits, scales = part
        out = _signs(bits, sh.hi - sh.lo, dtype)
        return _scale_pieces(out, self._piece_sizes(offsets, sh), scales.to(dtype))

    def encode_shard(self, t: Tensor, offsets: Sequence[int], sh: Shard) -> List[Tensor]:
        """The owner's re-compression of its shard sum ``t`` (entries ``[lo,
        hi)``): sign bits and one scale per piece (segment or chunk ∩
        shard), the piece's ‖t‖₁/n summed in float64 and rounded once to
        float32 (0 for an empty piece)."""
        sizes = self._piece_sizes(offsets, sh)
        if self.chunk:  # no empty pieces; equal-width pieces reduced as one 2-D view
            scales = torch.cat([t[a:a + w * m].view(m, w).abs().sum(1, dtype=torch.float64).div_(w)
                                for a, w, m in _runs(sizes)]).to(torch.float32)
            return [pack_bits(t >= 0), scales]
        scales, at = [], 0
        for n in sizes:
            scales.append(float(t[at:at + n].abs().sum(dtype=torch.float64)) / n if n else 0.0)
            at += n
        return [pack_bits(t >= 0), torch.tensor(scales, dtype=torch.float32, device=t.device)]

    def server_residual(self, key: str, n: int, dtype: torch.dtype, device) -> Tensor:
        """This rank's server residual for layout ``key`` (zeros at first)."""
        e = self._server.get(key)
        if e is None or e.numel() != n or e.dtype != dtype:
            return torch.zeros(n, dtype=dtype, device=device)
        return e.to(device)

    def set_server_residual(self, key: str, e: Tensor) -> None:
        self._server[key] = e

    # server residuals: bit-exact resume (no state: {} as before)
    def state_dict(self) -> dict:
        if not self._server:
            return {}
        return {"server": {k: e.detach().cpu().clone() for k, e in self._server.items()}}

    def load_state_dict(self, sd: dict) -> None:
        extra = set(sd) - {"server"}
        if extra:
            raise ValueError(f"method 'onebit' keeps only server residuals; got {sorted(extra)}")
        self._server = {str(k): e.clone() for k, e in sd.get("server", {}).items()}
