"""Random-k's O(k) draw (gtopk_plugin/compress/randomk.py):
``sample_distinct`` replaced ``torch.randperm(n)[:k]`` per segment, so the
indices random-k draws changed (every layer -- reducer, DDP hook, both
Horovod layers, the single-process Oracle -- reaches them only through
``RandomKSelector.select``, so they stay consistent with each other).

What is pinned here, for each of its paths (the stream of distinct
uniform draws for k <= n/2 on large segments, forced onto small ones by
lowering the size cut; the randperm prefix otherwise): exactly k distinct
ascending indices in range, the same for the same key and different for
another step, uniform over positions (χ² at α = 1e-3) and independent from
step to step (overlap of consecutive draws against the hypergeometric law).
test_selection_stats.py keeps its uniformity test of the selector itself.
"""
import numpy as np
import pytest
import torch

from gtopk_plugin.compress import randomk
from gtopk_plugin.compress.compressor import seeded_generator
from oracles import chi2_critical, hypergeom_pmf, subset_chi2

ALPHA = 1e-3


@pytest.mark.parametrize("n,k", [(1, 1), (7, 7), (10, 6), (20, 4), (9000, 1), (50_000, 500),
                                 (50_000, 25_000), (50_000, 25_001), (300_000, 3000)])
def test_k_distinct_ascending_in_range_and_keyed(n, k):
    a = randomk.sample_distinct(n, k, seeded_generator(3, 7, "w"))
    b = randomk.sample_distinct(n, k, seeded_generator(3, 7, "w"))
    c = randomk.sample_distinct(n, k, seeded_generator(3, 8, "w"))
    assert a.dtype == torch.int64 and a.numel() == k
    assert int(a.min()) >= 0 and int(a.max()) < n
    assert bool((a[1:] > a[:-1]).all()), "not strictly ascending (duplicates or unsorted)"
    assert torch.equal(a, b), "the same key must draw the same indices"
    if 0 < k < n and n > 10:
        assert not torch.equal(a, c), "another step must draw anew"


@pytest.mark.parametrize("path", ["stream", "randperm"])
def test_uniform_over_positions_and_fresh_every_step(monkeypatch, path):
    # n = 20, k = 4 (k <= n/2): the stream path when the size cut is lowered
    monkeypatch.setattr(randomk, "_SMALL", 0 if path == "stream" else 1 << 30)
    n, k, T = 20, 4, 6000
    counts = np.zeros(n)
    overlaps, prev = [], None
    for step in range(T):
        idx = randomk.sample_distinct(n, k, seeded_generator(1, step, "w")).numpy()
        counts[idx] += 1
        cur = frozenset(idx.tolist())
        if prev is not None:
            overlaps.append(len(cur & prev))
        prev = cur
    x2 = subset_chi2(counts, T, k)
    assert x2 < chi2_critical(n - 1, ALPHA), f"{path}: not uniform, X² = {x2:.1f}, counts {counts}"
    ov = np.bincount(overlaps, minlength=k + 1)
    e = len(overlaps) * hypergeom_pmf(n, k)
    x2o = float(np.sum((ov - e) ** 2 / e))
    assert x2o < chi2_critical(k, ALPHA), f"{path}: consecutive draws not independent: {ov} vs {e}"


def test_large_segment_draw_is_uniform_over_blocks():
    # the stream path at its real size: 200 draws of 1% of 100,000 entries,
    # counted in 20 blocks of 5,000 positions (each block expects 1/20)
    n, k, T, B = 100_000, 1000, 200, 20
    counts = np.zeros(B)
    for step in range(T):
        idx = randomk.sample_distinct(n, k, seeded_generator(5, step, "big")).numpy()
        counts += np.bincount(idx // (n // B), minlength=B)
    e = T * k / B
    x2 = float(np.sum((counts - e) ** 2 / e))
    assert x2 < chi2_critical(B - 1, ALPHA), f"blocks not uniform: X² = {x2:.1f}, {counts}"
