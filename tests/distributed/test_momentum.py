"""DGC momentum correction, factor masking, local clipping and AMP loss-scale
handling, checked against an independent numpy oracle
(tests/support/momentum_oracle.py), against torch.optim.SGD itself, and against the
invariant of docs/design.md §2:
    Σ_ranks Σ_steps increment_t = Σ_steps result_t + Σ_ranks v   (op=sum).
"""
import math

import numpy as np
import pytest
import torch

import gtopk_plugin as gp
from gtopk_plugin.collectives.transport import SingleProcessTransport
from dist_utils import run_workers
from momentum_oracle import NumpyMomentumOracle
from momentum_workers import (ddp_momentum, ddp_resume, elastic_momentum, local_model_grads, reducer_runs,
                              split_call_clipping)
from workers import grads_for

STEPS = 12
METHOD_CONFIGS = [
    dict(method="gtopk", density=0.1, op="sum", momentum_correction=0.9),
    dict(method="topk", density=0.1, op="sum", momentum_correction=0.9),
    dict(method="rtopk", density=0.1, r_factor=3.0, op="sum", seed=7, momentum_correction=0.9),
    dict(method="randomk", density=0.1, op="sum", seed=3, momentum_correction=0.9),
    dict(method="threshold", density=0.1, op="sum", momentum_correction=0.9),
    dict(method="gtopk", density=0.1, op="sum", momentum_correction=0.9, nesterov=True, grad_seed=1),
    dict(method="topk", density=0.1, op="sum", momentum_correction=0.8, momentum_masking=False, grad_seed=2),
    dict(method="dense", op="sum", momentum_correction=0.9),
]


def _oracle_for(kw, P):
    kw = dict(kw)
    kw.pop("grad_seed", None)
    m = kw.pop("momentum_correction")
    nesterov = kw.pop("nesterov", False)
    masking = kw.pop("momentum_masking", True)
    return NumpyMomentumOracle(P, m, nesterov=nesterov, masking=masking, **kw)


def _bits(t):
    return t.detach().contiguous().view(torch.int32)


# ---------------------------------------------------------------- distributed
@pytest.mark.parametrize("P", [1, 3, 4])
def test_reducer_matches_numpy_oracle_bit_for_bit(P):
    """Every sparse method (and dense) with momentum correction: each rank's
    update, residual v and velocity u equal the numpy oracle bit for bit in
    fp32; the momentum invariant holds per entry."""
    res = run_workers(P, reducer_runs, METHOD_CONFIGS, STEPS, timeout=300)
    for c, kw in enumerate(METHOD_CONFIGS):
        oracle = _oracle_for(kw, P)
        seed = kw.get("grad_seed", 0)
        for s in range(STEPS):
            want = oracle.step([grads_for(r, s, seed) for r in range(P)])
            for r in range(P):
                got = res[r][c]["outs"][s]
                for n in want:
                    if kw["method"] in ("randomk", "dense"):
                        # values summed by the transport's allreduce, whose
                        # order is not the oracle's rank order: equal to fp32
                        # rounding, and bit-identical across ranks
                        torch.testing.assert_close(got[n], want[n], rtol=1e-6, atol=1e-6)
                        assert torch.equal(_bits(got[n]), _bits(res[0][c]["outs"][s][n]))
                    else:
                        assert torch.equal(_bits(got[n]), _bits(want[n])), (kw, s, r, n)
        for r in range(P):
            st = res[r][c]["state"]
            for n in oracle.v[r]:
                v = st["residuals"][n].reshape(-1).numpy()
                assert np.array_equal(v.view(np.int32), oracle.v[r][n].view(np.int32)), (kw, r, n, "v")
                u = st["velocities"][n].reshape(-1).numpy()
                assert np.array_equal(u.view(np.int32), oracle.u[r][n].view(np.int32)), (kw, r, n, "u")
        # invariant: Σ increments = Σ results + Σ residuals, per entry
        for n in oracle.increments_total:
            lhs = oracle.increments_total[n]
            rhs = oracle.result_total[n] + sum(res[r][c]["state"]["residuals"][n].reshape(-1).double().numpy()
                                               for r in range(P))
            assert np.allclose(lhs, rhs, rtol=1e-5, atol=1e-4), (kw, n, np.abs(lhs - rhs).max())


