"""int8 wire (``value_dtype=torch.int8``, 5 bytes per entry plus
one exponent byte per message) on real gloo process groups, P = 2, 3, 4:

- every rank gets the same bits, and they equal the single-process oracle's
  (gtopk_plugin.testing.Oracle, whose int8 model is written from the spec,
  not by calling collectives/wire.py) -- nearest and stochastic rounding,
  the butterfly's fold-in (P = 3) included;
- residuals equal the oracle's, and mass is conserved (op=sum):
  Σ_ranks Σ_steps grad = Σ_steps result + Σ_ranks residual to float32
  rounding -- every quantization error is owned by exactly one residual;
- the bytes every rank sends and receives equal the exact predictions of
  gtopk_plugin.pipeline.traffic (k·5 + 1 per message);
- the elastic scheduler and the DDP hook run with it (P = 2).
"""
import math

import pytest
import torch

import gtopk_plugin as gp
from gtopk_plugin.pipeline import traffic
from gtopk_plugin.testing import Oracle
from dist_utils import run_workers
import wire_workers
from wire_workers import SHAPES, flat, wire_grads, wire_run

N = sum(math.prod(s) for s in SHAPES.values())
DENSITY = 0.1
K = sum(gp.k_for(DENSITY, math.prod(s)) for s in SHAPES.values())
STEPS = 25
I8 = torch.int8
G, GS = dict(method="gtopk"), dict(method="gtopk", wire_rounding="stochastic", seed=11)
RUNS = {
    2: [G, GS, dict(method="topk"), dict(method="randomk", seed=3, wire_rounding="stochastic")],
    3: [G, GS, dict(method="topk", wire_rounding="stochastic", seed=2), dict(method="rtopk", r_factor=2.0, seed=5),
        dict(method="threshold", merge="butterfly"), dict(method="dense")],
    4: [G, GS, dict(method="topk"), dict(method="randomk", seed=3), dict(method="threshold")],
}


def _configs(P):
    out = []
    for m in RUNS[P]:
        kw = dict(m, op="sum", value_dtype=I8)
        if kw["method"] != "dense":
            kw["density"] = DENSITY
        out.append(kw)
    return out


def _name(kw):
    return f"{kw['method']}{'+' + kw['merge'] if kw.get('merge') else ''}/{kw.get('wire_rounding', 'nearest')}"


def _expected_bytes(kw, P, r):
    """(sent, received) of rank r in one step, or None (variable counts)."""
    agg = kw.get("merge") or {"gtopk": "butterfly", "topk": "allgather", "rtopk": "allgather",
                              "randomk": "values", "dense": "values"}.get(kw["method"])
    if agg == "butterfly" and kw["method"] != "threshold":
        return traffic.gtopk_bytes(P, r, K, "int8")
    if agg == "allgather":
        return (traffic.allgather_bytes(P, K, "int8"),) * 2
    if agg == "values":
        return traffic.sharded_allreduce_bytes(P, r, N if kw["method"] == "dense" else K, "int8")
    return None


