"""Single-process behaviour of GradientReducer: argument validation, warm-up,
non-finite policy, error feedback and state round trips (P = 1)."""
import io
import math

import pytest
import torch

import gtopk_plugin as gp


def make(**kw):
    kw.setdefault("transport", gp.SingleProcessTransport())
    return gp.GradientReducer(**kw)


@pytest.mark.parametrize("kw, fragment", [
    ({"density": 0.0}, "density"),
    ({"density": 1.5}, "density"),
    ({"density": float("nan")}, "density"),
    ({"density": "x"}, "density"),
    ({"r_factor": 0.5}, "r_factor"),
    ({"r_factor": float("inf")}, "r_factor"),
    ({"method": "bogus"}, "gtopk"),
    ({"op": "max"}, "average"),
    ({"merge": "ring"}, "allgather"),
    ({"method": "dense", "merge": "gtopk"}, "merge"),
    ({"granularity": "tensor"}, "layer"),
    ({"value_dtype": torch.float64}, "float16"),
    ({"nonfinite": "ignore"}, "skip"),
    ({"warmup": [0.5, 2.0]}, "warmup"),
    ({"warmup": 3}, "warmup"),
    ({"kernels": "tpu"}, "reference"),
    ({"transport": object()}, "Transport"),
])
def test_bad_arguments_raise_value_error_saying_what_to_pass(kw, fragment):
    with pytest.raises(ValueError, match=fragment):
        make(**kw)


@pytest.mark.parametrize("grads, fragment", [
    ({}, "empty"),
    ({"w": torch.tensor(1.0)}, "0-d"),
    ({"w": torch.zeros(0)}, "empty"),
    ({"w": torch.zeros(3, dtype=torch.int64)}, "floating-point"),
    ({"w": [1.0, 2.0]}, "torch.Tensor"),
    ([torch.zeros(3)], "dict"),
])
def test_bad_gradients_raise_value_error(grads, fragment):
    with pytest.raises(ValueError, match=fragment):
        make().reduce(grads)


def test_k_rounding():
    assert gp.k_for(0.07, 100) == 7
    assert gp.k_for(0.001, 10) == 1
    assert gp.k_for(1.0, 10) == 10
    assert gp.k_for(0.01, 25_000_000) == 250_000


@pytest.mark.parametrize("method", ["dense", "topk", "gtopk", "rtopk", "randomk", "threshold"])
@pytest.mark.parametrize("value_dtype", [None, torch.float16])
def test_single_worker_conserves_mass(method, value_dtype):
    red = make(method=method, density=0.05, op="sum", value_dtype=value_dtype)
    g = torch.Generator().manual_seed(1)
    total_grad = torch.zeros(300)
    total_out = torch.zeros(300)
    for _ in range(50):
        grads = {"a": torch.randn(10, 20, generator=g), "b": torch.randn(100, generator=g)}
        out = red.reduce(grads)
        total_grad += torch.cat([grads["a"].flatten(), grads["b"]])
        total_out += torch.cat([out["a"].flatten(), out["b"]])
    res = red.state_dict()["residuals"]
    torch.testing.assert_close(total_grad, total_out + torch.cat([res["a"], res["b"]]),
                               atol=1e-4, rtol=1e-5)


def test_layer_granularity_keeps_k_per_tensor_and_global_over_bucket():
    grads = {"big": torch.arange(1000.0), "small": torch.full((10,), 1e6)}
    red = make(method="topk", density=0.01, granularity="layer")
    out = red.reduce(grads)
    assert int((out["big"] != 0).sum()) == 10 and int((out["small"] != 0).sum()) == 1
    red = make(method="topk", density=0.01, granularity="global")
    out = red.reduce(grads)
    assert red.last_stats.k == 11
    assert int((out["small"] != 0).sum()) == 10 and int((out["big"] != 0).sum()) == 1


def test_warmup_schedules_density():
    grads = {"w": torch.randn(1000)}
    red = make(method="topk", density=0.01, warmup=gp.DensityWarmup(steps=3, start_density=0.25))
    ks = []
    for _ in range(5):
        red.reduce(grads)
        ks.append(red.last_stats.k)
    assert ks[0] == 250 and ks[0] > ks[1] > ks[2] > ks[3] == ks[4] == 10
    red = make(method="topk", density=0.01, warmup=[1.0, 0.1])
    for expect in (1000, 100, 10):
        red.reduce(grads)
        assert red.last_stats.k == expect
    red = make(method="topk", density=0.01, warmup=lambda s: 0.5 if s == 0 else 0.01)
    red.reduce(grads)
    assert red.last_stats.k == 500


