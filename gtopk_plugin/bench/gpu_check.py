"""One prepared GPU check of the CUDA kernels (csrc/cuda): build, verify, time.

    gtopk-bench gpu-check                 # on a machine with a GPU (< 5 minutes)
    gtopk-bench gpu-check --device cpu --quick   # smoke test of this script, no GPU

Needs torch with CUDA and CuPy already installed (``gtopk-plugin[cuda]``).

1. **Build**: loads the ``cuda`` back end (NVRTC compile; time printed);
   if it cannot load, the checks are skipped and timing still runs.
2. **Checks**: every kernel against the reference on the same GPU, bit for
   bit, on data with ties, -0.0, NaN/Inf, denormals, edge k and segments,
   all dtypes; free allocator blocks are poisoned (0xFF) before every call
   so an unwritten output shows; failures are printed and it goes on.
3. **Timing** (CUDA events, medians): exact and threshold selection
   against a torch.topk loop and the one-read floor, for several N and
   densities and the ResNet-50 layout, plus the fused compensation.
4. **Sanitizer**: the GPU device tests of tests/unit/test_kernels_cuda.py
   (float32 cases, ``--sanitize-k``) under ``compute-sanitizer`` memcheck,
   racecheck and synccheck; skipped with a line when the tool or the test
   files (a checkout) are absent.  CI runs the same tests on the CPU
   executor (cuda_executor/) with its own checks.

Prints the table last and writes gtopk-bench-results/gpu_check.json
(``--out``).  See docs/kernels.md.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
import time
import traceback
from typing import Callable, List, Optional

import torch

from gtopk_plugin import k_for
from gtopk_plugin.kernels import reference

from gtopk_plugin.bench.bench_record import RESULTS, write_json
from gtopk_plugin.bench.gpu_timing import _resnet50_sizes, markdown, run_timing

INT_VIEW = {torch.float32: torch.int32, torch.float64: torch.int64,
            torch.float16: torch.int16, torch.bfloat16: torch.int16}
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


# ---------------------------------------------------------------------------
# Back end


def load_backend(device: str):
    """The module whose kernels are checked and timed: kernels/cuda.py on a
    GPU, kernels/cpu.py for the --device cpu smoke test."""
    t0 = time.perf_counter()
    if device == "cuda":
        from gtopk_plugin.kernels import cuda as mod
    else:
        from gtopk_plugin.kernels import cpu as mod
    ok = mod.load() is not None
    return (mod if ok else None), time.perf_counter() - t0


# ---------------------------------------------------------------------------
# Checks


def poison(device: str) -> None:
    """Fill the caching allocator's free memory with 0xFF bytes, so that
    buffers handed out next start as garbage (NaN floats, -1 indices)."""
    if device != "cuda":
        return
    free = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    if free > 0:
        try:
            junk = torch.full((int(free * 0.9),), 0xFF, dtype=torch.uint8, device=device)
            del junk
        except RuntimeError:
            pass


def _bits(t):
    return t.view(INT_VIEW[t.dtype]) if t.dtype in INT_VIEW else t


def same(a: torch.Tensor, b: torch.Tensor) -> Optional[str]:
    """None when a and b hold the same bits (any NaN equals any NaN), else why not."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"dtype/shape {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    a, b = a.cpu(), b.cpu()
    if a.dtype.is_floating_point:
        na, nb = torch.isnan(a), torch.isnan(b)
        if not torch.equal(na, nb):
            return f"NaN positions differ ({int(na.sum())} vs {int(nb.sum())})"
        a, b = _bits(a)[~na], _bits(b)[~nb]
    if not torch.equal(a, b):
        bad = (a != b).nonzero()
        i = int(bad[0]) if bad.numel() else -1
        return f"{int((a != b).sum())} elements differ, first at {i}: {a[i].item()} vs {b[i].item()}"
    return None


def _data(n: int, dtype, g, device) -> torch.Tensor:
    x = torch.randn(n, generator=g)
    if n > 1000:
        x[100:200] = 0.5           # ties
        x[200:260] = -0.5
        x[300:400] = 0.0
        x[400:420] = -0.0
        x[500] = float("nan")
        x[501] = float("inf")
        x[502] = -float("inf")
        x[600:604] = torch.tensor([1e-40, -1e-42, 1e-45, 3e-39])  # denormals (fp32)
    return x.to(dtype).to(device)


def _select_cases(g):
    """(name, n, offsets, ks) cases: tiny/empty segments, k = 0, 1, n, n+1,
    a plateau, large segments (candidate buffers) and all-equal data."""
    return [
        ("mixed-segments", 70_000, [0, 0, 1, 3, 700, 1000, 20_000, 70_000],
         [[0, 1, 1, 50, 300, 1900, 700], [5, 5, 2, 697, 1000, 1, 50_000],
          [3, 1, 3, 698, 301, 19_000, 49_999], [1] * 7]),
        ("one-large", 3_000_000, [0, 3_000_000], [[30_000], [1], [2_999_999], [3_000_000]]),
        ("resnet50-layout-small-k", None, None, None),
    ]


def run_checks(mod, device: str, seed: int, quick: bool, log=print) -> List[dict]:
    results: List[dict] = []

    def check(name: str, fn: Callable[[], Optional[str]]):
        t0 = time.perf_counter()
        try:
            err = fn()
        except Exception as e:  # noqa: BLE001 - report and go on
            err = f"raised {type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}"
        dt = time.perf_counter() - t0
        results.append({"check": name, "ok": err is None, "error": err, "s": round(dt, 3)})
        log(f"  {'ok  ' if err is None else 'FAIL'} {name} ({dt:.2f} s)" + ("" if err is None else f": {err}"))

    g = torch.Generator().manual_seed(seed)
    dtypes = DTYPES[:1] if quick else DTYPES
    # selection
    for dtype in dtypes:
        for cname, n, offsets, kss in _select_cases(g):
            if n is None:  # the ResNet-50 layout at 0.1% and 1%
                sizes = _resnet50_sizes()
                offsets = [0]
                for s in sizes:
                    offsets.append(offsets[-1] + s)
                n = offsets[-1]
                if quick or dtype != torch.float32:
                    continue
                kss = [[k_for(d, s) for s in sizes] for d in (0.001, 0.01)]
            if quick and n > 100_000:
                continue
            x = _data(n, dtype, g, device)
            off = torch.tensor(offsets)
            for ks in kss:
                k = torch.tensor(ks)
                tag = f"{cname} {str(dtype)[6:]} k={ks[:4]}{'...' if len(ks) > 4 else ''}"
                for op in ("select_topk", "select_threshold"):
                    def f(op=op, x=x, off=off, k=k):
                        ref = getattr(reference, op)(x, off, k)
                        poison(device)
                        got = getattr(mod, op)(x, off, k)
                        for what, a, b in zip(("indices", "values"), got, ref):
                            e = same(a, b)
                            if e:
                                return f"{what}: {e}"
                        return None
                    check(f"{op} {tag}", f)
            del x
    # merge
    for dtype in dtypes:
        for itype in (torch.int32, torch.int64):
            def f(dtype=dtype, itype=itype):
                offsets = torch.tensor([0, 500, 520, 3000, 100_000, 2_000_000])
                k = torch.tensor([40, 0, 200, 1500, 20_000])
                ia = torch.sort(torch.randperm(2_000_000, generator=g)[:90_000]).values.to(itype)
                ib = torch.sort(torch.randperm(2_000_000, generator=g)[:70_000]).values.to(itype)
                va = torch.randn(90_000, generator=g).to(dtype)
                vb = torch.randn(70_000, generator=g).to(dtype)
                va[:50], vb[:50], va[60], vb[61] = -0.25, 0.25, float("nan"), -0.0
                a = [t.to(device) for t in (ia, va)]
                b = [t.to(device) for t in (ib, vb)]
                ref = reference.merge_select(*a, *b, offsets, k)
                poison(device)
                got = mod.merge_select(*a, *b, offsets, k)
                for what, x, y in zip(("idx", "val", "keep_a", "keep_b"), got, ref):
                    e = same(x, y)
                    if e:
                        return f"{what}: {e}"
                poison(device)
                sw = mod.merge_select(*b, *a, offsets, k)
                e = same(sw[1], got[1]) or same(sw[0].long(), got[0].long())
                return f"not symmetric: {e}" if e else None
            check(f"merge_select {str(dtype)[6:]} {str(itype)[6:]}", f)
    # scatter
    for dtype in dtypes:
        for divisor in (1, 3, 7):
            def f(dtype=dtype, divisor=divisor):
                n = 1_000_000
                idx = torch.sort(torch.randperm(n, generator=g)[:10_000]).values.to(torch.int32).to(device)
                vals = torch.randn(10_000, generator=g).to(dtype).to(device)
                for name, ours, theirs in (
                        ("scatter_update", lambda: mod.scatter_update(n, idx, vals, divisor, dtype),
                         lambda: reference.scatter_update(n, idx, vals, divisor, dtype)),
                        ("scatter_update unsorted",
                         lambda: mod.scatter_update(n, idx.flip(0), vals, divisor, dtype),
                         lambda: reference.scatter_update(n, idx.flip(0), vals, divisor, dtype))):
                    ref = theirs()
                    poison(device)
                    got = ours()
                    got = got if isinstance(got, tuple) else (got,)
                    ref = ref if isinstance(ref, tuple) else (ref,)
                    for a, b in zip(got, ref):
                        e = same(a, b)
                        if e:
                            return f"{name}: {e}"
                return None
            check(f"scatter/residual {str(dtype)[6:]} divisor={divisor}", f)
    run_fused_checks(mod, device, g, dtypes, quick, check)
    return results


def _first_diff(pairs) -> Optional[str]:
    for what, a, b in pairs:
        e = same(a, b) if isinstance(a, torch.Tensor) else (None if a == b else f"{a} vs {b}")
        if e:
            return f"{what}: {e}"
    return None


def run_fused_checks(mod, device: str, g, dtypes, quick: bool, check) -> None:
    """The reducer's kernels: compensate, compensate_select_topk
    (acc, flags and the top-k; layer and global segments, NaN/Inf
    gradients, heavy ties), subtract_at_, scatter_reset_, div_count_."""
    sizes = [0, 3, 700, 20_000, 30_000 if quick else 3_000_000]
    N = sum(sizes)
    layer = torch.tensor([0] + sizes).cumsum(0)
    for dtype in dtypes:
        for bad, resid in (((), False), ((3,), True), ((1, 4), True)):
            def f(dtype=dtype, bad=bad, resid=resid):
                grads = [_data(n, dtype, g, device) for n in sizes]
                for t, n in enumerate(sizes):
                    if t in bad and n:
                        grads[t][n // 2] = float("nan")
                    elif n > 502:
                        grads[t][500:503] = 0.25  # _data put NaN/Inf there
                r = _data(N, dtype, g, device) * 0.5 if resid else None
                if r is not None:
                    r[torch.isfinite(r).logical_not()] = 0.0
                cases = [(layer, [1, 1, 50, 300, sizes[-1] // 100]),
                         (layer, [0, 3, 700, 1, sizes[-1] // 2]), (torch.tensor([0, N]), [N // 1000])]
                if device == "cuda":  # segments short of acc (the CPU kernel refuses them)
                    cases.append((torch.tensor([0, 5000]), [9]))
                for offsets, ks in cases:
                    k = torch.tensor(ks)
                    acc = torch.empty(N, dtype=dtype, device=device)
                    ref_acc = acc.clone()
                    ref = reference.compensate_select_topk(ref_acc, grads, r, offsets, k)
                    poison(device)
                    got = mod.compensate_select_topk(acc, grads, r, offsets, k)
                    e = _first_diff(zip(("idx", "vals", "finite"), got, ref)) or same(acc, ref_acc)
                    if e:
                        return f"compensate_select_topk k={ks}: {e}"
                    if got[2].tolist() != [t not in bad for t in range(len(sizes))]:
                        return f"finite flags {got[2].tolist()} for bad={bad}"
                for t, x in enumerate(grads):
                    rr = None if r is None else r[int(layer[t]):int(layer[t + 1])]
                    out, ref_out = torch.empty_like(x), torch.empty_like(x)
                    e = _first_diff([("finite", mod.compensate(out, x, rr),
                                      reference.compensate(ref_out, x, rr)), ("out", out, ref_out)])
                    if e:
                        return f"compensate grad {t}: {e}"
                z = [torch.zeros(200_000, dtype=dtype, device=device)]
                z[0][[5, 77, 100_000]] = torch.tensor([1.0, -2.0, 0.5], dtype=dtype, device=device)
                for ks in ([2], [3000]):  # heavy ties: the sampled bound fails
                    off, k = torch.tensor([0, 200_000]), torch.tensor(ks)
                    acc, ref_acc = z[0].clone(), z[0].clone()
                    e = _first_diff(zip(("idx", "vals", "finite"),
                                        mod.compensate_select_topk(acc, z, None, off, k),
                                        reference.compensate_select_topk(ref_acc, z, None, off, k)))
                    if e:
                        return f"heavy ties k={ks}: {e}"
                return None
            check(f"compensate(_select_topk) {str(dtype)[6:]} bad={bad} residual={resid}", f)
        for divisor in (1, 3, 7):
            def f(dtype=dtype, divisor=divisor):
                n = 1_000_000
                base = _data(n, dtype, g, device)
                base[1000:30_000] = 0.0
                for itype in (torch.int32, torch.int64):
                    idx = torch.sort(torch.randperm(n, generator=g)[:10_000]).values.to(itype).to(device)
                    sent = _data(10_000, dtype, g, device)
                    prev = torch.sort(torch.randperm(n, generator=g)[:8000]).values.to(itype).to(device)
                    prev[:100] = idx[:100]
                    a, b = base.clone(), base.clone()
                    e = _first_diff([("subtract_at_", mod.subtract_at_(a, idx, sent),
                                      reference.subtract_at_(b, idx, sent))])
                    a, b = base.clone(), base.clone()
                    e = e or _first_diff([("scatter_reset_", mod.scatter_reset_(a, prev, idx, sent, divisor),
                                           reference.scatter_reset_(b, prev, idx, sent, divisor))])
                    if e:
                        return f"{str(itype)[6:]} {e}"
                a, b = base.clone(), base.clone()
                return _first_diff([("div_count_ count", mod.div_count_(a, divisor),
                                     reference.div_count_(b, divisor)), ("div_count_ x", a, b)])
            check(f"subtract_at_/scatter_reset_/div_count_ {str(dtype)[6:]} divisor={divisor}", f)


# ---------------------------------------------------------------------------
# compute-sanitizer runs of the device tests

SANITIZER_TOOLS = ("memcheck", "racecheck", "synccheck")
SANITIZER_K = "cuda and not executor and (dtype0 or dispatch)"


def run_sanitizer(tools, k_expr: str, timeout_s: float, log=print) -> List[dict]:
    """pytest of the GPU device tests under each compute-sanitizer tool: one
    row per tool (ok None: skipped, with the reason)."""
    exe = shutil.which("compute-sanitizer")
    if exe is None and os.path.exists("/usr/local/cuda/bin/compute-sanitizer"):
        exe = "/usr/local/cuda/bin/compute-sanitizer"
    tests = Path(__file__).resolve().parents[2] / "tests" / "unit" / "test_kernels_cuda.py"
    why = ("compute-sanitizer not found (CUDA toolkit)" if exe is None else
           None if tests.exists() else f"{tests} not found (needs a checkout)")
    if why:
        log(f"  sanitizer runs SKIPPED: {why}")
        return [{"tool": t, "ok": None, "error": why, "s": 0.0} for t in tools]
    rows = []
    for tool in tools:
        cmd = [exe, "--tool", tool, "--error-exitcode", "99", "--target-processes", "all",
               sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tests),
               "-k", k_expr]
        t0 = time.perf_counter()
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                               cwd=str(tests.parents[2]))
            out, rc = r.stdout + r.stderr, r.returncode
        except subprocess.TimeoutExpired as e:
            out, rc = f"timed out after {timeout_s:.0f} s: {(e.stdout or b'')[-2000:]!r}", -1
        dt = time.perf_counter() - t0
        summary = [ln for ln in out.splitlines() if "SUMMARY" in ln or " passed" in ln
                   or " failed" in ln]
        ok = rc == 0
        rows.append({"tool": tool, "ok": ok, "error": None if ok else out[-4000:],
                     "summary": summary[-3:], "s": round(dt, 1)})
        log(f"  {'ok  ' if ok else 'FAIL'} compute-sanitizer --tool {tool} ({dt:.0f} s): "
            f"{'; '.join(summary[-2:]) or out[-300:]}")
    return rows


# ---------------------------------------------------------------------------
# Timing


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cuda (the real check) or cpu (smoke test of the script on the CPU back end)")
    ap.add_argument("--quick", action="store_true", help="small sizes, one dtype")
    ap.add_argument("--seed", type=int, default=None, help="check data seed (default: time-based)")
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--out", default=os.path.join(RESULTS, "gpu_check.json"))
    ap.add_argument("--sanitize", nargs="*", default=list(SANITIZER_TOOLS), metavar="TOOL",
                    help=f"compute-sanitizer tools to run the device tests under (default: all of "
                         f"{', '.join(SANITIZER_TOOLS)}; none: --sanitize with no tool)")
    ap.add_argument("--sanitize-k", default=SANITIZER_K, help="pytest -k of the sanitized tests")
    ap.add_argument("--sanitize-timeout", type=float, default=300.0, help="seconds per tool")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device (torch.cuda.is_available() is False); "
              "use --device cpu for a smoke test of the script", file=sys.stderr)
        return 2
    seed = args.seed if args.seed is not None else int(time.time()) % 100_000
    info = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor(),
            "torch": torch.__version__, "python": platform.python_version(), "seed": seed,
            "quick": args.quick}
    try:
        import cupy
        info["cupy"] = cupy.__version__
    except Exception as e:  # noqa: BLE001
        info["cupy"] = f"not importable: {e}"
    print(f"gpu_check: {info}")
    mod, t_load = load_backend(args.device)
    info["load_s"] = round(t_load, 2)
    print(f"[1/4] build: back end {'loaded' if mod else 'NOT AVAILABLE'} in {t_load:.1f} s")
    checks: List[dict] = []
    if mod is not None:
        print(f"[2/4] checks against the reference (seed {seed}):")
        checks = run_checks(mod, args.device, seed, args.quick)
    else:
        print("[2/4] checks skipped: the back end did not load")
    rows: List[dict] = []
    if not args.no_timing:
        print("[3/4] timing (CUDA events, medians):" if args.device == "cuda" else "[3/4] timing:")
        try:
            rows = run_timing(mod, args.device, args.quick)
        except Exception as e:  # noqa: BLE001
            print(f"  timing aborted: {type(e).__name__}: {e}")
            traceback.print_exc()
    sanitizer: List[dict] = []
    if args.sanitize and args.device == "cuda":
        print(f"[4/4] compute-sanitizer ({', '.join(args.sanitize)}) of the device tests "
              f"(-k {args.sanitize_k!r}):")
        sanitizer = run_sanitizer(args.sanitize, args.sanitize_k, args.sanitize_timeout)
    elif args.sanitize:
        print("[4/4] compute-sanitizer SKIPPED: needs --device cuda")
    if args.device == "cuda":  # the reducer's communication worker: side stream and events
        from gtopk_plugin.bench.overlap_bench import gpu_worker_check
        try:
            w = gpu_worker_check(args.device)
            checks.append(dict(w, check="comm_worker side stream", ok=bool(w["passed"])))
        except Exception as e:  # noqa: BLE001 -- reported as a failed check, the rest still written
            checks.append({"check": "comm_worker side stream", "ok": False, "error": f"{type(e).__name__}: {e}"})
        print(f"  comm worker on a side stream: {'ok' if checks[-1]['ok'] else 'FAILED'}")
    failed = [c["check"] for c in checks if not c["ok"]]
    failed += [f"compute-sanitizer {r['tool']}" for r in sanitizer if r["ok"] is False]
    info["total_s"] = round(time.perf_counter() - t_start, 1)
    write_json(args.out, "gpu_check", document={"machine": info, "checks": checks, "timing": rows,
                                                "sanitizer": sanitizer})
    print(f"\nwrote {args.out} ({info['total_s']} s in all)")
    print(f"checks: {len(checks) + len(sanitizer) - len(failed)}/{len(checks) + len(sanitizer)} passed"
          + (f"; FAILED: {failed}" if failed else ""))
    if rows:
        print(markdown(rows))
    return 1 if failed or mod is None else 0


if __name__ == "__main__":
    sys.exit(main())
