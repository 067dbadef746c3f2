"""Worker functions of tests/distributed/test_elastic_distributed.py, run in real
torch.distributed gloo process groups (tests/dist_utils.run_workers)."""
import os
import sys
import types

import torch
import torch.distributed as dist

import gtopk_plugin as gp
from gtopk_plugin.elastic import ElasticScheduler, ThreadedReduction
from gtopk_plugin.elastic.torch_backend import TorchDenseReduction

from elastic_helpers import (OPTIMIZERS, Gate, Recorder, RecordingSGD, make_model, params_of,
                             train_elastic, train_sync)

STEPS = 5


def _allreduce_avg(P):
    def f(flat):
        dist.all_reduce(flat)
        return flat / P
    return f


def equivalence(rank, P):
    """Synchronous reference vs the scheduler under several policies, for
    each optimizer; returns parameters and statistics."""
    out = {}
    configs = {"barrier": dict(policy="barrier"), "norm_beta1": dict(policy="norm", beta=1.0),
               "staleness0": dict(policy="norm", beta=0.3, max_staleness=0),
               "norm_beta0.5": dict(policy="norm", beta=0.5), "norm_beta0_s2": dict(policy="norm", beta=0.0,
                                                                                   max_staleness=2),
               "variance": dict(policy="variance", variance_factor=1.0)}
    for oname, mk in OPTIMIZERS.items():
        m = make_model()
        out[(oname, "sync")] = train_sync(m, mk(m.parameters()), STEPS, rank, _allreduce_avg(P))
        for cname, kw in configs.items():
            m = make_model()
            sched = ElasticScheduler(m, mk(m.parameters()), **kw)
            out[(oname, cname)] = train_elastic(sched, m, STEPS, rank)
            out[(oname, cname, "stats")] = sched.stats.as_dict()
            sched.close()
    return out


def gated(rank, P):
    """Deterministic arrival order (Gate) on the real gloo allreduce: break
    records, staleness, what was applied, what was reduced."""
    out = {}
    scenarios = {
        # unit 1 (the 10x8 layer) is delayed: released last in every step
        "norm_delay1": dict(order=[3, 2, 0, 1], kw=dict(policy="norm", beta=0.5)),
        "norm_delay0_s2": dict(order=[1, 3, 2, 0], kw=dict(policy="norm", beta=0.6, max_staleness=2)),
        "norm_beta0.9": dict(order=[0, 1, 2, 3], kw=dict(policy="norm", beta=0.9)),
        "variance": dict(order=[3, 2, 1, 0], kw=dict(policy="variance", variance_factor=2.0)),
    }
    for name, sc in scenarios.items():
        m = make_model()
        names = {id(p): n for n, p in m.named_parameters()}
        opt = RecordingSGD(m.parameters(), names, lr=0.1)
        gate = Gate(TorchDenseReduction(timeout=60), sc["order"])
        sched = ElasticScheduler(m, opt, transport=gate, **sc["kw"])
        params = train_elastic(sched, m, 6, rank)
        out[name] = {"params": params, "stats": sched.stats.as_dict(), "local": gate.local,
                     "reduced": gate.reduced, "released": gate.released, "forced": gate.forced,
                     "applied": opt.applied, "units": [u.param_names for u in sched.units],
                     "max_staleness": sched.config.max_staleness, "beta": sched.config.beta,
                     "variance_factor": sched.config.variance_factor}
        sched.close()
    return out


