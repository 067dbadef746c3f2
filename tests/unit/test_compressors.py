"""The compressor registry as the one source of truth, single
process: metadata and hyper-parameter validation, the 1-bit codec against a
numpy oracle of its encode/decode, and compressors registered from user code
(a selector with a hyper-parameter, a codec) working through
``GradientReducer`` and ``Compression.from_name``."""
import copy
import math

import numpy as np
import pytest
import torch

import gtopk_plugin as gp
from gtopk_plugin.compress import Codec, HyperParam, Selector, register, unregister
from gtopk_plugin.compress.compressor import SelectionContext
from gtopk_plugin.frameworks.compression_names import SPARSE_METHODS, CompressionNames

BUILTIN = ("dense", "topk", "gtopk", "rtopk", "randomk", "threshold", "onebit")


def make(**kw):
    kw.setdefault("transport", gp.SingleProcessTransport())
    return gp.GradientReducer(**kw)


# --------------------------------------------------------------- registry
def test_builtins_registered_with_metadata():
    assert gp.compress.available()[:len(BUILTIN)] == BUILTIN
    assert gp.compress.available("codec")[:1] == ("onebit",)
    assert "onebit" not in gp.compress.available("selector")
    d = gp.compress.describe("rtopk")
    assert d["kind"] == "selector" and d["aggregation"] == "allgather"
    assert d["merges"] == ("allgather", "butterfly") and d["uses_density"]
    assert [p["name"] for p in d["hyperparams"]] == ["r_factor"]
    assert d["hyperparams"][0]["default"] == 4.0 and ">= 1" in d["hyperparams"][0]["range"]
    d = gp.compress.describe("onebit")
    assert (d["kind"], d["aggregation"], d["merges"], d["uses_density"]) == \
        ("codec", "allgather_payloads", ("allgather_payloads", "reduce_scatter_payloads"), False)
    table = gp.compress.table()
    assert all(f"`{n}`" in table for n in BUILTIN)
    # the old import path still works
    from gtopk_plugin import registry as old

    assert old.get("gtopk") is gp.compress.get("gtopk")


@pytest.mark.parametrize("spec, value, ok", [
    (HyperParam("r", 4.0, "doc", float, low=1.0), 1.0, 1.0),
    (HyperParam("r", 4.0, "doc", float, low=1.0), "2", 2.0),
    (HyperParam("r", 4.0, "doc", float, low=1.0), 0.5, None),
    (HyperParam("r", 4.0, "doc", float, low=1.0), float("inf"), None),
    (HyperParam("r", 4.0, "doc", float, low=0.0, low_open=True), 0.0, None),
    (HyperParam("n", 2, "doc", int, low=1, high=8), 8, 8),
    (HyperParam("n", 2, "doc", int, low=1, high=8), 2.5, None),
    (HyperParam("n", 2, "doc", int, low=1, high=8), True, None),
    (HyperParam("s", "a", "doc", str, choices=("a", "b")), "c", None),
    (HyperParam("f", False, "doc", bool), 1, None),
])
def test_hyperparam_validation_names_the_range(spec, value, ok):
    if ok is None:
        with pytest.raises(ValueError, match=spec.name + " must be"):
            spec.validate(value)
    else:
        assert spec.validate(value) == ok


@pytest.mark.parametrize("kw, fragment", [
    ({"method": "rtopk", "r_factor": 0.5}, "r_factor must be a finite number >= 1"),
    ({"method": "gtopk", "r_factor": 0.5}, "r_factor"),  # validated whatever the method
    ({"method": "topk", "bogus": 1}, "has no hyper-parameter 'bogus'"),
    ({"method": "onebit", "merge": "gtopk"}, "unknown merge 'gtopk' for method 'onebit'"),
    ({"method": "qsgd", "merge": "reduce_scatter_payloads"}, "does not apply to method 'qsgd'"),
    ({"method": "onebit", "value_dtype": torch.float16}, "value_dtype"),
    ({"method": "randomk", "merge": "allgather"}, "merge"),
    ({"method": "nope"}, "onebit"),  # the message lists the registered methods
])
def test_reducer_validates_through_the_registry(kw, fragment):
    with pytest.raises(ValueError, match=fragment):
        make(**kw)


