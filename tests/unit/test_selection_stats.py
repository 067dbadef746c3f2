"""Statistical tests of the random selectors, fixed seeds, against
numpy oracles that share no code with the implementation (tests/support/oracles.py:
numpy only).  Each test states the deviation it detects and with what
probability (power of the chi-square test at level α = 10⁻³, computed from
the non-central χ² with the stated non-centrality λ; the false-alarm
probability of a correct implementation is ≤ 10⁻³ per statistic, and with
fixed seeds a pass is reproducible).

Counts of positions drawn as uniform k-subsets of r are not multinomial;
:func:`oracles.subset_chi2` uses their exact covariance (the Pearson sum
times (r−1)/(r−k)), which is χ²(r−1) under the null.
"""
import math

import numpy as np
import pytest
import torch

import gtopk_plugin as gp
from gtopk_plugin import registry
from gtopk_plugin.compress.compressor import SelectionContext
from oracles import chi2_critical, hypergeom_pmf, subset_chi2, topk_np

ALPHA = 1e-3


def rtopk_case():
    """Two segments.  Segment "a" (64 entries, k = 4, r_factor 2.5: r = 10)
    has 9 clearly large entries and three entries tied at |v| = 2 (indices 7,
    30, 50) for the 10th place: the tie rule (larger |v| first, then the
    smaller index) admits index 7 only.  Segment "b" (36 entries, k = 2:
    r = 5) is random."""
    g = torch.Generator().manual_seed(2020)
    a = torch.rand(64, generator=g) * 1.5          # all below 2
    big = [3, 11, 19, 26, 38, 44, 57, 60, 62]
    a[big] = torch.tensor([9.0, -8.0, 7.5, 7.0, -6.5, 6.0, 5.5, -5.0, 4.0])
    a[7], a[30], a[50] = -2.0, 2.0, 2.0
    b = torch.randn(36, generator=g)
    x = torch.cat([a, b])
    offsets, ks = [0, 64, 100], [4, 2]
    return x, offsets, ks


def draw(selector, x, offsets, ks, step, rank, names=("a", "b"), seed=11):
    ctx = SelectionContext(step=step, segment_names=list(names), seed=seed, rank=rank)
    idx, vals = selector.select(x, torch.tensor(offsets), torch.tensor(ks), ctx)
    return idx.long().numpy(), vals


def test_rtopk_picks_k_of_the_top_rk_uniformly_and_independently_per_rank():
    """rTop-k (Barnes et al. 2020): every draw is k distinct positions of the
    top r·k (numpy oracle with the tie rule), uniform over them, and the
    draws of different ranks are independent.

    - Support: exact, every one of 8,000 draws per rank (any position outside
      the top r·k, e.g. a wrong tie rule picking index 30 or 50, fails).
    - Uniformity (rank 0, segment "a", r = 10, k = 4, T = 8,000 draws):
      X² ~ χ²(9) under the null, critical value 27.9.  One position favoured
      by 10% relative (p = 0.44 instead of 0.40, the others compensating)
      gives λ = 53 and is detected with probability 0.996 (by 5%: λ = 13,
      probability 0.24); a position never drawn, or always drawn, gives λ in
      the thousands (probability 1).
    - Independence per rank (ranks 0, 1, 2; 3,000 steps each): the overlap
      |S₀ ∩ S₁| of two ranks' draws at the same step must follow the
      hypergeometric law of independent uniform 4-subsets of 10 (χ²(4),
      critical 18.5).  Sharing the draw in 2% of the steps (overlap 4
      instead of hypergeometric) gives λ = 251 (3,000 steps): detected with
      probability 1.0; identical draws would give overlap 4 in every step.
    """
    sel = registry.get("rtopk")(r_factor=2.5)
    x, offsets, ks = rtopk_case()
    tops = []
    for s, k in enumerate(ks):
        r = math.ceil(2.5 * k)
        tops.append(set(topk_np(x[offsets[s]:offsets[s + 1]], [0, offsets[s + 1] - offsets[s]], [r])
                        .tolist()))
        tops[-1] = {i + offsets[s] for i in tops[-1]}
    assert 7 in tops[0] and 30 not in tops[0] and 50 not in tops[0]  # the oracle's tie rule
    top_a = sorted(tops[0])
    T, T_ranks = 8000, 3000
    counts = np.zeros(len(top_a))
    draws = {r: [] for r in range(3)}
    for rank in range(3):
        for step in range(T if rank == 0 else T_ranks):
            idx, vals = draw(sel, x, offsets, ks, step, rank)
            assert np.all(np.diff(idx) > 0)
            a, b = idx[idx < 64], idx[idx >= 64]
            assert len(a) == 4 and len(b) == 2
            assert set(a.tolist()) <= tops[0] and set(b.tolist()) <= tops[1], (rank, step, idx)
            assert torch.equal(vals, x[torch.from_numpy(idx)])
            if rank == 0:
                counts[np.searchsorted(top_a, a)] += 1
            if step < T_ranks:
                draws[rank].append(frozenset(a.tolist()))
    x2 = subset_chi2(counts, T, 4)
    crit = chi2_critical(9, ALPHA)
    print(f"rTop-k uniformity: X² = {x2:.2f} (df 9, critical {crit:.1f}); counts {counts.tolist()}")
    assert x2 < crit, f"rTop-k not uniform over the top r·k: X² = {x2:.1f} ≥ {crit:.1f}, counts {counts}"
    pmf = hypergeom_pmf(10, 4)
    crit4 = chi2_critical(4, ALPHA)
    for r1, r2 in ((0, 1), (0, 2), (1, 2)):
        ov = np.bincount([len(p & q) for p, q in zip(draws[r1], draws[r2])], minlength=5)
        e = T_ranks * pmf
        x2o = float(np.sum((ov - e) ** 2 / e))
        print(f"rTop-k ranks {r1},{r2} overlap: X² = {x2o:.2f} (df 4, critical {crit4:.1f}); {ov.tolist()}")
        assert x2o < crit4, f"ranks {r1} and {r2} do not draw independently: overlaps {ov}, expected {e}"