def sparse(rank, P, methods):
    """The scheduler composed with sparse GradientReducers (op=sum): inputs,
    outputs, residuals and final parameters for the mass-conservation and
    cross-rank checks."""
    out = {}
    for method, kw in methods.items():
        m = make_model()
        red = gp.GradientReducer(method=method, op="sum",
                                 transport=gp.TorchDistributedTransport(dist.new_group(), timeout=60), **kw)
        rec = Recorder(ThreadedReduction(red))
        sched = ElasticScheduler(m, torch.optim.SGD(m.parameters(), lr=0.02, momentum=0.9), transport=rec,
                                 policy="norm", beta=0.5)
        params = train_elastic(sched, m, STEPS, rank)
        out[method] = {"params": params, "local": rec.local, "reduced": rec.reduced,
                       "state": sched.state_dict(), "stats": sched.stats.as_dict()}
        sched.close()
    # the default path: reducer= on the default group (moved to its own group)
    m = make_model()
    sched = ElasticScheduler(m, torch.optim.SGD(m.parameters(), lr=0.02),
                             reducer=gp.GradientReducer(method="gtopk", density=0.3))
    out["reducer_kwarg"] = {"params": train_elastic(sched, m, STEPS, rank),
                            "group_is_default": sched.backend.transport.group is None}
    sched.close()
    return out


def _try(fn):
    try:
        fn()
        return ("no error", "")
    except Exception as e:  # noqa: BLE001
        return (type(e).__name__, str(e))


def bad_inputs(rank, P):
    out = {}

    def build(**kw):
        m = make_model()
        ElasticScheduler(m, torch.optim.SGD(m.parameters(), lr=0.1), **kw).close()

    out["beta_all"] = _try(lambda: build(beta=2.0))
    out["beta_one"] = _try(lambda: build(beta=-0.1 if rank == 1 else 0.5))
    out["policy_one"] = _try(lambda: build(policy="fast" if rank == 0 else "norm"))
    out["staleness_all"] = _try(lambda: build(max_staleness=-1))
    out["variance_factor_one"] = _try(lambda: build(policy="variance",
                                                    variance_factor=float("nan") if rank == P - 1 else 1.0))

    def mismatch():
        m = make_model(widths=(12, 10, 8, 6, 3) if rank != 1 else (12, 9, 8, 6, 3))
        ElasticScheduler(m, torch.optim.SGD(m.parameters(), lr=0.1)).close()

    out["layout"] = _try(mismatch)
    # still usable afterwards
    m = make_model()
    sched = ElasticScheduler(m, torch.optim.SGD(m.parameters(), lr=0.1), policy="barrier")
    out["after"] = train_elastic(sched, m, 2, rank)
    sched.close()
    return out


# ---------------------------------------------------------------------------
# BytePS adapter against a FAKE byteps.torch (adapter unit test only: BytePS
# itself needs a CUDA GPU and did not run).  The fake forwards to gloo.
# ---------------------------------------------------------------------------
def _fake_byteps():
    group = dist.new_group()
    declared = []

    class _H:
        def __init__(self, work, buf, average):
            self.work, self.buf, self.average = work, buf, average

    handles = {}
    counter = [0]

    def push_pull_async(tensor, average=True, name=None, version=0, priority=0):
        assert name is not None, "the adapter always names its push-pulls"
        buf = tensor.clone()
        counter[0] += 1
        h = counter[0]
        handles[h] = _H(dist.all_reduce(buf, group=group, async_op=True), buf, average)
        return h

    def poll(h):
        return handles[h].work.is_completed()

    def synchronize(h):
        x = handles.pop(h)
        x.work.wait()
        return x.buf / dist.get_world_size() if x.average else x.buf

    mod = types.ModuleType("byteps.torch")
    mod.push_pull_async, mod.poll, mod.synchronize = push_pull_async, poll, synchronize
    mod.declare = declared.append
    mod.rank, mod.size = dist.get_rank, dist.get_world_size
    mod.declared = declared
    return mod


