"""``gtopk-bench step``: where one ``GradientReducer.reduce()`` spends its
time, beside what the passes it must make cost.

    gtopk-bench step                          # the full grid
    gtopk-bench step --sizes 1000000 --threads 1 --workers 1 --reps 3

For every layout (N fp32 elements in 4 tensors, and ResNet-50's 161),
thread count and world size (P = 1 in process, P = 2 on loopback gloo),
interleaved on the same data, it times: ``floor`` (``x.sum()``, one
streaming read; ``floor huge`` the same on 2 MB pages, as the reducer's
buffers are); ``kernel`` (``kernels.select_topk`` alone); ``merge``
(``kernels.merge_select``, one butterfly round's merge); and ``reduce()``
per method, its ``last_stats.seconds`` phases and the *local compute* =
total minus the time inside the transport's primitives.  ``--pin`` pins
rank r's compute thread to CPU r.

Prints medians and the ratios local / floor and kernel / floor; writes
gtopk-bench-results/step.json and a PNG.  Timings depend on the machine
and its load (recorded); compare ratios.  Results: docs/results.md.
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from typing import Dict, List

SIZES = [1_000_000, 25_000_000, 100_000_000]
THREADS = [1, 2]
WORKERS = [1, 2]
#: (label, method, density)
METHODS = [("gtopk 0.1%", "gtopk", 0.001), ("gtopk 1%", "gtopk", 0.01),
           ("topk 0.1%", "topk", 0.001), ("dense", "dense", 0.01)]
PHASES = ["check", "select", "communicate", "update", "total", "wait"]


def layouts(sizes) -> List[dict]:
    """name -> shape lists: N in 4 equal tensors per size, and ResNet-50."""
    from gtopk_plugin.bench.selection_bench import resnet50_shapes

    out = []
    for n in sizes:
        q = n // 4
        shapes = [(f"w{i}", (q if i < 3 else n - 3 * q,)) for i in range(4)]
        out.append({"layout": f"{n / 1e6:g}M x4", "shapes": shapes})
    out.append({"layout": "resnet50", "shapes": resnet50_shapes()})
    return out


def _median(v):
    return statistics.median(v) if v else float("nan")


def bench_case(transport, shapes, threads: int, reps: int, seed: int) -> List[dict]:
    """All methods on one layout and thread count; every rank runs this in
    lockstep (reduce() is collective)."""
    import torch

    import gtopk_plugin as gp
    from gtopk_plugin import kernels
    from gtopk_plugin.pipeline import huge_pages

    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(seed + 1000 * transport.rank)
    grads = {n: torch.randn(s, generator=gen) for n, s in shapes}
    numel = sum(t.numel() for t in grads.values())
    flat = torch.randn(numel, generator=gen)
    # the same read on 2 MB pages, as the reducer's own persistent buffers
    # are (gtopk_plugin.pipeline.huge_pages); the gradients, like flat, are the
    # caller's 4 KB pages
    flat_huge = huge_pages.empty_like(flat).copy_(flat)
    sizes = [t.numel() for t in grads.values()]
    offs = torch.tensor([0] + [sum(sizes[:i + 1]) for i in range(len(sizes))], dtype=torch.int64)
    reducers = {label: gp.GradientReducer(method=m, density=d, transport=transport)
                for label, m, d in METHODS}
    ks = {d: torch.tensor([gp.k_for(d, s) for s in sizes], dtype=torch.int64) for _, _, d in METHODS}

    def floor():
        return flat.sum()

    def floor_huge():
        return flat_huge.sum()

    def kern(d):
        return lambda: kernels.select_topk(flat, offs, ks[d])

    def merge(d):
        # a partner's set like this rank's own: in each segment k distinct
        # random indices (sorted, as a selection emits them), the same values
        # permuted; O(k) memory at any N
        idx_a, val_a = kernels.select_topk(flat, offs, ks[d])
        parts = []
        for s, (lo, hi) in enumerate(zip(offs[:-1].tolist(), offs[1:].tolist())):
            kk = int(ks[d][s])
            cand = torch.unique(torch.randint(hi - lo, (2 * kk + 16,), generator=gen))
            pick = cand[torch.randperm(cand.numel(), generator=gen)[:kk]].sort().values
            parts.append(pick + lo)
        idx_b = torch.cat(parts).to(idx_a.dtype)
        val_b = val_a[torch.randperm(val_a.numel(), generator=gen)]
        return lambda: kernels.merge_select(idx_a, val_a, idx_b, val_b, offs, ks[d])

    def sync():
        # every entry starts on all ranks at once: at P = 2 the floor and the
        # kernel then share the memory bus with the other rank exactly as
        # reduce()'s passes do (collectives keep those in lockstep); without
        # it the floor was contended in some runs and not in others
        if transport.size > 1:
            transport.control_allreduce_max(torch.zeros(1, dtype=torch.int64))

    entries = {"floor": floor, "floor huge": floor_huge}
    for d in sorted({d for _, m, d in METHODS if m != "dense"}):
        entries[f"kernel {d:g}"] = kern(d)
        entries[f"merge {d:g}"] = merge(d)
    for label in reducers:
        entries[label] = (lambda r: lambda: r.reduce(grads))(reducers[label])
    for _ in range(2):  # warm-up: first-use compile, buffers, page faults
        for f in entries.values():
            f()
    times: Dict[str, List[float]] = {e: [] for e in entries}
    phases: Dict[str, Dict[str, List[float]]] = {label: {p: [] for p in PHASES} for label in reducers}
    gc.collect()
    gc.disable()
    try:
        for _ in range(reps):
            for e, f in entries.items():
                sync()
                t0 = time.perf_counter()
                f()
                times[e].append(time.perf_counter() - t0)
                if e in reducers:
                    sec = reducers[e].last_stats.seconds
                    for p in PHASES:
                        phases[e][p].append(sec.get(p, 0.0))
    finally:
        gc.enable()
    floor_ms = _median(times["floor"]) * 1e3
    floor_huge_ms = _median(times["floor huge"]) * 1e3
    rows = []
    for label, m, d in METHODS:
        ph = {p: _median(v) * 1e3 for p, v in phases[label].items()}
        # local compute: total minus the time inside the transport's
        # primitives (waiting on the peer at the check and in the exchange;
        # the merges in "communicate" are local work and count)
        local_reps = [t - w for t, w in zip(phases[label]["total"], phases[label]["wait"])]
        local = _median(local_reps) * 1e3
        # the same ratio per repetition, each local time over the floor read
        # of its own repetition (a few ms apart), then the median: a drift of
        # the machine's speed (another VM, the other rank's scheduling) moves
        # both sides of one repetition alike, where the ratio of two medians
        # can take the floor from a fast moment and the reduce from a slow one
        paired = _median([lt / ft for lt, ft in zip(local_reps, times["floor"])])
        local_nc = _median([t - c for t, c in zip(phases[label]["total"], phases[label]["communicate"])]) * 1e3
        kernel_ms = None if m == "dense" else _median(times[f"kernel {d:g}"]) * 1e3
        merge_ms = None if m != "gtopk" else _median(times[f"merge {d:g}"]) * 1e3
        rows.append({"method": label, "density": d, "numel": numel, "tensors": len(sizes),
                     "threads": threads, "floor_ms": floor_ms, "kernel_ms": kernel_ms, "merge_ms": merge_ms,
                     "phases_ms": ph, "local_ms": local, "local_over_floor": local / floor_ms,
                     "local_over_floor_paired": paired,
                     "floor_huge_ms": floor_huge_ms, "local_over_floor_huge": local / floor_huge_ms,
                     "floor_reps_ms": [t * 1e3 for t in times["floor"]],
                     "local_reps_ms": [t * 1e3 for t in local_reps],
                     "total_minus_communicate_ms": local_nc,
                     "kernel_over_floor": None if kernel_ms is None else kernel_ms / floor_ms,
                     "total_over_floor": ph["total"] / floor_ms})
    del reducers, grads, flat, flat_huge
    gc.collect()
    return rows


def worker(ctx, payload) -> List[dict]:
    """gtopk_plugin.bench.bench_launch target (P = 2), also called directly for P = 1."""
    transport = ctx.transport if ctx is not None else _single()
    pinned = _pin(transport.rank) if payload.get("pin") else None
    rows = []
    for lay in payload["layouts"]:
        shapes = [(n, tuple(s)) for n, s in lay["shapes"]]
        for th in payload["threads"]:
            for r in bench_case(transport, shapes, th, payload["reps"], payload["seed"]):
                r.update(layout=lay["layout"], workers=transport.size, pinned_cpu=pinned)
                rows.append(r)
                if transport.rank == 0 and payload.get("echo"):
                    print(_fmt(r), flush=True)
    return rows


def _pin(rank: int):
    """Pin this rank's calling thread (its compute: one thread per worker)
    to CPU ``rank`` of those it may use, so two ranks never share a core or
    migrate between cores in the middle of a pass; threads started later
    inherit it.  Returns the CPU, or None where affinity cannot be set."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
        cpu = cpus[rank % len(cpus)]
        os.sched_setaffinity(0, {cpu})
        return cpu
    except (AttributeError, OSError):
        return None


