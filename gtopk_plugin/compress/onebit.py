"""1-bit quantization with error feedback: 1-bit SGD (Seide et al. 2014,
"1-Bit Stochastic Gradient Descent and its Application to Data-Parallel
Distributed Training of Speech DNNs") in the scaled-sign form of EF-signSGD
(Karimireddy et al. 2019, arXiv 1901.09847, Algorithm 1).

Per segment s (a tensor with granularity "layer", the whole bucket with
"global") the worker sends the sign of every entry of its accumulator
``acc = grad + residual`` -- one bit, packed 8 per byte, little-endian
within a byte, bit 1 for ``acc >= 0`` -- and one float32 scale, the mean
absolute value ``‖acc_s‖₁ / n_s``.  It decodes to ``scale_s · sign(acc)``
(sign(0) = +1), which preserves the segment's ℓ1 norm (EF-signSGD's
scaling).  Error feedback keeps ``acc − scale_s · sign(acc)`` in the
residual, so nothing is lost: the scaled sign is a biased compressor, and
error feedback is what makes it converge (Karimireddy et al., Theorem II).

Payloads do not sum in encoded form (each worker has its own scales), so
they travel by an allgather of payloads and every rank decodes and adds all
P of them in rank order (bit-identical results everywhere).  Bytes per
worker and step: (P − 1)·(⌈N/8⌉ + 4·segments) each way, against
2·(P − 1)/P·4N for a float32 ring allreduce: a ratio of about P/64 (1/16 at
P = 4), so the allgather pays off up to a few dozen workers.
"""
from __future__ import annotations

from typing import List, Sequence

import torch

from .bits import pack_bits, unpack_bits
from .base import Codec
from .registry import register

Tensor = torch.Tensor


@register("onebit")
class OneBitCodec(Codec):
    """Sign bits (8 per byte) and one mean-|acc| scale per segment, with error feedback (1-bit SGD / EF-signSGD)."""

    def encode(self, acc: Tensor, offsets: Tensor, ctx) -> List[Tensor]:
        sizes = (offsets[1:] - offsets[:-1]).tolist()
        # the scale in float32 whatever the gradient dtype: 4 bytes per segment
        scales = torch.stack([part.abs().mean(dtype=torch.float32)
                              for part in torch.split(acc, sizes)]) if sizes else \
            torch.empty(0, dtype=torch.float32, device=acc.device)
        return [pack_bits(acc >= 0), scales]

    def decode(self, payload: Sequence[Tensor], offsets: Tensor, numel: int,
               dtype: torch.dtype) -> Tensor:
        bits, scales = payload
        sizes = (offsets[1:] - offsets[:-1]).tolist()
        # ±1 from the bits, then each segment times its scale (in place)
        out = unpack_bits(bits, numel).to(dtype).mul_(2).sub_(1)
        for part, s in zip(torch.split(out, sizes), scales.to(dtype)):
            part.mul_(s)
        return out