def byteps_adapter(rank, P):
    fake = _fake_byteps()
    pkg = types.ModuleType("byteps")
    pkg.torch = fake
    sys.modules["byteps"], sys.modules["byteps.torch"] = pkg, fake
    import gtopk_plugin.byteps as gbps

    out = {}
    os.environ["BYTEPS_ELASTIC_POLICY"] = "barrier"
    os.environ["BYTEPS_ELASTIC_MAX_STALENESS"] = "2"
    try:
        m = make_model()
        sched = gbps.ElasticScheduler(m, torch.optim.Adam(m.parameters(), lr=0.01))  # imports the fake
        out["config"] = (sched.config.policy, sched.config.beta, sched.config.max_staleness)
        out["barrier"] = train_elastic(sched, m, STEPS, rank)
        sched.close()
        m = make_model()
        out["sync"] = train_sync(m, torch.optim.Adam(m.parameters(), lr=0.01), STEPS, rank, _allreduce_avg(P))
        m = make_model()
        sched = gbps.ElasticScheduler(m, torch.optim.SGD(m.parameters(), lr=0.1), policy="norm", beta=0.5)
        out["config_kw"] = (sched.config.policy, sched.config.beta, sched.config.max_staleness)
        out["norm"] = train_elastic(sched, m, STEPS, rank)
        sched.close()
        out["declared"] = list(fake.declared)
        def bad_beta():
            mm = make_model()
            gbps.ElasticScheduler(mm, torch.optim.SGD(mm.parameters(), lr=0.1), beta=3.0 if rank == 0 else 0.5)

        out["bad_beta_one"] = _try(bad_beta)
        os.environ["BYTEPS_ELASTIC_BETA"] = "1.5"
        out["bad_env"] = _try(lambda: gbps.ElasticScheduler(m, torch.optim.SGD(m.parameters(), lr=0.1)))
    finally:
        for k in ("BYTEPS_ELASTIC_POLICY", "BYTEPS_ELASTIC_MAX_STALENESS", "BYTEPS_ELASTIC_BETA"):
            os.environ.pop(k, None)
    return out


def bucketed(rank, P):
    """bucket_cap_mb: per-layer (no cap) vs a cap that fuses two layers vs
    one bucket per step, with the default dense back end and a gTop-k
    reducer; parameters, how many launches reached the wrapped back end,
    and the synchronous reference."""
    out = {}
    m0 = make_model()
    out["sync"] = train_sync(m0, torch.optim.SGD(m0.parameters(), lr=0.05, momentum=0.9), STEPS, rank,
                             _allreduce_avg(P))
    sizes = [sum(p.numel() * 4 for p in u.parameters(recurse=False)) for u in make_model()
             if isinstance(u, torch.nn.Linear)]
    two = (sizes[-1] + sizes[-2]) / 2 ** 20  # the last two layers launch first: one bucket
    for reducer in ("dense", "gtopk"):
        for name, cap, policy in (("off", 0.0, "barrier"), ("two", two, "barrier"), ("all", 100.0, "barrier"),
                                  ("all_norm", 100.0, "norm"), ("two_norm", two, "norm")):
            m = make_model()
            red = None if reducer == "dense" else gp.GradientReducer(method="gtopk", density=0.3)
            sched = ElasticScheduler(m, torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
                                     reducer=red, policy=policy, beta=0.5, bucket_cap_mb=cap)
            inner = getattr(sched.backend, "inner", sched.backend)
            launches = []
            orig = inner.launch

            def counting(unit, step, names, tensors, last, _orig=orig, _l=launches):
                _l.append((step, tuple(names)))
                return _orig(unit, step, names, tensors, last)

            inner.launch = counting
            out[(reducer, name)] = {"params": train_elastic(sched, m, STEPS, rank), "launches": launches,
                                    "kind": sched.backend.kind, "stats": sched.stats.as_dict()}
            sched.close()
    try:
        m = make_model()
        ElasticScheduler(m, torch.optim.SGD(m.parameters(), lr=0.1), bucket_cap_mb=-1 if rank == 1 else 0)
        out["bad"] = None
    except Exception as e:  # noqa: BLE001 - the error's type and text are the result
        out["bad"] = (type(e).__name__, str(e))
    return out


def several(rank, P, jobs):
    """Run ``jobs`` -- ``(key, worker function, extra args)`` each -- one
    after the other on this rank's group (one spawn for all of a world
    size's checks); ``{key: result}``.  A job that raises ends the spawn."""
    return {key: fn(rank, P, *args) for key, fn, args in jobs}