def _single():
    from gtopk_plugin.collectives.transport import SingleProcessTransport

    return SingleProcessTransport()


def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _fmt(r: dict) -> str:
    ph = r["phases_ms"]
    k = "" if r["kernel_ms"] is None else f"{r['kernel_ms']:8.1f}"
    mg = "" if r.get("merge_ms") is None else f"{r['merge_ms']:6.1f}"
    return (f"P={r['workers']} t={r['threads']} {r['layout']:>9} {r['method']:>10} | floor "
            f"{r['floor_ms']:7.1f} kernel {k:>8} merge {mg:>6} | check {ph['check']:7.1f} select {ph['select']:7.1f} "
            f"comm {ph['communicate']:7.1f} update {ph['update']:7.1f} total {ph['total']:7.1f} wait {ph['wait']:6.1f} | "
            f"local {r['local_ms']:7.1f} = {r['local_over_floor']:5.1f}x floor"
            f" (paired {r['local_over_floor_paired']:4.1f}x; "
            f"floor on huge pages {r.get('floor_huge_ms', float('nan')):5.1f} ms: "
            f"{r.get('local_over_floor_huge', float('nan')):4.1f}x)")


def plot(rows: List[dict], path: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    cases = sorted({(r["workers"], r["threads"]) for r in rows})
    lays = list(dict.fromkeys(r["layout"] for r in rows))
    fig, axes = plt.subplots(1, len(cases), figsize=(5 * len(cases), 4), squeeze=False)
    for ax, (P, th) in zip(axes[0], cases):
        width = 0.8 / len(METHODS)
        for j, (label, _, _) in enumerate(METHODS):
            ys = [next((r["local_over_floor"] for r in rows if r["workers"] == P and r["threads"] == th
                        and r["layout"] == L and r["method"] == label), 0) for L in lays]
            ax.bar([i + j * width for i in range(len(lays))], ys, width, label=label)
        ax.axhline(6, color="k", ls="--", lw=0.8)
        ax.axhline(3, color="k", ls=":", lw=0.8)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(lays))])
        ax.set_xticklabels(lays, fontsize=8)
        ax.set_title(f"P={P}, {th} thread(s)")
        ax.set_ylabel("reduce() local compute / one read")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv=None) -> int:
    from gtopk_plugin.bench import bench_launch as launch
    from gtopk_plugin.bench.bench_record import RESULTS, write_json

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=SIZES)
    ap.add_argument("--threads", type=int, nargs="+", default=THREADS)
    ap.add_argument("--workers", type=int, nargs="+", default=WORKERS, choices=[1, 2])
    ap.add_argument("--no-resnet", action="store_true", help="leave out the ResNet-50 layout")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--pin", action="store_true",
                    help="pin rank r's compute thread to CPU r (one core per worker; for --threads 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--json", default=os.path.join(RESULTS, "step.json"))
    args = ap.parse_args(argv)
    rows: List[dict] = []
    skipped = []
    for P in args.workers:
        # grads, flat, residual, accumulator, update, a dense sum and wire copies:
        # about 9 N-sized (with the floor's huge-page copy) fp32 buffers per rank at peak
        sizes = [n for n in args.sizes if 9 * 4 * n * P < 0.8 * _mem_available()]
        skipped += [(P, n) for n in args.sizes if n not in sizes]
        lays = layouts(sizes)
        if args.no_resnet:
            lays = [L for L in lays if L["layout"] != "resnet50"]
        payload = {"layouts": lays, "threads": args.threads, "reps": args.reps, "seed": args.seed,
                   "echo": True, "pin": args.pin}
        if P == 1:
            allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
            rows += worker(None, payload)
            if allowed is not None:  # the P = 2 workers started next inherit it
                os.sched_setaffinity(0, allowed)
        else:
            per_rank = launch.run_workers(P, worker, payload, engine="torch", ifname="lo",
                                          timeout=args.timeout, echo=True)
            rows += per_rank[0]
    for P, n in skipped:
        print(f"skipped N={n} at P={P}: not enough memory available", file=sys.stderr)
    print()
    for r in rows:
        print(_fmt(r))
    settings = {"sizes": args.sizes, "threads": args.threads, "workers": args.workers, "reps": args.reps,
                "pin": args.pin,
                "methods": METHODS, "skipped": skipped, "nice": os.nice(0)}
    write_json(args.json, "step", settings, rows, packages=("torch", "gtopk_plugin"))
    png = os.path.splitext(args.json)[0] + ".png"
    print(f"wrote {args.json}" + (f" and {png}" if plot(rows, png) else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
