"""The int8 wire's quantizer (gtopk_plugin/collectives/wire.py),
single process: exactness of the residual's share (decoded + err == v bit
for bit), bounds (|q| <= 127, never ±inf, zero and empty messages), the
per-message exponent, lossless re-encoding of a slice, stochastic rounding
(unbiased, deterministic given its key, independent of entry order), the
message layout and byte counts, the keywords' validation, and agreement of
the oracle's independent model (gtopk_plugin.testing) with the code."""

import pytest
import torch

import gtopk_plugin as gp
from gtopk_plugin import testing
from gtopk_plugin.pipeline import traffic
from gtopk_plugin.collectives import wire

I8 = torch.int8


def _wide(n, dtype=torch.float32, seed=0, spread=20.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g, dtype=torch.float64)
            * torch.exp(spread * torch.randn(n, generator=g, dtype=torch.float64))).to(dtype)


def _bits(t):
    return t.view({torch.float32: torch.int32, torch.float64: torch.int64}[t.dtype])


def _draws(n, key="k"):
    return wire.uniform(key, torch.arange(n))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("stochastic", [False, True])
def test_decoded_plus_error_is_the_value_bit_for_bit(dtype, stochastic):
    for seed, spread in [(0, 1.0), (1, 5.0), (2, 20.0)]:
        v = _wide(4000, dtype, seed, spread)
        v[:3] = torch.tensor([0.0, -0.0, 1e-45 if dtype == torch.float32 else 5e-324])
        w, err = wire.quantize(v, _draws(v.numel()) if stochastic else None)
        d = wire.values(w, dtype)
        assert w.dtype == I8 and w.numel() == v.numel() + 1
        assert torch.equal(_bits(d + err), _bits(v + 0.0))  # in the value's own dtype, exactly
        assert torch.equal((d.double() + err.double()), v.double())  # and as real numbers
        q, e = w[:-1].long(), int(w[-1])
        assert q.abs().max() <= 127 and (q != -128).all()
        m = float(v.abs().max())
        assert m <= 127 * 2.0 ** e and (e == -128 or m > 127 * 2.0 ** (e - 1))
        assert torch.isfinite(d).all() and torch.isfinite(err).all()


def test_exponent_range_and_edge_messages():
    # float32 near its maximum: never decodes to inf (q capped so q·2^e is finite)
    big = torch.finfo(torch.float32).max
    v = torch.tensor([big, -big, 1.0])
    w, err = wire.quantize(v)
    d = wire.values(w, torch.float32)
    assert torch.isfinite(d).all() and torch.equal(d + err, v)
    # all zeros and empty messages: codes 0, exponent at the bottom of the range
    w, err = wire.quantize(torch.zeros(5))
    assert w[:-1].eq(0).all() and int(w[-1]) == -128 and err.eq(0).all()
    w, err = wire.quantize(torch.empty(0))
    assert w.numel() == 1 and err.numel() == 0 and wire.values(w, torch.float32).numel() == 0
    # one exponent per message: 127 fits at e = 0, 127.5 needs e = 1
    assert int(wire.quantize(torch.tensor([127.0, 3.0]))[0][-1]) == 0
    assert int(wire.quantize(torch.tensor([127.5, 3.0]))[0][-1]) == 1
    # float16 gradients: steps no finer than fp16's smallest subnormal (2^-24)
    assert wire.exponent(1e-7, torch.float16) == -24
    # float64 beyond 127·2^127 saturates at ±127·2^127, remainder kept
    w, err = wire.quantize(torch.tensor([1e45, -2.0], dtype=torch.float64))
    assert int(w[-1]) == 127 and int(w[0]) == 127 and err[0] == 1e45 - 127 * 2.0 ** 127


def test_a_slice_of_a_message_re_encodes_losslessly():
    """What the sharded value sum relies on: every piece of a quantized
    vector is a message of its own with its own (smaller or equal) exponent."""
    v = _wide(1000, spread=3.0)
    d = wire.values(wire.quantize(v)[0], torch.float32)
    for a, b in [(0, 10), (10, 500), (500, 1000), (3, 4)]:
        w, err = wire.quantize(d[a:b])
        assert err.eq(0).all() and torch.equal(wire.values(w, torch.float32), d[a:b])
        assert int(w[-1]) <= int(wire.quantize(v)[0][-1])


def test_stochastic_rounding_is_unbiased_outside_the_dead_zone_and_keyed():
    # x = v / 2^e with e = 0 (max 127): fractions .3 .5 .75 .9, negatives, dead zone
    v = torch.tensor([127.0, 64.3, -3.75, 0.6, -0.9, 2.5, 0.3, -0.2])
    trials = 4000  # one message of 4000 copies (max 127: e = 0), independent draws per index
    rep = v.repeat(trials)
    qs = wire.values(wire.quantize(rep, wire.Draws(7, 0, "t")("rank0", torch.arange(rep.numel())))[0],
                     torch.float64).view(trials, 8)
    mean = qs.mean(0)
    frac = (v.double() - v.double().floor())
    sigma = torch.sqrt(frac * (1 - frac) / trials)
    live = v.abs() >= 0.5
    assert ((mean - v.double()).abs()[live] <= 5 * sigma[live] + 1e-12).all(), (mean, v)
    assert qs[:, 6].eq(0).all() and qs[:, 7].eq(0).all()  # |x| < 1/2: 0, kept in the residual
    assert set(qs[:, 1].tolist()) == {64.0, 65.0}
    # deterministic given the key; another step draws other numbers
    k = wire.Draws(7, 3, "t")
    assert torch.equal(k("rank0", torch.arange(50)), wire.Draws(7, 3, "t")("rank0", torch.arange(50)))
    assert not torch.equal(k("rank0", torch.arange(50)), wire.Draws(7, 4, "t")("rank0", torch.arange(50)))
    assert not torch.equal(k("rank0", torch.arange(50)), k("rank1", torch.arange(50)))
    # a draw is a function of the index: any order or subset gives the same numbers
    idx = torch.tensor([5, 2**33 + 1, 0, 17])
    u = k("final", idx)
    perm = torch.tensor([2, 0, 3, 1])
    assert torch.equal(k("final", idx[perm]), u[perm])
    assert ((u >= 0) & (u < 1)).all()
    big = k("x", torch.arange(200_000))
    assert abs(float(big.mean()) - 0.5) < 0.005 and abs(float((big < 0.1).double().mean()) - 0.1) < 0.005


