"""``python -m lab fp16-allreduce``: one dense allreduce in fp32 and in fp16,
through Horovod's gloo and torch.distributed's gloo, side by side: wall
time and the CPU of each rank's whole process, medians over repetitions.

    python -m lab.fp16_allreduce                 # P = 4, 8.3 M elements (vgg's gradient)
    python -m lab.fp16_allreduce -P 2 --numel 1000000 --reps 3

Why: in ``python -m lab train`` at the paper-matched link,
Horovod's ``Compression.fp16`` step took 748 ms against 504 ms for DDP's
``fp16_compress_hook`` with the same bytes on the wire, and its workers
used 430 ms more CPU per step, almost all of it outside the training
thread.  Both engines send fp16 and sum it on the CPU in gloo: this
measures that allreduce alone, without the model, the hooks or the shaped
link (each rank in its own namespace, ``--rate`` 10gbit by default, so the
wire is not what is measured).

Each rank fills its tensor from its own seed; the result is checked
against the float64 sum of every rank's tensor (``rel_err``: largest
absolute error over the largest absolute sum).  Prints the table and
writes ``lab/results/fp16_allreduce.json``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import List

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
ENGINES = ("horovod", "torch")
DTYPES = ("float32", "float16")


def _rank_tensor(rank: int, numel: int):
    import torch

    return torch.randn(numel, generator=torch.Generator().manual_seed(1000 + rank), dtype=torch.float64)


def allreduce_worker(ctx, payload) -> dict:
    """One rank: per dtype, the median wall and process-CPU ms of one sum
    allreduce, and the result's error against the float64 oracle."""
    import torch

    torch.set_num_threads(1)
    engine, numel, reps = payload["engine"], payload["numel"], payload["reps"]
    if engine == "horovod":
        import horovod.torch as hvd
        from horovod.torch import mpi_ops

        from gtopk_plugin.frameworks.horovod import waiting

        def allreduce(x, tag):  # in place, waited with sleeps (no spinning thread)
            waiting.synchronize(mpi_ops.allreduce_async_(x, op=hvd.Sum, name=tag))
    else:
        import torch.distributed as dist

        def allreduce(x, tag):
            dist.all_reduce(x)
    oracle = sum(_rank_tensor(r, numel) for r in range(ctx.size))
    mine = _rank_tensor(ctx.rank, numel)
    out = {}
    for name in payload["dtypes"]:
        src = mine.to(getattr(torch, name))
        walls, cpus = [], []
        for i in range(reps):
            x = src.clone()
            ctx.barrier()
            w0, c0 = time.perf_counter(), time.process_time()
            allreduce(x, f"fp16probe.{name}.{i}")
            walls.append(time.perf_counter() - w0)
            cpus.append(time.process_time() - c0)
        err = (x.double() - oracle).abs().max() / oracle.abs().max()
        out[name] = {"wall_ms": 1e3 * statistics.median(walls), "cpu_ms": 1e3 * statistics.median(cpus),
                     "rel_err": float(err), "bytes": x.numel() * x.element_size()}
    return out


def main(argv=None) -> int:
    from lab.cluster import harness, netns
    from gtopk_plugin.bench.bench_record import write_json

    ap = argparse.ArgumentParser(prog="python -m lab fp16-allreduce", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", "-P", type=int, default=4)
    ap.add_argument("--numel", type=int, default=8_300_000)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rate", default="10gbit", help="tc tbf rate of every rank's link")
    ap.add_argument("--json", default=os.path.join(RESULTS, "fp16_allreduce.json"))
    args = ap.parse_args(argv)
    if args.workers < 2 or args.numel < 1 or args.reps < 1:
        ap.error("--workers must be >= 2, --numel and --reps >= 1")
    if not harness.horovod_netns_preflight("python -m lab fp16-allreduce"):
        return 2
    rows: List[dict] = []
    with netns.NetCluster(args.workers, rate=args.rate) as net:
        for engine in ENGINES:
            payload = {"engine": engine, "numel": args.numel, "reps": args.reps, "dtypes": list(DTYPES)}
            per_rank = harness.run_job(net, args.workers, allreduce_worker, payload, engine, timeout=900)
            for name in DTYPES:
                ranks = [r[name] for r in per_rank]
                rows.append({"engine": engine, "dtype": name, "MB": ranks[0]["bytes"] / 1e6,
                             "wall_ms": statistics.median(r["wall_ms"] for r in ranks),
                             "cpu_ms_per_rank": statistics.median(r["cpu_ms"] for r in ranks),
                             "cpu_ms_all_ranks": sum(r["cpu_ms"] for r in ranks),
                             "rel_err": max(r["rel_err"] for r in ranks)})
    by = {(r["engine"], r["dtype"]): r for r in rows}
    for r in rows:
        r["cpu_vs_fp32"] = r["cpu_ms_all_ranks"] / max(by[(r["engine"], "float32")]["cpu_ms_all_ranks"], 1e-9)
    print(f"P = {args.workers}, {args.numel:,} elements, median of {args.reps}, link {args.rate}")
    print("| engine | dtype | MB | wall ms | CPU ms per rank | CPU ms, all ranks | CPU vs own fp32 | rel. error |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['engine']} | {r['dtype']} | {r['MB']:.1f} | {r['wall_ms']:.0f} | {r['cpu_ms_per_rank']:.0f} | "
              f"{r['cpu_ms_all_ranks']:.0f} | {r['cpu_vs_fp32']:.2f}× | {r['rel_err']:.1e} |")
    hv, tv = by[("horovod", "float16")], by[("torch", "float16")]
    ratio = hv["cpu_ms_all_ranks"] / max(tv["cpu_ms_all_ranks"], 1e-9)
    print(f"fp16: Horovod's allreduce uses {ratio:.2f}× torch's CPU "
          f"({hv['cpu_ms_all_ranks'] - tv['cpu_ms_all_ranks']:.0f} ms more over all ranks)")
    settings = {"P": args.workers, "numel": args.numel, "reps": args.reps, "rate": args.rate,
                "fp16_cpu_horovod_vs_torch": ratio, "loadavg": harness.loadavg()}
    write_json(args.json, "fp16_allreduce", settings, rows, packages=("torch", "horovod"))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
