"""Inputs that used to pass silently or fail obscurely are clear errors:
non-numeric densities, meta tensors, and gradients whose buffers cannot fit
in memory (an expanded, stride-0 tensor of 2^37 elements was materialised
and OOM-killed the process); each checked before anything is allocated or
changed."""
import numpy as np
import pytest
import torch

import gtopk_plugin as gp

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("density", ["0.1", True, None, [0.1], torch.tensor(0.1)])
def test_a_density_that_is_not_a_real_number_is_refused(density):
    with pytest.raises(ValueError, match="density must be a float"):
        gp.GradientReducer(method="topk", density=density, transport=gp.SingleProcessTransport())


@pytest.mark.parametrize("density", [0.1, np.float32(0.25), np.float64(0.5), 1])
def test_real_densities_are_accepted(density):
    red = gp.GradientReducer(method="topk", density=density, transport=gp.SingleProcessTransport())
    assert red.config.density == float(density)


def test_a_meta_tensor_is_a_clear_error():
    red = gp.GradientReducer(method="topk", density=0.1, transport=gp.SingleProcessTransport())
    with pytest.raises(ValueError, match="meta device"):
        red.reduce({"w": torch.empty(10, device="meta")})
    assert red.step == 0 and not red.memory.residuals


def test_buffers_that_cannot_fit_are_refused_before_any_allocation():
    red = gp.GradientReducer(method="topk", density=0.1, transport=gp.SingleProcessTransport())
    huge = torch.zeros(1).expand(2 ** 37)  # 0.5 TiB of float32 state per buffer
    with pytest.raises(ValueError, match="GiB"):
        red.reduce({"w": huge})
    assert red.step == 0 and not red.memory.residuals and not red.memory._flat
    out = red.reduce({"w": torch.ones(100)})  # the reducer stays usable
    assert out["w"].shape == (100,)


def test_half_gradients_keep_float32_state_and_return_their_dtype():
    """The state dtype, checked directly (the distributed conservation tests
    check the numbers): fp16/bf16 in, float32 residuals, updates out in the
    gradient's dtype; a float16 residual from an older checkpoint widens."""
    for dt in (torch.float16, torch.bfloat16):
        red = gp.GradientReducer(method="topk", density=0.1, transport=gp.SingleProcessTransport(),
                                 momentum_correction=0.9)
        out = red.reduce({"w": torch.randn(50).to(dt)})
        assert out["w"].dtype == dt
        assert red.memory.residuals["w"].dtype == torch.float32
        assert red.momentum.velocities["w"].dtype == torch.float32
    red = gp.GradientReducer(method="topk", density=0.1, transport=gp.SingleProcessTransport())
    old = torch.randn(50).half()
    red.memory.residuals["w"] = old
    red.memory._live.add("w")
    red.reduce({"w": torch.zeros(50, dtype=torch.float16)})
    # the old fp16 residual entered the accumulator exactly (widened)
    assert red.memory.residuals["w"].dtype == torch.float32


def test_qsgd_on_a_single_bucket_reduces_and_conserves_mass():
    """A call whose layout is one QSGD bucket (one small tensor, or global
    granularity) used to fail on every rank packing its payload ("stride
    must be 1 to view Float as Byte"); the oracle is the invariant."""
    for kw in (dict(), dict(granularity="global")):
        red = gp.GradientReducer(method="qsgd", op="sum", transport=gp.SingleProcessTransport(), **kw)
        x = torch.randn(20, generator=torch.Generator().manual_seed(3))
        total = torch.zeros(20, dtype=torch.float64)
        for _ in range(5):
            total += red.reduce({"w": x})["w"].double()
        err = (5 * x.double() - total - red.memory.residuals["w"].double()).abs().max()
        assert float(err) <= 1e-5


def test_powersgd_with_global_granularity_is_refused_at_construction():
    with pytest.raises(ValueError, match="granularity='layer'"):
        gp.GradientReducer(method="powersgd", granularity="global", transport=gp.SingleProcessTransport())


@pytest.mark.parametrize("use_out", [False, True])
def test_an_update_beyond_a_narrower_tensors_range_is_clamped_into_the_residual(use_out):
    """A call mixing float32 and float16 gradients sums in float32; an fp16
    tensor's update beyond 65504 used to come back as inf with -inf in the
    residual.  It is clamped to the dtype's range and the remainder stays in
    the residual: finite, and conserved exactly (float64 oracle)."""
    red = gp.GradientReducer(method="topk", density=0.25, op="sum", transport=gp.SingleProcessTransport())
    fed = {n: torch.zeros(4, dtype=torch.float64) for n in "ab"}
    got = {n: torch.zeros(4, dtype=torch.float64) for n in "ab"}
    for _ in range(4):
        x = {"a": torch.ones(4), "b": torch.tensor([6e4, 6e4, 0, 0], dtype=torch.float16)}
        out = {n: torch.empty_like(t) for n, t in x.items()} if use_out else None
        u = red.reduce(x, out=out)
        for n in x:
            assert bool(torch.isfinite(u[n]).all()) and bool(torch.isfinite(red.memory.residuals[n]).all())
            fed[n] += x[n].double()
            got[n] += u[n].double()
    assert float(u["b"].abs().max()) == 65504.0
    for n in "ab":
        assert torch.equal(fed[n] - got[n], red.memory.residuals[n].double())
