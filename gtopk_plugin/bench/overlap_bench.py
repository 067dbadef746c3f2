"""How much of the exchange a DDP hook hides behind backward, on an
emulated 1 Gbit/s cluster, side by side in one run.

    gtopk-bench overlap                       # P=2 table, then the P=4 MLP table
    gtopk-bench overlap --rate none --quick   # loopback smoke run

Workers are processes in network namespaces with tbf-shaped links
(:mod:`.shaped_net`; loopback, labelled unshaped, where they cannot be
made), one torch thread each, each pinned to a core of its own when there
are enough.  Rows (DDP copies of one MLP, taking turns): a no-op hook (no
communication), PyTorch's ``allreduce_hook`` and ``fp16_compress_hook``,
ours synchronous (``overlap=False``) and asynchronous (default policy, and
per bucket).  Per step (slowest rank, median): step, process CPU time,
backward, the exchange alone (the hook replayed on the step's buckets with
nothing beside it), the exposed exchange (step less the no-op step), and
ratios to the no-op step, PyTorch's best hook and max(no-op, exchange).
The second table is the DDP-against-PyTorch configuration (P=4, 10.5M
parameters); parameters are compared across ranks.  Writes
``gtopk-bench-results/overlap.json``.  A benchmark, not a test.
"""
from __future__ import annotations

import argparse
import hashlib
import inspect
import os
import statistics
import time

from gtopk_plugin.bench import shaped_net
from gtopk_plugin.bench.bench_launch import run_workers
from gtopk_plugin.bench.bench_record import RESULTS, write_json

MLP = [1024, 2048, 2048, 2048, 10]   # 10.5M parameters: the DDP-against-PyTorch configuration
BATCH = 16
BUCKET_MB = 25.0


def rows(density: float, table: str):
    """(name, spec): spec "noop" | "allreduce" | "fp16" | SparseState keywords."""
    ours = {"method": "gtopk", "density": density}
    out = [("no-op hook (no communication)", "noop"), ("allreduce_hook", "allreduce"),
           ("fp16_compress_hook", "fp16"),
           (f"sparse_hook gtopk {density:g} sync", dict(ours, overlap=False)),
           (f"sparse_hook gtopk {density:g} async", dict(ours, overlap=True)),
           (f"sparse_hook gtopk {density:g} async per bucket", dict(ours, overlap=True, coalesce_buckets=False))]
    if table == "overlap":
        out.insert(4, (f"sparse_hook gtopk {density:g} sync per bucket",
                       dict(ours, overlap=False, coalesce_buckets=False)))
    return out


def _runnable(spec):
    """The row's spec for this SparseState, or None when it cannot run it
    (a SparseState without ``overlap`` is synchronous)."""
    if not isinstance(spec, dict) or "overlap" not in spec:
        return spec
    from gtopk_plugin.frameworks.ddp.ddp_hook import SparseState

    if "overlap" in inspect.signature(SparseState.__init__).parameters:
        return spec
    return None if spec["overlap"] else {k: v for k, v in spec.items() if k != "overlap"}


def _mlp(widths):
    import torch

    torch.manual_seed(0)
    layers = []
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def _build(spec, widths, bucket_mb=BUCKET_MB):
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as dh
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gtopk_plugin as gp

    model = _mlp(widths)
    ddp = DDP(model, bucket_cap_mb=bucket_mb)
    seen = []  # the buckets of the last step (DDP rebuilds them after the first)
    if spec == "noop":
        hook, state = _noop, None
    elif spec == "allreduce":
        hook, state = dh.allreduce_hook, None
    elif spec == "fp16":
        hook, state = dh.fp16_compress_hook, None
    else:
        hook = gp.torch_ddp.sparse_hook
        state = gp.torch_ddp.SparseState(named_parameters=model.named_parameters(), **spec)

    def recording(st, bucket):
        if bucket.index() == 0:
            seen.clear()
        seen.append(bucket)  # replayed by _exchange_alone (DDP keeps its tensors)
        return row["hook"](st, bucket)

    ddp.register_comm_hook(state, recording)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    row = {"ddp": ddp, "opt": opt, "hook": hook, "state": state, "buckets": seen,
           "times": {"step": [], "forward": [], "backward": [], "optimizer": [], "exchange": [], "cpu": []}}
    return row


def _noop(state, bucket):
    import torch

    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def _step(ctx, row, x, y):
    import torch.nn.functional as F

    ctx.barrier()
    c0 = time.process_time()
    t0 = time.perf_counter()
    row["opt"].zero_grad(set_to_none=False)
    loss = F.cross_entropy(row["ddp"](x), y)
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    row["opt"].step()
    t3 = time.perf_counter()
    cpu = time.process_time() - c0  # every thread of the process: compute, the worker, gloo's
    for k, v in (("step", t3 - t0), ("forward", t1 - t0), ("backward", t2 - t1), ("optimizer", t3 - t2),
                 ("cpu", cpu)):
        row["times"][k].append(v)


