"""GradientReducer checkpoints without a process group: what a state
records, every kind of bad state refused with a clear error and the
reducer left exactly as it was (compared tensor by tensor before and after,
read from the reducer's internals, and by one more step against a twin
that never saw the bad state), version-1 states, and the in-memory
redistribution to another world size against an independent float32 sum.

Transports here are fixed (rank, world size) stand-ins: loading never
communicates, so a state can be checked against any rank of any job.
"""
import copy

import pytest
import torch

import gtopk_plugin as gp
from gtopk_plugin import checkpoint

SHAPES = {"w": (6, 5), "m": (16, 12), "v": (40,), "b": (4,)}  # "b": below dense_below (the dense part)
NAN = float("nan")


class Fixed(gp.SingleProcessTransport):
    """Rank ``rank`` of ``size`` for identity checks (loading only)."""

    def __init__(self, rank=0, size=1):
        super().__init__()
        self._r, self._p = rank, size

    @property
    def rank(self):
        return self._r

    @property
    def size(self):
        return self._p


def _grads(step, scale=1.0):
    g = torch.Generator().manual_seed(17 + step)
    return {n: torch.randn(s, generator=g) * scale for n, s in SHAPES.items()}


def _make(transport=None, **kw):
    kw = {**dict(method="gtopk", density=0.1, momentum_correction=0.9, dense_below=10, seed=3), **kw}
    return gp.GradientReducer(transport=transport or gp.SingleProcessTransport(), **kw)


def _trained(steps=3, scale=1.0, **kw):
    red = _make(**kw)
    for s in range(steps):
        red.reduce(_grads(s, scale))
    return red


