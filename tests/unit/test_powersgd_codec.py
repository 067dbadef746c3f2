"""PowerSGD codec (compress/powersgd.py) on one process: the orthonormalization
and the compress-or-dense rule against PyTorch's own (``powerSGD_hook``'s
``_orthogonalize`` and ``_should_compress``), hyper-parameter validation,
the generated ``Compression.powersgd``, and the codec through
GradientReducer at P = 1: error feedback, mass conservation, warm start and
a bit-exact state_dict round trip.  The comparison with torch's hook itself
on gloo process groups is in tests/distributed/test_powersgd.py."""
import copy

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps

import gtopk_plugin as gp
from gtopk_plugin.collectives import SingleProcessTransport
from gtopk_plugin.compress.powersgd import PowerSGDCodec, matrix_plan, orthonormalize_
from gtopk_plugin.frameworks.compression_names import CompressionNames, signature


@pytest.mark.parametrize("r", [1, 2, 3, 4])
@pytest.mark.parametrize("eps", [0.0, 1e-8])
def test_orthonormalize_matches_torch(r, eps):
    x = torch.randn(30, r, generator=torch.Generator().manual_seed(r))
    want = x.clone().unsqueeze(0)
    ps._orthogonalize(want, eps)
    got = orthonormalize_(x.clone(), eps)
    torch.testing.assert_close(got, want[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got.t() @ got, torch.eye(r), rtol=0, atol=1e-5)


def test_orthonormalize_zero_column_stays_zero():
    x = torch.zeros(5, 2)
    x[:, 1] = 1.0
    out = orthonormalize_(x.clone())
    assert torch.isfinite(out).all() and torch.equal(out[:, 0], torch.zeros(5))


@pytest.mark.parametrize("shape", [(7,), (6, 5), (24, 20), (16, 3, 3, 3), (1, 100), (100, 1), (3, 4)])
@pytest.mark.parametrize("rank", [1, 2, 4])
@pytest.mark.parametrize("rate", [0.5, 2.0])
def test_compress_rule_matches_torch(shape, rank, rate):
    n = shape[0]
    m = 1
    for d in shape[1:]:
        m *= d
    r = min(n, m, rank)
    want = len(shape) >= 2 and ps._should_compress(n, m, r, rate)[0]
    plan = matrix_plan(shape, rank, rate)
    assert (plan is not None) == want and (plan is None or plan == (n, m, r))


def test_hyperparameters_validated():
    t = SingleProcessTransport()
    with pytest.raises(ValueError, match="rank must be an integer >= 1"):
        gp.GradientReducer(method="powersgd", rank=0, transport=t)
    with pytest.raises(ValueError, match="start_iter must be an integer >= 0"):
        gp.GradientReducer(method="powersgd", start_iter=-1, transport=t)
    with pytest.raises(ValueError, match="min_compression_rate must be"):
        gp.GradientReducer(method="powersgd", min_compression_rate=float("nan"), transport=t)
    with pytest.raises(ValueError, match="warm_start must be True or False"):
        gp.GradientReducer(method="powersgd", warm_start=1, transport=t)
    with pytest.raises(ValueError, match="has no hyper-parameter 'levels'"):
        gp.GradientReducer(method="powersgd", levels=3, transport=t)
    with pytest.raises(ValueError, match="value_dtype does not apply"):
        gp.GradientReducer(method="powersgd", value_dtype=torch.bfloat16, transport=t)
    d = gp.compress.describe("powersgd")
    assert d["kind"] == "codec" and d["aggregation"] == "allreduce_rounds" and not d["uses_density"]
    with pytest.raises(ValueError, match="granularity='layer'"):
        gp.GradientReducer(method="powersgd", granularity="global", transport=t).reduce(
            {"w": torch.randn(10, 10), "b": torch.randn(3)})
    with pytest.raises(NotImplementedError, match="allreduce rounds"):
        PowerSGDCodec().encode(torch.zeros(4), torch.tensor([0, 4]), None)


def _grads(t):
    g = torch.Generator().manual_seed(t)
    return {"w": torch.randn(30, 20, generator=g), "conv": torch.randn(8, 2, 3, 3, generator=g),
            "b": torch.randn(7, generator=g)}


def _make(**kw):
    return gp.GradientReducer(method="powersgd", rank=2, op="sum", seed=4,
                              transport=SingleProcessTransport(), **kw)


def test_reducer_mass_warm_start_and_resume():
    red = _make()
    tot = {n: torch.zeros(v.shape, dtype=torch.float64) for n, v in _grads(0).items()}
    out_tot = copy.deepcopy(tot)
    for t in range(6):
        if t == 3:
            saved = copy.deepcopy(red.state_dict())
        out = red.reduce(_grads(t))
        for n, g in _grads(t).items():
            tot[n] += g.double()
            out_tot[n] += out[n].double()
        assert torch.equal(out["b"], _grads(t)["b"])  # dense: the sum (P = 1), residual 0
    res = red.state_dict()["residuals"]
    for n in tot:
        err = (tot[n] - out_tot[n] - res[n].double().view_as(tot[n])).abs().max().item()
        assert err < 1e-5, (n, err)
    assert torch.equal(res["b"], torch.zeros(7))
    assert sorted(red.state_dict()["compressor"]["q"]) == ["conv", "w"]  # conv: 8 x 18
    again = _make()
    again.load_state_dict(saved)
    red2 = _make()
    red2.load_state_dict(copy.deepcopy(saved))
    for t in range(3, 6):
        a, b = again.reduce(_grads(t)), red2.reduce(_grads(t))
    ref = _make()
    for t in range(6):
        c = ref.reduce(_grads(t))
    for n in a:
        assert torch.equal(a[n], c[n]) and torch.equal(b[n], c[n])
        assert torch.equal(again.state_dict()["residuals"][n], ref.state_dict()["residuals"][n])
    for n, q in ref.state_dict()["compressor"]["q"].items():
        assert torch.equal(again.state_dict()["compressor"]["q"][n], q)


def test_start_iter_dense_then_compressed_and_no_warm_start():
    red = _make(start_iter=2)
    for t in range(2):
        out = red.reduce(_grads(t))
        assert all(torch.equal(out[n], g) for n, g in _grads(t).items())  # dense, P = 1
        assert red.state_dict()["compressor"]["q"] == {}
    out = red.reduce(_grads(2))
    assert not torch.equal(out["w"], _grads(2)["w"])  # rank 2 of a 30 x 20 matrix
    cold = _make(warm_start=False)
    cold.reduce(_grads(0))
    assert cold.state_dict()["compressor"]["q"] == {}


class _Namespace(CompressionNames):
    @staticmethod
    def _sparse(method, density, **kw):
        return ("sparse", method, density, kw)


def test_compression_powersgd_generated():
    assert _Namespace.powersgd(rank=4) == ("sparse", "powersgd", 1.0, {"rank": 4})
    assert _Namespace.from_name("powersgd", rank=2, start_iter=10) == \
        ("sparse", "powersgd", 1.0, {"rank": 2, "start_iter": 10})
    assert signature("powersgd") == ("powersgd(rank=1, min_compression_rate=2.0, start_iter=0, "
                                     "warm_start=True, epsilon=0.0)")
    with pytest.raises(ValueError, match="rank must be"):
        _Namespace.powersgd(rank=0)