def test_clipping_norm_spans_calls():
    """clip_norm with a step split over two calls (buckets) and the step's
    norm passed in gives exactly the single-call result, at P = 3."""
    assert all(run_workers(3, split_call_clipping, 6, timeout=120))


# ---------------------------------------------------------------- local
def _single(**kw):
    return gp.GradientReducer(transport=SingleProcessTransport(), **kw)


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("weight_decay", [0.0, 1e-2])
def test_momentum_correction_equals_torch_sgd_when_everything_is_sent(nesterov, weight_decay):
    """P = 1, density 1, no masking: momentum correction is exactly SGD
    momentum, so a model trained through bind_optimizer(opt) matches
    torch.optim.SGD(momentum, nesterov, weight_decay) itself."""
    torch.manual_seed(0)
    m1, m2 = torch.nn.Linear(5, 3), torch.nn.Linear(5, 3)
    m2.load_state_dict(m1.state_dict())
    kw = dict(lr=0.01, momentum=0.9, nesterov=nesterov, weight_decay=weight_decay)
    o1, o2 = torch.optim.SGD(m1.parameters(), **kw), torch.optim.SGD(m2.parameters(), **kw)
    red = _single(method="topk", density=1.0, momentum_masking=False).bind_optimizer(o2, m2.named_parameters())
    for _ in range(15):
        x = torch.randn(4, 5)
        for m, o in ((m1, o1), (m2, o2)):
            o.zero_grad()
            m(x).pow(2).sum().backward()
        up = red.reduce({n: p.grad for n, p in m2.named_parameters()})
        for n, p in m2.named_parameters():
            p.grad.copy_(up[n])
        o1.step()
        o2.step()
    for a, b in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    # the user's settings are intact between steps; the optimizer kept no momentum buffer
    assert o2.param_groups[0]["momentum"] == 0.9 and o2.param_groups[0]["weight_decay"] == weight_decay
    assert all("momentum_buffer" not in s or s["momentum_buffer"] is None for s in o2.state.values())


def test_momentum_correction_refuses_adam_and_mixed_groups():
    m = torch.nn.Linear(3, 2)
    with pytest.raises(ValueError, match="Adam|SGD-style"):
        _single(method="topk", density=0.5).bind_optimizer(torch.optim.AdamW(m.parameters()),
                                                             m.named_parameters())
    other = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD(list(m.parameters()) + [other], lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match="separate param group"):
        _single(method="topk", density=0.5).bind_optimizer(opt, m.named_parameters())


def test_momentum_follows_optimizer_schedule():
    """Momentum is read at every call: a schedule that changes the group's
    momentum (OneCycleLR's cycle_momentum) changes the correction."""
    p = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.5)
    red = _single(method="topk", density=1.0, momentum_masking=False).bind_optimizer(opt, [("p", p)])
    g = torch.ones(4)
    red.reduce({"p": g})
    opt.param_groups[0]["momentum"] = 0.0
    out = red.reduce({"p": g})
    assert torch.equal(out["p"], g)  # u = 0·u + g


def test_bad_keywords_raise():
    for kw in (dict(momentum_correction=1.0), dict(momentum_correction=-0.1), dict(nesterov=True),
               dict(momentum_correction=0.9, nesterov=True, dampening=0.1), dict(clip_norm=0.0),
               dict(clip_norm=float("inf")), dict(clip_norm="x")):
        with pytest.raises(ValueError):
            _single(method="topk", density=0.1, **kw)


def test_local_clipping_against_numpy():
    """clip_norm c at P = 1: g·min(1, c / ‖g‖) over all tensors of the call."""
    red = _single(method="dense", clip_norm=0.5)
    g = {"a": torch.tensor([3.0, 4.0]), "b": torch.tensor([12.0])}
    out = red.reduce(g)
    norm = 13.0
    for n in g:
        np.testing.assert_allclose(out[n].numpy(), g[n].numpy() * 0.5 / norm, rtol=1e-6)
    small = {"a": torch.tensor([0.1, 0.1]), "b": torch.tensor([0.1])}
    out = red.reduce(small)
    assert all(torch.equal(out[n], small[n]) for n in small)