@pytest.mark.timeout(240)
@pytest.mark.parametrize("P", [2, 3, 4])
def test_int8_wire_agrees_with_oracle_conserves_mass_and_bytes(P):
    configs = _configs(P)
    results = run_workers(P, wire_run, configs, STEPS, "wide", timeout=220)
    failures = []
    for c, kw in enumerate(configs):
        runs = [results[r][c] for r in range(P)]
        oracle = Oracle(P, **kw)
        sum_grad, sum_abs, sum_out = (torch.zeros(N, dtype=torch.float64) for _ in range(3))
        for s in range(STEPS):
            grads = [wire_grads(r, s, "wide") for r in range(P)]
            want = flat(oracle.step(grads))
            got = runs[0]["outs"][s]
            if not torch.isfinite(got).all():
                failures.append(f"{_name(kw)} step {s}: non-finite update")
            for r in range(1, P):
                if not torch.equal(runs[r]["outs"][s].view(torch.int32), got.view(torch.int32)):
                    failures.append(f"{_name(kw)} step {s}: rank {r} differs from rank 0")
            if not torch.equal(got.view(torch.int32), want.view(torch.int32)):
                failures.append(f"{_name(kw)} step {s}: differs from the oracle by "
                                f"{(got - want).abs().max().item():.3g}")
            for g in grads:
                sum_grad += flat(g).double()
                sum_abs += flat(g).double().abs()
            sum_out += got.double()
        total_res = torch.zeros(N, dtype=torch.float64)
        for r in range(P):
            res, want = runs[r]["residuals"], flat(oracle.residuals[r])
            if not torch.allclose(res.double(), want.double(), rtol=1e-6, atol=1e-6 * float(sum_abs.max())):
                failures.append(f"{_name(kw)}: residual of rank {r} differs from the oracle by "
                                f"{(res - want).abs().max().item():.3g}")
            total_res += res.double()
        gap = ((sum_grad - sum_out - total_res).abs() / sum_abs.clamp_min(1e-30)).max().item()
        if not gap <= 1e-5:
            failures.append(f"{_name(kw)}: mass not conserved, max relative gap {gap:.3g}")
        for r, x in enumerate(runs):
            want_bytes = _expected_bytes(kw, P, r)
            if want_bytes is not None and (x["sent"], x["received"]) != want_bytes:
                failures.append(f"{_name(kw)} rank {r}: sent/received {(x['sent'], x['received'])}, "
                                f"traffic.py predicts {want_bytes}")
        if sum(x["sent"] for x in runs) != sum(x["received"] for x in runs):
            failures.append(f"{_name(kw)}: bytes sent != bytes received over ranks")
    assert not failures, "\n".join(failures[:30])


@pytest.mark.timeout(200)
def test_elastic_scheduler_and_ddp_hook_with_int8_gtopk():
    """Elastic scheduler: the same bits on every rank, mass conserved per
    layer.  DDP hook: value_dtype/wire_rounding pass through; bit for bit
    the reducer's updates, 5·K + 1 bytes per message."""
    P, steps = 2, 4
    res = run_workers(P, wire_workers.elastic_int8, steps, timeout=180)
    for r in range(P):
        d = res[r]["ddp"]
        for s in range(steps):
            assert all(torch.equal(d["hook"][s][n], d["reducer"][s][n]) for n in d["hook"][s]), (r, s)
            assert all(torch.equal(d["hook"][s][n], res[0]["ddp"]["hook"][s][n]) for n in d["hook"][s])
        t = d["traffic"]
        assert (t["payload_bytes_sent"], t["payload_bytes_received"]) == traffic.gtopk_bytes(P, r, t["k"], "int8")
    keys = sorted(res[0]["reduced"])
    assert len(keys) == 4 * steps
    for k in keys:  # every rank applies the same bits
        assert all(torch.equal(a, b) for a, b in zip(res[1]["reduced"][k], res[0]["reduced"][k]))
    assert all(torch.equal(res[1]["params"][n], res[0]["params"][n]) for n in res[0]["params"])
    for u in range(4):  # per layer (unit): Σ local = Σ reduced + Σ residuals
        lk = [k for k in keys if k[0] == u]
        cat = lambda ts: torch.cat([t.reshape(-1).double() for t in ts])  # noqa: E731
        g = sum(cat(res[r]["local"][k]) for r in range(P) for k in lk)
        out = sum(cat(res[0]["reduced"][k]) for k in lk)
        names = sorted((n for n in res[0]["residuals"] if n.startswith(f"{2 * u}.")),
                       key=lambda n: n.endswith("bias"))
        resid = sum(cat([res[r]["residuals"][n] for n in names]) for r in range(P))
        assert torch.allclose(g, out + resid, atol=1e-5), f"layer {u}: mass not conserved"
