"""``GradientReducer(dense_below=N)`` (gtopk_plugin/small_tensors.py)
on real gloo process groups, P = 1, 3, 4.

Tensors below N entries go dense in the same call: their updates are the
plain sum (op="sum") or average of every rank's gradients, bit for bit (the
gradients are multiples of 1/8, so every summation order is exact and a
numpy oracle gives the bits); the other tensors get exactly the updates and
residuals of a reducer run without the small tensors; bytes are the dense
ring allreduce of the small part plus the method's, exactly; mass is
conserved; and a NaN in a small tensor skips the whole step on every rank.
"""
import math

import numpy as np
import pytest
import torch

import gtopk_plugin as gp
from gtopk_plugin.pipeline.input_check import NonFiniteGradientError
from dist_utils import run_workers
from ddp_vs_reducer import hook_vs_reducer

SHAPES = {"w": (40, 30), "v": (300,), "b": (13,), "c": (5, 3, 2), "s": (99,)}
THRESHOLD = 100
SMALL = sorted(n for n, s in SHAPES.items() if math.prod(s) < THRESHOLD)
BIG = sorted(n for n in SHAPES if n not in SMALL)
STEPS = 4
CASES = [("gtopk", "layer", "sum"), ("gtopk", "global", "average"), ("qsgd", "layer", "sum"),
         ("topk", "layer", "average")]


def _grads(rank, step):
    g = torch.Generator().manual_seed(100 * rank + step)
    # multiples of 1/8: sums over ranks are exact in any order
    return {n: torch.randint(-64, 65, s, generator=g).float() / 8 for n, s in SHAPES.items()}


def _flat(d, names):
    return torch.cat([d[n].reshape(-1) for n in names]) if names else torch.zeros(0)


def _worker(rank, P):
    out = {}
    for method, gran, op in CASES:
        kw = dict(method=method, density=0.05, granularity=gran, op=op, seed=5)
        red = gp.GradientReducer(dense_below=THRESHOLD, **kw)
        ref = gp.GradientReducer(**kw)  # the same method on the large tensors only
        steps = []
        for t in range(STEPS):
            g = _grads(rank, t)
            u = red.reduce(g)
            st = red.last_stats
            u_ref = ref.reduce({n: g[n] for n in BIG})
            st_ref = ref.last_stats
            steps.append(dict(
                small=_flat(u, SMALL).clone(), big=_flat(u, BIG).clone(), big_ref=_flat(u_ref, BIG).clone(),
                res=_flat(red.state_dict()["residuals"], BIG).clone(),
                res_ref=_flat(ref.state_dict()["residuals"], BIG).clone(),
                grad_small=_flat(g, SMALL), grad_big=_flat(g, BIG),
                sent=st.payload_bytes_sent, recv=st.payload_bytes_received,
                sent_ref=st_ref.payload_bytes_sent, recv_ref=st_ref.payload_bytes_received,
                dense_sent=st.parts["dense"].payload_bytes_sent, numel=st.numel, step=red.step))
        assert "b" not in red.state_dict()["residuals"]  # small tensors keep no residual
        out[(method, gran, op)] = steps
    # a NaN in a small tensor on the last rank: every rank skips the whole step
    red = gp.GradientReducer(method="gtopk", density=0.05, dense_below=THRESHOLD, nonfinite="skip")
    g = _grads(rank, 0)
    if rank == P - 1:
        g["b"][3] = float("nan")
    u = red.reduce(g)
    out["skip"] = (red.last_stats.skipped, all(bool((x == 0).all()) for x in u.values()),
                   red.state_dict()["residuals"] == {} or all(
                       bool((r == 0).all()) for r in red.state_dict()["residuals"].values()))
    red = gp.GradientReducer(method="gtopk", density=0.05, dense_below=THRESHOLD)
    try:
        red.reduce(g)
        out["raise"] = None
    except NonFiniteGradientError as e:
        out["raise"] = str(e)
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("P", [1, 3, 4])
def test_dense_below_gloo(P):
    results = run_workers(P, _worker, timeout=280)
    n_small = sum(math.prod(SHAPES[n]) for n in SMALL)
    ring = 2 * (P - 1) * n_small * 4 // P
    for case in CASES:
        op = case[2]
        total_grad = np.zeros(sum(math.prod(SHAPES[n]) for n in BIG))
        total_out = np.zeros_like(total_grad)
        for t in range(STEPS):
            # numpy oracle: the plain sum / average of the small gradients
            want = np.sum([results[r][case][t]["grad_small"].numpy() for r in range(P)], axis=0,
                          dtype=np.float32)
            if op == "average":
                want = want / np.float32(P)
            for r in range(P):
                s = results[r][case][t]
                assert np.array_equal(s["small"].numpy(), want), (case, t, r)
                assert torch.equal(s["big"], s["big_ref"]), (case, t, r)
                assert torch.equal(s["res"], s["res_ref"]), (case, t, r)
                assert s["dense_sent"] == ring
                assert s["sent"] == s["sent_ref"] + ring and s["recv"] == s["recv_ref"] + ring
                assert s["numel"] == sum(math.prod(v) for v in SHAPES.values())
                assert s["step"] == t + 1
                total_grad += s["grad_big"].double().numpy()
            total_out += results[0][case][t]["big"].double().numpy() * (P if op == "average" else 1)
        if op == "sum":  # mass conservation of the compressed part
            res = sum(results[r][case][-1]["res"].double().numpy() for r in range(P))
            np.testing.assert_allclose(total_out + res, total_grad, rtol=0, atol=1e-4)
    for r in range(P):
        skipped, zeros, res_zero = results[r]["skip"]
        assert skipped and zeros and res_zero
        assert results[r]["raise"] is not None and f"rank {P - 1}: b" in results[r]["raise"]


# ------------------------------------------------------------------ DDP hook
def _ddp_worker(rank, P):
    # the biases (40, 30, 3) go dense
    _, reducer, diffs = hook_vs_reducer(rank, method="gtopk", density=0.1, dense_below=50)
    return dict(diffs=diffs, small_residuals=[n for n in reducer.state_dict()["residuals"] if "bias" in n])


@pytest.mark.timeout(300)
def test_dense_below_through_ddp_hook():
    for r in run_workers(2, _ddp_worker, timeout=280):
        assert r["diffs"] == [0.0] * 4  # the hook gives the reducer's bits
        assert r["small_residuals"] == []