@pytest.mark.parametrize("method", ["topk", "gtopk", "threshold"])
def test_loss_scale_changes_keep_error_feedback_exact(method):
    """A run whose gradients carry a changing loss scale (2^0 … 2^24, as a
    GradScaler's) gives, once unscaled, bit-identical updates to the
    unscaled run: residuals and velocities follow the scale exactly."""
    scales = [2.0 ** e for e in (0, 0, 3, 3, 24, 24, 10, 16, 16, 0)]
    plain = _single(method=method, density=0.2, momentum_correction=0.9)
    scaled = _single(method=method, density=0.2, momentum_correction=0.9)
    for s, sc in enumerate(scales):
        g = grads_for(0, s)
        a = plain.reduce(g)
        b = scaled.reduce({n: t * sc for n, t in g.items()}, loss_scale=sc)
        for n in a:
            assert torch.equal(b[n] / sc, a[n]), (s, n)
    for n, r in plain.memory.residuals.items():
        assert torch.equal(scaled.memory.residuals[n] / scales[-1], r)


def test_fp16_wire_with_huge_inputs_and_scales_stays_finite():
    """Inputs up to 1e6 with an fp16 wire and loss scales up to 2^24 never
    make a residual, velocity or update non-finite; what the wire cannot
    hold stays in the residual."""
    red = _single(method="topk", density=0.25, value_dtype=torch.float16, momentum_correction=0.9, op="sum")
    total_in, total_out = torch.zeros(4, dtype=torch.float64), torch.zeros(4, dtype=torch.float64)
    for s in range(40):
        sc = 2.0 ** (s % 25)
        g = torch.tensor([1e6, -3e5, 2.0, 1e-3]) * sc
        out = red.reduce({"a": g}, loss_scale=sc)["a"]
        assert torch.isfinite(out).all()
        assert torch.isfinite(red.memory.residuals["a"]).all()
        assert torch.isfinite(red.momentum.velocities["a"]).all()
        assert out.abs().max() <= 65504
        total_out += out.double() / sc
    del total_in


def test_nonfinite_propagate_poisons_updates_and_keeps_state():
    red = _single(method="topk", density=0.5, momentum_correction=0.9, nonfinite="propagate")
    red.reduce({"a": torch.arange(4.0)})
    before = red.state_dict()
    out = red.reduce({"a": torch.tensor([1.0, float("inf"), 0.0, 1.0])})
    assert torch.isinf(out["a"]).all() and red.last_stats.skipped
    after = red.state_dict()
    assert torch.equal(after["residuals"]["a"], before["residuals"]["a"])
    assert torch.equal(after["velocities"]["a"], before["velocities"]["a"])


@pytest.mark.parametrize("nesterov", [False, True])
def test_state_dict_resume_with_velocity_is_bit_exact(nesterov):
    kw = dict(method="gtopk", density=0.2, momentum_correction=0.9, nesterov=nesterov, clip_norm=2.0)
    a = _single(**kw)
    for s in range(5):
        a.reduce(grads_for(0, s))
    b = _single(**kw)
    b.load_state_dict(a.state_dict())
    for s in range(5, 10):
        x, y = a.reduce(grads_for(0, s)), b.reduce(grads_for(0, s))
        assert all(torch.equal(x[n], y[n]) for n in x)
    assert all(torch.equal(a.momentum.velocities[n], b.momentum.velocities[n]) for n in a.momentum.velocities)


# ---------------------------------------------------------------- DDP hook
DDP_STEPS = 5