def test_oracle_model_agrees_with_the_code():
    """The oracle's numpy model (written from the spec) and wire.py: the
    same draws and the same decoded values, nearest and stochastic."""
    idx = torch.tensor([0, 1, 7, 2**31 + 5, 2**40 + 3])
    assert torch.equal(testing._uniform_model("a:b", idx.numpy()), wire.uniform("a:b", idx))
    for seed in range(5):
        v = _wide(300, seed=seed, spread=4.0)
        for u in (None, wire.uniform(f"s{seed}", torch.arange(300))):
            d = wire.values(wire.quantize(v, u)[0], torch.float32)
            assert torch.equal(_bits(testing._int8_model(v, u)), _bits(d))


def test_message_layout_and_bytes():
    idx = torch.tensor([3, 9, 200], dtype=torch.int32)
    w, _ = wire.quantize(torch.tensor([1.5, -100.0, 7.25]))
    mask = wire.pack_bits(torch.tensor([True, False, True]))
    blob = torch.cat([wire.pack(idx, w, torch.int32), mask])
    assert blob.numel() == wire.message_bytes(3, torch.int32, I8) + mask.numel() == 3 * 5 + 1 + 1
    i2, w2, tail = wire.unpack(blob, torch.int32, I8, extra_bytes=mask.numel())
    assert torch.equal(i2, idx) and torch.equal(w2, w) and torch.equal(tail, mask)
    with pytest.raises(RuntimeError, match="corrupt"):
        wire.unpack(blob[:-2], torch.int32, I8)
    assert traffic.sparse_message_bytes(1000, "int8") == 5001
    assert traffic.sparse_message_bytes(1000, "fp32") == 8000


def test_keywords_are_validated():
    with pytest.raises(ValueError, match="wire_rounding"):
        gp.GradientReducer("gtopk", 0.1, value_dtype=I8, wire_rounding="up",
                           transport=gp.SingleProcessTransport())
    with pytest.raises(ValueError, match="int8"):
        gp.GradientReducer("gtopk", 0.1, value_dtype=torch.float16, wire_rounding="stochastic",
                           transport=gp.SingleProcessTransport())
    with pytest.raises(ValueError, match="value_dtype"):
        gp.GradientReducer("onebit", value_dtype=I8, transport=gp.SingleProcessTransport())
    with pytest.raises(ValueError, match="int8"):
        gp.GradientReducer("gtopk", 0.1, value_dtype=torch.uint8, transport=gp.SingleProcessTransport())


@pytest.mark.parametrize("method", ["gtopk", "topk", "randomk", "rtopk", "threshold", "dense"])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_single_worker_matches_oracle_stays_finite_and_conserves_mass(method, rounding):
    kw = dict(method=method, op="sum", value_dtype=I8, wire_rounding=rounding, seed=4)
    if method != "dense":
        kw["density"] = 0.1
    red = gp.GradientReducer(transport=gp.SingleProcessTransport(), **kw)
    oracle = testing.Oracle(1, **kw)
    tot_g = tot_abs = tot_out = 0
    for s in range(15):
        g = {"a": _wide(120, seed=s, spread=3.0), "b": _wide(30, seed=100 + s, spread=3.0).view(5, 6)}
        if s % 5 == 0:
            g["a"][:3] = torch.tensor([1e38, -1e30, 1e-40])  # huge and subnormal entries
        out = red.reduce(g)
        want = oracle.step([g])
        for n in g:
            assert torch.isfinite(out[n]).all() and torch.equal(out[n], want[n])
        flat = torch.cat([g[n].reshape(-1).double() for n in sorted(g)])
        tot_g, tot_abs = tot_g + flat, tot_abs + flat.abs()
        tot_out = tot_out + torch.cat([out[n].reshape(-1).double() for n in sorted(out)])
    res = red.state_dict()["residuals"]
    r = torch.cat([res[n].reshape(-1).double() for n in sorted(res)])
    assert torch.isfinite(r).all()
    assert float(((tot_g - tot_out - r).abs() / tot_abs).max()) <= 1e-6
    # state_dict resume: the step counter is the whole RNG state
    red2 = gp.GradientReducer(transport=gp.SingleProcessTransport(), **kw)
    red2.load_state_dict(red.state_dict())
    g = {"a": _wide(120, seed=99), "b": _wide(30, seed=98).view(5, 6)}
    a, b = red.reduce(g), red2.reduce(g)
    assert all(torch.equal(a[n], b[n]) for n in g)
