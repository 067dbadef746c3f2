"""Reduced-precision wire (fp16/bf16 values, docs/design.md §2 "Precision and
determinism") on real gloo process groups, P = 3, 4, 7:

- mass is conserved to float32 rounding (Σ_ranks Σ_steps grad =
  Σ_steps result + Σ_ranks residual, per entry, relative error ≤ 1e-5 over
  100 steps) for every method: merges add in float32 and every re-rounding
  of a merged sum is owned by exactly one residual;
- every rank gets the same bits, and they equal the single-process oracle's;
- values beyond fp16's range (up to 1e6, and pairs of ranks sending 40000)
  never make an update or a residual non-finite (P = 1, 2, 3);
- the bytes are those of the plain wire (the butterfly's formula; a ring
  allreduce of the wire dtype for dense/random-k).
"""
import math

import pytest
import torch

import gtopk_plugin as gp
from lab.cluster import model as abm
from gtopk_plugin.collectives.dense_allreduce import shard_bounds
from gtopk_plugin.testing import Oracle
from dist_utils import run_workers
from wire_workers import SHAPES, flat, wire_grads, wire_run

N = sum(math.prod(s) for s in SHAPES.values())
DENSITY = 0.1
SPARSE = [dict(method="gtopk"), dict(method="topk"), dict(method="rtopk", r_factor=2.0, seed=5),
          dict(method="randomk", seed=3), dict(method="threshold"), dict(method="dense")]
FP16, BF16 = torch.float16, torch.bfloat16
# Every (method, wire dtype) pair runs at some P; the P-dependent paths --
# the butterfly's fold-in (P = 3, 7), uneven dense shards (P = 7), the
# variable-count butterfly with size headers -- at several.  (Each config is
# STEPS steps of real gloo exchanges; this keeps the file at a minute or two.)
# 100 steps: the residuals reach their steady size by then (the largest
# |residual| over 100 steps is at least 3/4 of that over 200 in every
# config), and the mass bound is relative to Σ|grad|, so a per-step loss shows
# alike at any length; every step is also checked against the oracle's bits.
STEPS = 100
RUNS = {
    3: [(m, FP16) for m in SPARSE] + [(dict(method="gtopk"), BF16)],
    4: [(m, BF16) for m in SPARSE] + [(dict(method="gtopk"), FP16)],
    7: [(dict(method="gtopk"), FP16), (dict(method="gtopk"), BF16), (dict(method="dense"), FP16),
        (dict(method="dense"), BF16), (dict(method="randomk", seed=3), BF16),
        (dict(method="threshold", merge="butterfly"), FP16)],
}


def _configs(pairs):
    out = []
    for m, dt in pairs:
        kw = dict(m, op="sum", value_dtype=dt)
        if kw["method"] != "dense":
            kw["density"] = DENSITY
        out.append(kw)
    return out


def _name(kw):
    merge = f"+{kw['merge']}" if kw.get("merge") else ""
    return f"{kw['method']}{merge}/{str(kw['value_dtype']).split('.')[-1]}"


def _bits(t):
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def _check(P, configs, steps, kind, results, rel_tol):
    """Compare every config's run with the oracle; returns failure strings."""
    failures = []
    for c, kw in enumerate(configs):
        oracle = Oracle(P, **kw)
        sum_grad = torch.zeros(N, dtype=torch.float64)
        sum_abs = torch.zeros(N, dtype=torch.float64)
        sum_out = torch.zeros(N, dtype=torch.float64)
        runs = [results[r][c] for r in range(P)]
        for s in range(steps):
            grads = [wire_grads(r, s, kind) for r in range(P)]
            want = flat(oracle.step(grads))
            got = runs[0]["outs"][s]
            if not torch.isfinite(got).all():
                failures.append(f"{_name(kw)} step {s}: non-finite update")
            for r in range(1, P):
                if not torch.equal(_bits(runs[r]["outs"][s]), _bits(got)):
                    failures.append(f"{_name(kw)} step {s}: rank {r} differs from rank 0")
            if not torch.equal(_bits(got), _bits(want)):
                failures.append(f"{_name(kw)} step {s}: differs from the oracle by "
                                f"{(got - want).abs().max().item():.3g}")
            for g in grads:
                f = flat(g).double()
                sum_grad += f
                sum_abs += f.abs()
            sum_out += got.double()
        total_res = torch.zeros(N, dtype=torch.float64)
        for r in range(P):
            res = runs[r]["residuals"]
            if not torch.isfinite(res).all():
                failures.append(f"{_name(kw)}: non-finite residual on rank {r}")
            want = flat(oracle.residuals[r])
            # equal up to float32 rounding of sums taken in another order
            if not torch.allclose(res.double(), want.double(), rtol=1e-6, atol=1e-6 * float(sum_abs.max())):
                failures.append(f"{_name(kw)}: residual on rank {r} differs from the oracle by "
                                f"{(res - want).abs().max().item():.3g}")
            total_res += res.double()
        gap = ((sum_grad - sum_out - total_res).abs() / sum_abs.clamp_min(1e-30)).max().item()
        if not gap <= rel_tol:
            failures.append(f"{_name(kw)}: mass not conserved, max relative gap {gap:.3g}")
    return failures


