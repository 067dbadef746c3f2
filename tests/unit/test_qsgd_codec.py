"""QSGD codec (compress/qsgd.py): encode/decode against a numpy oracle of the
documented wire format (LSB-first bit stream of level + s in
ceil(log2(2s+1)) bits, one float32 L2 norm per bucket), the random
rounding keyed by (seed, step, segment, rank), unbiasedness, hyper-parameter
validation, and the codec through GradientReducer on one process: error
feedback, mass conservation, a bit-exact state_dict round trip, and the
generated ``Compression.qsgd``."""
import math

import numpy as np
import pytest
import torch

import gtopk_plugin as gp
from gtopk_plugin.collectives import SingleProcessTransport
from gtopk_plugin.compress.compressor import SelectionContext, seeded_generator
from gtopk_plugin.compress.qsgd import QSGDCodec, code_bits
from gtopk_plugin.frameworks.compression_names import CompressionNames, signature

SIZES = [37, 5, 1100]  # segments not multiples of the bucket or of 8


def _offsets(sizes):
    return torch.tensor([0] + list(np.cumsum(sizes)), dtype=torch.int64)


def _np_encode(acc, sizes, names, s, bucket, norms, ctx):
    """Levels from the float32 norms as they travel (x in float64), the
    uniforms from the documented generator; the packed bit stream."""
    a = acc.double().numpy()
    nrm = np.concatenate([np.full(min(bucket, n - j), norms[b])
                          for b, (n, j) in enumerate((n, j) for n in sizes for j in range(0, n, bucket))])
    u = np.concatenate([torch.rand(n, generator=seeded_generator(ctx.seed, ctx.step, nm, ctx.rank)).numpy()
                        for n, nm in zip(sizes, names)]).astype(np.float64)
    x = np.where(nrm > 0, np.abs(a) / np.where(nrm > 0, nrm, 1) * s, 0.0)
    low = np.floor(x)
    level = np.minimum(low + (u < x - low), s).astype(np.int64)
    level = np.where(acc.float().numpy() < 0, -level, level)
    bits = code_bits(s)
    codes = level + s
    planes = ((codes[:, None] >> np.arange(bits)) & 1).astype(np.uint8).reshape(-1)
    return level, np.packbits(planes, bitorder="little")


def _np_norms(acc, sizes, bucket):
    a = acc.double().numpy()
    out, at = [], 0
    for n in sizes:
        for j in range(0, n, bucket):
            seg = a[at + j:at + min(n, j + bucket)]
            out.append(np.sqrt((seg ** 2).sum()))
        at += n
    return np.array(out)