def test_r_factor_routes_into_rtopk_and_hyper_wins():
    assert make(method="rtopk", r_factor=2.5).compressor.r_factor == 2.5
    assert gp.ReducerConfig(method="rtopk", r_factor=2.5, hyper={"r_factor": 3.0}).method_hyper == \
        {"r_factor": 3.0}
    assert make(method="topk", r_factor=2.5).compressor.hyper == {}


def test_config_does_not_import_compress():
    import ast
    import inspect

    from gtopk_plugin import config

    tree = ast.parse(inspect.getsource(config))
    mods = [getattr(n, "module", None) or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not any("compress" in m for m in mods), mods


# ------------------------------------------------------------- 1-bit codec
def _np_onebit(a: np.ndarray, offsets):
    bits = np.packbits(a >= 0, bitorder="little")
    scales = np.array([np.abs(a[offsets[i]:offsets[i + 1]].astype(np.float64)).mean()
                       for i in range(len(offsets) - 1)])
    signs = np.unpackbits(bits, bitorder="little")[:a.size].astype(np.float64) * 2 - 1
    dec = np.concatenate([signs[offsets[i]:offsets[i + 1]] * scales[i] for i in range(len(offsets) - 1)])
    return bits, scales, dec


@pytest.mark.parametrize("sizes", [[1], [8], [13, 5, 64], [3, 1000, 7]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_onebit_encode_decode_match_numpy(sizes, dtype):
    g = torch.Generator().manual_seed(sum(sizes))
    acc = torch.randn(sum(sizes), generator=g).to(dtype)
    acc[0] = 0.0  # sign(0) = +1
    offsets = torch.tensor(np.concatenate([[0], np.cumsum(sizes)]), dtype=torch.int64)
    codec = gp.compress.get("onebit")()
    payload = codec.encode(acc, offsets, SelectionContext(0, [str(i) for i in sizes], 0))
    bits, scales, dec = _np_onebit(acc.double().numpy(), offsets.tolist())
    assert payload[0].dtype == torch.uint8 and payload[0].numel() == math.ceil(sum(sizes) / 8)
    assert np.array_equal(payload[0].numpy(), bits)
    assert payload[1].dtype == torch.float32 and payload[1].numel() == len(sizes)
    np.testing.assert_allclose(payload[1].numpy(), scales, rtol=1e-2 if dtype == torch.bfloat16 else 2e-6)
    out = codec.decode(payload, offsets, acc.numel(), dtype)
    assert out.dtype == dtype
    # decode of the payload as sent: exact
    signs = np.unpackbits(payload[0].numpy(), bitorder="little")[:acc.numel()] * 2.0 - 1
    seg = np.repeat(np.arange(len(sizes)), sizes)
    want = signs * payload[1].to(dtype).double().numpy()[seg]
    assert np.array_equal(out.double().numpy(), want)
    np.testing.assert_allclose(out.double().numpy(), dec, rtol=1e-2 if dtype == torch.bfloat16 else 2e-6)


def _np_chunks(sizes, chunk):
    """The spec's scale pieces: each segment cut into ``chunk``-entry chunks
    from its own start, the last one shorter; an empty segment has none."""
    out, at = [], 0
    for n in sizes:
        out += [(at + a, at + min(n, a + chunk)) for a in range(0, n, chunk)]
        at += n
    return out


@pytest.mark.parametrize("sizes, chunk", [([1], 64), ([8], 3), ([13, 5, 64], 8), ([3, 1000, 7], 64),
                                          ([0, 70, 0, 9], 16), ([300], 1000)])
def test_onebit_chunked_scales_match_numpy_and_the_byte_formula(sizes, chunk):
    from gtopk_plugin.pipeline import traffic

    g = torch.Generator().manual_seed(7 + sum(sizes))
    acc = torch.randn(sum(sizes), generator=g)
    acc[0] = 0.0  # sign(0) = +1
    o = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    offsets = torch.tensor(o)
    codec = gp.compress.get("onebit")(chunk=chunk)
    payload = codec.encode(acc, offsets, SelectionContext(0, [str(i) for i in sizes], 0))
    a = acc.double().numpy()
    pieces = _np_chunks(sizes, chunk)
    assert np.array_equal(payload[0].numpy(), np.packbits(a >= 0, bitorder="little"))
    assert payload[1].dtype == torch.float32 and payload[1].numel() == len(pieces)
    np.testing.assert_allclose(payload[1].numpy(), [np.abs(a[x:y]).mean() for x, y in pieces], rtol=2e-6)
    # bytes: ⌈N/8⌉ + 4 per chunk, exactly
    assert sum(p.numel() * p.element_size() for p in payload) == math.ceil(a.size / 8) + 4 * len(pieces) \
        == traffic.onebit_payload_bytes(o.tolist(), chunk)
    # decode of the payload as sent: each chunk's ±1 times its scale, exactly
    out = codec.decode(payload, offsets, acc.numel(), torch.float32)
    signs = np.unpackbits(payload[0].numpy(), bitorder="little")[:a.size].astype(np.float32) * 2 - 1
    want = np.empty(a.size, np.float32)
    for (x, y), s in zip(pieces, payload[1].numpy()):
        want[x:y] = signs[x:y] * s
    assert np.array_equal(out.numpy(), want)


@pytest.mark.parametrize("sizes, P, chunk", [([450], 3, 64), ([13, 30, 407], 4, 16), ([1, 8, 9, 0, 70], 2, 4)])
def test_onebit_chunked_shard_plan_carries_the_overlapped_chunks(sizes, P, chunk):
    from gtopk_plugin.pipeline import traffic

    o = np.concatenate([[0], np.cumsum(sizes)]).tolist()
    plan = gp.compress.get("onebit")(chunk=chunk).shard_plan(o, o[-1], P)
    pieces = _np_chunks(sizes, chunk)
    for sh, mj in zip(plan, traffic.onebit_shard_bytes(o, P, chunk)):
        over = [i for i, (x, y) in enumerate(pieces) if x < sh.hi and y > sh.lo]
        assert (sh.s0, sh.s1) == (over[0], over[-1] + 1)
        assert mj == sh.b1 - sh.b0 + 4 * len(over)


def test_onebit_chunk_is_validated_and_default_per_tensor():
    assert gp.compress.get("onebit")().chunk == 0
    for bad in (-1, 1.5, "64", True):
        with pytest.raises(ValueError, match="chunk"):
            gp.compress.get("onebit")(chunk=bad)
    with pytest.raises(ValueError, match="chunk"):
        make(method="onebit", chunk=-8)


def test_onebit_single_worker_conserves_mass_and_shrinks_the_residual():
    red = make(method="onebit", op="sum")
    g = torch.Generator().manual_seed(1)
    tot_g = torch.zeros(300, dtype=torch.float64)
    tot_o = torch.zeros(300, dtype=torch.float64)
    for _ in range(40):
        grads = {"a": torch.randn(10, 20, generator=g), "b": torch.randn(100, generator=g)}
        out = red.reduce(grads)
        tot_g += torch.cat([grads["a"].flatten(), grads["b"]]).double()
        tot_o += torch.cat([out["a"].flatten(), out["b"]]).double()
    res = red.state_dict()["residuals"]
    torch.testing.assert_close(tot_g, tot_o + torch.cat([res["a"], res["b"]]).double(), atol=1e-4, rtol=0)
    st = red.last_stats
    assert (st.method, st.aggregation, st.k, st.sent_entries) == ("onebit", "allgather_payloads", 300, 300)
    # error feedback keeps the residual bounded (EF-signSGD): well below the summed gradient
    assert float(torch.cat([res["a"], res["b"]]).abs().max()) < 10


@pytest.mark.parametrize("sizes, P", [([450], 3), ([13, 30, 407], 4), ([1, 8, 9, 0, 70], 2), ([5], 2)])
def test_onebit_shard_plan_tiles_the_payload_and_matches_the_byte_formula(sizes, P):
    from gtopk_plugin.pipeline import traffic

    o = np.concatenate([[0], np.cumsum(sizes)]).tolist()
    plan = gp.compress.get("onebit")().shard_plan(o, o[-1], P)
    m = traffic.onebit_shard_bytes(o, P)
    if plan is None:  # fewer sign bytes than ranks: the allgather runs instead
        assert m is None and math.ceil(o[-1] / 8) < P
        return
    assert plan[0].lo == 0 and plan[-1].hi == o[-1] and plan[-1].b1 == math.ceil(o[-1] / 8)
    assert all(a.hi == b.lo and a.b1 == b.b0 and b.lo == 8 * b.b0 for a, b in zip(plan, plan[1:]))
    for sh, mj in zip(plan, m):  # the scales of exactly the segments each shard overlaps
        segs = [s for s in range(len(sizes)) if o[s] < sh.hi and o[s + 1] > sh.lo]
        assert segs and segs[0] == sh.s0 and segs[-1] < sh.s1
        assert mj == sh.b1 - sh.b0 + 4 * len(segs)


def test_onebit_two_phase_single_worker_conserves_mass_and_resumes_bit_exactly():
    # P = 1: the owner of everything re-compresses its own sum; the server
    # residual is state (bit-exact resume through state_dict)
    def run(red, steps, seed):
        g = torch.Generator().manual_seed(seed)
        outs = []
        for _ in range(steps):
            grads = {"a": torch.randn(10, 20, generator=g), "b": torch.randn(100, generator=g)}
            outs.append((grads, red.reduce(grads)))
        return outs

    red = make(method="onebit", merge="reduce_scatter_payloads", op="sum")
    steps = run(red, 6, 1)
    tot = sum(torch.cat([gr["a"].flatten(), gr["b"]]).double() - torch.cat([o["a"].flatten(), o["b"]]).double()
              for gr, o in steps)
    sd = red.state_dict()
    res = sd["residuals"]
    (server,) = sd["compressor"]["server"].values()
    torch.testing.assert_close(tot, torch.cat([res["a"], res["b"]]).double() + server.double(), atol=1e-4, rtol=0)
    assert red.last_stats.aggregation == "reduce_scatter_payloads"
    again = make(method="onebit", merge="reduce_scatter_payloads", op="sum")
    again.load_state_dict(copy.deepcopy(sd))
    a, b = run(red, 3, 2), run(again, 3, 2)
    assert all(torch.equal(x[1][n], y[1][n]) for x, y in zip(a, b) for n in ("a", "b"))


# ------------------------------------------------ compressors from user code
class StridedK(Selector):
    """User selector: every ``stride``-th entry of each segment from ``start`` (same on every rank)."""

    hyperparams = (HyperParam("stride", 2, "take every stride-th entry", int, low=1),
                   HyperParam("start", 0, "first index of each segment", int, low=0))
    aggregation = "allgather"
    merges = ("allgather", "butterfly")
    exact_count = False

    def select(self, acc, offsets, k, ctx):
        o = offsets.tolist()
        idx = torch.cat([torch.arange(o[i] + min(self.start, o[i + 1] - o[i] - 1), o[i + 1], self.stride)
                         for i in range(len(o) - 1)])
        return idx, acc[idx]


class Fp16Codec(Codec):
    """User codec: the accumulator in float16."""

    def encode(self, acc, offsets, ctx):
        return [acc.to(torch.float16)]

    def decode(self, payload, offsets, numel, dtype):
        return payload[0].to(dtype)


@pytest.fixture
def user_methods():
    register("strided_user", StridedK)
    register("fp16_user")(Fp16Codec)
    yield
    unregister("strided_user")
    unregister("fp16_user")


class _Namespace(CompressionNames):
    """A framework's Compression without the framework: records the call."""

    @staticmethod
    def _sparse(method, density, **kw):
        return ("sparse", method, density, kw)


def test_user_selector_through_reducer(user_methods):
    assert "strided_user" in gp.compress.available() and "strided_user" in SPARSE_METHODS
    grads = {"w": torch.arange(10.0), "v": torch.arange(5.0) + 100}
    red = make(method="strided_user", stride=3, start=1, op="sum")
    out = red.reduce(grads)
    want_w = torch.zeros(10)
    want_w[1::3] = grads["w"][1::3]
    want_v = torch.zeros(5)
    want_v[1::3] = grads["v"][1::3]
    assert torch.equal(out["w"], want_w) and torch.equal(out["v"], want_v)
    res = red.state_dict()["residuals"]
    assert torch.equal(res["w"] + out["w"], grads["w"])
    with pytest.raises(ValueError, match="stride must be an integer >= 1"):
        make(method="strided_user", stride=0)
    # on the butterfly, too (merge= from its declared merges)
    out = make(method="strided_user", density=0.5, merge="butterfly", stride=2).reduce(grads)
    assert int((out["w"] != 0).sum()) <= 5


def test_user_codec_through_reducer(user_methods):
    g = torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 1e-3
    red = make(method="fp16_user", op="sum")
    out = red.reduce({"g": g})
    assert torch.equal(out["g"], g.half().float())
    assert torch.equal(red.state_dict()["residuals"]["g"], g - g.half().float())


def test_user_methods_through_compression_names(user_methods):
    assert _Namespace.from_name("strided_user", 0.1, stride=4, seed=3) == \
        ("sparse", "strided_user", 0.1, {"stride": 4, "seed": 3})
    assert _Namespace.strided_user(0.2) == ("sparse", "strided_user", 0.2, {})
    assert _Namespace.from_name("fp16_user") == ("sparse", "fp16_user", 1.0, {})
    assert _Namespace.onebit() == ("sparse", "onebit", 1.0, {})
    assert "strided_user" in _Namespace.names() and "strided_user" in dir(_Namespace)
    with pytest.raises(ValueError, match="stride must be"):
        _Namespace.strided_user(0.1, stride=-1)
    with pytest.raises(ValueError, match="needs a density"):
        _Namespace.from_name("strided_user")
    with pytest.raises(AttributeError, match="strided_user\\(density, stride=2, start=0\\)"):
        _Namespace.strided  # noqa: B018 - the typo lists every method with its signature


def test_user_methods_gone_after_unregister(user_methods):
    unregister("strided_user")
    with pytest.raises(ValueError, match="unknown method"):
        make(method="strided_user")
    with pytest.raises(ValueError, match="unknown compression"):
        _Namespace.from_name("strided_user", 0.1)
    register("strided_user", StridedK)  # for the fixture's teardown


def test_builtin_lists_only_the_package_compressors(user_methods):
    """available(builtin=True) is what a fresh worker process knows: the
    user compressors registered in this process are in available() but not
    in it (benchmarks hand these names to new processes)."""
    from gtopk_plugin import registry

    assert "strided_user" in registry.available()
    own = registry.available(builtin=True)
    assert "strided_user" not in own and "fp16_user" not in own
    assert {"dense", "topk", "gtopk", "rtopk", "randomk", "threshold", "onebit", "qsgd", "powersgd"} <= set(own)
    assert registry.available("codec", builtin=True) == tuple(
        n for n in own if registry.get(n).kind == "codec")


def test_register_rejects_bad_names_and_clashes():
    with pytest.raises(ValueError, match="identifier"):
        register("not a name", StridedK)
    with pytest.raises(ValueError, match="reserved"):
        register("fp16", Fp16Codec)
    with pytest.raises(ValueError, match="already registered"):
        register("topk", StridedK)


def test_onebit_with_momentum_correction_conserves_the_velocity_mass():
    # docs/design.md §2 momentum correction, for a codec: Σ_steps u_t = Σ_steps result_t + v
    red = make(method="onebit", op="sum", momentum_correction=0.9)
    g = torch.Generator().manual_seed(2)
    tot_u = torch.zeros(50, dtype=torch.float64)
    tot_o = torch.zeros(50, dtype=torch.float64)
    for _ in range(20):
        out = red.reduce({"w": torch.randn(50, generator=g)})
        tot_u += red.momentum.velocities["w"].double()  # u_t, the increment (no Nesterov)
        tot_o += out["w"].double()
    v = red.state_dict()["residuals"]["w"].double()
    torch.testing.assert_close(tot_u, tot_o + v, atol=1e-4, rtol=0)


def test_docs_table_is_the_registry_table():
    # docs/compressors.md shows gp.compress.table() for the built-in methods
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "compressors.md")
    # (only the package's own rows: other test modules register user
    # compressors into this process's registry, e.g. tests/support/tf_user_compressors.py)
    from gtopk_plugin import registry

    rows = gp.compress.table().split("\n")
    own = [r for r in rows[2:] if registry.get(r.split("`")[1]).__module__.startswith("gtopk_plugin.")]
    assert len(own) >= 9
    with open(path, encoding="utf-8") as f:
        assert "\n".join(rows[:2] + own) in f.read(), "regenerate the table in docs/compressors.md"
