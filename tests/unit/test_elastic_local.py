"""Elastic scheduler, single process (no process group): settings
validation, the optimizer-equivalence contract, checkpoints, the
BYTEPS_ELASTIC_* readers, the BytePS module without BytePS, and the
policies' formulas.  Distributed behaviour: tests/distributed/test_elastic_distributed.py
(gloo) and tests/horovod/test_elastic_horovod.py (horovodrun)."""
import importlib.util
import math
import subprocess
import sys

import pytest
import torch

import gtopk_plugin as gp
from gtopk_plugin import config
from gtopk_plugin.elastic import ElasticConfig, ElasticScheduler, NormPolicy, VariancePolicy

from elastic_helpers import OPTIMIZERS, loss_of, make_model, params_of


def one(model, opt, **kw):
    return ElasticScheduler(model, opt, transport=gp.SingleProcessTransport(), **kw)


def same(a, b):
    return set(a) == set(b) and all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize("kw, words", [
    (dict(beta=1.5), "beta"), (dict(beta=-0.1), "beta"), (dict(beta=float("nan")), "beta"),
    (dict(beta="half"), "beta"), (dict(max_staleness=-1), "max_staleness"),
    (dict(max_staleness=1.5), "max_staleness"), (dict(max_staleness=True), "max_staleness"),
    (dict(policy="fast"), "policy"), (dict(policy=None), "policy"),
    (dict(variance_factor=-1.0), "variance_factor"), (dict(variance_factor=float("inf")), "variance_factor"),
])
def test_bad_settings_raise_clear_value_error_without_process_group(kw, words):
    m = make_model()
    with pytest.raises(ValueError, match=words):
        ElasticScheduler(m, torch.optim.SGD(m.parameters(), lr=0.1), **kw)  # default back end, no group
    with pytest.raises(ValueError, match=words):
        one(m, torch.optim.SGD(m.parameters(), lr=0.1), **kw)


def test_bad_objects_raise_value_error():
    m = make_model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="torch.nn.Module"):
        one(object(), opt)
    with pytest.raises(ValueError, match="torch.optim.Optimizer"):
        one(m, "sgd")
    with pytest.raises(ValueError, match="LBFGS"):
        one(m, torch.optim.LBFGS(m.parameters()))
    with pytest.raises(ValueError, match="not parameters of the model"):
        one(make_model(), opt)
    with pytest.raises(ValueError, match="reducer"):
        one(m, opt, reducer="gtopk")
    with pytest.raises(ValueError, match="transport"):
        ElasticScheduler(m, opt, transport="gloo")
    with pytest.raises(ValueError, match="either transport= or a reducer"):
        ElasticScheduler(m, opt, transport=gp.SingleProcessTransport(),
                         reducer=gp.GradientReducer("gtopk", 0.1, transport=gp.SingleProcessTransport()))
    with pytest.raises(RuntimeError, match="not initialised"):
        ElasticScheduler(m, opt)  # valid settings, no process group: say so


def test_policy_names_match_config():
    from gtopk_plugin.elastic import policies
    assert policies.names() == config.ELASTIC_POLICIES
    assert ElasticConfig().policy == "norm" and ElasticConfig().max_staleness == 1


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("kw", [dict(policy="barrier"), dict(policy="norm", beta=1.0),
                                dict(policy="variance", max_staleness=0)])
def test_same_bits_as_the_optimizers_own_step(opt_name, kw):
    """Per-layer application through the user's optimizer == optimizer.step(),
    with two parameter groups and an LR scheduler changing lr every 2 steps."""
    def groups(m):
        return [{"params": [p for n, p in m.named_parameters() if n.endswith("weight")]},
                {"params": [p for n, p in m.named_parameters() if n.endswith("bias")], "lr": 0.003}]

    ref_m = make_model()
    ref_opt = OPTIMIZERS[opt_name](groups(ref_m))
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, 2, 0.5)
    m = make_model()
    opt = OPTIMIZERS[opt_name](groups(m))
    lrs = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
    es = one(m, opt, **kw)
    for s in range(6):
        ref_opt.zero_grad()
        loss_of(ref_m, s, 0).backward()
        ref_opt.step()
        ref_sched.step()
        es.zero_grad()
        loss_of(m, s, 0).backward()
        es.step()
        lrs.step()
    es.finish()
    assert same(params_of(m), params_of(ref_m))
    assert es.stats.updates_applied == 6 * 4 and es.stats.barrier_breaks == 0


