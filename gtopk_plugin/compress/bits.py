"""Bool masks packed 8 per byte, little-endian within a byte (bit j of byte
i is entry 8i + j): the sign bits of the 1-bit codec and the butterfly's
survivor bitmask (``collectives.wire`` re-exports these).  Pure torch; in
compress/ because it is the lowest layer that needs it (collectives import
compress, never the reverse)."""
from __future__ import annotations

import torch

Tensor = torch.Tensor


def pack_bits(mask: Tensor) -> Tensor:
    """Bool tensor -> uint8 bitmask of ``ceil(n/8)`` bytes."""
    n = mask.numel()
    pad = (-n) % 8
    m = torch.cat([mask.reshape(-1).to(torch.uint8),
                   torch.zeros(pad, dtype=torch.uint8, device=mask.device)])
    weights = (2 ** torch.arange(8, dtype=torch.uint8, device=mask.device))
    return (m.view(-1, 8) * weights).sum(1).to(torch.uint8)


def unpack_bits(bits: Tensor, n: int) -> Tensor:
    """uint8 bitmask -> the first ``n`` entries as a bool tensor."""
    weights = (2 ** torch.arange(8, dtype=torch.uint8, device=bits.device))
    return ((bits.view(-1, 1) & weights) != 0).view(-1)[:n]


def bitmask_bytes(n: int) -> int:
    return (n + 7) // 8
