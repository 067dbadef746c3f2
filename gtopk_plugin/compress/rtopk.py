"""rTop-k (Barnes et al. 2020, arXiv 2005.10761): take the top ``r·k``
coordinates by magnitude, then keep a uniformly random ``k``-subset of them.

Workers sample independently, as in the paper: each segment's draw is keyed
by (seed, step, segment name, rank), so it does not depend on how tensors are
grouped into calls (DDP buckets) and resumes bit-exactly from the step."""
import math

import torch

from gtopk_plugin import kernels
from gtopk_plugin.compress.compressor import HyperParam, Selector, seeded_generator
from gtopk_plugin.registry import register


@register("rtopk")
class RTopKSelector(Selector):
    """k random entries of each rank's top r·k, sparse allgather (Barnes et al. 2020)."""

    aggregation = "allgather"
    merges = ("allgather", "butterfly")
    hyperparams = (HyperParam("r_factor", 4.0, "rTop-k keeps k random entries of the top r*k",
                              float, low=1.0),)

    def select(self, acc, offsets, k, ctx):
        if self.r_factor == 1.0:
            return kernels.select_topk(acc, offsets, k, kernels=ctx.kernels)
        sizes = (offsets[1:] - offsets[:-1]).tolist()
        ks = k.tolist()
        r = torch.tensor([min(n, math.ceil(self.r_factor * kk)) for n, kk in zip(sizes, ks)],
                         dtype=torch.long)
        idx, _ = kernels.select_topk(acc, offsets, r, kernels=ctx.kernels)
        # idx is grouped by segment (ascending); pick k_s of each group of r_s.
        picks, start = [], 0
        for r_s, k_s, name in zip(r.tolist(), ks, ctx.segment_names):
            k_s = min(k_s, r_s)
            g = seeded_generator(ctx.seed, ctx.step, name, rank=ctx.rank)
            perm = torch.randperm(r_s, generator=g)[:k_s]
            picks.append(torch.sort(perm).values + start)
            start += r_s
        sel = idx[torch.cat(picks).to(idx.device)] if picks else idx[:0]
        return sel, acc[sel.long()]
