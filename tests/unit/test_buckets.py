"""gtopk_plugin.pipeline.param_buckets: parameter naming, groups and the fixed bucket layout
shared by the Horovod optimizer and the DDP hook."""
import pytest
import torch

from gtopk_plugin.pipeline.param_buckets import (bucket_names, bucket_scope, make_buckets, name_parameters, named_pairs,
                                  resolve_groups)


def _params(*sizes):
    return [torch.nn.Parameter(torch.zeros(n)) for n in sizes]


def test_named_pairs_validates():
    a, b = _params(1, 2)
    assert named_pairs(iter([("a", a), ("b", b)])) == [("a", a), ("b", b)]
    assert named_pairs([("a", a), ("a2", a)]) == [("a", a), ("a2", a)]  # tied: allowed
    for bad, phrase in ((5, "iterable"), ([("a", 1)], "(str, torch.Tensor)"), ([a], "pairs"),
                        ([("a", a), ("a", b)], "twice")):
        with pytest.raises(ValueError, match="named_parameters") as e:
            named_pairs(bad)
        assert phrase in str(e.value)


def test_name_parameters_horovod_rules():
    a, b, c = _params(1, 2, 3)
    groups = [{"params": [a, b]}, {"params": [c]}]
    assert name_parameters(None, groups) == {a: "allreduce.noname.0.0", b: "allreduce.noname.0.1",
                                             c: "allreduce.noname.1.0"}
    assert name_parameters([("x", a), ("y", b), ("z", c)], groups) == {a: "x", b: "y", c: "z"}
    with pytest.raises(ValueError, match=r"not named in it: param_groups\[1\]\['params'\]\[0\] \(shape \(3,\)\)"):
        name_parameters([("x", a), ("y", b)], groups)


def test_resolve_groups():
    ps = _params(1, 1, 1, 1, 1)
    assert resolve_groups(None, ps) == [] and resolve_groups(0, ps) == []
    assert [len(g) for g in resolve_groups(2, ps)] == [3, 2]
    assert [len(g) for g in resolve_groups(9, ps)] == [1] * 5
    other = torch.zeros(1)
    assert resolve_groups([[ps[0], other], [ps[3]]], ps) == [(ps[0],), (ps[3],)]
    for bad in (-1, True, "x"):
        with pytest.raises(ValueError, match="groups should be"):
            resolve_groups(bad, ps)
    with pytest.raises(ValueError, match="only appear once"):
        resolve_groups([[ps[0]], [ps[0]]], ps)
    with pytest.raises(ValueError, match="torch.Tensor"):
        resolve_groups([[1]], ps)


def test_make_buckets_reverse_order_cut_at_threshold():
    ps = _params(10, 10, 10, 30)  # 40, 40, 40, 120 bytes
    names = {p: f"p{i}" for i, p in enumerate(ps)}
    assert bucket_names(make_buckets(ps, [], 80), names) == [["p3"], ["p2", "p1"], ["p0"]]
    assert bucket_names(make_buckets(ps, [], 1 << 20), names) == [["p3", "p2", "p1", "p0"]]
    # explicit groups first, the rest as before
    assert bucket_names(make_buckets(ps, [(ps[0], ps[3])], 80), names) == [["p0", "p3"], ["p2", "p1"]]
    # every parameter in exactly one bucket, whatever the threshold
    for t in (1, 40, 41, 200):
        flat = [p for b in make_buckets(ps, [], t) for p in b]
        assert sorted(map(id, flat)) == sorted(map(id, ps))


def test_bucket_scope_is_stable():
    assert bucket_scope(0) == "b0" and bucket_scope(12) == "b12"
