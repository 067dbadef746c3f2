"""Dense warm-up of the codecs (``start_iter``) on real gloo
process groups, P = 1, 3, 4.

Steps before ``start_iter`` are a dense allreduce of the accumulator: the
result is the sum of every rank's accumulator (checked against a float64
numpy sum of the gradients, independent of the library), the residual is
exactly zero, and the bytes are those of ``method="dense"`` on the same
gradients (a second reducer in the same job).  From ``start_iter`` on the
codec runs: mass is conserved over the whole run (op=sum: Σ grads = Σ
results + Σ residuals, server residuals included), every rank gets the same
bits, and a reducer restored from a checkpoint taken during the warm-up
continues bit for bit.
"""
import math

import numpy as np
import pytest
import torch

import gtopk_plugin as gp
from dist_utils import run_workers

SHAPES = {"w": (19, 12), "b": (12,), "v": (6, 5)}
NUMEL = sum(math.prod(s) for s in SHAPES.values())
STEPS, START = 6, 3
CASES = [("onebit", {}), ("onebit", {"merge": "reduce_scatter_payloads"}), ("qsgd", {}),
         ("powersgd", {"rank": 2})]
AGGREGATION = {"onebit": "allgather_payloads", "qsgd": "allgather_payloads", "powersgd": "allreduce_rounds"}


def _grads(rank, step):
    g = torch.Generator().manual_seed(7000 + 100 * rank + step)
    return {n: torch.randn(*s, generator=g) for n, s in SHAPES.items()}


def _flat(d):
    return torch.cat([d[n].reshape(-1) for n in sorted(d)])


def _residual(red):
    res = red.state_dict()["residuals"]
    return _flat(res) if res else torch.zeros(NUMEL)


def _server(red):
    sd = red.compressor.state_dict().get("server", {})
    return sum((e.sum().item() for e in sd.values()), 0.0)


def _worker(rank, P, method, kw):
    red = gp.GradientReducer(method=method, op="sum", start_iter=START, **kw)
    dense = gp.GradientReducer(method="dense", op="sum")
    steps, ckpt = [], None
    for t in range(STEPS):
        if t == START - 1:
            ckpt = red.state_dict()
        grads = _grads(rank, t)
        out = _flat(red.reduce(grads)).clone()
        st = red.last_stats
        dense.reduce(grads)
        steps.append(dict(out=out, res=_residual(red).clone(), aggregation=st.aggregation,
                          sent=st.bytes_sent, recv=st.bytes_received, dense_sent=dense.last_stats.bytes_sent,
                          dense_recv=dense.last_stats.bytes_received))
    # resume from the warm-up checkpoint: the same bits from there on
    again = gp.GradientReducer(method=method, op="sum", start_iter=START, **kw)
    again.load_state_dict(ckpt)
    resumed = [_flat(again.reduce(_grads(rank, t))).clone() for t in range(START - 1, STEPS)]
    return dict(steps=steps, resumed=resumed, server=_server(red))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("P,method,kw", [(P, m, k) for m, k in CASES for P in ((1, 3, 4) if m == "onebit" else (3,))],
                         ids=lambda v: v if isinstance(v, (int, str)) else "-".join(map(str, v.values())) or "default")
def test_codec_dense_warmup_then_codec(P, method, kw):
    runs = run_workers(P, _worker, method, kw, timeout=240)
    for t in range(STEPS):
        for r in range(1, P):
            assert torch.equal(runs[r]["steps"][t]["out"], runs[0]["steps"][t]["out"]), f"step {t} rank {r}"
    want_agg = kw.get("merge") or AGGREGATION[method]
    for t in range(START):
        # dense: the sum of the gradients (residuals are zero in the warm-up)
        oracle = sum(_flat(_grads(r, t)).double().numpy() for r in range(P))
        got = runs[0]["steps"][t]["out"].double().numpy()
        np.testing.assert_allclose(got, oracle, rtol=0, atol=1e-5 * (1 + np.abs(oracle).max()))
        for run in runs:
            s = run["steps"][t]
            assert s["aggregation"] == "dense"
            assert torch.count_nonzero(s["res"]) == 0, f"step {t}: a warm-up step leaves no residual"
            assert (s["sent"], s["recv"]) == (s["dense_sent"], s["dense_recv"])
    for t in range(START, STEPS):
        for run in runs:
            assert run["steps"][t]["aggregation"] == want_agg
        if P > 1:  # the codec compresses: fewer bytes than a dense step
            assert runs[0]["steps"][t]["sent"] < runs[0]["steps"][t]["dense_sent"]
        assert any(torch.count_nonzero(run["steps"][t]["res"]) for run in runs), "the codec left no residual"
    grads = sum(_flat(_grads(r, t)).double() for r in range(P) for t in range(STEPS))
    outs = sum(runs[0]["steps"][t]["out"].double() for t in range(STEPS))
    diff = grads - outs - sum(run["steps"][-1]["res"].double() for run in runs)
    if kw.get("merge") == "reduce_scatter_payloads":  # the owners' server residuals hold the rest
        assert abs(diff.sum().item() - sum(run["server"] for run in runs)) < 1e-3, "mass not conserved"
    else:
        assert diff.abs().max().item() < 1e-4, "mass not conserved"
    for run in runs:
        for t, got in zip(range(START - 1, STEPS), run["resumed"]):
            assert torch.equal(got, run["steps"][t]["out"]), f"resume: step {t} differs"



def _ddp_worker(rank, P):
    from ddp_vs_reducer import hook_vs_reducer
    state, reducer, diffs = hook_vs_reducer(rank, steps=4, method="onebit", start_iter=2)
    return dict(diffs=diffs, step=reducer.step, agg=reducer.last_stats.aggregation)


@pytest.mark.timeout(300)
def test_codec_dense_warmup_through_the_ddp_hook():
    """The DDP hook's bucket-by-bucket warm-up and the codec after it give
    the reducer's bits (the reducer on the whole gradient is the reference)."""
    for r in run_workers(2, _ddp_worker, timeout=240):
        assert r["diffs"] == [0.0] * 4 and r["step"] == 4 and r["agg"] == "allgather_payloads"
