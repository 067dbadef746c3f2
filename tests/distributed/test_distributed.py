"""Real torch.distributed gloo process groups, P = 1, 2, 3, 4, 5, 6, 8.

One spawn per P runs every method for 30 steps; the parent checks each
against the single-process oracle (gtopk_plugin.testing.Oracle), checks that
all ranks got the same bits, that mass is conserved, and that the traffic
counters match docs/design.md §2 exactly.
"""
import math

import pytest
import torch

import gtopk_plugin as gp
from gtopk_plugin.testing import Oracle
from dist_utils import run_workers
from workers import SHAPES, grads_for, run_configs

STEPS = 30
CONFIGS = [
    dict(method="gtopk", density=0.1, op="sum"),
    dict(method="topk", density=0.1, op="sum"),
    dict(method="rtopk", density=0.1, r_factor=3.0, op="sum", seed=7),
    dict(method="randomk", density=0.1, op="sum", seed=3),
    dict(method="threshold", density=0.1, op="sum"),
    dict(method="dense", op="sum"),
    dict(method="threshold", density=0.1, merge="butterfly", op="sum"),
    dict(method="rtopk", density=0.05, merge="butterfly", op="sum", grad_seed=1),
    dict(method="gtopk", density=0.1, value_dtype=torch.float16, op="sum", grad_seed=2),
    dict(method="topk", density=0.1, value_dtype=torch.bfloat16, op="sum"),
    dict(method="gtopk", density=0.05, granularity="global", op="sum", grad_seed=3),
    dict(method="gtopk", density=0.05, op="average", warmup=[0.5, 0.3]),
]
WORLD_SIZES = [1, 2, 3, 4, 5, 6, 8]
NUMEL = sum(math.prod(s) for s in SHAPES.values())


def _name(kw):
    return "-".join(f"{k}={v}" for k, v in kw.items())


def _flat(d):
    return torch.cat([d[n].reshape(-1).double() for n in sorted(d)])


def _same_bits(a, b):
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8) if a.dtype.itemsize == 2 else a,
                                              b.view(torch.uint8) if b.dtype.itemsize == 2 else b)


@pytest.fixture(scope="module")
def runs():
    return {}


def _results(runs, P):
    if P not in runs:
        runs[P] = run_workers(P, run_configs, CONFIGS, STEPS, timeout=400)
    return runs[P]


def _k_total(density):
    return sum(gp.k_for(density, math.prod(s)) for s in SHAPES.values())


@pytest.mark.timeout(600)
@pytest.mark.parametrize("P", WORLD_SIZES)
def test_every_method_matches_oracle_conserves_mass_and_agrees_across_ranks(runs, P):
    results = _results(runs, P)
    failures = []
    for c, kw in enumerate(CONFIGS):
        kw = dict(kw)
        seed = kw.pop("grad_seed", 0)
        oracle = Oracle(P, **kw)
        exact = kw["method"] not in ("dense", "randomk")  # gloo's allreduce order is its own
        # fp16/bf16 wires too: merges add in float32 and every re-rounding
        # lands in one residual (docs/design.md §2), so float32 tolerances hold
        tol = dict(atol=1e-4, rtol=1e-5)
        sum_grad = torch.zeros(NUMEL, dtype=torch.float64)
        sum_out = torch.zeros(NUMEL, dtype=torch.float64)
        for s in range(STEPS):
            per_rank = [grads_for(r, s, seed) for r in range(P)]
            expect = oracle.step(per_rank)
            for r in range(P):
                got = results[r][c]["outs"][s]
                for n in expect:
                    # 1. every rank gets the same bits
                    if not _same_bits(got[n], results[0][c]["outs"][s][n]):
                        failures.append(f"{_name(kw)} step {s}: rank {r} differs from rank 0 on {n}")
                    # 2. the result equals the oracle's
                    ok = _same_bits(got[n], expect[n]) if exact else torch.allclose(got[n], expect[n], atol=1e-4)
                    if not ok:
                        failures.append(f"{_name(kw)} step {s} rank {r} {n}: max diff "
                                        f"{(got[n] - expect[n]).abs().max().item():.3g} vs oracle")
            sum_grad += sum(_flat(g) for g in per_rank)
            sum_out += _flat(results[0][c]["outs"][s])
        residuals = [results[r][c]["state"]["residuals"] for r in range(P)]
        for r in range(P):
            for n, res in oracle.residuals[r].items():
                if not torch.allclose(residuals[r][n], res, **tol):
                    failures.append(f"{_name(kw)}: residual of {n} on rank {r} differs from oracle")
        # 3. mass conservation: sum of grads = sum of results + sum of residuals
        if kw.get("op") == "sum":
            total_res = sum((_flat({n: t for n, t in residuals[r].items()}) if residuals[r] else
                             torch.zeros(NUMEL, dtype=torch.float64)) for r in range(P))
            if not torch.allclose(sum_grad, sum_out + total_res, **tol):
                failures.append(f"{_name(kw)}: mass not conserved, max gap "
                                f"{(sum_grad - sum_out - total_res).abs().max().item():.3g}")
    assert not failures, "\n".join(failures[:20])


@pytest.mark.timeout(600)
@pytest.mark.parametrize("P", [2, 4, 8])
def test_traffic_accounting_is_exact_for_power_of_two(runs, P):
    results = _results(runs, P)
    K = _k_total(0.1)
    rounds = int(math.log2(P))
    for r in range(P):
        for st in results[r][0]["stats"]:  # gtopk, fp32
            assert st["payload_bytes_sent"] == rounds * K * 8
            assert st["payload_bytes_received"] == rounds * K * 8
            assert st["bytes_sent"] == rounds * K * 8  # no size header: counts are static
            assert st["messages_sent"] == rounds  # ONE message per partner per round
            assert st["rounds"] == rounds
            assert st["dense_bytes"] == 2 * (P - 1) * NUMEL * 4 // P
        for st in results[r][1]["stats"]:  # topk, fp32: sparse allgather
            assert st["payload_bytes_received"] == (P - 1) * K * 8
            assert st["payload_bytes_sent"] == (P - 1) * K * 8  # ring: forwards P-1 blocks
            assert st["header_bytes_sent"] == 0
        for st in results[r][8]["stats"]:  # gtopk, fp16 values: 6 bytes per entry
            assert st["payload_bytes_sent"] == rounds * K * 6


@pytest.mark.timeout(600)
@pytest.mark.parametrize("P", [3, 5, 6])
def test_traffic_accounting_non_power_of_two(runs, P):
    results = _results(runs, P)
    K = _k_total(0.1)
    Pp = 1 << (P.bit_length() - 1)
    log = int(math.log2(Pp))
    mask = (K + 7) // 8
    for r in range(P):
        st = results[r][0]["stats"][-1]
        if r >= Pp:  # folded in: sends its set, receives result + survivor bitmask
            assert (st["payload_bytes_sent"], st["payload_bytes_received"]) == (K * 8, K * 8 + mask)
        elif r < P - Pp:
            assert st["payload_bytes_sent"] == log * K * 8 + K * 8 + mask
            assert st["payload_bytes_received"] == log * K * 8 + K * 8
        else:
            assert st["payload_bytes_sent"] == st["payload_bytes_received"] == log * K * 8
        assert st["header_bytes_sent"] == 0


@pytest.mark.timeout(600)
def test_threshold_messages_carry_size_headers(runs):
    results = _results(runs, 4)
    st = results[0][4]["stats"][-1]
    assert st["header_bytes_sent"] > 0
    assert st["payload_bytes_received"] == 8 * sum(results[r][4]["stats"][-1]["selected"]
                                                   for r in range(1, 4))