def _exchange_alone(ctx, row):
    """The hook on the last step's buckets again, nothing else running:
    every bucket handed over, then every future waited for."""
    buckets = sorted(row["buckets"], key=lambda b: b.index())  # DDP's order
    st = row["state"]
    if st is not None:  # the usage check: every parameter received a gradient
        st._usage._used.update(id(p) for b in buckets for p in b.parameters())
    ctx.barrier()
    t0 = time.perf_counter()
    futs = [row["hook"](st, b) for b in buckets]
    for f in futs:
        f.wait()
    row["times"]["exchange"].append(time.perf_counter() - t0)


def worker(ctx, p):
    import torch

    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if p["pin"] and ctx.size <= len(cpus):  # one core each; more workers than cores: the OS shares them
        os.sched_setaffinity(0, {cpus[ctx.rank]})
    torch.set_num_threads(1)
    built = [(name, _build(spec, p["widths"], p["bucket_mb"])) for name, spec in p["rows"]]
    g = torch.Generator().manual_seed(1000 + ctx.rank)
    batches = [(torch.randn(p["batch"], p["widths"][0], generator=g),
                torch.randint(0, p["widths"][-1], (p["batch"],), generator=g)) for _ in range(4)]
    i = 0
    for rnd in range(p["warmup"] + p["rounds"]):
        order = built[rnd % len(built):] + built[:rnd % len(built)]
        for name, row in order:
            for _ in range(p["per_round"]):
                _step(ctx, row, *batches[i % len(batches)])
                i += 1
            if name != p["rows"][0][0]:
                _exchange_alone(ctx, row)
            if rnd < p["warmup"]:
                for v in row["times"].values():
                    v.clear()
        ctx.progress(what=f"round {rnd + 1}/{p['warmup'] + p['rounds']}")
    out = {}
    for name, row in built:
        h = hashlib.sha256()
        for prm in row["ddp"].module.parameters():
            h.update(prm.detach().contiguous().numpy().tobytes())
        st = row["state"]
        out[name] = dict(row["times"], params_sha256=h.hexdigest(), buckets=len(row["buckets"]),
                         bytes_sent=(st.last_step_traffic or {}).get("bytes_sent") if st is not None else None)
        if st is not None and hasattr(st, "close"):
            st.close()
    return out


def _merge(per_rank, names):
    """Per row: per step the slowest rank, then the median (ms)."""
    res = {}
    for n in names:
        rr = [r[n] for r in per_rank]
        med = {}
        for k in ("step", "forward", "backward", "optimizer", "exchange", "cpu"):
            steps = [max(x) for x in zip(*(r[k] for r in rr))]
            med[k] = statistics.median(steps) * 1e3 if steps else 0.0
        res[n] = dict(med, params_identical=len({r["params_sha256"] for r in rr}) == 1,
                      buckets=rr[0]["buckets"], bytes_sent=rr[0]["bytes_sent"])
    base = res[names[0]]["step"]
    torch_best = min((res[n]["step"] for n in names if n.startswith(("allreduce", "fp16"))), default=None)
    for n in names:
        r = res[n]
        r["exposed"] = r["step"] - base
        r["x_noop"] = r["step"] / base
        r["x_best_pytorch"] = r["step"] / torch_best if torch_best else None
        r["x_max_noop_exchange"] = r["step"] / max(base, r["exchange"]) if r["exchange"] else None
    return res


def _run_table(args, table, P, widths, label, specs=None, target=None, bucket_mb=BUCKET_MB):
    if specs is None:
        specs = [(n, _runnable(s)) for n, s in rows(args.density, table) if _runnable(s) is not None]
    skipped = [n for n, s in rows(args.density, table) if _runnable(s) is None]
    net, why = shaped_net.network(P, args.rate)
    payload = {"rows": specs, "widths": widths, "batch": args.batch, "warmup": args.warmup,
               "rounds": args.rounds, "per_round": args.per_round, "pin": not args.no_pin, "bucket_mb": bucket_mb}
    kw = {"timeout": args.timeout, "progress": lambda r, m: r == 0 and print(f"  {table}: {m.get('what')}",
                                                                               flush=True)}
    if net is None:
        per_rank = run_workers(P, target or worker, payload, **kw)
        desc = {"shaped": False, "why": why}
    else:
        with net:
            per_rank = run_workers(P, target or worker, payload, prefix=net.prefix, ifname=net.iface, **kw)
        desc = net.describe()
    res = _merge(per_rank, [n for n, _ in specs])
    ncpu = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    desc["cores"] = "one core per worker" if not args.no_pin and P <= ncpu else f"{P} workers on {ncpu} cores"
    _print(table, P, widths, desc, res, skipped, f"{label}, DDP buckets of {bucket_mb:g} MB")
    return {"P": P, "widths": widths, "bucket_cap_mb": bucket_mb, "network": desc, "rows": res,
            "not_run": skipped}


