"""Worker script of tests/horovod/test_elastic_horovod.py, run under
``horovodrun -np N -H localhost:N --gloo``:

    python tests/jobs/hvd_elastic_scheduler_job.py OUTDIR

Every rank runs every check and saves ``OUTDIR/rank{r}.pt``; one job per N
because each horovodrun start costs seconds.  A check that raises is
recorded as an error and the job goes on.

Tensor fusion is off (HOROVOD_FUSION_THRESHOLD=0, set before hvd.init):
with fusion, how tensors are batched — and so, at P ≥ 3, the order in which
a ring allreduce sums an element — depends on timing, and "bit for bit"
would compare two fusion decisions instead of two schedulers.
"""
import os
import sys
import traceback

os.environ["HOROVOD_FUSION_THRESHOLD"] = "0"

import torch  # noqa: E402

import horovod.torch as hvd  # noqa: E402

torch.set_num_threads(1)
hvd.init()

import gtopk_plugin as gp  # noqa: E402
from gtopk_plugin.elastic import ElasticScheduler, ThreadedReduction  # noqa: E402
from gtopk_plugin.frameworks.horovod.waiting import barrier  # noqa: E402
from gtopk_plugin.horovod import HorovodTransport  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support"))
from elastic_helpers import OPTIMIZERS, Recorder, make_model, train_elastic, train_sync  # noqa: E402

R, P = hvd.rank(), hvd.size()
STEPS = 4


def check(res, key, fn):
    try:
        res[key] = ("ok", fn())
    except Exception as e:  # noqa: BLE001
        res[key] = ("error", (type(e).__name__, str(e), traceback.format_exc()))


def sync_reference(opt_name):
    counter = [0]

    def reduce_flat(flat):
        counter[0] += 1
        return hvd.allreduce(flat, op=hvd.Average, name=f"ref.{counter[0] % 8}")

    m = make_model()
    return train_sync(m, OPTIMIZERS[opt_name](m.parameters()), STEPS, R, reduce_flat)


def elastic(opt_name, **kw):
    m = make_model()
    sched = ElasticScheduler(m, OPTIMIZERS[opt_name](m.parameters()), transport=HorovodTransport(), **kw)
    assert sched.backend.kind == "horovod", sched.backend.kind
    params = train_elastic(sched, m, STEPS, R)
    stats = sched.stats.as_dict()
    sched.close()
    return params, stats


def sparse(method, **kw):
    m = make_model()
    red = gp.GradientReducer(method=method, op="sum", transport=HorovodTransport(prefix=f"sp.{method}"), **kw)
    rec = Recorder(ThreadedReduction(red))
    sched = ElasticScheduler(m, torch.optim.SGD(m.parameters(), lr=0.02, momentum=0.9), transport=rec,
                             policy="norm", beta=0.5)
    params = train_elastic(sched, m, STEPS, R)
    out = {"params": params, "local": rec.local, "reduced": rec.reduced, "state": sched.state_dict()}
    sched.close()
    return out


def bad(**kw):
    m = make_model()
    ElasticScheduler(m, torch.optim.SGD(m.parameters(), lr=0.1), transport=HorovodTransport(), **kw).close()
    return "no error"


def main():
    outdir = sys.argv[1]
    res = {"rank": R, "size": P}
    for opt in ("sgd_momentum", "adam"):
        check(res, f"{opt}/sync", lambda: sync_reference(opt))
        check(res, f"{opt}/barrier", lambda: elastic(opt, policy="barrier"))
        check(res, f"{opt}/beta1", lambda: elastic(opt, policy="norm", beta=1.0))
        check(res, f"{opt}/beta0.5", lambda: elastic(opt, policy="norm", beta=0.5))
        if opt == "sgd_momentum":  # one variance run is enough here (the gloo tests cover all three)
            check(res, f"{opt}/variance", lambda: elastic(opt, policy="variance", max_staleness=2))
    check(res, "sparse/gtopk", lambda: sparse("gtopk", density=0.3))
    check(res, "bad/beta_one", lambda: bad(beta=2.0 if R == 1 else 0.5))
    check(res, "bad/after", lambda: elastic("sgd_momentum", policy="barrier")[0])
    torch.save(res, os.path.join(outdir, f"rank{R}.pt"))
    barrier()  # Horovod's own barrier spins: see waiting.barrier
    hvd.shutdown()


if __name__ == "__main__":
    main()