def test_parameter_read_outside_its_module_and_tied_and_frozen_parameters():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(1)
            self.emb = torch.nn.Linear(12, 8)
            self.mid = torch.nn.Linear(8, 8)
            self.head = torch.nn.Linear(8, 12, bias=False)
            self.head.weight = self.emb.weight.__class__(self.emb.weight.detach().t().clone())
            self.tied = torch.nn.Linear(8, 8)
            self.tied.weight = self.mid.weight          # the same Parameter in two modules
            self.frozen = torch.nn.Linear(8, 8)
            self.frozen.requires_grad_(False)
            self.scale = torch.nn.Linear(1, 1)          # read outside its forward

        def forward(self, x):
            h = torch.relu(self.emb(x))
            h = self.tied(torch.relu(self.mid(h))) * self.scale.weight[0, 0]
            return self.head(self.frozen(h))

    def run(make_opt, elastic):
        m = Net()
        opt = make_opt(m.parameters())
        es = one(m, opt, policy="barrier") if elastic else None
        for s in range(5):
            x = torch.randn(4, 12, generator=torch.Generator().manual_seed(s))
            (es or opt).zero_grad()
            m(x).square().mean().backward()
            (es or opt).step()
        if es:
            es.finish()
            assert es.stats.updates_applied == 5 * len(es.units)
        return params_of(m), es

    for mk in (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), lambda p: torch.optim.Adam(p, lr=0.01)):
        ref, _ = run(mk, False)
        got, es = run(mk, True)
        assert same(got, ref)
    names = [u.name for u in es.units]
    assert "frozen" not in names and "scale" in names
    tied = es.units[names.index("tied")]
    assert tied.param_names == ["tied.bias"]  # its weight is mid's: waited for through mid's unit
    assert es._module_units[es.model.tied] == [names.index("mid"), names.index("tied")]
    assert [u for u in es._functional] == [names.index("scale")]


def test_misuse_raises():
    m = make_model()
    es = one(m, torch.optim.SGD(m.parameters(), lr=0.1))
    loss_of(m, 0, 0).backward()
    with pytest.raises(RuntimeError, match="call step\\(\\) first"):
        es.finish()
    with pytest.raises(RuntimeError, match="second gradient"):
        loss_of(m, 1, 0).backward()
    with pytest.raises(ValueError, match="closure"):
        es.step(closure=lambda: 0)


def test_state_dict_round_trip_with_a_sparse_reducer_is_bit_exact():
    def build():
        m = make_model()
        opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
        red = gp.GradientReducer("gtopk", 0.2, transport=gp.SingleProcessTransport())
        return m, opt, ElasticScheduler(m, opt, reducer=red, policy="barrier")

    def train(m, es, steps):
        for s in steps:
            es.zero_grad()
            loss_of(m, s, 0).backward()
            es.step()

    m, opt, es = build()
    train(m, es, range(3))
    sd = es.state_dict()  # drains first
    ckpt = {"model": {k: v.clone() for k, v in m.state_dict().items()},
            "opt": __import__("copy").deepcopy(opt.state_dict()), "sched": sd}
    assert sd["step"] == 3 and sd["reducer"]["step"] == 3 and sd["reducer"]["residuals"]
    train(m, es, range(3, 6))
    es.finish()
    m2, opt2, es2 = build()
    m2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    es2.load_state_dict(ckpt["sched"])
    train(m2, es2, range(3, 6))
    es2.finish()
    assert same(params_of(m2), params_of(m))
    with pytest.raises(ValueError, match="policy"):
        one(m2, opt2, policy="norm").load_state_dict(sd)
    es.close()
    es2.close()


def test_policies_formulas():
    p = NormPolicy(0.5)
    assert not p.requires_all and p.broken(0.25, 0.75, 1.0) and not p.broken(0.2499, 0.7501, 1.0)
    assert NormPolicy(1.0).requires_all and NormPolicy(0.0).broken(0.0, 1.0, 1.0)
    v = VariancePolicy(2.0)
    assert not v.broken(1.0, 0.0, 1.0)  # no estimate yet: the barrier holds
    v.observe(3.0)
    v.observe(1.0)
    assert v.estimate == pytest.approx(0.9 * 3.0 + 0.1 * 1.0) and v.bound() == pytest.approx(2 * v.estimate)
    assert v.broken(0.0, v.bound(), 1.0) and not v.broken(0.0, v.bound() * 1.001, 1.0)
    v.observe(float("nan"))
    assert math.isfinite(v.estimate)