def _print(table, P, widths, desc, res, skipped, label):
    link = f"{desc['rate']} shaped" if desc["shaped"] else f"UNSHAPED ({desc['why']})"
    nparams = sum(a * b + b for a, b in zip(widths[:-1], widths[1:]))
    print(f"\n{label}: P={P}, {link}, MLP {widths} ({nparams / 1e6:.1f}M parameters), {desc['cores']}")
    print(f"{'row':<40} {'step':>7} {'cpu':>6} {'backward':>9} {'exchange':>9} {'exposed':>8} {'x no-op':>8} "
          f"{'x best PyTorch':>15} {'x max(no-op, exch)':>19}  same params")
    for n, r in res.items():
        m, b = r["x_max_noop_exchange"], r["x_best_pytorch"]
        print(f"{n:<40} {r['step']:7.1f} {r['cpu']:6.1f} {r['backward']:9.1f} {r['exchange']:9.1f} {r['exposed']:8.1f} "
              f"{r['x_noop']:8.2f} {'-' if b is None else f'{b:.2f}':>15} {'-' if m is None else f'{m:.2f}':>19}  "
              f"{'n/a' if n.startswith('no-op') else 'yes' if r['params_identical'] else 'NO'}")
    if skipped:
        print(f"not run (this SparseState has no `overlap`): {', '.join(skipped)}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", "-P", type=int, default=2, help="workers of the overlap table (default 2)")
    ap.add_argument("--mlp-workers", type=int, default=4, help="workers of the MLP table (default 4; 0: skip)")
    ap.add_argument("--rate", default="1gbit", help="tc rate of every link ('none': loopback, unshaped)")
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--widths", default=",".join(map(str, MLP)),
                    help="the overlap table's MLP widths (default: at P=2 its backward is comparable to "
                         "gTop-k 1 %%'s exchange)")
    ap.add_argument("--bucket-mb", type=float, default=BUCKET_MB, help="DDP's bucket_cap_mb")
    ap.add_argument("--batch", type=int, default=BATCH)
    ap.add_argument("--warmup", type=int, default=2, help="untimed rounds")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--per-round", type=int, default=3, help="timed steps per row and round")
    ap.add_argument("--no-pin", action="store_true",
                    help="do not pin each worker to a core of its own (never pinned with more workers than cores)")
    ap.add_argument("--quick", action="store_true", help="smoke run: small MLP, 1 round")
    ap.add_argument("--timeout", type=float, default=1800.0)
    ap.add_argument("--out", default=os.path.join(RESULTS, "overlap.json"))
    args = ap.parse_args(argv)
    widths = [int(w) for w in args.widths.split(",")]
    mlp = MLP
    if args.quick:
        widths, mlp = [64, 128, 128, 10], [64, 128, 128, 10]
        args.warmup, args.rounds, args.per_round = 1, 1, 1
    results = {"overlap": _run_table(args, "overlap", args.workers, widths, "overlap", bucket_mb=args.bucket_mb)}
    if args.mlp_workers:
        results["mlp"] = _run_table(args, "mlp", args.mlp_workers, mlp, "DDP against PyTorch's hooks",
                                    bucket_mb=args.bucket_mb)
    write_json(args.out, "overlap",
               settings={"rate": args.rate, "density": args.density, "batch": args.batch,
                         "warmup_rounds": args.warmup, "rounds": args.rounds, "per_round": args.per_round,
                         "pinned": not args.no_pin, "threads_per_worker": 1, "bucket_cap_mb": args.bucket_mb,
                         "optimizer": "SGD lr 0.01 momentum 0.9"},
               results=results, packages=("torch",))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


def gpu_worker_check(device="cuda") -> dict:
    """The communication worker's CUDA side, for ``gtopk-bench gpu-check``:
    a job runs on the worker's side stream, after the work the submitting
    stream queued before it, and whoever waits on its future sees its
    result (the waiter's stream waits on the job's event)."""
    import torch

    from gtopk_plugin.pipeline.comm_worker import CommWorker

    w = CommWorker("gtopk-gpu-check", device=device)
    x = torch.randn(2048, 2048, device=device)
    y = x @ x  # queued on the current stream, not finished at submission

    def job(t):
        return torch.cuda.current_stream(t.device) == w.stream, t @ t

    on_side, z = w.submit(job, y).wait()
    ref = y @ y
    ok = bool(torch.equal(z, ref))
    closed = w.close(timeout=30)
    return {"job_on_side_stream": bool(on_side), "result_equal": ok, "thread_ended": closed,
            "passed": bool(on_side) and ok and closed}
