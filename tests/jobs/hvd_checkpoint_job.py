"""Worker script of tests/horovod/test_checkpoint_horovod.py, run under
``horovodrun -np 3 --gloo``:

    python tests/jobs/hvd_checkpoint_job.py OUTDIR

1. A sparse DistributedOptimizer in ``hvd.elastic.TorchState`` trains and
   commits.  The state handler is then told that the three live states were
   made on ranks 0, 3 and 1 of a 4-rank world (what a resize from 4 to 3
   workers that kept those three looks like, with Horovod handing out new
   ranks 0, 1, 2) and ``state.sync()`` runs: new rank j must hold the sum of
   the states whose old rank is ≡ j (mod 3), moved by Horovod ops; the job
   trains on.
2. ``state.restore()`` after uncommitted steps brings back this process's
   own commit.
3. ``gp.save_job`` / ``gp.load_job`` on the optimizer's reducer (the
   Horovod transport): a round trip, and a refused corrupt checkpoint.

Every rank saves ``OUTDIR/rank{r}.pt``.
"""
import os
import sys
import traceback

import torch

import horovod.torch as hvd

torch.set_num_threads(1)
hvd.init()

import gtopk_plugin as gp  # noqa: E402
from gtopk_plugin.frameworks.horovod.waiting import barrier  # noqa: E402
from gtopk_plugin.horovod import Compression, DistributedOptimizer  # noqa: E402

R, P = hvd.rank(), hvd.size()
OUT = sys.argv[1]
HOMES = {0: (0, 4), 1: (3, 4), 2: (1, 4)}  # rank -> the (rank, world size) its state claims


def residuals(opt):
    return {n: t.clone() for n, t in opt.reducer.state_dict()["residuals"].items()}


def train(model, opt, first, n):
    for s in range(first, first + n):
        g = torch.Generator().manual_seed(100 * s + R)
        x, y = torch.randn(8, 12, generator=g), torch.randint(0, 3, (8,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def main():
    out = {"rank": R}
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 10), torch.nn.ReLU(), torch.nn.Linear(10, 3))
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               named_parameters=model.named_parameters(),
                               compression=Compression.gtopk(0.1))
    state = hvd.elastic.TorchState(model=model, optimizer=opt, batch=0)
    state.sync()
    train(model, opt, 0, 3)
    state.commit()
    handler = state._handlers["optimizer"]
    # 1. a resize, as the handler sees it after Horovod's reset
    out["before"] = residuals(opt)
    handler._home = HOMES[R]
    state.sync()
    out["after"] = residuals(opt)
    out["home_after"] = handler._home
    out["params"] = train(model, opt, 3, 2)
    out["step"] = opt.reducer.step
    # 2. restore: this process's own commit comes back
    state.commit()
    out["committed"] = residuals(opt)
    train(model, opt, 5, 2)
    state.restore()
    out["restored"] = residuals(opt)
    state.sync()
    # 3. a job checkpoint through the Horovod transport
    ckpt = os.path.join(OUT, "ckpt")
    gp.save_job(opt.reducer, ckpt)
    saved = residuals(opt)
    train(model, opt, 7, 1)
    gp.load_job(opt.reducer, ckpt, named_parameters=model.named_parameters())
    out["job_round_trip"] = all(torch.equal(residuals(opt)[n], t) for n, t in saved.items()) and \
        set(residuals(opt)) == set(saved)
    barrier()
    if R == 0:  # a NaN in rank 2's file: every rank must refuse the checkpoint
        f = gp.checkpoint.rank_file(ckpt, 2)
        obj = torch.load(f, weights_only=True)
        next(iter(obj["state"]["residuals"].values())).view(-1)[0] = float("nan")
        torch.save(obj, f)
    barrier()
    before = residuals(opt)
    try:
        gp.load_job(opt.reducer, ckpt)
        out["corrupt"] = None
    except gp.CheckpointError as e:
        out["corrupt"] = str(e)
    out["corrupt_unchanged"] = all(torch.equal(residuals(opt)[n], t) for n, t in before.items())
    return out


if __name__ == "__main__":
    try:
        res = ("ok", main())
    except Exception as e:  # noqa: BLE001 - reported to the parent
        res = ("error", (type(e).__name__, str(e), traceback.format_exc()))
    torch.save(res, os.path.join(OUT, f"rank{R}.pt"))
    barrier()
    hvd.shutdown()
