"""Random-k: ``k_s`` uniformly random coordinates per segment, drawn from a
seed shared by all ranks for that step and segment name (Stich et al.'s
random sparsification with shared seed), so every rank picks the same
indices and only values travel, summed by a dense allreduce."""
import torch

from .base import Selector, seeded_generator
from .registry import register


@register("randomk")
class RandomKSelector(Selector):
    """k random indices per segment shared by all ranks; values allreduced."""

    shared_indices = True
    aggregation = "allreduce_values"
    merges = ()

    def select(self, acc, offsets, k, ctx):
        offs = offsets.tolist()
        parts = []
        for s, (k_s, name) in enumerate(zip(k.tolist(), ctx.segment_names)):
            n = offs[s + 1] - offs[s]
            g = seeded_generator(ctx.seed, ctx.step, name)  # same on every rank
            parts.append(torch.sort(torch.randperm(n, generator=g)[: min(k_s, n)]).values + offs[s])
        idx = torch.cat(parts).to(acc.device)
        return idx, acc[idx]
