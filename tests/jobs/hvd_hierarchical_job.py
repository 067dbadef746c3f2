"""Worker script of tests/horovod/test_horovod_hierarchical.py,
run under ``horovodrun -np 4 -H localhost:4 --gloo``: the PyTorch Horovod
``DistributedOptimizer(..., hierarchical=True)``.  All four ranks are on
one host, so the nodes are faked with ``local_size=2`` (2 nodes of 2); the
default topology (Horovod's cross_rank) makes one node of 4.

    horovodrun -np 4 -H localhost:4 --gloo python tests/jobs/hvd_hierarchical_job.py OUTDIR

Every rank saves ``OUTDIR/rank{r}.pt``: per configuration and step its
local gradients, the reduced ones and the step's traffic, then its state.
"""
import os
import sys
import traceback

import torch

import horovod.torch as hvd

torch.set_num_threads(1)
hvd.init()

from gtopk_plugin.frameworks.horovod.waiting import barrier  # noqa: E402
from gtopk_plugin.horovod import Compression, DistributedOptimizer  # noqa: E402

R, P = hvd.rank(), hvd.size()
STEPS = 2


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 10), torch.nn.ReLU(), torch.nn.Linear(10, 3))


def run(comp, **kw):
    model = make_model()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model.named_parameters(),
                               compression=comp, op=hvd.Sum, **{"hierarchical": True, **kw})
    raws, outs, traffic = [], [], []
    for s in range(STEPS):
        opt.zero_grad()
        g = torch.Generator().manual_seed(100 * s + R)
        x, y = torch.randn(8, 12, generator=g), torch.randint(0, 3, (8,), generator=g)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        raws.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        opt.step()
        outs.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        traffic.append(dict(opt.last_step_traffic))
    st = opt.last_stats
    return {"raw": raws, "out": outs, "traffic": traffic, "state": opt.state_dict().get("gtopk_plugin"),
            "nodes": st.nodes, "k": st.k, "fabric": st.intra_fabric,
            "fabric_mode": opt.reducer._fabric_mode}


def main():
    res = {"rank": R, "size": P}
    for key, comp, kw in (("gtopk_2x2", Compression.gtopk(0.1), dict(local_size=2)),
                          ("gtopk_2x2_engine", Compression.gtopk(0.1), dict(local_size=2, intra_fabric="engine")),
                          ("gtopk_default", Compression.gtopk(0.1), {}),
                          ("bad_local_size", Compression.gtopk(0.1), dict(local_size=3)),
                          ("fabric_but_flat", Compression.gtopk(0.1), dict(hierarchical=False, intra_fabric="engine"))):
        try:
            res[key] = ("ok", run(comp, **kw))
        except BaseException as e:  # noqa: BLE001 - recorded for the parent
            res[key] = ("error", (type(e).__name__, str(e), traceback.format_exc()))
    torch.save(res, os.path.join(sys.argv[1], f"rank{R}.pt"))
    barrier()  # Horovod's own barrier spins: see waiting.barrier
    hvd.shutdown()


if __name__ == "__main__":
    main()
