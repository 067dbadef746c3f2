"""Overhead of gtopk_plugin's Horovod DistributedOptimizer with
``Compression.none`` against stock ``hvd.DistributedOptimizer``, and the bytes
per step of every compression, under real ``horovodrun --gloo`` jobs.

    python -m benchmarks.horovod_overhead --workers 2 4 --rounds 30 --steps 10

For each P one horovodrun job trains two identical copies of each model, one
through each optimizer, interleaved step by step (the order swaps every
round, so drift in machine load hits both alike); the reported ratio is the
median over all pairs of (our step time / stock step time), goal ≤ 1.05,
next to the ratio of the two median step times.
At the largest P the job also runs every compression at ``--density`` for a
few steps and records ``last_step_traffic`` (exact bytes, payload + headers,
per worker per step).  Prints tables and writes
``benchmarks/results/horovod_overhead.json``.  Needs Horovod
(``bash scripts/install_horovod.sh``).  A benchmark, not a test.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

from gtopk_plugin.compress import available

from .launch import horovodrun
from .record import dump, write_json

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
MODELS = {  # name -> layer widths of an MLP
    "mlp-17k": [64, 128, 64, 10],
    "mlp-1.1M": [784, 1024, 256, 10],
}
# Horovod's own two, then every compressor in the registry ("dense" is Horovod's "none")
COMPRESSIONS = ["none", "fp16"] + [m for m in available() if m != "dense"]


def _mlp(widths, seed):
    import torch

    torch.manual_seed(seed)
    layers = []
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def worker(args):
    """Runs inside horovodrun."""
    import torch
    import torch.nn.functional as F

    import horovod.torch as hvd
    from gtopk_plugin.horovod import Compression, DistributedOptimizer

    torch.set_num_threads(1)
    hvd.init()
    rank, P = hvd.rank(), hvd.size()
    out = {"P": P, "models": {}, "bytes": {}}

    def batch(widths, step):
        g = torch.Generator().manual_seed(step * 131 + rank)
        return torch.randn(args.batch, widths[0], generator=g), torch.randint(0, widths[-1], (args.batch,), generator=g)

    def one_step(model, opt, widths, step):
        x, y = batch(widths, step)
        t0 = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        return time.perf_counter() - t0

    for mname, widths in MODELS.items():
        runs = {}
        for kind in ("stock", "ours"):
            model = _mlp(widths, seed=0)
            base = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
            if kind == "stock":
                opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                               compression=hvd.Compression.none)
            else:
                opt = DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                           compression=Compression.none)
            runs[kind] = (model, opt)
        times = {"stock": [], "ours": []}
        step = 0
        for w in range(args.warmup):  # both paths warm (Horovod's response cache, allocator)
            for kind in ("stock", "ours"):
                one_step(*runs[kind], widths, step)
            step += 1
        # Interleaved at the finest grain: one step of each per pair, the
        # order swapped every round, so load drift on a shared machine hits
        # both alike; the paired ratio of neighbouring steps is the estimate.
        pair_ratios = []
        for r in range(args.rounds):
            order = ("stock", "ours") if r % 2 == 0 else ("ours", "stock")
            for s in range(args.steps):
                t = {kind: one_step(*runs[kind], widths, step + s) for kind in order}
                times["stock"].append(t["stock"])
                times["ours"].append(t["ours"])
                pair_ratios.append(t["ours"] / t["stock"])
            step += args.steps
        # Ranks step in lockstep (every step ends in collectives): rank 0's clock.
        med = {k: statistics.median(v) for k, v in times.items()}
        q = statistics.quantiles(pair_ratios, n=4)
        out["models"][mname] = {
            "numel": sum(p.numel() for p in runs["ours"][0].parameters()),
            "median_step_s": med, "ratio_of_medians": med["ours"] / med["stock"],
            "ratio": statistics.median(pair_ratios), "pair_ratio_quartiles": [q[0], q[2]],
            "pairs": len(pair_ratios),
        }
        # same parameters through both (sanity: the comparison is like for like)
        diff = max((a - b).abs().max().item() for a, b in zip(runs["ours"][0].parameters(),
                                                               runs["stock"][0].parameters()))
        out["models"][mname]["max_param_diff"] = diff

    if args.bytes:
        widths = MODELS["mlp-1.1M"]
        for cname in COMPRESSIONS:
            model = _mlp(widths, seed=0)
            opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                       named_parameters=model.named_parameters(),
                                       compression=Compression.from_name(cname, args.density))
            ts = [one_step(model, opt, widths, s) for s in range(args.bytes_steps)]
            t = dict(opt.last_step_traffic)
            t["median_step_s"] = statistics.median(ts[1:] or ts)
            out["bytes"][cname] = t
    if rank == 0:
        dump(args.out, out, digits=None)  # to the launcher, exact
    hvd.shutdown()


def run_job(P, args, out):
    argv = ["-m", __spec__.name, "--worker", "--out", out, "--rounds", str(args.rounds),
            "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch", str(args.batch),
            "--density", str(args.density), "--bytes-steps", str(args.bytes_steps)]
    if P == max(args.workers):
        argv.append("--bytes")
    t0 = time.time()
    horovodrun(P, argv, timeout=args.timeout)
    with open(out) as f:
        res = json.load(f)
    res["job_seconds"] = time.time() - t0
    return res


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--steps", type=int, default=10, help="timed steps per optimizer per round")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batch", type=int, default=32, help="per worker")
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--bytes-steps", type=int, default=4)
    p.add_argument("--timeout", type=int, default=1200)
    p.add_argument("--json", default=os.path.join(RESULTS, "horovod_overhead.json"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--bytes", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)

    results = {}
    with tempfile.TemporaryDirectory(prefix="gtopk-hvd-bench-") as d:
        for P in args.workers:
            print(f"horovodrun -np {P} ...", flush=True)
            results[P] = run_job(P, args, os.path.join(d, f"P{P}.json"))

    print("\nCompression.none through gtopk_plugin vs stock hvd.DistributedOptimizer "
          "(median step time, interleaved rounds)")
    print(f"{'P':>2}  {'model':<9} {'stock ms':>9} {'ours ms':>9} {'median ratio':>12}  "
          f"{'quartiles':>13}  {'ratio of medians':>16}")
    for P, res in results.items():
        for m, r in res["models"].items():
            q = r["pair_ratio_quartiles"]
            print(f"{P:>2}  {m:<9} {1e3 * r['median_step_s']['stock']:9.2f} {1e3 * r['median_step_s']['ours']:9.2f} "
                  f"{r['ratio']:12.3f}  {q[0]:6.3f}-{q[1]:.3f}  {r['ratio_of_medians']:16.3f}")
    Pmax = max(args.workers)
    if results[Pmax]["bytes"]:
        print(f"\nBytes per worker per step at P = {Pmax}, model mlp-1.1M, density {args.density} "
              "(payload + size headers; control = per-step consistency check)")
        print(f"{'compression':<11} {'sent B':>10} {'received B':>11} {'dense B':>10} {'dense/sent':>10} "
              f"{'control B':>9} {'step ms':>8}")
        for c, t in results[Pmax]["bytes"].items():
            ratio = t["dense_bytes"] / t["bytes_sent"] if t["bytes_sent"] else float("nan")
            print(f"{c:<11} {t['bytes_sent']:>10,} {t['bytes_received']:>11,} {t['dense_bytes']:>10,} "
                  f"{ratio:>9.1f}x {t['control_bytes']:>9} {1e3 * t['median_step_s']:8.1f}")
    write_json(args.json, "horovod_overhead",
               {k: v for k, v in vars(args).items() if k not in ("worker", "bytes", "out")},
               {str(P): r for P, r in results.items()}, packages=("horovod", "torch"))
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