def _simulate_variance(pol, P, op, steps=300, d=2000, sigma=0.05, seed=0):
    """P simulated workers, g_i = mu + sigma * xi_i (numpy, i.i.d. normal
    noise: the per-worker variance is sigma^2 = d * sigma^2 exactly), split
    into two layers; the reduction is the dense mean (op="average") or sum
    (op="sum"), computed in numpy.  Feeds the policy like the scheduler does
    (observe(Σ_layers deviation)) on worker 0 and returns sigma^2."""
    import numpy as np

    rng = np.random.default_rng(seed)
    mu = rng.standard_normal(d)
    cut = d // 3
    for _ in range(steps):
        g = mu + sigma * rng.standard_normal((P, d))
        red = g.sum(0) if op == "sum" else g.mean(0)
        local = [torch.from_numpy(g[0, :cut].astype(np.float32)), torch.from_numpy(g[0, cut:].astype(np.float32))]
        reduced = [torch.from_numpy(red[:cut].astype(np.float32)), torch.from_numpy(red[cut:].astype(np.float32))]
        pol.observe(math.fsum(pol.deviation([a], [b]) for a, b in zip(local, reduced)))
    return d * sigma ** 2


@pytest.mark.parametrize("P", [2, 3, 5])
@pytest.mark.parametrize("op", ["average", "sum"])
def test_variance_policy_estimates_the_per_worker_variance_unbiased(P, op):
    """The bound policy's estimate σ̂² of the paper's σ² (E‖g_i − ∇f‖²):
    P/(P−1)·‖g_i − ḡ‖², ḡ = the reduced update, divided by P under op="sum".
    With d = 2000 coordinates one sample has relative sd √(2/d) = 3.2%, the
    EMA (m = 0.1) 0.7%: the 4% tolerance is 5 sd.  The uncorrected estimate
    (unbound policy) is off by (P−1)/P — 50%, 33%, 20% low here — or, under
    op="sum", by orders of magnitude: the test tells them apart."""
    pol = VariancePolicy(2.0).bind(P, op=op, exact=True)
    sigma2 = _simulate_variance(pol, P, op)
    assert pol.estimate == pytest.approx(sigma2, rel=0.04)
    assert pol.bound() == pytest.approx(2.0 * pol.estimate) and pol.samples == 300
    legacy = VariancePolicy(2.0)  # unbound: Σ‖g_i − reduced‖² as before
    _simulate_variance(legacy, P, op)
    if op == "average":
        assert legacy.estimate == pytest.approx(sigma2 * (P - 1) / P, rel=0.04)
    else:
        assert legacy.estimate > 10 * sigma2
    assert abs(legacy.estimate / sigma2 - 1) > 0.15


def test_variance_policy_takes_no_sample_from_a_compressed_update_or_one_worker():
    """A compressing reducer's update is not the workers' mean: binding says
    so with a RuntimeWarning, no sample is taken and the barrier holds; one
    worker has no spread to measure.  Bad bindings raise ValueError."""
    with pytest.warns(RuntimeWarning, match="compressing reducer"):
        pol = VariancePolicy(1.0).bind(3, op="sum", exact=False)
    assert math.isnan(pol.deviation([torch.ones(3)], [torch.zeros(3)]))
    pol.observe(pol.deviation([torch.ones(3)], [torch.zeros(3)]))
    pol.observe(5.0)  # whatever the core computed: no sample without a mean
    assert pol.estimate is None and pol.bound() is None and not pol.broken(0.0, 0.0, 1.0)
    one = VariancePolicy(1.0).bind(1)
    one.observe(one.deviation([torch.ones(3)], [torch.zeros(3)]))
    assert one.estimate is None
    for kw in (dict(world_size=0), dict(world_size=2, op="max"), dict(world_size=2.0)):
        with pytest.raises(ValueError):
            VariancePolicy(1.0).bind(**kw)


