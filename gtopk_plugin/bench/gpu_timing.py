"""The timing part of ``gtopk-bench gpu-check`` (:mod:`gtopk_plugin.bench.gpu_check`):
the kernels against ``torch.topk`` and the one-read floor on the GPU (CUDA
events) or the CPU, and the table it prints."""
from __future__ import annotations

import statistics
import time
from typing import Callable, List

import torch

from gtopk_plugin import k_for
from gtopk_plugin.bench.selection_bench import _numel, resnet50_shapes
from gtopk_plugin.kernels import reference


def _resnet50_sizes() -> List[int]:
    """Element counts of ResNet-50's 161 parameter tensors."""
    return [_numel(s) for _, s in resnet50_shapes()]


class Timer:
    """Median milliseconds of fn over reps, each timed with CUDA events (or
    perf_counter on CPU); fn(i) gets the repetition number (to rotate inputs)."""

    def __init__(self, device: str):
        self.cuda = device == "cuda"

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def __call__(self, fn: Callable[[int], object], reps: int, warmup: int = 3) -> float:
        for i in range(warmup):
            fn(i)
        self.sync()
        ts = []
        for i in range(reps):
            if self.cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn(i)
                b.record()
                b.synchronize()
                ts.append(a.elapsed_time(b))
            else:
                t0 = time.perf_counter()
                fn(i)
                ts.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(ts)