def _snapshot(red):
    """The reducer's state read from its parts (not through state_dict)."""
    small = red._small
    return dict(step=red.step, loss_scale=red.loss_scale,
                res={n: r.clone() for n, r in red.memory.residuals.items()},
                vel={n: u.clone() for n, u in red.momentum.velocities.items()},
                comp=copy.deepcopy(red.compressor.state_dict()),
                small=None if small is None else (
                    {n: u.clone() for n, u in small.dense.momentum.velocities.items()}, small.dense.loss_scale))


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and set(a) == set(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _stamped(sd, rank, size):
    sd = copy.deepcopy(sd)
    sd["rank"], sd["world_size"] = rank, size
    return sd


# ---------------------------------------------------------- what is recorded
def test_state_records_rank_world_size_method_settings_and_layout():
    red = _trained(method="powersgd", rank=2, density=0.1, dense_below=10)
    sd = red.state_dict()
    assert sd["version"] == 2 and (sd["rank"], sd["world_size"]) == (0, 1)
    assert sd["method"] == "powersgd" and sd["seed"] == 3 and sd["step"] == 3
    assert sd["settings"]["hyper"]["rank"] == 2 and sd["settings"]["aggregation"] == red.aggregation
    assert sd["settings"]["dense_below"] == 10 and sd["settings"]["error_feedback"] is True
    for part in ("residuals", "velocities"):
        assert set(sd["layout"][part]) == set(sd[part]) and sd[part]
        for n, t in sd[part].items():
            assert sd["layout"][part][n] == {"shape": tuple(t.shape), "dtype": str(t.dtype)}
    assert set(sd["layout"]["small"]) == {"b"} == set(sd["small"]["velocities"])


def test_state_before_the_process_group_exists_has_no_rank_and_loads_anywhere():
    # a DDP hook state pickled before init_process_group: nothing per rank in it
    red = gp.GradientReducer("gtopk", 0.1, transport=gp.TorchDistributedTransport())
    sd = red.state_dict()
    assert (sd["rank"], sd["world_size"]) == (None, None) and sd["residuals"] == {}
    other = _make(Fixed(2, 4), momentum_correction=None, dense_below=0, seed=0)
    other.load_state_dict(sd)
    assert other.step == 0


def test_round_trip_is_bit_exact_and_records_its_origin():
    a = _trained(steps=3)
    sd = copy.deepcopy(a.state_dict())
    b = _make()
    b.load_state_dict(sd)
    assert _same(_snapshot(a), _snapshot(b))
    ua, ub = a.reduce(_grads(9)), b.reduce(_grads(9))
    assert _same(ua, ub) and _same(_snapshot(a), _snapshot(b))


# ------------------------------------------------------ bad states refused
def _set(path, value):
    def f(sd):
        d = sd
        for k in path[:-1]:
            d = d[k]
        d[path[-1]] = value
        return sd
    return f


def _poke(path, index, value):
    def f(sd):
        d = sd
        for k in path:
            d = d[k]
        d.view(-1)[index] = value
        return sd
    return f


def _delete(key):
    def f(sd):
        del sd[key]
        return sd
    return f


def _as_version1(sd):
    return {k: sd[k] for k in ("method", "seed", "step", "residuals", "velocities", "loss_scale",
                               "compressor", "small")} | {"version": 1}


def _reshape_residual(sd):
    sd["residuals"]["w"] = sd["residuals"]["w"][:-1].clone()
    return sd


BAD = {
    "nan residual": (_poke(["residuals", "w"], 3, NAN), r"residuals\['w'\] holds 1 non-finite"),
    "inf residual": (_poke(["residuals", "v"], 0, float("inf")), r"residuals\['v'\] holds 1 non-finite"),
    "nan velocity": (_poke(["velocities", "v"], 5, NAN), r"velocities\['v'\] holds 1 non-finite"),
    "nan small velocity": (_poke(["small", "velocities", "b"], 1, NAN),
                           r"small velocities\['b'\] holds 1 non-finite"),
    "negative step": (_set(["step"], -5), "step must be a non-negative int; got -5"),
    "float step": (_set(["step"], 2.5), "step must be a non-negative int"),
    "bool step": (_set(["step"], True), "step must be a non-negative int"),
    "string step": (_set(["step"], "3"), "step must be a non-negative int"),
    "missing residuals": (_delete("residuals"), r"missing keys \['residuals'\]"),
    "missing step": (_delete("step"), r"missing keys \['step'\]"),
    "residuals not a dict": (_set(["residuals"], [1.0]), "residuals must be a dict"),
    "residual not a tensor": (_set(["residuals", "w"], [0.0] * 30), r"residuals\['w'\] is a list"),
    "integer residual": (lambda sd: _set(["residuals", "w"], sd["residuals"]["w"].long())(sd),
                         r"residuals\['w'\] has dtype torch.int64"),
    "meta residual": (lambda sd: _set(["residuals", "w"], sd["residuals"]["w"].to("meta"))(sd),
                      r"residuals\['w'\] is a meta tensor"),
    "residual of another shape": (_reshape_residual, r"residuals\['w'\] is \(29,\).*layout records"),
    "foreign residual name": (_set(["residuals", "foreign"], torch.zeros(3)),
                              r"residuals\['foreign'\].*layout records None"),
    "unknown key": (_set(["extra"], 1), r"unknown keys \['extra'\]"),
    "version 1": (_as_version1, "version-1 state.*upgrade_state"),
    "version 3": (_set(["version"], 3), "unsupported state version 3"),
    "not a dict": (lambda sd: [sd], "is a dict; got list"),
    "other method": (_set(["method"], "topk"), "saved by method 'topk', this reducer runs 'gtopk'"),
    "other seed": (_set(["seed"], 4), "saved with seed=4, this reducer has seed=3"),
    "other dense_below": (_set(["settings", "dense_below"], 20), "dense_below=20"),
    "compressor state refused": (_set(["compressor"], {"junk": 1}), "compressor state does not load"),
    "nan loss scale": (_set(["loss_scale"], NAN), "loss_scale must be None or a positive finite"),
    "negative loss scale": (_set(["loss_scale"], -2.0), "loss_scale must be None or a positive finite"),
    "small part malformed": (_set(["small"], {"velocities": {}}), "small .*exactly 'velocities' and"),
    "rank beyond world size": (lambda sd: _stamped(sd, 4, 4), r"rank must be an int in \[0, world_size\)"),
    "rank without world size": (_set(["world_size"], None), "both given or both None"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_state_is_refused_and_changes_nothing(case):
    mutate, pattern = BAD[case]
    target = _trained(steps=2, scale=0.5)  # a state unlike the one being loaded
    twin = _trained(steps=2, scale=0.5)
    bad = mutate(copy.deepcopy(_trained(steps=4).state_dict()))
    before = _snapshot(target)
    with pytest.raises(ValueError, match=pattern):
        target.load_state_dict(bad)
    assert _same(_snapshot(target), before), "a refused state changed the reducer"
    # and it still works exactly as its twin that never saw the bad state
    assert _same(target.reduce(_grads(7)), twin.reduce(_grads(7)))
    assert _same(_snapshot(target), _snapshot(twin))


def test_error_is_a_checkpoint_error_naming_the_tensor():
    bad = copy.deepcopy(_trained().state_dict())
    bad["velocities"]["w"].view(-1)[0] = NAN
    with pytest.raises(gp.CheckpointError, match=r"velocities\['w'\]"):
        _make().load_state_dict(bad)


def _loaded(rank, size, **kw):
    red = _make(Fixed(rank, size), **kw)
    red.load_state_dict(_stamped(_trained(steps=2, scale=0.5, **kw).state_dict(), rank, size))
    return red


def test_state_of_another_rank_is_refused():
    # every rank loading rank 0's file: only rank 0 may
    sd0 = _stamped(_trained(steps=4).state_dict(), 0, 4)
    _make(Fixed(0, 4)).load_state_dict(copy.deepcopy(sd0))
    for r in (1, 2, 3):
        red = _loaded(r, 4)
        before = _snapshot(red)
        with pytest.raises(ValueError, match=f"saved by rank 0, this is rank {r} \\(of 4\\)"):
            red.load_state_dict(copy.deepcopy(sd0))
        assert _same(_snapshot(red), before)


def test_state_of_another_world_size_is_refused_with_the_redistribution_path():
    sd3 = _stamped(_trained(steps=4).state_dict(), 3, 4)
    for r, P in ((0, 3), (2, 3), (3, 5), (0, 1)):
        red = _loaded(r, P)
        before = _snapshot(red)
        with pytest.raises(ValueError, match=f"rank 3 of a 4-rank job, this job has {P} ranks.*load_job"):
            red.load_state_dict(copy.deepcopy(sd3))
        assert _same(_snapshot(red), before)


def test_state_before_the_transport_knows_its_rank_is_refused():
    red = _make(gp.TorchDistributedTransport())  # torch.distributed not initialised
    with pytest.raises(ValueError, match="cannot tell its rank yet"):
        red.load_state_dict(copy.deepcopy(_trained().state_dict()))
    assert red.step == 0 and red.memory.residuals == {}


def test_named_parameters_refuse_foreign_names_and_sizes():
    sd = copy.deepcopy(_trained().state_dict())
    params = {n: torch.zeros(s) for n, s in SHAPES.items()}
    red = _trained(steps=1, scale=0.5)
    before = _snapshot(red)
    with pytest.raises(ValueError, match=r"residual for \['w'\], which named_parameters does not name"):
        red.load_state_dict(copy.deepcopy(sd), named_parameters={n: params[n] for n in ("m", "v", "b")})
    with pytest.raises(ValueError, match=r"residual of 'w' has 30 entries, the parameter has 31"):
        red.load_state_dict(copy.deepcopy(sd), named_parameters=dict(params, w=torch.zeros(31)))
    assert _same(_snapshot(red), before)
    red.load_state_dict(sd, named_parameters=list(params.items()))  # model.named_parameters() form
    assert red.step == 3


def test_other_hyper_parameters_or_error_feedback_are_refused():
    sd = copy.deepcopy(_trained(method="powersgd", rank=2).state_dict())
    with pytest.raises(ValueError, match=r"hyper=.*'rank': 2.*this reducer has hyper=.*'rank': 1"):
        _make(method="powersgd", rank=1).load_state_dict(copy.deepcopy(sd))
    off = _make(error_feedback=False)
    with pytest.raises(ValueError, match="error_feedback"):
        off.load_state_dict(copy.deepcopy(_trained().state_dict()))
    assert off.memory.residuals == {}


def test_nan_in_compressor_state_is_refused():
    sd = copy.deepcopy(_trained(method="powersgd", rank=2).state_dict())
    q = next(iter(sd["compressor"]["q"].values()))
    q.view(-1)[0] = NAN
    red = _trained(method="powersgd", rank=2, steps=1, scale=0.5)
    before = _snapshot(red)
    with pytest.raises(ValueError, match=r"compressor\['q'\].*non-finite"):
        red.load_state_dict(sd)
    assert _same(_snapshot(red), before)


# ------------------------------------------------------------- version 1
def test_version_1_state_loads_through_upgrade_state_only():
    src = _trained(steps=3)
    v1 = _as_version1(copy.deepcopy(src.state_dict()))
    red = _make(Fixed(1, 2))
    with pytest.raises(ValueError, match="version-1"):
        red.load_state_dict(copy.deepcopy(v1))
    red.load_state_dict(checkpoint.upgrade_state(v1, red, rank=1, world_size=2))
    assert red.step == 3
    assert _same({n: r for n, r in red.memory.residuals.items()}, src.state_dict()["residuals"])
    with pytest.raises(ValueError, match="saved by rank 0, this is rank 1"):
        red.load_state_dict(checkpoint.upgrade_state(v1, red, rank=0, world_size=2))


# ------------------------------------------------- redistribution in memory
def _job(P, **kw):
    """States of a P-rank job: P reducers trained on different gradients."""
    out = []
    for i in range(P):
        red = _make(**kw)
        for s in range(3):
            red.reduce(_grads(10 * i + s, 1.0 + i))
        out.append(_stamped(red.state_dict(), i, P))
    return out


def _sum64(states, part, name):
    return sum(s[part][name].double() for s in states if name in s[part])


@pytest.mark.parametrize("P_new", [1, 2, 3, 4, 6])
def test_redistribute_gives_rank_j_the_sum_of_old_ranks_j_mod_p(P_new):
    old = _job(4)
    new = checkpoint.redistribute(copy.deepcopy(old[::-1]), P_new)  # any order in
    assert [s["rank"] for s in new] == list(range(P_new))
    for j, sd in enumerate(new):
        src = [old[i] for i in range(4) if i % P_new == j]
        assert sd["world_size"] == P_new and sd["step"] == old[0]["step"]
        for part in ("residuals", "velocities"):
            names = sorted(set().union(*[set(s[part]) for s in src])) if src else []
            assert sorted(sd[part]) == names
            for n in names:
                # the independent oracle: float32 additions in increasing old rank
                want = src[0][part][n].clone()
                for s in src[1:]:
                    want = want + s[part][n]
                assert torch.equal(sd[part][n], want), (j, part, n)
        _make(Fixed(j, P_new)).load_state_dict(sd)  # a valid state for new rank j
    # Σ_ranks residual: exact where each new rank takes one old state; else
    # each float32 addition a + b rounds once, by at most 2^-24·|a + b| (the
    # standard model; a + b is exact in float64), so the tolerance is the sum
    # of those over the additions made
    for part in ("residuals", "velocities"):
        for n in old[0][part]:
            want, got = _sum64(old, part, n), _sum64(new, part, n)
            if P_new >= 4:
                assert torch.equal(got, want)
                continue
            bound = torch.zeros_like(want)
            for j in range(P_new):
                src = [old[i][part][n] for i in range(4) if i % P_new == j]
                acc = src[0].clone()
                for t in src[1:]:
                    bound += (acc.double() + t.double()).abs() * 2.0 ** -24
                    acc = acc + t
            assert bool(((got - want).abs() <= bound).all()), (part, n, float((got - want).abs().max()))


def test_redistribute_refuses_what_is_not_one_job():
    old = _job(3)
    with pytest.raises(ValueError, match="not ranks 0..2"):
        checkpoint.redistribute([old[0], old[1], old[1]], 2)
    with pytest.raises(ValueError, match="not ranks 0..1"):
        checkpoint.redistribute(old[:2], 2)  # rank 2 missing: a 3-rank job given as 2
    later = copy.deepcopy(old)
    later[1]["step"] = 7
    with pytest.raises(ValueError, match="disagree on the step"):
        checkpoint.redistribute(later, 2)
    bad = copy.deepcopy(old)
    bad[2]["residuals"]["w"].view(-1)[0] = NAN
    with pytest.raises(ValueError, match=r"residuals\['w'\] holds 1 non-finite"):
        checkpoint.redistribute(bad, 2)


def test_redistribute_keeps_shared_compressor_state_and_refuses_per_rank_state():
    # PowerSGD's warm-start factors are the same on every rank: kept
    old = _job(2, method="powersgd", rank=1)
    q = old[0]["compressor"]["q"]
    for s in old[1:]:
        s["compressor"] = copy.deepcopy(old[0]["compressor"])
    for sd in checkpoint.redistribute(old, 3):
        assert _same(sd["compressor"]["q"], q)
    # per-rank compressor state (onebit's server residuals) cannot move
    for s, e in zip(old, (1.0, 2.0)):
        s["compressor"]["q"] = {k: v + e for k, v in q.items()}
    with pytest.raises(ValueError, match="compressor state.*cannot move to another world size"):
        checkpoint.redistribute(old, 3)