def test_make_policy_binds_the_variance_policy_to_its_back_end():
    from gtopk_plugin.elastic.policies import make_policy

    class Dense:
        size = 4

    class Reducer:
        size = 2
        reducer = gp.GradientReducer(method="dense", op="sum", transport=gp.SingleProcessTransport())

    cfg = ElasticConfig(policy="variance", variance_factor=1.0)
    p = make_policy(cfg, Dense())
    assert (p.world_size, p.op, p.exact) == (4, "average", True)
    p = make_policy(cfg, Reducer())
    assert (p.world_size, p.op, p.exact) == (2, "sum", True)
    Reducer.reducer = gp.GradientReducer(method="gtopk", transport=gp.SingleProcessTransport())
    with pytest.warns(RuntimeWarning):
        p = make_policy(cfg, Reducer())
    assert (p.world_size, p.op, p.exact) == (2, "average", False)
    Reducer.reducer = gp.GradientReducer(method="dense", momentum_correction=0.9, transport=gp.SingleProcessTransport())
    with pytest.warns(RuntimeWarning):  # the update is a velocity, not the mean gradient
        assert not make_policy(cfg, Reducer()).exact
    assert make_policy(cfg).world_size is None  # unbound without a back end


@pytest.mark.parametrize("cap_mb", [0.0, 0.1])
def test_the_variance_policy_sees_the_reducer_through_the_bucketed_back_end(cap_mb):
    from gtopk_plugin.elastic import ElasticScheduler

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for method, exact in (("gtopk", False), ("dense", True)):
        red = gp.GradientReducer(method=method, density=0.25, transport=gp.SingleProcessTransport())
        sched = ElasticScheduler(model, opt, reducer=red, policy="variance", bucket_cap_mb=cap_mb)
        try:
            assert (sched.policy.exact, sched.policy.op) == (exact, "average"), (method, cap_mb)
        finally:
            sched.close()


def test_byteps_env_readers(monkeypatch):
    for k in ("BYTEPS_ELASTIC_POLICY", "BYTEPS_ELASTIC_BETA", "BYTEPS_ELASTIC_MAX_STALENESS"):
        monkeypatch.delenv(k, raising=False)
    assert config.env_byteps_elastic() == {}
    monkeypatch.setenv("BYTEPS_ELASTIC_POLICY", " Variance ")
    monkeypatch.setenv("BYTEPS_ELASTIC_BETA", "0.25")
    monkeypatch.setenv("BYTEPS_ELASTIC_MAX_STALENESS", "3")
    assert config.env_byteps_elastic() == {"policy": "variance", "beta": 0.25, "max_staleness": 3}
    import gtopk_plugin.byteps as gbps
    assert gbps.elastic_settings(beta=0.75) == {"policy": "variance", "beta": 0.75, "max_staleness": 3}
    for var, val in (("BYTEPS_ELASTIC_POLICY", "fast"), ("BYTEPS_ELASTIC_BETA", "1.5"),
                     ("BYTEPS_ELASTIC_BETA", "half"), ("BYTEPS_ELASTIC_MAX_STALENESS", "-1"),
                     ("BYTEPS_ELASTIC_MAX_STALENESS", "1.5")):
        monkeypatch.setenv(var, val)
        with pytest.raises(ValueError, match=var):
            config.env_byteps_elastic()
        monkeypatch.delenv(var)


@pytest.mark.skipif(importlib.util.find_spec("byteps") is not None, reason="BytePS is installed here")
def test_byteps_module_imports_without_byteps_and_says_how_to_install():
    import gtopk_plugin.byteps as gbps
    m = make_model()
    with pytest.raises(ImportError, match="pip install byteps"):
        gbps.ElasticScheduler(m, torch.optim.SGD(m.parameters(), lr=0.1))


def test_import_gtopk_plugin_needs_only_torch():
    code = ("import sys, gtopk_plugin, gtopk_plugin.elastic, gtopk_plugin.byteps; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('horovod', 'byteps', 'tensorflow', 'cupy')]; "
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("div", [1.0, 3.0])
def test_squared_distance_matches_numpy_in_float64_across_chunk_boundaries(div):
    import numpy as np

    from gtopk_plugin.elastic.policies import DISTANCE_CHUNK, squared_distance

    g = torch.Generator().manual_seed(7)
    sizes = [(1,), (DISTANCE_CHUNK + 5,), (2, DISTANCE_CHUNK)]
    local = [torch.randn(s, generator=g) for s in sizes]
    reduced = [torch.randn(s, generator=g) * 1e-3 + a for s, a in zip(sizes, local)]
    want = sum(float(np.sum((a.numpy().astype(np.float64) - b.numpy().astype(np.float64) / div) ** 2))
               for a, b in zip(local, reduced))
    before = [t.clone() for t in local + reduced]
    got = squared_distance(local, reduced, div)
    assert got == pytest.approx(want, rel=1e-12)
    # the operands are not modified (the chunks are float64 copies)
    assert all(torch.equal(x, y) for x, y in zip(before, local + reduced))
