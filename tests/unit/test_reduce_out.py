"""GradientReducer.reduce(..., out=) (the update written straight
into the caller's tensors, e.g. DDP's bucket): against the numpy oracle of
test_reducer_alloc and against the same reducer without ``out`` (bit for
bit, every method, mixed dtypes, small tensors, skipped steps), ``out``
aliasing the gradients themselves, and bad ``out`` refused with a clear
error.  Single process, CPU."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import gtopk_plugin as gp
from gtopk_plugin import kernels
from gtopk_plugin.collectives.transport import SingleProcessTransport
from test_reducer_alloc import np_reduce_p1

BACKENDS = ["reference"] + (["cpu"] if kernels.backend("cpu") == "cpu" else [])


def _red(**kw):
    return gp.GradientReducer(transport=SingleProcessTransport(), **kw)


def _grads(seed, dtypes=(torch.float32,) * 3, shapes=((3000,), (40, 50), (7,))):
    g = torch.Generator().manual_seed(seed)
    return {f"t{i}": torch.randn(s, generator=g).to(d) for i, (s, d) in enumerate(zip(shapes, dtypes))}


@pytest.mark.parametrize("kern", BACKENDS)
def test_out_aliasing_the_gradients_matches_numpy_oracle(kern):
    """The gradients themselves receive the updates (what the DDP hook does
    with its bucket views): 10 steps of top-k with error feedback against
    numpy, the returned dict holding the very tensors passed as out."""
    seq = [_grads(300 + s) for s in range(10)]
    want, res = np_reduce_p1(seq, 0.03)
    red = _red(method="topk", density=0.03, kernels=kern)
    for s, grads in enumerate(seq):
        got = red.reduce(grads, out=grads)
        assert all(got[n] is grads[n] for n in grads)
        for n in grads:
            np.testing.assert_array_equal(grads[n].numpy().reshape(-1), want[s][n], err_msg=f"{s} {n}")
    for n in res:
        np.testing.assert_array_equal(red.memory.residuals[n].numpy(), res[n])


@pytest.mark.parametrize("kw", [
    dict(method="gtopk", density=0.02), dict(method="topk", density=0.02, op="sum"),
    dict(method="dense"), dict(method="randomk", density=0.05, seed=3),
    dict(method="threshold", density=0.02), dict(method="rtopk", density=0.02),
    dict(method="onebit"), dict(method="gtopk", density=0.02, dense_below=100),
    dict(method="gtopk", density=0.02, momentum_correction=0.9),
])
@pytest.mark.parametrize("mixed", [False, True])
def test_out_equals_the_returned_updates_bit_for_bit(kw, mixed):
    """Two reducers fed the same gradients, one writing into out (filled
    with garbage first), one returning its own buffers: every update equal
    bit for bit, residuals too, over 6 steps; mixed dtypes included."""
    dtypes = (torch.float32, torch.float16, torch.bfloat16) if mixed else (torch.float32,) * 3
    a, b = _red(**kw), _red(**kw)
    for s in range(6):
        grads = _grads(500 + s, dtypes)
        out = {n: torch.full_like(t, 1234.5) for n, t in grads.items()}
        got = a.reduce(grads, out=out)
        want = b.reduce({n: t.clone() for n, t in grads.items()})
        assert set(got) == set(want)
        for n in want:
            assert got[n] is out[n]
            assert torch.equal(got[n].view(torch.int16 if got[n].element_size() == 2 else torch.int32),
                               want[n].view(torch.int16 if want[n].element_size() == 2 else torch.int32)), (s, n)
        assert a.last_stats.result_nnz == b.last_stats.result_nnz
    for n, r in b.memory.residuals.items():
        assert torch.equal(a.memory.residuals[n], r)


@pytest.mark.parametrize("mode, fill", [("skip", 0.0), ("propagate", float("inf"))])
def test_out_on_a_skipped_step(mode, fill):
    red = _red(method="gtopk", density=0.1, nonfinite=mode, dense_below=100)
    grads = _grads(7)
    grads["t1"][3, 4] = float("nan")
    out = {n: torch.zeros_like(t) for n, t in grads.items()}
    got = red.reduce(grads, out=out)
    assert red.last_stats.skipped
    for n in grads:
        assert got[n] is out[n] and bool((out[n] == fill).all()), n


@pytest.mark.parametrize("bad, match", [
    ("list", "out must be a dict"),
    ("missing", "no tensor for gradient 't1'"),
    ("shape", r"out\['t1'\] must be a contiguous tensor of the gradient's shape"),
    ("dtype", r"out\['t0'\] must be"),
    ("strided", "not contiguous"),
])
def test_bad_out_is_refused(bad, match):
    grads = _grads(1)
    out = {n: torch.empty_like(t) for n, t in grads.items()}
    if bad == "list":
        out = list(out.values())
    elif bad == "missing":
        del out["t1"]
    elif bad == "shape":
        out["t1"] = torch.empty(50, 40)
    elif bad == "dtype":
        out["t0"] = out["t0"].double()
    elif bad == "strided":
        out["t1"] = torch.empty(50, 40).t()
    red = _red(method="gtopk", density=0.1)
    with pytest.raises(ValueError, match=match):
        red.reduce(grads, out=out)
    assert red.step == 0 and not red.memory.residuals  # nothing applied


@pytest.mark.parametrize("kw", [
    dict(method="gtopk", density=0.02, nonfinite="skip"),
    dict(method="topk", density=0.05, warmup=[1.0, 0.5]),   # a dense step first, then sparse
    dict(method="randomk", density=0.05, seed=2, nonfinite="skip"),
])
def test_out_reuse_over_steps_matches_fresh_results(kw):
    """The same out tensors every step with out_reuse=True (what the DDP
    hook does with its per-bucket result buffers): every update equals the
    reducer without out, bit for bit, over 10 steps whose selections move,
    through a skipped step (NaN) and a dense warm-up step."""
    a, b = _red(**kw), _red(**kw)
    out = {n: torch.full_like(t, 99.0) for n, t in _grads(0).items()}
    for s in range(10):
        grads = _grads(700 + s)
        if s == 4 and kw.get("nonfinite") == "skip":
            grads["t2"][1] = float("nan")
        got = a.reduce(grads, out=out, out_reuse=True)
        want = b.reduce({n: t.clone() for n, t in grads.items()})
        for n in want:
            assert got[n] is out[n] and torch.equal(got[n], want[n]), (s, n)
    # new tensors mid-way: zero-filled, not trusted
    out2 = {n: torch.full_like(t, -5.0) for n, t in out.items()}
    grads = _grads(900)
    got = a.reduce(grads, out=out2, out_reuse=True)
    want = b.reduce({n: t.clone() for n, t in grads.items()})
    assert all(torch.equal(got[n], want[n]) for n in want)


def test_out_reuse_clears_only_the_previous_entries():
    """O(k): with out_reuse the reducer clears only the entries its previous
    result set -- an entry written behind its back survives (the promise
    broken on purpose), while without out_reuse the tensors are zero-filled."""
    for reuse in (True, False):
        red, ref = _red(method="gtopk", density=0.01), _red(method="gtopk", density=0.01)
        out = {n: torch.zeros_like(t) for n, t in _grads(3).items()}
        red.reduce(_grads(3), out=out, out_reuse=reuse)
        want1 = ref.reduce(_grads(3))
        want2 = ref.reduce(_grads(4))
        # a position neither step selects
        free = int(torch.nonzero((want1["t0"] == 0) & (want2["t0"] == 0))[0])
        out["t0"][free] = 42.0
        red.reduce(_grads(4), out=out, out_reuse=reuse)
        assert float(out["t0"][free]) == (42.0 if reuse else 0.0), reuse
        out["t0"][free] = 0.0
        assert all(torch.equal(out[n], want2[n]) for n in want2)
