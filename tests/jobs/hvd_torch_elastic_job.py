"""Elastic worker run by tests/horovod/test_horovod.py under
``horovodrun --gloo -np 2 --min-np 2 --host-discovery-script ...``.

    python tests/jobs/hvd_torch_elastic_job.py OUTDIR

Trains with a sparse DistributedOptimizer inside ``hvd.elastic.run`` and, once
(tests/jobs/hvd_elastic_failure.py), raises ``HorovodInternalError`` on every
worker right after a few uncommitted steps (what Horovod raises when a peer is
lost).  ``hvd.elastic.run`` then
restores the last commit, re-initialises Horovod and syncs the state; the
script records the residuals and step counter at the commit, just before the
failure, and right after the restore, plus the final parameters.
"""
import os
import sys

import torch

import horovod.torch as hvd

from gtopk_plugin.horovod import Compression, DistributedOptimizer

from hvd_elastic_failure import run_with_one_failure  # this script's folder (tests/jobs/)

torch.set_num_threads(1)
hvd.init()
OUT = sys.argv[1]

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(12, 10), torch.nn.ReLU(), torch.nn.Linear(10, 3))
opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                           named_parameters=model.named_parameters(),
                           compression=Compression.gtopk(0.1, fusion_threshold=200))
state = hvd.elastic.TorchState(model=model, optimizer=opt, batch=0)


def residuals():
    sd = opt.state_dict()["gtopk_plugin"]
    return {"step": sd["step"], "residuals": {n: t.clone() for n, t in sd["residuals"].items()}}


def step(b):
    g = torch.Generator().manual_seed(100 * b + hvd.rank())
    x, y = torch.randn(8, 12, generator=g), torch.randint(0, 3, (8,), generator=g)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


log = run_with_one_failure(hvd, state, step, residuals)
log["final"] = {n: p.detach().clone() for n, p in model.named_parameters()}
log["final_step"] = opt.reducer.step
torch.save(log, os.path.join(OUT, f"rank{hvd.rank()}.pt"))