@pytest.mark.parametrize("s,bucket", [(1, 16), (7, 512), (127, 100), (200, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_encode_decode_match_numpy(s, bucket, dtype):
    g = torch.Generator().manual_seed(s + bucket)
    acc = (torch.randn(sum(SIZES), generator=g) * 3).to(dtype)
    acc[3] = 0.0
    acc[37:42] = 0.0  # segment "b" all zero: a zero norm, levels 0
    names = ["a", "b", "c"]
    off = _offsets(SIZES)
    ctx = SelectionContext(step=5, segment_names=names, seed=11, rank=2)
    c = QSGDCodec(levels=s, bucket_size=bucket)
    packed, norms = c.encode(acc, off, ctx)
    nb = sum(math.ceil(n / bucket) for n in SIZES)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(sum(SIZES) * code_bits(s) / 8)
    assert norms.dtype == torch.float32 and norms.numel() == nb
    np.testing.assert_allclose(norms.double().numpy(), _np_norms(acc, SIZES, bucket), rtol=2e-6)
    level, want = _np_encode(acc, SIZES, names, s, bucket, norms.double().numpy(), ctx)
    assert np.array_equal(packed.numpy(), want), "packed levels differ from the documented bit stream"
    assert np.abs(level).max() <= s
    # decode: level * float32(norm / s), in the dtype
    out = c.decode([packed, norms], off, sum(SIZES), dtype)
    scale = np.repeat((norms / s).numpy(), [min(bucket, n - j) for n in SIZES for j in range(0, n, bucket)])
    want_out = torch.from_numpy(level).to(dtype) * torch.from_numpy(scale).to(dtype)
    assert out.dtype == dtype and torch.equal(out, want_out)
    assert bool((out[37:42] == 0).all()) and out[3] == 0
    # deterministic; another rank or step draws other uniforms
    assert torch.equal(c.encode(acc, off, ctx)[0], packed)
    other = SelectionContext(step=5, segment_names=names, seed=11, rank=3)
    if s < 100:
        assert not torch.equal(c.encode(acc, off, other)[0], packed)


def test_code_bits():
    assert [code_bits(s) for s in (1, 2, 3, 7, 8, 127, 128, 32767)] == [2, 3, 3, 4, 5, 8, 9, 16]


def test_unbiased():
    acc = torch.tensor([0.3, -1.2, 0.05, 2.0, -0.7, 0.0, 1e-3, -2.5])
    off = _offsets([8])
    c = QSGDCodec(levels=4, bucket_size=8)
    mean = torch.zeros(8, dtype=torch.float64)
    T = 1500
    for t in range(T):
        ctx = SelectionContext(step=t, segment_names=["w"], seed=0, rank=0)
        mean += c.decode(c.encode(acc, off, ctx), off, 8, torch.float32).double()
    mean /= T
    # std of one draw <= norm/s/2 ~ 0.44; of the mean ~ 0.012
    assert torch.allclose(mean, acc.double(), atol=0.06)


def test_hyperparameters_validated():
    with pytest.raises(ValueError, match="levels must be an integer >= 1"):
        QSGDCodec(levels=0)
    with pytest.raises(ValueError, match="levels must be"):
        gp.GradientReducer(method="qsgd", levels=1.5, transport=SingleProcessTransport())
    with pytest.raises(ValueError, match="bucket_size must be an integer >= 1"):
        gp.GradientReducer(method="qsgd", bucket_size=0, transport=SingleProcessTransport())
    with pytest.raises(ValueError, match="has no hyper-parameter 'rank'"):
        gp.GradientReducer(method="qsgd", rank=2, transport=SingleProcessTransport())
    with pytest.raises(ValueError, match="value_dtype does not apply"):
        gp.GradientReducer(method="qsgd", value_dtype=torch.float16, transport=SingleProcessTransport())
    d = gp.compress.describe("qsgd")
    assert d["kind"] == "codec" and d["aggregation"] == "allgather_payloads" and not d["uses_density"]
    assert [p["name"] for p in d["hyperparams"]] == ["levels", "bucket_size", "start_iter"]


def _grads(t):
    g = torch.Generator().manual_seed(t)
    return {"w": torch.randn(30, 20, generator=g), "b": torch.randn(7, generator=g)}


def test_reducer_error_feedback_mass_and_resume():
    def make():
        return gp.GradientReducer(method="qsgd", levels=3, bucket_size=64, op="sum", seed=5,
                                  transport=SingleProcessTransport())
    red = make()
    total = {n: torch.zeros_like(v, dtype=torch.float64) for n, v in _grads(0).items()}
    outs = {n: torch.zeros_like(v, dtype=torch.float64) for n, v in _grads(0).items()}
    for t in range(6):
        g = _grads(t)
        res = {n: r.clone() for n, r in red.state_dict()["residuals"].items()}
        out = red.reduce(g)
        for n in g:
            acc = g[n] + res.get(n, torch.zeros(g[n].shape).reshape(-1)).view_as(g[n])
            # the residual is acc less the decode (= the result at P = 1), exactly
            assert torch.equal(red.state_dict()["residuals"][n].view_as(acc), acc - out[n])
            total[n] += g[n].double()
            outs[n] += out[n].double()
        if t == 2:
            saved = red.state_dict()
    for n in total:
        res = red.state_dict()["residuals"][n].double().view_as(total[n])
        torch.testing.assert_close(total[n], outs[n] + res, rtol=0, atol=1e-5)
    # resume at step 3: the same bits
    again = make()
    again.load_state_dict(saved)
    red2 = make()
    red2.load_state_dict(saved)
    for t in range(3, 6):
        a, b = again.reduce(_grads(t)), red2.reduce(_grads(t))
        assert all(torch.equal(a[n], b[n]) for n in a)
    ref = make()
    for t in range(6):
        last = ref.reduce(_grads(t))
    assert all(torch.equal(a[n], last[n]) for n in a)
    assert all(torch.equal(again.state_dict()["residuals"][n], ref.state_dict()["residuals"][n]) for n in a)


class _Namespace(CompressionNames):
    @staticmethod
    def _sparse(method, density, **kw):
        return ("sparse", method, density, kw)


def test_compression_qsgd_generated():
    assert _Namespace.qsgd(levels=15, bucket_size=128) == \
        ("sparse", "qsgd", 1.0, {"levels": 15, "bucket_size": 128})
    assert _Namespace.from_name("qsgd") == ("sparse", "qsgd", 1.0, {})
    assert signature("qsgd") == "qsgd(levels=7, bucket_size=32, start_iter=0)"
    with pytest.raises(ValueError, match="levels must be"):
        _Namespace.qsgd(levels=-1)
    with pytest.raises(TypeError, match="takes no density"):
        _Namespace.qsgd(0.01)
