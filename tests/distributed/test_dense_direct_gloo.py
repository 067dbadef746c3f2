"""The dense step's one pass (gtopk_plugin.pipeline.dense_direct) on real gloo groups:
bit for bit the sum divided by P, against oracles that do not depend on
gloo's order of addition -- P = 2 (one addition, commutative) on random
float32, P = 3..8 on values whose sums are exact in any order -- and
against the two-pass path (``out=`` on every rank) on values spread over
the exponent range; with the prescaled copy taken where P is a power of
two, and every rank redoing it unscaled when one rank's values are not
exactly prescalable (denormals, sums that overflow) or one rank cannot
take the path (a residual loaded from a sparse method, ``out=`` on one
rank only), then backing off on the step counter's schedule."""
import math

import numpy as np
import pytest
import torch

import gtopk_plugin as gp
from gtopk_plugin.pipeline import dense_direct
from dist_utils import run_workers

SHAPES = {"w": (300, 7), "b": (13,)}
STEPS = 4


def _grads(case, rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    out = {}
    for n, shape in SHAPES.items():
        if case in ("coarse",):  # multiples of 2^-6 below 2^10: every sum of up to 8 is exact
            t = torch.randint(-2 ** 16, 2 ** 16, shape, generator=g).float() / 64
        elif case == "spread":  # magnitudes from 2^-60 to 2^60
            t = torch.randn(shape, generator=g) * torch.pow(2.0, torch.randint(-60, 61, shape, generator=g).float())
        else:
            t = torch.randn(shape, generator=g)
        t.view(-1)[::5] = 0
        out[n] = t
    if case == "inexact" and step == 1:
        out["w"].view(-1)[:4] = torch.tensor([1e-45, 3e38, -3e38, 2.5e-45] if rank == 0 else
                                             [2e-45, 3e38, -3e38, 1e-45])
    if case == "nonfinite" and step == 1 and rank == 1:
        out["b"][3] = float("nan")
    return out


def _worker(rank, P, case):
    shifts = []
    real = dense_direct.kernels.prescale_copy

    def recording(out, grad, shift, **kw):
        shifts.append(shift)
        return real(out, grad, shift, **kw)

    dense_direct.kernels.prescale_copy = recording
    red = gp.GradientReducer(method="dense", op="average", nonfinite="skip")
    two_pass = gp.GradientReducer(method="dense", op="average", nonfinite="skip")
    if case == "residual" and rank == 0:  # as if the step before was a sparse method's
        red.memory.load_state_dict({n: torch.full(s, 0.25) for n, s in SHAPES.items()})
    res = {"outs": [], "two_pass": [], "nnz": [], "shifts": []}
    for s in range(STEPS):
        grads = _grads(case, rank, s)
        shifts.clear()
        out = {n: torch.empty_like(t) for n, t in grads.items()} if case == "outmix" and rank == 0 else None
        got = red.reduce(grads, out=out)
        res["outs"].append({n: t.clone() for n, t in got.items()})
        res["nnz"].append(red.last_stats.result_nnz)
        res["shifts"].append(list(shifts))
        if case == "spread":  # the two-pass path, on the same gradients
            o = {n: torch.empty_like(t) for n, t in grads.items()}
            res["two_pass"].append({n: t.clone() for n, t in two_pass.reduce(grads, out=o).items()})
    res["residual_zero"] = all(bool((r == 0).all()) for r in red.memory.residuals.values())
    return res


def _oracle(case, P, step):
    """sum / P in float32 where the sum is order-free (P = 2, or exact values)."""
    per_rank = [_grads(case, r, step) for r in range(P)]
    out = {}
    for n in SHAPES:
        if case == "nonfinite" and step == 1:
            out[n] = torch.zeros(SHAPES[n])  # skipped on every rank
            continue
        if P == 2:
            a = per_rank[0][n] + 0.25 if case == "residual" and step == 0 else per_rank[0][n]
            tot = a + per_rank[1][n]  # one float32 addition, either order
        else:
            tot = sum(g[n].double() for g in per_rank).float()  # exact: the values are coarse
        out[n] = tot / P
    return out


def _expected_shifts(case, P, step, rank):
    """What each rank copied, per tensor: the prescaled copy (shift s), the
    redo (0 after s), the general path ([]), or unscaled up front (0)."""
    s = P.bit_length() - 1 if P & (P - 1) == 0 else 0
    t = len(SHAPES)
    tried, redo = [s] * t, [s] * t + [0] * t
    if not s:
        return [0] * t
    if case == "inexact" and step == 1:
        return redo
    if case == "residual":  # rank 0 takes the general path at step 0, then the levels meet at step 2
        return {(0, 0): [], (0, 1): redo, (1, 0): redo, (1, 1): [0] * t}.get((rank, step), tried)
    if case == "outmix":  # rank 0 always passes out=: rank 1 backs off (tries at steps 0, 2)
        return [] if rank == 0 else (redo if step % 2 == 0 else [0] * t)
    return tried


@pytest.mark.timeout(300)
@pytest.mark.parametrize("P,case", [(2, "random"), (2, "inexact"), (2, "residual"), (2, "outmix"),
                                    (2, "nonfinite"), (3, "coarse"), (4, "coarse"), (5, "coarse"),
                                    (8, "coarse"), (4, "spread")])
def test_one_pass_dense_step_is_the_exact_average(P, case):
    results = run_workers(P, _worker, case, timeout=240)
    for s in range(STEPS):
        want = None if case == "spread" else _oracle(case, P, s)
        for r in range(P):
            got = results[r]["outs"][s]
            ref = results[r]["two_pass"][s] if case == "spread" else want
            for n in SHAPES:
                assert torch.equal(got[n].view(torch.int32), ref[n].view(torch.int32)), (r, s, n)
                assert torch.equal(got[n].view(torch.int32), results[0]["outs"][s][n].view(torch.int32))
            if not (case == "nonfinite" and s == 1):
                assert results[r]["nnz"][s] == sum(int(np.count_nonzero(ref[n].numpy())) for n in SHAPES)
            assert results[r]["shifts"][s] == _expected_shifts(case, P, s, r), (r, s)
    assert all(res["residual_zero"] for res in results)
    if case == "inexact":
        w = results[0]["outs"][1]["w"].view(-1)[:4]
        assert torch.isinf(w[1]) and torch.isinf(w[2])  # 3e38 + 3e38 overflows before the division
        assert w[0].item() == math.ldexp(1.0, -149)  # (1 + 1 ulp) / 2 of the smallest denormal
