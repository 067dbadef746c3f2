"""DDP training step on loopback gloo: PyTorch's default allreduce and its
own compression hooks (``fp16_compress_hook``, ``powerSGD_hook`` rank 4)
against our ``sparse_hook`` (gTop-k 1% and 0.1%), side by side in one run.

    gtopk-bench ddp-step --workers 2 --rounds 12

P workers (real gloo process group on loopback, one thread each) build one
DistributedDataParallel copy of a ~10M-parameter MLP per variant and step
them interleaved, round by round (the order rotates every round, so drift in
machine load hits every variant alike).  Reported: the median step time
(forward + backward with the hook + SGD step) of each variant over ranks and
rounds, and its ratio to allreduce.  On loopback the link is free, so this
measures each hook's local cost, not what it saves on a slow network (the repository's lab cluster emulator does that).  Writes
``gtopk-bench-results/ddp_step.json``.  A benchmark, not a test.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

from gtopk_plugin.bench.bench_record import RESULTS, write_json

WIDTHS = [1024, 2048, 2048, 2048, 10]  # 10.5M parameters
POWERSGD_START = 2  # the smallest start_powerSGD_iter DDP allows with error feedback
VARIANTS = {  # name -> SparseState kwargs, or a PyTorch hook's name (None: DDP's allreduce)
    "allreduce": None,
    "fp16_compress_hook": "fp16",
    "powerSGD_hook rank 4": "powersgd",
    "gtopk 1%": {"method": "gtopk", "density": 0.01},
    "gtopk 0.1%": {"method": "gtopk", "density": 0.001},
}


def _mlp(widths, seed=0):
    import torch

    torch.manual_seed(seed)
    layers = []
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def worker(ctx, args):
    import torch
    import torch.nn.functional as F
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as dh
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gtopk_plugin as gp

    torch.set_num_threads(1)
    runs, phases = {}, {}
    for name, kw in VARIANTS.items():
        model = _mlp(WIDTHS)
        # no 1 MiB first bucket; PowerSGD with the whole model in one bucket, as
        # the lab's cluster ddp runs it (25 MiB buckets left its ranks' gloo
        # collectives out of step in this interleaved run)
        ddp = DDP(model, bucket_cap_mb=1024 if kw == "powersgd" else 25)
        if kw == "fp16":
            ddp.register_comm_hook(None, dh.fp16_compress_hook)
        elif kw == "powersgd":
            state = ps.PowerSGDState(process_group=None, matrix_approximation_rank=4,
                                     start_powerSGD_iter=POWERSGD_START, random_seed=0)
            ddp.register_comm_hook(state, ps.powerSGD_hook)
        elif kw is not None:
            state = gp.torch_ddp.SparseState(named_parameters=model.named_parameters(), **kw)
            ddp.register_comm_hook(state, _timed(gp.torch_ddp.sparse_hook, phases.setdefault(name, [])))
        runs[name] = (ddp, torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9), [])
    n_params = sum(p.numel() for p in _mlp(WIDTHS).parameters())
    g = torch.Generator().manual_seed(ctx.rank)
    order = list(runs)
    for rnd in range(args.warmup + args.rounds):
        for name in order[rnd % len(order):] + order[:rnd % len(order)]:
            ddp, opt, times = runs[name]
            x = torch.randn(args.batch, WIDTHS[0], generator=g)
            y = torch.randint(0, WIDTHS[-1], (args.batch,), generator=g)
            ctx.barrier()
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=False)
            F.cross_entropy(ddp(x), y).backward()
            opt.step()
            if rnd >= args.warmup:
                times.append(time.perf_counter() - t0)
            elif name in phases:
                del phases[name][:]
    return {"params": n_params, "times": {n: r[2] for n, r in runs.items()}, "phases": phases}


def _timed(hook, out):
    """``hook`` recording, per bucket, its wall time and the reducer's phases."""
    def timed(state, bucket):
        t0 = time.perf_counter()
        fut = hook(state, bucket)
        sec = dict(state.reducer.last_stats.seconds)
        sec["hook"] = time.perf_counter() - t0
        out.append((bucket.is_last(), sec))
        return fut
    return timed


def _per_step(records):
    """Median per step of each phase (buckets of a step summed), in ms."""
    steps, cur = [], {}
    for last, sec in records:
        for k, v in sec.items():
            cur[k] = cur.get(k, 0.0) + v
        if last:
            steps.append(cur)
            cur = {}
    keys = steps[0].keys() if steps else ()
    return {k: statistics.median(s[k] for s in steps) * 1e3 for k in keys}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--out", default=os.path.join(RESULTS, "ddp_step.json"))
    args = ap.parse_args(argv)
    from gtopk_plugin._launch import launcher as launch

    reps = launch.run(args.workers, worker, args, timeout=1800)
    times = {n: [t for r in reps for t in r["times"][n]] for n in VARIANTS}
    med = {n: statistics.median(ts) * 1e3 for n, ts in times.items()}
    results = {n: {"median_ms": med[n], "vs_allreduce": med[n] / med["allreduce"], "samples": len(times[n])}
               for n in VARIANTS}
    for n in VARIANTS:
        recs = [rec for r in reps for rec in r["phases"].get(n, [])]
        if recs:  # the hook's wall time and the reducer's phases, per step
            results[n]["hook_ms"] = _per_step(recs)
    print(f"DDP step, P={args.workers} loopback gloo, {reps[0]['params'] / 1e6:.1f}M-parameter MLP, "
          f"batch {args.batch}, one thread per worker (median over ranks and {args.rounds} rounds)")
    print(f"{'variant':<21} {'ms':>8} {'x allreduce':>12}   in the hook, per step (ms)")
    for n, r in results.items():
        ph = " ".join(f"{k} {v:.1f}" for k, v in r.get("hook_ms", {}).items())
        print(f"{n:<21} {r['median_ms']:8.1f} {r['vs_allreduce']:12.2f}   {ph}")
    write_json(args.out, "ddp_step",
               settings={"workers": args.workers, "rounds": args.rounds, "warmup": args.warmup,
                         "batch": args.batch, "widths": WIDTHS, "params": reps[0]["params"],
                         "threads_per_worker": 1, "link": "loopback gloo",
                         "bucket_cap_mb": 25, "optimizer": "SGD lr 0.01 momentum 0.9"},
               results=results, packages=("torch",))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
