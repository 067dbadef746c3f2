"""``dense_below`` (gtopk_plugin/small_tensors.py) in one process:
validation, the split (small tensors dense and exact, the rest as without
them), global granularity (small tensors leave the global segment), bytes
and stats, checkpoints with momentum, and the DDP hook's keyword."""
import copy
import inspect

import pytest
import torch

import gtopk_plugin as gp
from gtopk_plugin.config import ReducerConfig
from gtopk_plugin.pipeline.small_tensors import split

SHAPES = {"w": (30, 20), "b": (20,), "g": (7,)}


def _red(**kw):
    kw.setdefault("transport", gp.SingleProcessTransport())
    return gp.GradientReducer(**kw)


def _grads(step):
    g = torch.Generator().manual_seed(step)
    return {n: torch.randn(*s, generator=g) for n, s in SHAPES.items()}


@pytest.mark.parametrize("bad", [-1, 1.5, "10", True, None])
def test_validation(bad):
    with pytest.raises(ValueError, match="dense_below"):
        _red(method="topk", dense_below=bad)
    with pytest.raises(ValueError, match="dense_below"):
        ReducerConfig(method="topk", dense_below=bad)


def test_defaults_and_split():
    assert ReducerConfig().dense_below == 0 and _red()._small is None
    assert ReducerConfig(dense_below=torch.tensor(5).item()).dense_below == 5
    g = _grads(0)
    assert split(g, 0) is None and split(g, 7) is None and split({"a": 1}, 10) is None
    small, rest = split(g, 21)
    assert sorted(small) == ["b", "g"] and sorted(rest) == ["w"]


@pytest.mark.parametrize("method,gran", [("gtopk", "layer"), ("topk", "global"), ("qsgd", "layer"),
                                         ("onebit", "global"), ("dense", "layer")])
def test_small_dense_rest_unchanged(method, gran):
    kw = dict(method=method, density=0.05, granularity=gran, seed=2)
    red, ref = _red(dense_below=21, **kw), _red(**kw)
    for t in range(4):
        g = _grads(t)
        u = red.reduce(g)
        u_ref = ref.reduce({"w": g["w"]})
        assert torch.equal(u["b"], g["b"]) and torch.equal(u["g"], g["g"])  # P=1: the gradient itself
        assert torch.equal(u["w"], u_ref["w"])
        st, st_ref = red.last_stats, ref.last_stats
        assert st.numel == 627 and st.parts["method"].numel == 600 and st.parts["dense"].numel == 27
        assert st.k == st_ref.k + 27  # global: k over "w" only
        assert st.bytes_sent == st_ref.bytes_sent  # P=1: nothing on the wire
        assert red.step == t + 1
    assert sorted(red.state_dict()["residuals"]) == sorted(ref.state_dict()["residuals"])


def test_all_small_and_none_small():
    red = _red(method="gtopk", density=0.05, dense_below=10_000)
    g = _grads(0)
    u = red.reduce(g)
    assert all(torch.equal(u[n], g[n]) for n in g) and red.step == 1
    assert red.last_stats.method == "gtopk" and red.last_stats.parts["method"] is None
    red = _red(method="gtopk", density=0.05, dense_below=5)
    red.reduce(g)
    assert not hasattr(red.last_stats, "parts")


def test_momentum_checkpoint_and_ddp_keyword():
    def make():
        return _red(method="topk", density=0.1, dense_below=21, momentum_correction=0.9)
    red = make()
    for t in range(3):
        red.reduce(_grads(t))
    sd = copy.deepcopy(red.state_dict())
    assert "small" in sd and sorted(sd["small"]["velocities"]) == ["b", "g"]
    a = [red.reduce(_grads(t)) for t in range(3, 5)]
    again = make()
    again.load_state_dict(sd)
    b = [again.reduce(_grads(t)) for t in range(3, 5)]
    for x, y in zip(a, b):
        assert all(torch.equal(x[n], y[n]) for n in x)
    from gtopk_plugin.frameworks.reducer_keywords import REDUCER_KWARGS  # what SparseState passes through
    assert "dense_below" in inspect.signature(gp.GradientReducer).parameters
    assert "dense_below" in REDUCER_KWARGS


def test_nonfinite_small_raises_before_anything_applied():
    red = _red(method="topk", density=0.1, dense_below=21)
    g = _grads(0)
    g["g"][0] = float("nan")
    with pytest.raises(gp.NonFiniteGradientError, match="g"):
        red.reduce(g)
    assert red.step == 0 and red.state_dict()["residuals"] == {}