def run_timing(mod, device: str, quick: bool, log=print) -> List[dict]:
    timer = Timer(device)
    rows: List[dict] = []
    g = torch.Generator(device=device).manual_seed(0)
    sizes = [1 << 16, 1 << 20] if quick else [1 << 24, 25_000_000, 100_000_000]
    densities = [0.001, 0.01]
    for n in sizes:
        nsets = 4 if n <= 25_000_000 else 2  # rotating inputs (> L2 in total)
        try:
            xs = [torch.randn(n, device=device, generator=g) for _ in range(nsets)]
        except RuntimeError as e:  # out of memory
            log(f"  N={n}: cannot allocate inputs ({e})")
            continue
        reps = 7 if quick else (30 if n <= 25_000_000 else 12)
        offsets = torch.tensor([0, n])
        floor = timer(lambda i: xs[i % nsets].sum(), reps)
        for d in densities:
            kk = k_for(d, n)
            k = torch.tensor([kk])
            row = {"layout": "single", "n": n, "density": d, "k": kk, "reps": reps, "floor_ms": floor}
            row["topk_ms"] = timer(lambda i: torch.topk(xs[i % nsets].abs(), kk, sorted=False), reps)
            for name, op in (("exact", "select_topk"), ("threshold", "select_threshold")):
                try:
                    row[f"{name}_ms"] = (timer(lambda i: getattr(mod, op)(xs[i % nsets], offsets, k), reps)
                                         if mod is not None else None)
                except Exception as e:  # noqa: BLE001
                    row[f"{name}_ms"] = None
                    row[f"{name}_error"] = f"{type(e).__name__}: {e}"
                    log(f"  FAIL timing {name} N={n} d={d}: {e}")
            # the reducer's step front: acc = grad + residual, flags, exact top-k
            # (grad = xs[i], residual = the next input), fused vs the reference
            acc = torch.empty(n, device=device)
            for name, m in (("fused", mod), ("fused_ref", reference)):
                try:
                    row[f"{name}_ms"] = (timer(lambda i: m.compensate_select_topk(
                        acc, [xs[i % nsets]], xs[(i + 1) % nsets], offsets, k), reps)
                        if m is not None else None)
                except Exception as e:  # noqa: BLE001
                    row[f"{name}_ms"] = None
                    log(f"  FAIL timing {name} N={n} d={d}: {e}")
            del acc
            rows.append(row)
            log("  " + _fmt(row))
        del xs
        if device == "cuda":
            torch.cuda.empty_cache()
    # ResNet-50 layout
    sizes = _resnet50_sizes()
    if quick:
        sizes = [max(1, s // 64) for s in sizes]
    gen = torch.Generator().manual_seed(1)
    scales = torch.exp(torch.empty(len(sizes)).uniform_(-4, 3, generator=gen))
    flats = []
    for _ in range(4):
        flats.append(torch.cat([torch.randn(s, device=device, generator=g) * float(c)
                                for s, c in zip(sizes, scales)]))
    offsets = torch.tensor([0] + sizes).cumsum(0)
    views = [list(torch.split(f, sizes)) for f in flats]
    reps = 7 if quick else 20
    floor = timer(lambda i: flats[i % 4].sum(), reps)
    for d in densities:
        ks = [k_for(d, s) for s in sizes]
        k_t = torch.tensor(ks)
        row = {"layout": "resnet50", "tensors": len(sizes), "n": sum(sizes), "density": d,
               "k": sum(ks), "reps": reps, "floor_ms": floor}
        row["topk_ms"] = timer(lambda i: [torch.topk(v.abs(), kk, sorted=False)
                                          for v, kk in zip(views[i % 4], ks)], reps)
        for name, op in (("exact", "select_topk"), ("threshold", "select_threshold")):
            try:
                row[f"{name}_ms"] = (timer(lambda i: getattr(mod, op)(flats[i % 4], offsets, k_t), reps)
                                     if mod is not None else None)
            except Exception as e:  # noqa: BLE001
                row[f"{name}_ms"] = None
                row[f"{name}_error"] = f"{type(e).__name__}: {e}"
                log(f"  FAIL timing {name} resnet50 d={d}: {e}")
        rows.append(row)
        log("  " + _fmt(row))
    return rows


def _ratio(a, b):
    return (a / b) if (a is not None and b) else None


def _f(v, spec=".3f", width=8):
    return f"{v:{width}{spec}}" if v is not None else f"{'-':>{width}}"


def _fmt(r: dict) -> str:
    name = "ResNet-50" if r["layout"] == "resnet50" else f"{r['n'] / 1e6:.1f}M"
    return (f"{name:>9} {r['density'] * 100:5.1f}% | floor {_f(r['floor_ms'])} | topk {_f(r['topk_ms'])} | "
            f"exact {_f(r.get('exact_ms'))} | thr {_f(r.get('threshold_ms'))} ms | "
            f"topk/exact {_f(_ratio(r['topk_ms'], r.get('exact_ms')), '.1f', 5)}x | "
            f"exact/floor {_f(_ratio(r.get('exact_ms'), r['floor_ms']), '.1f', 5)}x | "
            f"thr/floor {_f(_ratio(r.get('threshold_ms'), r['floor_ms']), '.1f', 5)}x"
            + (f" | comp+exact {_f(r.get('fused_ms'))} (ref {_f(r.get('fused_ref_ms'))}) ms, "
               f"{_f(_ratio(r.get('fused_ms'), r['floor_ms']), '.1f', 5)}x floor"
               if "fused_ms" in r else ""))


def markdown(rows: List[dict]) -> str:
    out = ["| layout | density | floor ms | torch.topk ms | exact ms | threshold ms | topk / exact "
           "| exact / floor | threshold / floor |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        name = "ResNet-50 (161 tensors)" if r["layout"] == "resnet50" else f"{r['n'] / 1e6:.1f}M"

        def c(v, spec=".3f"):
            return "-" if v is None else f"{v:{spec}}"
        out.append(f"| {name} | {r['density'] * 100:g}% | {c(r['floor_ms'])} | {c(r['topk_ms'])} | "
                   f"{c(r.get('exact_ms'))} | {c(r.get('threshold_ms'))} | "
                   f"{c(_ratio(r['topk_ms'], r.get('exact_ms')), '.1f')}x | "
                   f"{c(_ratio(r.get('exact_ms'), r['floor_ms']), '.1f')}x | "
                   f"{c(_ratio(r.get('threshold_ms'), r['floor_ms']), '.1f')}x |")
    return "\n".join(out)
