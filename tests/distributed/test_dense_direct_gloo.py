"""The dense step's one pass (gtopk_plugin.dense_direct) on real gloo groups:
bit for bit the sum divided by P, against oracles that do not depend on
gloo's order of addition -- P = 2 (one addition, commutative) on random
float32, and P = 3..8 on values whose sums are exact in any order -- with
the prescaled copy taken where P is a power of two, and every rank
redoing it unscaled when one rank's values would not be exact
(denormals, sums that overflow) or one rank cannot take the path (a
residual loaded from a sparse method)."""
import numpy as np
import pytest
import torch

import gtopk_plugin as gp
from gtopk_plugin import dense_direct
from dist_utils import run_workers

SHAPES = {"w": (300, 7), "b": (13,)}
STEPS = 3


def _grads(case, rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    out = {}
    for n, shape in SHAPES.items():
        if case == "random":
            t = torch.randn(shape, generator=g)
        else:  # multiples of 2^-6 below 2^10: every sum of up to 8 is exact
            t = torch.randint(-2 ** 16, 2 ** 16, shape, generator=g).float() / 64
        t.view(-1)[::5] = 0
        out[n] = t
    if case == "inexact" and step == 1 and rank == 0:
        out["w"].view(-1)[:4] = torch.tensor([1e-45, 3e38, -3e38, 2.5e-45])
    if case == "inexact" and step == 1 and rank == 1:
        out["w"].view(-1)[:4] = torch.tensor([2e-45, 3e38, -3e38, 1e-45])
    return out


def _worker(rank, P, case):
    shifts = []
    real = dense_direct.kernels.prescale_copy

    def recording(out, grad, shift, **kw):
        shifts.append(shift)
        return real(out, grad, shift, **kw)

    dense_direct.kernels.prescale_copy = recording
    red = gp.GradientReducer(method="dense", op="average")
    outs, nnz, per_step = [], [], []
    if case == "residual" and rank == 0:  # as if the step before was a sparse method's
        red.memory.load_state_dict({n: torch.full(s, 0.25) for n, s in SHAPES.items()})
    for s in range(STEPS):
        shifts.clear()
        res = red.reduce(_grads(case, rank, s))
        outs.append({n: t.clone() for n, t in res.items()})
        nnz.append(red.last_stats.result_nnz)
        per_step.append(list(shifts))
    residual_zero = all(bool((r == 0).all()) for r in red.memory.residuals.values())
    return {"outs": outs, "nnz": nnz, "shifts": per_step, "residual_zero": residual_zero}


def _oracle(case, P, step):
    """sum / P in float32 where the sum is order-free (P = 2, or exact values)."""
    per_rank = [_grads(case, r, step) for r in range(P)]
    out = {}
    for n in SHAPES:
        if P == 2:
            tot = per_rank[0][n] + per_rank[1][n]  # one float32 addition, either order
        else:
            tot = sum(g[n].double() for g in per_rank).float()  # exact: the values are coarse
        if case == "residual" and step == 0:
            tot = (per_rank[0][n] + 0.25) + per_rank[1][n]
        out[n] = tot / P
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("P,case", [(2, "random"), (2, "inexact"), (2, "residual"),
                                    (3, "coarse"), (4, "coarse"), (5, "coarse"), (8, "coarse")])
def test_one_pass_dense_step_is_the_exact_average(P, case):
    results = run_workers(P, _worker, case, timeout=240)
    shift = P.bit_length() - 1 if P & (P - 1) == 0 else 0
    for s in range(STEPS):
        want = _oracle(case, P, s)
        for r in range(P):
            got = results[r]["outs"][s]
            for n in SHAPES:
                assert torch.equal(got[n].view(torch.int32), want[n].view(torch.int32)), (r, s, n)
            assert results[r]["nnz"][s] == sum(int(np.count_nonzero(want[n].numpy())) for n in SHAPES)
            # the path every rank took: prescaled, redone unscaled where one rank could not
            redo = (case == "inexact" and s == 1) or (case == "residual" and s == 0)
            if case == "residual" and s == 0 and r == 0:
                expect = []  # the residual goes into the scratch accumulator: the general path
            else:
                expect = [shift] * len(SHAPES) + ([0] * len(SHAPES) if redo and shift else [])
            assert results[r]["shifts"][s] == expect, (r, s)
        assert all(res["residual_zero"] for res in results)
    if case == "inexact":
        w = results[0]["outs"][1]["w"].view(-1)[:4]
        assert torch.isinf(w[1]) and torch.isinf(w[2])  # 3e38 + 3e38 overflows before the division