@pytest.mark.timeout(300)
@pytest.mark.parametrize("P", [3, 4, 7])
def test_wire_conserves_mass_agrees_across_ranks_and_with_oracle(P):
    steps = STEPS
    configs = _configs(RUNS[P])
    results = run_workers(P, wire_run, configs, steps, "wide", timeout=280)
    failures = _check(P, configs, steps, "wide", results, rel_tol=1e-5)
    # bytes: those of the plain wire (6 bytes per fp16/bf16 entry)
    K = sum(gp.k_for(DENSITY, math.prod(s)) for s in SHAPES.values())
    b = shard_bounds(N, P)
    for c, kw in enumerate(configs):
        runs = [results[r][c] for r in range(P)]
        if sum(x["sent"] for x in runs) != sum(x["received"] for x in runs):
            failures.append(f"{_name(kw)}: bytes sent != bytes received over ranks")
        if kw["method"] == "gtopk":
            busiest = max(x["sent"] for x in runs)
            if busiest != abm.traffic("gtopk", P, N, K, entry_bytes=6)["bytes"]:
                failures.append(f"{_name(kw)}: {busiest} bytes, model says otherwise")
        if kw["method"] == "dense":
            # reduce-scatter + allgather of 2-byte values: every rank sends
            # the vector less its own shard, then less its right neighbour's
            for r, x in enumerate(runs):
                n = lambda q: b[q % P + 1] - b[q % P]  # noqa: E731
                if x["sent"] != 2 * (2 * N - n(r) - n(r + 1)) or \
                        x["received"] != 2 * ((P - 1) * n(r) + N - n(r)):
                    failures.append(f"{_name(kw)} rank {r}: sent {x['sent']} received {x['received']}")
            if N % P == 0 and max(x["sent"] for x in runs) != 2 * (P - 1) * N * 2 // P:
                failures.append(f"{_name(kw)}: not a ring allreduce's bytes")
            if max(x["sent"] for x in runs) != abm.traffic("dense", P, N, None, elem_bytes=2)["bytes"]:
                failures.append(f"{_name(kw)}: busiest rank's bytes differ from the model")
    assert not failures, "\n".join(failures[:30])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("P", [2, 3])
def test_fp16_wire_out_of_range_values_stay_finite(P):
    """Entries up to 1e6 and 40000 on every rank: the wire clamps to 65504,
    the remainder stays in a residual; nothing ever becomes ±inf."""
    steps = 20
    configs = [dict(kw, op="sum", value_dtype=torch.float16, **({} if kw["method"] == "dense" else
                                                                  {"density": DENSITY}))
               for kw in (dict(method="gtopk"), dict(method="topk"), dict(method="randomk", seed=1),
                          dict(method="dense"))]
    results = run_workers(P, wire_run, configs, steps, "big", timeout=280)
    failures = _check(P, configs, steps, "big", results, rel_tol=1e-5)
    assert not failures, "\n".join(failures[:30])


@pytest.mark.parametrize("method", ["gtopk", "topk", "randomk", "dense", "threshold"])
def test_fp16_wire_out_of_range_single_worker(method):
    kw = {} if method == "dense" else {"density": 0.1}
    red = gp.GradientReducer(method=method, op="sum", value_dtype=torch.float16,
                             transport=gp.SingleProcessTransport(), **kw)
    total_grad, total_abs, total_out = (torch.zeros(N, dtype=torch.float64) for _ in range(3))
    for s in range(20):
        g = wire_grads(0, s, "big")
        out = flat(red.reduce(g))
        assert torch.isfinite(out).all() and out.abs().max() <= 65504
        total_grad += flat(g).double()
        total_abs += flat(g).double().abs()
        total_out += out.double()
    res = flat(red.state_dict()["residuals"]).double()
    assert torch.isfinite(res).all()
    assert ((total_grad - total_out - res).abs() / total_abs).max() <= 1e-6


def test_p1_topk_fp16_wire_clamps_and_keeps_the_remainder():
    """Regression: grad [1e5, 1, 2, 3], k = 1, fp16 wire: the update is
    65504 (not inf) and the residual keeps 1e5 − 65504."""
    red = gp.GradientReducer(method="topk", density=0.25, op="sum", value_dtype=torch.float16,
                             transport=gp.SingleProcessTransport())
    out = red.reduce({"w": torch.tensor([1e5, 1.0, 2.0, 3.0])})["w"]
    assert out.tolist() == [65504.0, 0.0, 0.0, 0.0]
    assert red.state_dict()["residuals"]["w"].tolist() == [1e5 - 65504.0, 1.0, 2.0, 3.0]
    out = red.reduce({"w": torch.tensor([1e5, 1.0, 2.0, 3.0])})["w"]
    assert out.tolist() == [65504.0, 0.0, 0.0, 0.0]
    assert red.state_dict()["residuals"]["w"].tolist() == [2e5 - 2 * 65504.0, 2.0, 4.0, 6.0]
