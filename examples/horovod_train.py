"""Train a small MLP on scikit-learn's digits with Horovod and gtopk_plugin's
drop-in DistributedOptimizer (sparse or dense gradient exchange).

    horovodrun -np 4 -H localhost:4 --gloo python examples/horovod_train.py --compression gtopk --density 0.01

Compared with a stock Horovod script, only two lines differ: the import of
``DistributedOptimizer``/``Compression`` and the ``compression=`` argument.
Rank 0 prints, per epoch, the training loss (averaged over all ranks), the
test accuracy and the bytes each worker sent per step next to what a dense
ring allreduce of the same gradients sends, then the final accuracy.
"""
import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import horovod.torch as hvd
from gtopk_plugin.horovod import Compression, DistributedOptimizer

COMPRESSIONS = ("none", "fp16", "topk", "gtopk", "rtopk", "randomk", "threshold")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--compression", default="gtopk", choices=COMPRESSIONS)
    p.add_argument("--density", type=float, default=0.01,
                   help="fraction of each gradient sent (sparse compressions)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=16, help="per worker")
    p.add_argument("--lr", type=float, default=0.3)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


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
    hvd.init()
    rank, world = hvd.rank(), hvd.size()
    torch.manual_seed(args.seed)

    train_set, (X_test, y_test) = data(args.seed)
    # Every rank must run the same number of steps (each step is collective).
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)

    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    # sparse compressions: DGC momentum correction (the optimizer's momentum
    # moves in front of the compressor; docs/recipes.md)
    sparse = args.compression not in ("none", "fp16")
    compression = Compression.from_name(args.compression, args.density,
                                        **({"momentum_correction": True} if sparse else {}))
    opt = DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=compression)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)

    if rank == 0:
        n = sum(p.numel() for p in model.parameters())
        print(f"world size {world}, compression {compression!r}, {n} parameters, "
              f"{len(loader)} steps per epoch", flush=True)
    t0 = time.perf_counter()
    acc = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        totals = torch.zeros(4, dtype=torch.float64)  # loss sum, samples, bytes sent, dense bytes
        steps = 0
        for x, y in loader:
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()  # reductions start here, bucket by bucket
            opt.step()       # waits for them and applies the result
            traffic = opt.last_step_traffic or {}
            totals += torch.tensor([loss.item() * len(y), len(y), traffic.get("bytes_sent", 0),
                                    traffic.get("dense_bytes", 0)], dtype=torch.float64)
            steps += 1
        totals = hvd.allreduce(totals, op=hvd.Sum, name="example.totals")
        model.eval()
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


if __name__ == "__main__":
    main()