@pytest.mark.parametrize("P", [2, 3])
def test_ddp_hook_momentum_correction_matches_oracle(P):
    """DDP + sparse_hook(momentum_correction=True, optimizer=SGD(momentum=0.9,
    nesterov=True)) over several buckets: the weights follow the oracle
    (numpy momentum oracle on each rank's local gradients, then plain SGD),
    and the optimizer's own momentum is untouched between steps."""
    kw = dict(method="gtopk", density=0.2)
    res = run_workers(P, ddp_momentum, kw, DDP_STEPS, True, 0.0, timeout=240)
    r0 = res[0]
    assert r0["momentum"] == 0.9 and r0["buckets"] > 1
    before = r0["before"]
    grads = [local_model_grads(r, before, DDP_STEPS) for r in range(P)]
    oracle = NumpyMomentumOracle(P, 0.9, nesterov=True, method="gtopk", density=0.2)
    for s in range(DDP_STEPS):
        upd = oracle.step([grads[r][s] for r in range(P)])
        want_next = {n: before[s][n] - 0.05 * upd[n] for n in upd}
        got_next = before[s + 1] if s + 1 < DDP_STEPS else r0["params"][0]
        for n in upd:
            torch.testing.assert_close(got_next[n], want_next[n], rtol=1e-5, atol=1e-6)
    for r in range(1, P):
        assert all(torch.equal(res[r]["params"][0][n], r0["params"][0][n]) for n in r0["params"][0])


def test_ddp_hook_clipping_across_buckets_and_loss_scale():
    """clip_norm over all buckets of a step (held back until the last) and a
    scripted loss scale that changes: the hook, with gradients scaled by the
    loss scale, gives the same weights as the unscaled hook at P = 2."""
    # bucket by bucket (coalesce_buckets=False): the norm is still the step's
    kw = dict(method="topk", density=0.2, clip_norm=0.05, coalesce_buckets=False)
    scales = [1.0, 8.0, 8.0, 2.0 ** 20, 4.0]
    plain = run_workers(2, ddp_momentum, kw, DDP_STEPS, False, 1e-3, timeout=240)
    scaled = run_workers(2, ddp_momentum, kw, DDP_STEPS, False, 1e-3, scales, timeout=240)
    assert plain[0]["buckets"] > 1
    for n, p in plain[0]["params"][0].items():
        torch.testing.assert_close(scaled[0]["params"][0][n], p, rtol=1e-6, atol=1e-7)
    # clipping was active (the unclipped run differs)
    free = run_workers(2, ddp_momentum, dict(method="topk", density=0.2), DDP_STEPS, False, 1e-3,
                       timeout=240)
    assert any(not torch.allclose(free[0]["params"][0][n], p) for n, p in plain[0]["params"][0].items())
    assert plain[0]["wd"] == 1e-3


# ---------------------------------------------------------------- elastic
def test_elastic_barrier_with_momentum_correction_equals_synchronous():
    """The elastic scheduler (barrier policy) with a gTop-k reducer and
    momentum_correction=True applies what the synchronous loop with
    momentum_correction=True applies, at P = 3; the optimizer's momentum is intact."""
    res = run_workers(3, elastic_momentum, 5, timeout=240)
    for r in res:
        assert r["momentum"] == 0.9 and r["velocity_names"]
        assert set(r["sync"]) == set(r["elastic"])
        for n in r["sync"]:
            torch.testing.assert_close(r["elastic"][n], r["sync"][n], rtol=1e-6, atol=1e-7)
    assert all(torch.equal(res[0]["elastic"][n], x["elastic"][n]) for x in res for n in res[0]["elastic"])


def test_dgc_warmup_recipe_is_one_argument():
    """DensityWarmup.dgc(steps_per_epoch): 25% at step 0, geometric decay to
    the target after `epochs` epochs (numbers computed by hand)."""
    w = gp.DensityWarmup.dgc(10, epochs=4)
    red = _single(method="topk", density=0.001, warmup=w)
    assert red.config.density_at(0) == 0.25
    assert math.isclose(red.config.density_at(20), 0.25 * (0.001 / 0.25) ** 0.5)
    assert red.config.density_at(40) == 0.001
    with pytest.raises(ValueError):
        gp.DensityWarmup.dgc(0)


def test_ddp_state_pickle_resume_with_velocity_is_bit_exact():
    """A SparseState with momentum correction pickled mid-training: the hook
    refuses to run until the optimizer is rebound, then training continues
    bit-identically to the uninterrupted run (velocities travel), P = 2."""
    res = run_workers(2, ddp_resume, 5, 2, timeout=240)
    for r in res:
        assert r["refused"] and r["same"], r