def test_error_feedback_off_discards_residual():
    red = make(method="topk", density=0.1, error_feedback=False)
    red.reduce({"w": torch.arange(10.0)})
    assert red.state_dict()["residuals"] == {}


@pytest.mark.parametrize("method", ["gtopk", "rtopk", "randomk", "threshold"])
def test_state_dict_resume_is_bit_exact(method):
    g = torch.Generator().manual_seed(3)
    steps = [{"w": torch.randn(50, generator=g), "v": torch.randn(7, 3, generator=g)} for _ in range(10)]
    a = make(method=method, density=0.1, seed=5)
    outs = [a.reduce(s) for s in steps[:5]]
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    outs += [a.reduce(s) for s in steps[5:]]
    b = make(method=method, density=0.1, seed=5)
    buf.seek(0)
    b.load_state_dict(torch.load(buf))
    for s, o in zip(steps[5:], outs[5:]):
        r = b.reduce(s)
        assert all(torch.equal(r[n], o[n]) for n in o)
    with pytest.raises(ValueError, match="method"):
        make(method="topk").load_state_dict(a.state_dict())


def test_nonfinite_raise_names_tensor_and_leaves_state_alone():
    red = make(method="gtopk", density=0.1)
    red.reduce({"w": torch.randn(20), "v": torch.randn(5)})
    before = red.state_dict()
    with pytest.raises(gp.NonFiniteGradientError, match="'?v'?"):
        red.reduce({"w": torch.randn(20), "v": torch.tensor([1.0, float("nan"), 0, 0, 0])})
    after = red.state_dict()
    assert after["step"] == before["step"]
    assert all(torch.equal(after["residuals"][n], before["residuals"][n]) for n in before["residuals"])


@pytest.mark.parametrize("dtype, big", [(torch.float32, 3e38), (torch.float16, 6e4), (torch.bfloat16, 3e38)])
def test_finite_gradients_whose_sum_overflows_are_not_called_nonfinite(dtype, big):
    """The finiteness check sums first; a sum that overflows must fall back to
    the elementwise test, not report a NaN/Inf that is not there."""
    red = make(method="topk", density=0.5)
    g = torch.full((64,), big, dtype=dtype)
    assert torch.isfinite(g).all() and not torch.isfinite(g.sum())
    out = red.reduce({"w": g})
    assert torch.isfinite(out["w"]).all()
    for bad in (float("nan"), float("inf"), -float("inf")):
        g2 = g.clone()
        g2[7] = bad
        with pytest.raises(gp.NonFiniteGradientError):
            red.reduce({"w": g2})


def test_nonfinite_skip_returns_zero_update_and_keeps_residual():
    red = make(method="gtopk", density=0.1, nonfinite="skip")
    red.reduce({"w": torch.randn(20)})
    before = red.state_dict()
    out = red.reduce({"w": torch.full((20,), float("inf"))})
    assert red.last_stats.skipped and torch.count_nonzero(out["w"]) == 0
    assert torch.equal(red.state_dict()["residuals"]["w"], before["residuals"]["w"])


def test_average_divides_by_world_size_and_stats_exposed():
    red = make(method="dense", op="average")
    out = red.reduce({"w": torch.ones(4)})
    assert torch.equal(out["w"], torch.ones(4))
    st = red.last_stats.as_dict()
    for key in ("bytes_sent", "bytes_received", "rounds", "selected", "seconds"):
        assert key in st
    assert math.isclose(sum(v for k, v in st["seconds"].items() if k != "total"), st["seconds"]["total"],
                        rel_tol=0.5)


def test_outputs_keep_shapes_and_dtypes():
    red = make(method="gtopk", density=0.2)
    grads = {"h": torch.randn(4, 5).half(), "f": torch.randn(3, 2, 2)}
    out = red.reduce(grads)
    for n in grads:
        assert out[n].shape == grads[n].shape and out[n].dtype == grads[n].dtype


@pytest.mark.parametrize("method", ["rtopk", "randomk", "gtopk"])
def test_draws_do_not_depend_on_how_tensors_are_grouped_into_calls(method):
    g = torch.Generator().manual_seed(9)
    grads = {"a": torch.randn(200, generator=g), "b": torch.randn(50, generator=g)}
    together = make(method=method, density=0.05, seed=2).reduce(grads)
    split = make(method=method, density=0.05, seed=2)
    parts = {**split.reduce({"a": grads["a"]}, advance_step=False), **split.reduce({"b": grads["b"]})}
    assert all(torch.equal(together[n], parts[n]) for n in grads)