def test_randomk_is_uniform_shared_across_ranks_and_fresh_every_step():
    """Random-k: every rank draws the same positions (shared seed), uniform
    over the segment, independent from step to step.

    - Shared: ranks 0, 1, 2 identical at each of 400 steps (exact).
    - Uniformity (n = 20, k = 4, T = 10,000 draws): X² ~ χ²(19), critical
      43.8.  One position favoured by 10% relative (p = 0.22 instead of 0.20)
      gives λ = 25 and is detected with probability 0.48; by 20%, λ = 100,
      probability 1.0; a position never drawn, λ = 2,500, probability 1.
    - Fresh draws: the overlap of consecutive steps' draws follows the
      hypergeometric law of independent 4-subsets of 20 (χ²(4), critical
      18.5); repeating the previous step's draw in 2% of the steps gives
      λ ≈ 19,000: detected with probability 1.0.
    """
    sel = registry.get("randomk")()
    n, k, T = 20, 4, 10_000
    x = torch.randn(n, generator=torch.Generator().manual_seed(1))
    counts = np.zeros(n)
    prev, overlaps = None, []
    for step in range(T):
        idx, vals = draw(sel, x, [0, n], [k], step, rank=0, names=("w",))
        assert len(set(idx.tolist())) == k and torch.equal(vals, x[torch.from_numpy(idx)])
        if step < 400:
            for rank in (1, 2):
                np.testing.assert_array_equal(draw(sel, x, [0, n], [k], step, rank, names=("w",))[0], idx)
        counts[idx] += 1
        cur = frozenset(idx.tolist())
        if prev is not None:
            overlaps.append(len(cur & prev))
        prev = cur
    x2 = subset_chi2(counts, T, k)
    crit = chi2_critical(n - 1, ALPHA)
    print(f"random-k uniformity: X² = {x2:.2f} (df {n - 1}, critical {crit:.1f})")
    assert x2 < crit, f"random-k not uniform: X² = {x2:.1f}, counts {counts}"
    ov = np.bincount(overlaps, minlength=k + 1)
    e = len(overlaps) * hypergeom_pmf(n, k)
    x2o = float(np.sum((ov - e) ** 2 / e))
    crit4 = chi2_critical(4, ALPHA)
    print(f"random-k consecutive-step overlap: X² = {x2o:.2f} (df 4, critical {crit4:.1f})")
    assert x2o < crit4, f"random-k draws of consecutive steps are not independent: {ov} vs {e}"


