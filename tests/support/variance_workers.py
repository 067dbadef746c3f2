"""Worker of the gated variance-policy tests in tests/distributed/test_elastic_distributed.py
(real gloo process groups, tests/dist_utils.run_workers): the scheduler on a
REAL reduction behind ``elastic_helpers.Gate`` (deterministic arrival order),
with the variance policy bound to its back end as
``policies.bind_to_backend`` does it."""
import warnings

import torch.distributed as dist

import gtopk_plugin as gp
from gtopk_plugin.elastic import ElasticScheduler, ThreadedReduction
from gtopk_plugin.elastic.policies import bind_to_backend
from gtopk_plugin.elastic.torch_backend import TorchDenseReduction

from elastic_helpers import Gate, RecordingSGD, make_model, train_elastic

STEPS = 6


def _run(rank, inner, factor, bind_to):
    m = make_model()
    names = {id(p): n for n, p in m.named_parameters()}
    opt = RecordingSGD(m.parameters(), names, lr=0.1)
    gate = Gate(inner, [3, 2, 1, 0])
    sched = ElasticScheduler(m, opt, transport=gate, policy="variance", variance_factor=factor)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        bind_to_backend(sched.policy, bind_to(gate))
    train_elastic(sched, m, STEPS, rank)
    out = {"stats": sched.stats.as_dict(), "local": gate.local, "reduced": gate.reduced,
           "released": gate.released, "applied": opt.applied, "units": [u.param_names for u in sched.units],
           "max_staleness": sched.config.max_staleness, "variance_factor": factor,
           "bound": (sched.policy.world_size, sched.policy.op, sched.policy.exact),
           "estimate": sched.policy.estimate, "warnings": [str(w.message) for w in caught]}
    sched.close()
    return out


def gated_variance(rank, P):
    return {
        # dense allreduce, averaged: the reduced update is the workers' mean
        "dense": _run(rank, TorchDenseReduction(timeout=60), 2.0, lambda g: g),
        # gTop-k (op=sum): compressed, so no variance sample: the barrier holds
        "gtopk": _run(rank, ThreadedReduction(gp.GradientReducer(
            method="gtopk", density=0.3, op="sum",
            transport=gp.TorchDistributedTransport(dist.new_group(), timeout=60))), 2.0, lambda g: g.inner),
    }
