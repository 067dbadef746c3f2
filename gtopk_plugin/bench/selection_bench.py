"""Selection speed on CPU: torch.topk vs the compiled kernels vs one read.

    gtopk-bench selection                # the full grid (a few minutes)
    gtopk-bench selection --sizes 1000000 10000000 --threads 1

For every N x density x thread count, interleaved on the same tensor:
``floor`` (``x.sum()``), ``torch.topk`` (of ``x.abs()``), ``exact``
(``kernels.select_topk``) and ``threshold`` (``kernels.select_threshold``,
with its recall and count / k); plus ResNet-50's 161 tensors in one kernel
call against a loop of torch.topk.  Prints medians and ratios and writes
JSON + PNG to gtopk-bench-results/.  Compare ratios, not milliseconds;
results: docs/results.md.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import os
import platform
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch

from gtopk_plugin import k_for, kernels

from gtopk_plugin.bench.bench_record import RESULTS, write_json
from gtopk_plugin.kernels import cpu as cpu_kernels

SIZES = [1_000_000, 10_000_000, 25_000_000, 100_000_000]
DENSITIES = [0.001, 0.01]
THREADS = [1, 2]
METHODS = ["floor", "torch.topk", "exact", "threshold"]


# ---------------------------------------------------------------------------
# ResNet-50 parameter layout (torchvision.models.resnet50, no torchvision needed)

def resnet50_shapes() -> List[Tuple[str, Tuple[int, ...]]]:
    """(name, shape) of the 161 parameter tensors of ResNet-50, in model order."""
    shapes: List[Tuple[str, Tuple[int, ...]]] = [("conv1.weight", (64, 3, 7, 7)),
                                                 ("bn1.weight", (64,)), ("bn1.bias", (64,))]
    inplanes = 64
    for li, (planes, blocks) in enumerate([(64, 3), (128, 4), (256, 6), (512, 3)], start=1):
        out = planes * 4
        for b in range(blocks):
            p = f"layer{li}.{b}."
            shapes += [(p + "conv1.weight", (planes, inplanes, 1, 1)),
                       (p + "bn1.weight", (planes,)), (p + "bn1.bias", (planes,)),
                       (p + "conv2.weight", (planes, planes, 3, 3)),
                       (p + "bn2.weight", (planes,)), (p + "bn2.bias", (planes,)),
                       (p + "conv3.weight", (out, planes, 1, 1)),
                       (p + "bn3.weight", (out,)), (p + "bn3.bias", (out,))]
            if b == 0:
                shapes += [(p + "downsample.0.weight", (out, inplanes, 1, 1)),
                           (p + "downsample.1.weight", (out,)), (p + "downsample.1.bias", (out,))]
            inplanes = out
    shapes += [("fc.weight", (1000, 2048)), ("fc.bias", (1000,))]
    return shapes


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# ---------------------------------------------------------------------------
# Timing

def _time(f: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    f()
    return time.perf_counter() - t0


def _interleaved(methods: Dict[str, Callable[[], object]], reps: int,
                 mins: Optional[Dict[str, float]] = None) -> Dict[str, float]:
    """Median seconds of each method; every repetition runs each once, in turn.
    ``mins`` (if given) receives the fastest repetition of each."""
    for f in methods.values():  # warm-up (allocator, page faults, first-use compile)
        f()
    times: Dict[str, List[float]] = {m: [] for m in methods}
    gc.collect()
    gc.disable()  # a GC pass over the interpreter heap would land in one method's time
    try:
        for _ in range(reps):
            for m, f in methods.items():
                times[m].append(_time(f))
    finally:
        gc.enable()
    if mins is not None:
        mins.update({m: min(v) for m, v in times.items()})
    return {m: statistics.median(v) for m, v in times.items()}


def _recall(x, offsets, k) -> Tuple[float, float]:
    """Recall of the exact top-k set by the threshold selection, and its count / k."""
    ex, _ = kernels.select_topk(x, offsets, k)
    th, _ = kernels.select_threshold(x, offsets, k)
    inter = torch.isin(th.long(), ex.long()).sum().item()
    K = int(k.sum())
    return inter / K, th.numel() / K


def bench_grid(sizes, densities, threads, reps, log=print) -> List[dict]:
    rows = []
    g = torch.Generator().manual_seed(0)
    for n in sizes:
        x = torch.randn(n, generator=g)
        offsets = torch.tensor([0, n])
        r = reps if n <= 25_000_000 else max(3, reps // 2)
        for t in threads:
            torch.set_num_threads(t)
            ks = {d: torch.tensor([k_for(d, n)]) for d in densities}
            methods = {"floor": lambda: x.sum()}
            for d in densities:
                kk, ki = ks[d], int(ks[d])
                methods[f"torch.topk@{d}"] = lambda ki=ki: torch.topk(x.abs(), ki, sorted=False)
                methods[f"exact@{d}"] = lambda kk=kk: kernels.select_topk(x, offsets, kk)
                methods[f"threshold@{d}"] = lambda kk=kk: kernels.select_threshold(x, offsets, kk)
            fastest: Dict[str, float] = {}
            med = _interleaved(methods, r, fastest)
            for d in densities:
                recall, count = _recall(x, offsets, ks[d])
                row = {"n": n, "density": d, "k": int(ks[d]), "threads": t, "reps": r,
                       "floor_ms": med["floor"] * 1e3,
                       "topk_ms": med[f"torch.topk@{d}"] * 1e3,
                       "exact_ms": med[f"exact@{d}"] * 1e3,
                       "threshold_ms": med[f"threshold@{d}"] * 1e3,
                       "threshold_recall": recall, "threshold_count_over_k": count,
                       "min_ms": {"floor": fastest["floor"] * 1e3,
                                  "topk": fastest[f"torch.topk@{d}"] * 1e3,
                                  "exact": fastest[f"exact@{d}"] * 1e3,
                                  "threshold": fastest[f"threshold@{d}"] * 1e3}}
                row["topk_over_exact"] = row["topk_ms"] / row["exact_ms"]
                row["exact_over_floor"] = row["exact_ms"] / row["floor_ms"]
                row["threshold_over_floor"] = row["threshold_ms"] / row["floor_ms"]
                rows.append(row)
                log(_fmt_row(row))
        del x
    return rows


def bench_resnet(densities, threads, reps, log=print) -> List[dict]:
    shapes = resnet50_shapes()
    sizes = [_numel(s) for _, s in shapes]
    g = torch.Generator().manual_seed(1)
    # per-layer gradient scales spread over three decades, like real layers
    scales = torch.exp(torch.empty(len(sizes)).uniform_(-4, 3, generator=g))
    flat = torch.cat([torch.randn(n, generator=g) * float(s) for n, s in zip(sizes, scales)])
    offsets = torch.tensor([0] + sizes).cumsum(0)
    views = list(torch.split(flat, sizes))
    rows = []
    for t in threads:
        torch.set_num_threads(t)
        methods = {}
        for d in densities:
            ks = [k_for(d, n) for n in sizes]
            k_t = torch.tensor(ks)

            def loop(ks=ks):
                return [torch.topk(v.abs(), k, sorted=False) for v, k in zip(views, ks)]

            methods[f"loop@{d}"] = loop
            methods[f"exact@{d}"] = lambda k_t=k_t: kernels.select_topk(flat, offsets, k_t)
            methods[f"threshold@{d}"] = lambda k_t=k_t: kernels.select_threshold(flat, offsets, k_t)
        methods["floor"] = lambda: flat.sum()
        fastest: Dict[str, float] = {}
        med = _interleaved(methods, reps, fastest)
        for d in densities:
            k_t = torch.tensor([k_for(d, n) for n in sizes])
            recall, count = _recall(flat, offsets, k_t)
            row = {"layout": "resnet50", "tensors": len(sizes), "n": flat.numel(), "density": d,
                   "k": int(k_t.sum()), "threads": t, "reps": reps,
                   "floor_ms": med["floor"] * 1e3, "loop_topk_ms": med[f"loop@{d}"] * 1e3,
                   "exact_ms": med[f"exact@{d}"] * 1e3, "threshold_ms": med[f"threshold@{d}"] * 1e3,
                   "threshold_recall": recall, "threshold_count_over_k": count,
                   "min_ms": {"floor": fastest["floor"] * 1e3, "loop_topk": fastest[f"loop@{d}"] * 1e3,
                              "exact": fastest[f"exact@{d}"] * 1e3,
                              "threshold": fastest[f"threshold@{d}"] * 1e3}}
            row["loop_over_exact"] = row["loop_topk_ms"] / row["exact_ms"]
            rows.append(row)
            log(f"resnet50 {len(sizes)} tensors {flat.numel() / 1e6:.1f}M d={d:<6} t={t}  "
                f"loop {row['loop_topk_ms']:8.1f} ms  exact {row['exact_ms']:7.1f} ms  "
                f"({row['loop_over_exact']:.1f}x)  threshold {row['threshold_ms']:7.1f} ms  "
                f"floor {row['floor_ms']:6.1f} ms")
    return rows


# ---------------------------------------------------------------------------
# Output

HEADER = ("     N  density thr |  floor  torch.topk    exact  threshold | topk/exact exact/floor "
          "thr/floor | recall count/k")


def _fmt_row(r: dict) -> str:
    return (f"{r['n'] / 1e6:5.0f}M {r['density'] * 100:6.1f}% {r['threads']:3d} | "
            f"{r['floor_ms']:6.1f} {r['topk_ms']:11.1f} {r['exact_ms']:8.1f} {r['threshold_ms']:10.1f} | "
            f"{r['topk_over_exact']:10.1f} {r['exact_over_floor']:11.1f} {r['threshold_over_floor']:9.1f} | "
            f"{r['threshold_recall']:6.3f} {r['threshold_count_over_k']:7.3f}")


def markdown(grid: List[dict], resnet: List[dict]) -> str:
    out = ["| N | density | threads | floor ms | torch.topk ms | exact ms | threshold ms | "
           "topk / exact | exact / floor | threshold / floor | recall | count / k |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in grid:
        out.append(f"| {r['n'] / 1e6:.0f}M | {r['density'] * 100:g}% | {r['threads']} | "
                   f"{r['floor_ms']:.1f} | {r['topk_ms']:.1f} | {r['exact_ms']:.1f} | "
                   f"{r['threshold_ms']:.1f} | {r['topk_over_exact']:.1f}x | "
                   f"{r['exact_over_floor']:.1f}x | {r['threshold_over_floor']:.1f}x | "
                   f"{r['threshold_recall']:.3f} | {r['threshold_count_over_k']:.3f} |")
    if resnet:
        out += ["", "| ResNet-50 layout | density | threads | loop of torch.topk ms | exact ms | "
                "threshold ms | loop / exact | floor ms |", "|---|---|---|---|---|---|---|---|"]
        for r in resnet:
            out.append(f"| {r['tensors']} tensors, {r['n'] / 1e6:.1f}M | {r['density'] * 100:g}% | "
                       f"{r['threads']} | {r['loop_topk_ms']:.1f} | {r['exact_ms']:.1f} | "
                       f"{r['threshold_ms']:.1f} | {r['loop_over_exact']:.1f}x | {r['floor_ms']:.1f} |")
    return "\n".join(out)


def _plot(grid: List[dict], path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return False
    threads = sorted({r["threads"] for r in grid})
    fig, axes = plt.subplots(1, len(threads), figsize=(6 * len(threads), 4.5), sharey=True,
                             squeeze=False)
    axes = axes[0]
    for ax, t in zip(axes, threads):
        for d, ls in zip(sorted({r["density"] for r in grid}), ["-", "--"]):
            rows = sorted((r for r in grid if r["threads"] == t and r["density"] == d), key=lambda r: r["n"])
            ns = [r["n"] for r in rows]
            for key, label, c in [("topk_ms", "torch.topk", "C3"), ("exact_ms", "exact", "C0"),
                                  ("threshold_ms", "threshold", "C2"), ("floor_ms", "floor x.sum()", "C7")]:
                if key == "floor_ms" and ls == "--":
                    continue
                ax.plot(ns, [r[key] for r in rows], ls, color=c, marker="o",
                        label=f"{label} d={d * 100:g}%" if key != "floor_ms" else label)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("N (fp32 elements)")
        ax.set_title(f"{t} thread{'s' if t > 1 else ''}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("median time (ms)")
    axes[-1].legend(fontsize=8)
    fig.suptitle("Per-tensor selection on CPU (gtopk_plugin.kernels)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _machine() -> dict:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
    except Exception:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__,
            "python": platform.python_version(), "kernels_backend": kernels.backend("cpu"),
            "kernels_origin": cpu_kernels.origin(),
            "loadavg_start": os.getloadavg() if hasattr(os, "getloadavg") else None}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=SIZES)
    ap.add_argument("--densities", type=float, nargs="+", default=DENSITIES)
    ap.add_argument("--threads", type=int, nargs="+", default=THREADS)
    ap.add_argument("--reps", type=int, default=7, help="timed repetitions per method (medians)")
    ap.add_argument("--no-resnet", action="store_true", help="skip the ResNet-50 layout case")
    ap.add_argument("--out", default=RESULTS)
    args = ap.parse_args(argv)

    t_start = time.perf_counter()
    threads_before = torch.get_num_threads()
    info = _machine()
    print(f"# {info['cpu']}, {info['cores']} cores, torch {info['torch']}, kernels: "
          f"{info['kernels_backend']} ({info['kernels_origin']}), load average {info['loadavg_start']}")
    if info["kernels_backend"] != "cpu":
        print("# WARNING: the compiled CPU kernels are not in use; timing the reference kernels")
    print(HEADER)
    try:
        grid = bench_grid(args.sizes, args.densities, args.threads, args.reps)
        resnet = [] if args.no_resnet else bench_resnet(args.densities, args.threads, args.reps)
    finally:
        torch.set_num_threads(threads_before)
    info["loadavg_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    info["seconds"] = time.perf_counter() - t_start
    result = {"benchmark": "selection", "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "machine": info, "grid": grid, "resnet50": resnet}
    write_json(os.path.join(args.out, "selection.json"), "selection", document=result)
    png = os.path.join(args.out, "selection.png")
    plotted = _plot(grid, png) if grid else False
    print()
    print(markdown(grid, resnet))
    print(f"\nwrote {os.path.join(args.out, 'selection.json')}" + (f" and {png}" if plotted else "")
          + f" in {info['seconds']:.0f} s")
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
