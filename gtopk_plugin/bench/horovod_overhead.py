"""Overhead of gtopk_plugin's Horovod DistributedOptimizer with
``Compression.none`` against stock ``hvd.DistributedOptimizer``, and the bytes
per step of every compression, under real ``horovodrun --gloo`` jobs.

    gtopk-bench horovod-overhead --workers 2 4 --rounds 30 --steps 10

For each P one horovodrun job trains two identical copies of each model, one
through each optimizer, interleaved step by step (the order swaps every
round, so drift in machine load hits both alike); the reported ratio is the
median over all pairs of (our step time / stock step time), goal ≤ 1.05,
next to the ratio of the two median step times.
At the largest P the job also runs every compression at ``--density`` for a
few steps and records ``last_step_traffic`` (exact bytes, payload + headers,
per worker per step).  Prints tables and writes
``gtopk-bench-results/horovod_overhead.json``.  Needs Horovod
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

from gtopk_plugin.bench.bench_launch import horovodrun
from gtopk_plugin.bench.bench_record import RESULTS, dump, write_json

MODELS = {  # name -> layer widths of an MLP
    "mlp-17k": [64, 128, 64, 10],
    "mlp-1.1M": [784, 1024, 256, 10],
}
# Horovod's own two, then every compressor in the registry ("dense" is Horovod's "none")
COMPRESSIONS = ["none", "fp16"] + [m for m in available(builtin=True) if m != "dense"]
# also timed with every exchange step as a Horovod collective (exchange="horovod",
# the layer's first exchange), next to the default gloo side channel
HOROVOD_EXCHANGE = ["topk", "gtopk"]


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

    for mname, widths in (MODELS.items() if args.rounds > 0 else ()):
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
        out["bytes"] = compare_compressions(args, rank, _mlp, batch, one_step)
    if rank == 0:
        dump(args.out, out, digits=None)  # to the launcher, exact
    hvd.shutdown()


def _counting_ops():
    """Count the Horovod ops our sparse layer issues (alltoall, allgather,
    allreduce), by wrapping the module its two files call."""
    from gtopk_plugin.frameworks.horovod import hvd_sparse as sp
    from gtopk_plugin.frameworks.horovod import hvd_transport as tr

    counts = {"n": 0}
    real = tr._ops

    class _Counting:
        def __getattr__(self, name):
            f = getattr(real, name)
            if name.endswith("_async") or name.endswith("_async_"):
                def counted(*a, **k):
                    counts["n"] += 1
                    return f(*a, **k)
                return counted
            return f

    tr._ops = sp._ops = _Counting()
    return counts


def compare_compressions(args, rank, mlp, batch, one_step):
    """Every compression on its own copy of mlp-1.1M, side by side: each
    round steps every compression once (the order rotates), so the ratios
    to ``none`` see the same machine load.  Records the exact bytes of the
    last step, the median step time, the median of the per-round ratios to
    ``none``, the reducer's phase seconds and the Horovod collectives per
    step (Horovod's, and all the transport's incl. the side channel)."""
    import statistics as st

    import torch

    from gtopk_plugin.horovod import Compression, DistributedOptimizer

    counts = _counting_ops()
    widths = MODELS["mlp-1.1M"]
    runs = {}
    for label in COMPRESSIONS + [f"{c}/horovod" for c in HOROVOD_EXCHANGE]:
        cname, _, exchange = label.partition("/")
        kw = {"exchange": exchange} if exchange else {}
        model = mlp(widths, seed=0)
        opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters(),
                                   compression=Compression.from_name(cname, args.density, **kw))
        runs[label] = (model, opt)
    times = {c: [] for c in runs}
    ops = {c: [] for c in runs}
    allops = {c: [] for c in runs}
    phases = {c: {} for c in runs}
    names = list(runs)
    for r in range(args.warmup + args.bytes_steps):
        order = names[r % len(names):] + names[:r % len(names)]
        step_t = {}
        for c in order:
            n0 = counts["n"]
            tr = getattr(runs[c][1], "_transport", None)
            a0 = tr.collectives if tr is not None else 0
            step_t[c] = one_step(*runs[c], widths, r)
            if r >= args.warmup:
                ops[c].append(counts["n"] - n0)
                allops[c].append(tr.collectives - a0 if tr is not None else 0)
                stats = getattr(runs[c][1], "last_stats", None)
                for k, v in ((stats.seconds or {}) if stats is not None else {}).items():
                    phases[c].setdefault(k, []).append(v)
        if r >= args.warmup:
            for c in names:
                times[c].append(step_t[c])
    res = {}
    for c, (model, opt) in runs.items():
        t = dict(opt.last_step_traffic)
        t["median_step_s"] = st.median(times[c])
        t["ratio_to_none"] = st.median(a / b for a, b in zip(times[c], times["none"]))
        t["horovod_ops_per_step"] = st.median(ops[c])
        t["transport_ops_per_step"] = st.median(allops[c])
        t["phase_s"] = {k: st.median(v) for k, v in phases[c].items()}
        res[c] = t
    return res


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
    p.add_argument("--bytes-steps", type=int, default=20,
                   help="timed side-by-side rounds of every compression at the largest P")
    p.add_argument("--timeout", type=int, default=1200)
    p.add_argument("--json", default=os.path.join(RESULTS, "horovod_overhead.json"))
    p.add_argument("--before", help="a results JSON of an earlier run to keep next to this one")
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
        print(f"{'compression':<15} {'sent B':>10} {'received B':>11} {'dense B':>10} {'dense/sent':>10} "
              f"{'control B':>9} {'step ms':>8} {'vs none':>8} {'hvd ops':>7} {'all ops':>7}")
        for c, t in results[Pmax]["bytes"].items():
            ratio = t["dense_bytes"] / t["bytes_sent"] if t["bytes_sent"] else float("nan")
            print(f"{c:<15} {t['bytes_sent']:>10,} {t['bytes_received']:>11,} {t['dense_bytes']:>10,} "
                  f"{ratio:>9.1f}x {t['control_bytes']:>9} {1e3 * t['median_step_s']:8.1f} "
                  f"{t['ratio_to_none']:7.2f}x {t['horovod_ops_per_step']:7g} {t['transport_ops_per_step']:7g}")
    results = {str(P): r for P, r in results.items()}
    if args.before:  # an earlier run (e.g. before a change), kept side by side
        with open(args.before) as f:
            results["before"] = json.load(f)
    write_json(args.json, "horovod_overhead",
               {k: v for k, v in vars(args).items() if k not in ("worker", "bytes", "out", "before")},
               results, packages=("horovod", "torch"))
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
