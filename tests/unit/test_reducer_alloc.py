"""GradientReducer.reduce in steady state: persistent residual,
accumulator and update buffers, no N-sized allocation per step on the sparse
path, the update buffers' lifetime contract, and the fused CPU kernels
(compensate, compensate_select_topk, subtract_at_, scatter_reset_) against
the reference twins and a numpy oracle.  Single process, CPU."""
from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

import gtopk_plugin as gp
from gtopk_plugin import kernels
from gtopk_plugin.collectives.transport import SingleProcessTransport
from gtopk_plugin.kernels import reference

BACKENDS = ["reference"] + (["cpu"] if kernels.backend("cpu") == "cpu" else [])


def _red(**kw):
    return gp.GradientReducer(transport=SingleProcessTransport(), **kw)


def _grads(seed, shapes=((3000,), (40, 50), (7,))):
    g = torch.Generator().manual_seed(seed)
    return {f"t{i}": torch.randn(s, generator=g) for i, s in enumerate(shapes)}


def _ptrs(red):
    """data_ptrs of every persistent buffer the reducer holds."""
    out = set()
    for f in red.memory._flat.values():
        out |= {b.data_ptr() for b in f.bufs if b is not None}
    for ring in red._updates._rings.values():
        out |= {e["buf"].data_ptr() for e in ring}
    return out


# ------------------------------------------------------------ numpy oracle
def np_topk(x: np.ndarray, k: int) -> np.ndarray:
    """Positions (ascending) of the k largest |x|, ties to the smaller index."""
    mag = np.abs(x)
    order = np.lexsort((np.arange(x.size), -mag))
    return np.sort(order[:k])


def np_reduce_p1(grads_seq, density):
    """P = 1 gtopk/topk with error feedback, layer granularity: per step the
    updates and, at the end, the residuals (float32 arithmetic)."""
    res, updates = {}, []
    for grads in grads_seq:
        upd = {}
        for n in sorted(grads):
            g = grads[n].numpy().reshape(-1)
            acc = (g + res[n]).astype(np.float32) if n in res else g.copy()
            k = gp.k_for(density, g.size)
            idx = np_topk(acc, k)
            u = np.zeros_like(acc)
            u[idx] = acc[idx]
            r = acc.copy()
            r[idx] = np.float32(0)  # acc - acc
            res[n] = r
            upd[n] = u
        updates.append(upd)
    return updates, res


# ------------------------------------------------------- steady state
@pytest.mark.parametrize("method", ["gtopk", "topk", "dense", "threshold", "randomk", "rtopk"])
def test_persistent_buffers_are_reused(method):
    red = _red(method=method, density=0.05)
    seen = []
    for s in range(8):
        out = red.reduce(_grads(s))
        del out
        seen.append(_ptrs(red))
    # from the second step on no new buffer appears (residual/accumulator
    # swap between two storages, the update ring holds one)
    assert all(p == seen[1] for p in seen[2:]), seen
    assert len(red.memory._flat) == 1
    f = next(iter(red.memory._flat.values()))
    for n, v in zip(f.names, f.views[f.cur]):
        assert red.memory.residuals[n] is v


def _big_allocs(fn, nbytes):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return [(e.name, e.cpu_memory_usage) for e in prof.events() if e.cpu_memory_usage >= nbytes]


