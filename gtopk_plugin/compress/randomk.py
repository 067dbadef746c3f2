"""Random-k: ``k_s`` uniformly random coordinates per segment, drawn from a
seed shared by all ranks for that step and segment name (Stich et al.'s
random sparsification with shared seed), so every rank picks the same
indices and only values travel, summed by a dense allreduce."""
import hashlib

import torch

from .base import Selector
from .registry import register


def shared_seed(seed: int, step: int, name: str) -> int:
    """Deterministic 63-bit seed from (seed, step, segment name), identical on
    every rank and independent of Python's hash randomisation."""
    h = hashlib.blake2b(f"{seed}:{step}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)


@register("randomk")
class RandomKSelector(Selector):
    shared_indices = True
    aggregation = "allreduce_values"

    def select(self, acc, offsets, k, ctx):
        offs = offsets.tolist()
        parts = []
        for s, (k_s, name) in enumerate(zip(k.tolist(), ctx.segment_names)):
            n = offs[s + 1] - offs[s]
            g = torch.Generator().manual_seed(shared_seed(ctx.seed, ctx.step, name))
            parts.append(torch.sort(torch.randperm(n, generator=g)[: min(k_s, n)]).values + offs[s])
        idx = torch.cat(parts).to(acc.device)
        return idx, acc[idx]
