"""The QSGD codec (compress/qsgd.py) on real gloo process groups, P = 1, 3, 4,
and through the DDP hook at P = 2.

Every rank's result is, bit for bit, the rank-order sum of every rank's
payload decoded (the payloads each rank sent, gathered back); each residual
is exactly acc − its own decode; mass is conserved over the run; bytes are
the allgather's (P−1)·(⌈N·bits/8⌉ + 4·buckets) each way, no headers; and a
run resumed from a state_dict gives the same bits.
"""
import copy
import math

import numpy as np
import pytest
import torch

import gtopk_plugin as gp
from gtopk_plugin.compress.compressor import SelectionContext
from gtopk_plugin.compress.qsgd import QSGDCodec, code_bits
from dist_utils import run_workers
from ddp_vs_reducer import hook_vs_reducer

SHAPES = {"w": (37, 11), "b": (13,), "c": (5, 3, 2)}
NUMEL = sum(math.prod(s) for s in SHAPES.values())
STEPS = 8
HYPER = dict(levels=5, bucket_size=64)


def _grads(rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return {n: torch.randn(*s, generator=g) for n, s in SHAPES.items()}


def _flat(d):
    return torch.cat([d[n].reshape(-1) for n in sorted(d)])


def _worker(rank, P):
    red = gp.GradientReducer(method="qsgd", op="sum", seed=3, **HYPER)
    names = sorted(SHAPES)
    offsets = torch.tensor([0] + list(np.cumsum([math.prod(SHAPES[n]) for n in names])), dtype=torch.int64)
    steps = []
    saved = None
    for t in range(STEPS):
        if t == STEPS // 2:
            saved = copy.deepcopy(red.state_dict())
        grads = _grads(rank, t)
        res = red.state_dict()["residuals"]
        acc = _flat(grads) + (torch.zeros(NUMEL) if not res else _flat(res))
        payload = red.compressor.encode(acc, offsets, SelectionContext(t, names, 3, rank))
        out = red.reduce(grads)
        st = red.last_stats
        steps.append(dict(grad=_flat(grads), acc=acc, payload=[p.clone() for p in payload],
                          out=_flat(out).clone(), res=_flat(red.state_dict()["residuals"]).clone(),
                          sent=st.payload_bytes_sent, recv=st.payload_bytes_received,
                          headers=st.header_bytes_sent + st.header_bytes_received))
    # resume from the saved state in a fresh reducer: the same bits
    again = gp.GradientReducer(method="qsgd", op="sum", seed=3, **HYPER)
    again.load_state_dict(saved)
    resumed = [_flat(again.reduce(_grads(rank, t))).clone() for t in range(STEPS // 2, STEPS)]
    return dict(steps=steps, offsets=offsets, resumed=resumed,
                res_resumed=_flat(again.state_dict()["residuals"]))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("P", [1, 3, 4])
def test_qsgd_gloo_bits_residuals_mass_bytes_resume(P):
    results = run_workers(P, _worker, timeout=280)
    offsets = results[0]["offsets"]
    codec = QSGDCodec(**HYPER)
    nbuckets = sum(math.ceil(math.prod(s) / HYPER["bucket_size"]) for s in SHAPES.values())
    payload_bytes = math.ceil(NUMEL * code_bits(HYPER["levels"]) / 8) + 4 * nbuckets
    total_grad = torch.zeros(NUMEL, dtype=torch.float64)
    total_out = torch.zeros(NUMEL, dtype=torch.float64)
    for t in range(STEPS):
        expect = torch.zeros(NUMEL)
        for r in range(P):  # rank order, float32
            s = results[r]["steps"][t]
            d = codec.decode(s["payload"], offsets, NUMEL, torch.float32)
            assert torch.equal(s["res"], s["acc"] - d), f"rank {r} step {t}: residual != acc - decode"
            expect = expect + d
            total_grad += s["grad"].double()
        for r in range(P):
            s = results[r]["steps"][t]
            assert torch.equal(s["out"], expect), f"rank {r} step {t}: result differs"
            assert s["sent"] == s["recv"] == (P - 1) * payload_bytes and s["headers"] == 0
        total_out += expect.double()
    residuals = sum(results[r]["steps"][-1]["res"].double() for r in range(P))
    torch.testing.assert_close(total_grad, total_out + residuals, rtol=0, atol=1e-4)
    for r in range(P):
        for i, t in enumerate(range(STEPS // 2, STEPS)):
            assert torch.equal(results[r]["resumed"][i], results[r]["steps"][t]["out"])
        assert torch.equal(results[r]["res_resumed"], results[r]["steps"][-1]["res"])


# ------------------------------------------------------------------ DDP hook
def _ddp_worker(rank, P, method):
    state, _, diffs = hook_vs_reducer(rank, method=method)
    return dict(diffs=diffs, traffic=state.last_step_traffic)


@pytest.mark.timeout(300)
def test_qsgd_through_ddp_hook():
    results = run_workers(2, _ddp_worker, "qsgd", timeout=280)
    for r in results:
        assert r["diffs"] == [0.0] * 4  # the hook gives the reducer's bits
        assert r["traffic"]["bytes_sent"] > 0