@pytest.mark.parametrize("method,allowed", [("gtopk", 0), ("dense", 0)])
def test_no_n_sized_allocation_in_steady_state(method, allowed):
    """torch's profiler counts every allocation of at least half the layout:
    none on the gtopk path, none on the dense one (its sum is taken in the
    update ring's buffer, not in a fresh clone of the accumulator)."""
    N = 1 << 17
    g = {"a": torch.randn(N // 2), "b": torch.randn(N // 2)}
    red = _red(method=method, density=0.01)
    for _ in range(3):
        red.reduce(g)
    big = _big_allocs(lambda: red.reduce(g), N * 4 // 2)
    assert len(big) <= allowed, big


@pytest.mark.skipif("cpu" not in BACKENDS, reason="the CPU extension did not build")
@pytest.mark.parametrize("with_out", [False, True])
def test_dense_step_passes(with_out):
    """A dense step on the CPU kernels, P = 1: without ``out`` one pass over
    N, the copy into the update buffer that also checks and counts
    (dense_direct); with ``out`` two, the fused compensation into the
    accumulator and one division out of it into ``out``.  No torch copy,
    clone, division or count over N-sized inputs, no scratch
    accumulator without ``out``; the result is still the exact sum."""
    from torch.profiler import ProfilerActivity, profile

    N = 1 << 16
    g = {"a": torch.randn(N // 2), "b": torch.randn(N // 2)}
    g["a"][::3] = 0
    red = _red(method="dense", kernels="cpu")
    out = {n: torch.empty_like(t) for n, t in g.items()} if with_out else None
    for _ in range(2):
        red.reduce(g, out=out)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        res = red.reduce(g, out=out)
    shapes = [(e.name, e.input_shapes) for e in prof.events()]
    big = [n for n, sh in shapes
           if any(len(s) == 1 and s[0] >= N // 2 for s in (sh or []) if isinstance(s, list))]
    torch_ops = [n for n in big if n in ("aten::copy_", "aten::clone", "aten::div", "aten::div_",
                                         "aten::count_nonzero", "aten::add")]
    assert torch_ops == [], torch_ops
    kernels_run = sorted(n.split("::")[-1] for n in big if n.startswith("gtopk_cpu::"))
    want = ["compensate"] * 2 + ["div_count_into"] * 2 if with_out else ["prescale_copy"] * 2
    assert kernels_run == sorted(want), kernels_run
    f = next(iter(red.memory._flat.values()))
    assert (f.bufs[1] is None) != with_out  # the scratch accumulator only where out= needs it
    for n in g:
        assert torch.equal(res[n], g[n])  # P = 1: the sum is the gradient
    assert red.last_stats.result_nnz == sum(int(np.count_nonzero(t.numpy())) for t in g.values())


def _rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/statm"), reason="needs /proc")
def test_rss_does_not_grow_over_200_steps():
    N = 1 << 20  # 4 MiB per buffer: a leak of one buffer per step would be 800 MiB
    g = {"a": torch.randn(N // 2), "b": torch.randn(N // 2)}
    red = _red(method="gtopk", density=0.01)
    for _ in range(20):
        red.reduce(g)
    gc.collect()
    before = _rss()
    for _ in range(200):
        out = red.reduce(g)
        del out
    gc.collect()
    assert _rss() - before < 16 * 2**20, (before, _rss())


# ------------------------------------------------------ lifetime contract
def test_held_updates_are_not_overwritten():
    """A caller that keeps the updates of several steps (the elastic
    scheduler) gets each step intact; once dropped, the buffer is reused."""
    red = _red(method="gtopk", density=0.02)
    held, copies = [], []
    for s in range(3):
        out = red.reduce(_grads(s))
        held.append(out)
        copies.append({n: t.clone() for n, t in out.items()})
    for out, want in zip(held, copies):
        for n in want:
            assert torch.equal(out[n], want[n])
    ptrs = {held[i]["t0"].data_ptr() for i in range(3)}
    assert len(ptrs) == 3
    del held, out
    gc.collect()
    again = red.reduce(_grads(9))
    assert again["t0"].data_ptr() in ptrs


@pytest.mark.parametrize("method", ["gtopk", "topk"])
@pytest.mark.parametrize("kern", BACKENDS)
def test_reused_buffers_match_numpy_oracle(method, kern):
    """Updates and residuals over 12 steps with changing gradients (so the
    selected entries move and every reset matters) equal the numpy oracle."""
    seq = [_grads(100 + s) for s in range(12)]
    red = _red(method=method, density=0.03, kernels=kern)
    want, res = np_reduce_p1(seq, 0.03)
    for s, grads in enumerate(seq):
        out = red.reduce(grads)
        for n in grads:
            np.testing.assert_array_equal(out[n].numpy().reshape(-1), want[s][n], err_msg=f"{s} {n}")
    for n in res:
        np.testing.assert_array_equal(red.memory.residuals[n].numpy(), res[n])


def test_layout_change_carries_the_residual():
    """DDP rebuilds buckets: names move to a new layout with their residual."""
    red = _red(method="topk", density=0.01)
    g = _grads(1)
    red.reduce(g)
    saved = {n: r.clone() for n, r in red.memory.residuals.items()}
    zero = {n: torch.zeros_like(t) for n, t in g.items()}
    red.reduce({"t0": zero["t0"]}, advance_step=False)  # t0 alone: acc = residual
    assert red.memory.residuals["t1"].data_ptr() != red.memory.residuals["t0"].data_ptr()
    np.testing.assert_array_equal(red.memory.residuals["t1"].numpy(), saved["t1"].numpy())
    out = red.reduce({"t1": zero["t1"], "t2": zero["t2"]})
    k = gp.k_for(0.01, saved["t1"].numel())
    idx = np_topk(saved["t1"].numpy(), k)
    np.testing.assert_array_equal(out["t1"].reshape(-1).numpy()[idx], saved["t1"].numpy()[idx])


def test_load_state_dict_is_reimported():
    a, b = _red(method="gtopk", density=0.02), _red(method="gtopk", density=0.02)
    for s in range(3):
        a.reduce(_grads(s))
    b.reduce(_grads(50))  # b has buffers of its own, then loads a's state
    b.load_state_dict(a.state_dict())
    for s in range(3, 6):
        ua, ub = a.reduce(_grads(s)), b.reduce(_grads(s))
        for n in ua:
            assert torch.equal(ua[n], ub[n])
    for n in a.memory.residuals:
        assert torch.equal(a.memory.residuals[n], b.memory.residuals[n])


@pytest.mark.parametrize("mode", ["skip", "raise", "propagate"])
@pytest.mark.parametrize("method", ["gtopk", "threshold", "dense"])
def test_nonfinite_step_leaves_state_untouched(mode, method):
    red = _red(method=method, density=0.05, nonfinite=mode)
    red.reduce(_grads(0))
    red.reduce(_grads(1))
    saved = {n: r.clone() for n, r in red.memory.residuals.items()}
    bad = _grads(2)
    bad["t1"][3, 4] = float("nan")
    if mode == "raise":
        with pytest.raises(gp.NonFiniteGradientError if hasattr(gp, "NonFiniteGradientError")
                           else Exception):
            red.reduce(bad)
    else:
        out = red.reduce(bad)
        fill = 0.0 if mode == "skip" else float("inf")
        assert all(bool((t == fill).all()) for t in out.values())
    for n in saved:
        assert torch.equal(red.memory.residuals[n], saved[n])
    # and the next finite step equals that of a reducer that never saw the bad one
    ref = _red(method=method, density=0.05, nonfinite=mode)
    ref.reduce(_grads(0))
    ref.reduce(_grads(1))
    ref.step = red.step
    u1, u2 = red.reduce(_grads(3)), ref.reduce(_grads(3))
    for n in u1:
        assert torch.equal(u1[n], u2[n])


# --------------------------------------------------------- fused kernels
def _case(seed, sizes, dtype, ties=False):
    g = torch.Generator().manual_seed(seed)
    grads = [torch.randn(s, generator=g, dtype=torch.float64).to(dtype) for s in sizes]
    if ties:  # many equal magnitudes: the tie rule decides
        grads = [torch.round(x * 2) / 2 for x in grads]
    res = torch.randn(sum(sizes), generator=g, dtype=torch.float64).to(dtype)
    if ties:
        res = torch.round(res * 2) / 2
    return grads, res


@pytest.mark.parametrize("kern", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_compensate_matches_numpy(kern, dtype):
    grads, res = _case(1, [70001], dtype)
    g = grads[0]
    for r in (res, None):
        out = torch.empty_like(g)
        ok = kernels.compensate(out, g, r, kernels=kern)
        if r is None:
            want = g.double().numpy()
        elif dtype == torch.bfloat16:  # numpy has no bfloat16: one rounding of the exact float sum
            want = (g.float() + r.float()).to(dtype).float().numpy()
        else:
            npdt = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16}[dtype]
            want = (g.numpy().astype(npdt) + r.numpy().astype(npdt)).astype(np.float64)
        np.testing.assert_array_equal(out.double().numpy(), np.asarray(want, dtype=np.float64))
        assert ok is True
    for special in (float("nan"), float("inf"), -float("inf")):
        g2 = g.clone()
        g2[12345] = special
        out = torch.empty_like(g2)
        assert kernels.compensate(out, g2, res, kernels=kern) is False
        assert reference.compensate(torch.empty_like(g2), g2, res) is False


@pytest.mark.parametrize("kern", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("sizes", [[5], [100_000, 3, 5000, 300_000], [1 << 18]])
@pytest.mark.parametrize("density", [0.001, 0.02, 0.6])
@pytest.mark.parametrize("ties", [False, True])
def test_compensate_select_topk_matches_reference_and_numpy(kern, dtype, sizes, density, ties):
    grads, res = _case(7, sizes, dtype, ties)
    N = sum(sizes)
    for gran in ("layer", "global"):
        if gran == "layer":
            offs = torch.tensor(np.concatenate([[0], np.cumsum(sizes)]), dtype=torch.int64)
            ks = torch.tensor([gp.k_for(density, s) for s in sizes], dtype=torch.int64)
        else:
            offs = torch.tensor([0, N], dtype=torch.int64)
            ks = torch.tensor([gp.k_for(density, N)], dtype=torch.int64)
        for r in (res, None):
            a1, a2 = torch.empty(N, dtype=dtype), torch.empty(N, dtype=dtype)
            i1, v1, f1 = kernels.compensate_select_topk(a1, grads, r, offs, ks, kernels=kern)
            i2, v2, f2 = reference.compensate_select_topk(a2, grads, r, offs, ks)
            assert torch.equal(a1, a2) and torch.equal(i1, i2) and torch.equal(v1, v2)
            assert f1.tolist() == f2.tolist() == [True] * len(sizes)
            acc = np.concatenate([g.numpy() for g in grads])
            if r is not None:
                acc = acc + r.numpy()
            np.testing.assert_array_equal(a1.numpy(), acc)
            o = offs.tolist()
            want = np.concatenate([np_topk(acc[o[s]:o[s + 1]], int(ks[s])) + o[s] for s in range(len(ks))])
            np.testing.assert_array_equal(i1.numpy(), want)
            np.testing.assert_array_equal(v1.numpy(), acc[want])


@pytest.mark.parametrize("kern", BACKENDS)
def test_compensate_select_topk_flags_nonfinite_per_tensor(kern):
    grads, res = _case(3, [50_000, 20_000, 9], torch.float32)
    grads[1][777] = float("inf")
    grads[2][0] = float("nan")
    offs = torch.tensor([0, 50_000, 70_000, 70_009])
    ks = torch.tensor([50, 20, 1])
    i, v, f = kernels.compensate_select_topk(torch.empty(70_009), grads, res, offs, ks, kernels=kern)
    assert f.tolist() == [True, False, False]
    assert i.numel() == 71  # NaN ranks as +inf, the kernel stays total


@pytest.mark.parametrize("kern", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_subtract_at_and_scatter_reset_match_numpy(kern, dtype):
    g = torch.Generator().manual_seed(5)
    acc = torch.randn(10_000, generator=g).to(dtype)
    idx = torch.randperm(10_000, generator=g)[:300].sort().values.to(torch.int32)
    sent = torch.randn(300, generator=g).to(dtype)
    a1 = acc.clone()
    kernels.subtract_at_(a1, idx, sent, kernels=kern)
    want = acc.float().numpy().copy()
    want[idx.long().numpy()] = (acc[idx.long()] - sent).float().numpy()
    np.testing.assert_array_equal(a1.float().numpy(), want)
    # masked: only the entries that reached the result (numpy's own mask)
    mask = torch.rand(300, generator=g) < 0.5
    a2 = acc.clone()
    kernels.subtract_at_(a2, idx, sent, mask=mask, kernels=kern)
    want = acc.float().numpy().copy()
    m, ii = mask.numpy(), idx.long().numpy()
    want[ii[m]] = (acc.float().numpy()[ii[m]].astype(np.float64) - sent.float().numpy()[m]).astype(
        {torch.float32: np.float32, torch.float64: np.float64}.get(dtype, np.float64))
    if dtype in (torch.float16, torch.bfloat16):  # one rounding to the dtype, as torch rounds it
        want[ii[m]] = torch.tensor(want[ii[m]]).to(dtype).float().numpy()
    np.testing.assert_array_equal(a2.float().numpy(), want)
    out = torch.zeros(10_000, dtype=dtype)
    prev = torch.randperm(10_000, generator=g)[:200]
    out[prev] = 5
    nidx = torch.randperm(10_000, generator=g)[:250].to(torch.int32)
    vals = torch.randn(250, generator=g).to(dtype)
    for divisor in (1, 3):
        o1, o2 = out.clone(), out.clone()
        kernels.scatter_reset_(o1, prev, nidx, vals, divisor, kernels=kern)
        reference.scatter_reset_(o2, prev, nidx, vals, divisor)
        assert torch.equal(o1, o2)
        w = np.zeros(10_000, dtype=np.float64)
        w[nidx.long().numpy()] = (vals / divisor).double().numpy() if divisor != 1 else vals.double().numpy()
        np.testing.assert_array_equal(o1.double().numpy(), w)


@pytest.mark.parametrize("kern", BACKENDS)
@pytest.mark.parametrize("place", ["in", "out"])
@pytest.mark.parametrize("dtype,n", [(torch.float32, 100_003), (torch.float32, (1 << 20) + 3),
                                     (torch.float64, 100_003), (torch.float16, 100_003),
                                     (torch.bfloat16, 100_003)])
def test_div_count_matches_numpy(kern, dtype, n, place):
    """In place and from x into another tensor (the dense step divides its
    sum out of the accumulator into the update: above 4 MB the float32
    kernel streams those stores), against torch's division and numpy's
    count."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(n, generator=g).to(dtype)
    x[::5] = 0
    x[7] = 1e-45 if dtype == torch.float32 else 0  # a denormal that divides to zero
    x[8:12] = torch.tensor([float("nan"), float("inf"), -0.0, 3e-39 if dtype == torch.float32 else 1.0])
    # the float32 kernel multiplies by the reciprocal of a power of two (exact)
    # and divides otherwise: both must be the true division, bit for bit,
    # also on an unaligned view (the SIMD loop's scalar head and tail)
    for divisor in (1, 2, 3, 4, 7, 8):
        for lo in (0, 1):
            src = x[lo:].clone() if lo == 0 else x.clone()[lo:]
            if place == "in":
                y = src
                got = kernels.div_count_(y, divisor, kernels=kern)
            else:  # out aligned differently from x: the head loop follows out
                y = torch.full((n + 2,), 5.0, dtype=dtype)[1 - lo:1 - lo + n - lo]
                got = kernels.div_count_(src, divisor, out=y, kernels=kern)
                assert torch.equal(src.isnan(), x[lo:].isnan())  # x is only read
                assert torch.equal(src[~src.isnan()], x[lo:][~x[lo:].isnan()])
            want = (x[lo:] / divisor) if divisor != 1 else x[lo:]
            assert torch.equal(y.isnan(), want.isnan())
            ok = ~want.isnan()
            assert torch.equal(y[ok], want[ok]) and torch.equal(y[ok].signbit(), want[ok].signbit())
            assert got == int(np.count_nonzero(want.double().numpy()))


@pytest.mark.skipif("cpu" not in BACKENDS, reason="the CPU extension did not build")
def test_div_count_rejects_partial_overlap():
    x = torch.zeros(1000)
    with pytest.raises(RuntimeError, match="overlaps"):
        kernels.div_count_(x[:900], 2, out=x[100:], kernels="cpu")
    # the fused compensation writes acc while it still reads grads and residual
    from gtopk_plugin.kernels import cpu
    acc, offs, k = torch.zeros(1000), torch.tensor([0, 1000]), torch.tensor([10])
    with pytest.raises(RuntimeError, match="overlaps acc"):
        cpu.compensate_select_topk(acc, [acc[:1000]], None, offs, k)
    with pytest.raises(RuntimeError, match="overlaps acc"):
        cpu.compensate_select_topk(acc, [torch.zeros(1000)], acc, offs, k)


@pytest.mark.parametrize("kern", BACKENDS)
def test_div_count_by_one_copies_the_bits(kern):
    """op="sum" divides by 1: out of place that is a copy, bit for bit, even
    with denormals flushed (a multiplication by 1.0 would flush them)."""
    x = torch.full((1 << 20,), 1e-40)  # denormal float32, past the streamed-store size
    x[::3] = -2.5
    y = torch.empty_like(x)
    torch.set_flush_denormal(True)
    try:
        n = kernels.div_count_(x, 1, out=y, kernels=kern)
        want = int(torch.count_nonzero(x))  # torch's count in the same mode (denormals as zero where flushed)
    finally:
        torch.set_flush_denormal(False)
    assert torch.equal(y.view(torch.int32), x.view(torch.int32)), "not a bit-exact copy"
    assert n == want


@pytest.mark.parametrize("kern", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 100_003, (1 << 17) + 5])
def test_nonzero_indices_match_numpy(kern, dtype, n):
    """The hierarchical leader's sparse encoding of its update: the
    positions whose bits are not all zero, against numpy's flatnonzero on
    the integer bits -- -0.0 (the leader's bits must travel), NaN, inf and
    denormals count, and a thread that flushes denormals does not drop them
    (scalar tail, SIMD groups, several parallel blocks); past ``limit`` the
    kernel gives up (None)."""
    g = torch.Generator().manual_seed(n)
    x = torch.zeros(n, dtype=dtype)
    if n:
        hit = torch.randperm(n, generator=g)[:max(1, n // 50)]
        x[hit] = torch.randn(hit.numel(), generator=g).to(dtype)
        special = [float("nan"), float("inf"), -0.0, torch.finfo(dtype).tiny / 4, -1.0]
        x[-len(special):] = torch.tensor(special[-n:], dtype=torch.float64).to(dtype)
    ints = {2: np.int16, 4: np.int32, 8: np.int64}[x.element_size()]
    bits = x.numpy().view(ints) if dtype != torch.bfloat16 else x.view(torch.int16).numpy()
    want = np.flatnonzero(bits)
    torch.set_flush_denormal(True)
    try:
        got = kernels.nonzero_indices(x, kernels=kern)
        at_limit = kernels.nonzero_indices(x, limit=len(want), kernels=kern)
        over = kernels.nonzero_indices(x, limit=len(want) - 1, kernels=kern) if len(want) else None
    finally:
        torch.set_flush_denormal(False)
    assert got.dtype == torch.int64
    np.testing.assert_array_equal(got.numpy(), want)
    np.testing.assert_array_equal(at_limit.numpy(), want)
    assert over is None
