"""Random-k: ``k_s`` uniformly random coordinates per segment, drawn from a
seed shared by all ranks for that step and segment name (Stich et al.'s
random sparsification with shared seed), so every rank picks the same
indices and only values travel, summed by a dense allreduce.

The draw costs O(k log k), not O(n) (a ``torch.randperm(n)``
per tensor was most of a random-k step on a 1.1M-parameter model).  For
``k <= n/2`` it takes the first ``k`` *distinct* values of a stream of
i.i.d. uniform integers in ``[0, n)`` from the keyed generator
(``seeded_generator(seed, step, name)``, the same on every rank): by the
symmetry of i.i.d. uniform draws under any relabelling of ``[0, n)``, that
set is a uniformly random k-subset, whatever the batch sizes the stream is
read in (they depend only on ``n``, ``k`` and how many distinct values the
stream has shown, all relabelling-invariant).  About ``-n·ln(1 - k/n) <=
1.39·k`` draws suffice on average.  For ``k > n/2`` (or a small segment,
``n <= 8192``) the prefix of a keyed ``randperm(n)`` is as cheap (O(n) =
O(k), or a few microseconds) and exact.  Deterministic in
(seed, step, name): the step counter is the whole RNG state, so a resumed
run draws the same indices.
"""
import math

import torch

from gtopk_plugin.compress.compressor import Selector, seeded_generator
from gtopk_plugin.registry import register

Tensor = torch.Tensor
# up to this many entries a keyed randperm(n) is cheaper than the stream
# path's fixed cost (tens of µs on one thread)
_SMALL = 8192


def sample_distinct(n: int, k: int, g: torch.Generator) -> Tensor:
    """``k`` distinct indices of ``[0, n)`` (int64, ascending), a uniformly
    random k-subset under the generator ``g``; O(k log k) for ``k <= n/2``."""
    k = min(int(k), int(n))
    if k <= 0:
        return torch.zeros(0, dtype=torch.int64)
    if k == n:
        return torch.arange(n, dtype=torch.int64)
    if 2 * k > n or n <= _SMALL:
        return torch.sort(torch.randperm(n, generator=g)[:k]).values
    # expected draws for k distinct values: n·(H_n − H_{n−k}) ≈ −n·ln(1 − k/n)
    need = -n * math.log1p(-k / n)
    stream = torch.randint(n, (int(need + 4 * math.sqrt(need)) + 16,), generator=g)
    while True:
        uniq, inv = torch.unique(stream, sorted=True, return_inverse=True)
        have = uniq.numel()
        if have >= k:
            break
        # short (rare): read more of the same stream; the batch depends only
        # on (n, k, have)
        more = (k - have) * n / (n - k)
        stream = torch.cat([stream, torch.randint(n, (int(more + 4 * math.sqrt(more)) + 16,), generator=g)])
    # position of each distinct value's first occurrence in the stream
    first = torch.full((have,), stream.numel(), dtype=torch.int64)
    first.scatter_reduce_(0, inv, torch.arange(stream.numel()), reduce="amin")
    if have == k:
        return uniq
    # the k values that appeared first (positions are distinct: exactly k);
    # uniq is ascending, so the kept values are too
    cut = torch.kthvalue(first, k).values
    return uniq[first <= cut]


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
            parts.append(sample_distinct(n, k_s, g) + offs[s])
        idx = torch.cat(parts).to(acc.device)
        return idx, acc[idx]
