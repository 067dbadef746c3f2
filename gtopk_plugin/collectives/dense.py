"""Dense allreduce (S-SGD baseline) and the value-only allreduce of random-k,
whose indices are known to every rank."""
from __future__ import annotations

import torch

from .transport import Transport


def dense_allreduce(values: torch.Tensor, transport: Transport) -> torch.Tensor:
    """Sum of ``values`` over ranks (a new tensor)."""
    out = values.clone()
    if transport.size > 1:
        transport.allreduce_sum_(out)
    return out
