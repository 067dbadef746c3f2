"""Train a small MLP on scikit-learn's digits with PyTorch DDP (gloo, CPU) and
gtopk_plugin's sparse communication hook.

    torchrun --nproc_per_node 4 examples/ddp_train.py --method gtopk --density 0.05 --epochs 3

Rank 0 prints, per epoch, the training loss (averaged over all ranks), the
test accuracy, and the bytes each worker sent per step next to what a dense
ring allreduce of the same gradients would send.  Without torchrun it runs as
a single process (world size 1).
"""
import argparse
import gc
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import gtopk_plugin as gp
from gtopk_plugin import registry


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--method", default="gtopk", choices=registry.available())
    p.add_argument("--density", type=float, default=0.05)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=16, help="per worker")
    p.add_argument("--lr", type=float, default=0.3)
    p.add_argument("--warmup-steps", type=int, default=0,
                   help="density warm-up steps (DensityWarmup from density 0.25)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def init_distributed():
    if "RANK" in os.environ:  # launched by torchrun
        dist.init_process_group("gloo")
    else:  # plain `python examples/ddp_train.py`: one process
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return dist.get_rank(), dist.get_world_size()


def data(seed):
    X, y = load_digits(return_X_y=True)
    X = torch.tensor(X / 16.0, dtype=torch.float32)
    y = torch.tensor(y, dtype=torch.int64)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    n_test = len(y) // 5
    test, train = perm[:n_test], perm[n_test:]
    return TensorDataset(X[train], y[train]), (X[test], y[test])


def kib(n):
    return f"{n / 1024:.1f} KiB"


def main():
    args = parse_args()
    torch.set_num_threads(1)
    rank, world = init_distributed()
    torch.manual_seed(args.seed)  # same initial model on every rank (DDP also broadcasts it)

    train_set, (X_test, y_test) = data(args.seed)
    # DistributedSampler pads so that every rank runs the same number of steps
    # (each step is a collective: a rank with one batch more would hang).
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)

    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10))
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    warmup = gp.DensityWarmup(args.warmup_steps) if args.warmup_steps > 0 else None
    # DGC momentum correction: the optimizer's momentum moves in front of the
    # compressor (docs/recipes.md)
    state = gp.torch_ddp.SparseState(method=args.method, density=args.density, warmup=warmup,
                                     named_parameters=model.named_parameters(),
                                     momentum_correction=True, optimizer=opt)
    ddp.register_comm_hook(state, gp.torch_ddp.sparse_hook)

    if rank == 0:
        n = sum(p.numel() for p in model.parameters())
        print(f"world size {world}, method {args.method}, density {args.density}, {n} parameters, "
              f"{len(loader)} steps per epoch", flush=True)
    t0 = time.perf_counter()
    acc = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        ddp.train()
        totals = torch.zeros(4, dtype=torch.float64)  # loss sum, samples, bytes sent, dense bytes
        steps = 0
        for x, y in loader:
            opt.zero_grad()
            loss = F.cross_entropy(ddp(x), y)
            loss.backward()  # the hook reduces the gradients here
            opt.step()
            traffic = state.last_step_traffic or {}
            totals += torch.tensor([loss.item() * len(y), len(y), traffic.get("bytes_sent", 0),
                                    traffic.get("dense_bytes", 0)], dtype=torch.float64)
            steps += 1
        dist.all_reduce(totals)  # sums over ranks
        ddp.eval()
        with torch.no_grad():  # every rank holds the same model; rank 0 reports
            acc = (model(X_test).argmax(1) == y_test).double().mean().item()
        if rank == 0:
            loss_avg = totals[0].item() / totals[1].item()
            sent = totals[2].item() / (steps * world)
            dense = totals[3].item() / (steps * world)
            ratio = f"{dense / sent:.1f}x less" if sent > 0 else "n/a"
            print(f"epoch {epoch + 1}/{args.epochs}  loss {loss_avg:.4f}  test accuracy {acc:.4f}  "
                  f"sent per step per worker {kib(sent)} vs dense allreduce {kib(dense)} ({ratio})",
                  flush=True)
    if rank == 0:
        print(f"final test accuracy {acc:.4f}  ({time.perf_counter() - t0:.1f} s)", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Free the process group now, not at interpreter shutdown.  DDP and its
    # hook state sit in reference cycles, so they (and the process group
    # they hold, which destroy_process_group() only unregisters) would
    # otherwise be collected during finalization.  Gloo's worker thread
    # then frees the last finished collective's tensors, needs the GIL,
    # and aborts the process ("terminate called without an active
    # exception"; torch 2.13, about 1 run in 10 on two cores).
    gc.collect()