@pytest.mark.parametrize("method", ["randomk", "rtopk"])
def test_buckets_of_one_step_draw_independently_in_the_reducer(method):
    """Two buckets (different tensor names, the SAME values) reduced in one
    step (advance_step=False on the first, as DDP does) with
    granularity="global": the positions drawn for the two buckets must be
    independent.  Error feedback is off, so both buckets see the same
    accumulator and the same top r·k: only the draws can differ.

    600 steps; overlap |S₁ ∩ S₂| against the hypergeometric law of
    independent k-subsets (random-k: k = 10 of n = 100; rTop-k: 10 of the
    top 20), tail cells pooled until each expects ≥ 5 (χ²(3) and χ²(6)), at
    α = 10⁻³.  Buckets that share one key (a bug this test once caught) have
    overlap k in every step: λ ≈ 9,400 and 52,000, detected with
    probability 1; sharing the draw in 5% of the steps gives λ = 23.5
    (random-k) and 129 (rTop-k), detected with probability 0.85 and 1.0;
    in 10% of the steps, λ = 94 and 515, probability 1.0.
    """
    red = gp.GradientReducer(method=method, density=0.1, r_factor=2.0, granularity="global", seed=4,
                             error_feedback=False, transport=gp.SingleProcessTransport())
    n, k, steps = 100, 10, 600
    r = n if method == "randomk" else 20
    g = torch.Generator().manual_seed(8)
    overlaps = []
    for _ in range(steps):
        w = torch.randn(60, generator=g)
        b = torch.randn(40, generator=g)
        up1 = red.reduce({"l1.weight": w, "l1.bias": b}, advance_step=False)
        up2 = red.reduce({"l2.weight": w.clone(), "l2.bias": b.clone()})
        m1 = torch.cat([up1["l1.weight"], up1["l1.bias"]]) != 0
        m2 = torch.cat([up2["l2.weight"], up2["l2.bias"]]) != 0
        assert int(m1.sum()) == k and int(m2.sum()) == k
        if method == "rtopk":
            top = topk_np(torch.cat([w, b]), [0, n], [r])
            assert set(torch.nonzero(m1).flatten().tolist()) <= set(top.tolist())
        overlaps.append(int((m1 & m2).sum()))
    assert red.step == steps
    pmf = hypergeom_pmf(r, k)
    ov = np.bincount(overlaps, minlength=k + 1)[:k + 1].astype(float)
    e = steps * pmf
    # pool both tails so that every cell expects at least 5
    lo = int(np.nonzero(np.cumsum(e) >= 5)[0].min())
    hi = int(np.nonzero(np.cumsum(e[::-1])[::-1] >= 5)[0].max())

    def pooled(v):
        return np.concatenate([[v[:lo + 1].sum()], v[lo + 1:hi], [v[hi:].sum()]])

    ov_p, e_p = pooled(ov), pooled(e)
    x2 = float(np.sum((ov_p - e_p) ** 2 / e_p))
    crit = chi2_critical(len(e_p) - 1, ALPHA)
    print(f"{method} bucket overlap: X² = {x2:.2f} (df {len(e_p) - 1}, critical {crit:.1f}); {ov.tolist()}")
    assert x2 < crit, f"{method}: buckets of one step do not draw independently: overlaps {ov}, expected {e}"


def test_threshold_never_drops_an_entry_above_its_final_threshold_and_keeps_the_rest():
    """Threshold selection through the reducer (P = 1, error feedback): per
    step and tensor, every entry above the final threshold (the smallest
    |acc| sent) is sent, the update equals acc on the sent entries (numpy),
    and every unsent entry stays in the residual bit for bit."""
    red = gp.GradientReducer(method="threshold", density=0.01, transport=gp.SingleProcessTransport())
    g = torch.Generator().manual_seed(3)
    shapes = {"big": (20_000,), "small": (37,)}
    for _ in range(20):
        grads = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
        before = {n: red.memory.residuals.get(n) for n in shapes}
        acc = {n: (grads[n] if before[n] is None else grads[n] + before[n]).numpy() for n in shapes}
        out = red.reduce(grads)
        for n in shapes:
            a = acc[n]
            up = out[n].numpy()
            sent = up != 0
            assert sent.any()
            thr = np.abs(a[sent]).min()
            assert not np.any(np.abs(a[~sent]) > thr), f"{n}: an entry above the final threshold was dropped"
            np.testing.assert_array_equal(up[sent], a[sent])
            res = red.memory.residuals[n].numpy()
            np.testing.assert_array_equal(res[~sent], a[~sent])
            assert np.all(res[sent] == 0)
