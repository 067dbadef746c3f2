"""The mutation check: does the executor catch realistic bugs in csrc/cuda?

    python -m cuda_executor.mutations [--out FILE] [--only NAME ...] [--jobs N]

Each mutation below replaces one piece of text in one kernel file (a
dropped barrier or fence, an atomic made plain, an off-by-one bound, a
wrong warp mask, a wrong radix digit, a shared array one too small, ...).
The unmodified kernels first run the workload under every schedule
(forward, reverse, two random seeds) and must pass; then each mutant is
compiled and runs the workload in a subprocess (rotating schedules): it is
*caught* when the executor reports (race, uninitialized read, bounds,
barrier or warp misuse, deadlock), a result differs from the reference
back end, or the process crashes or hangs.  Prints a table and writes JSON
(default: cuda-executor-mutations.json).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
CUDA_DIR = ROOT / "csrc" / "cuda"


@dataclass
class Mutation:
    name: str
    file: str
    old: str
    new: str
    bug: str


M = Mutation
MUTATIONS: List[Mutation] = [
    # -- barriers ------------------------------------------------------------------
    M("collect-base-barrier", "select.cu",
      "atomicAdd(&counter[s], tot)) : 0;\n  __syncthreads();", "atomicAdd(&counter[s], tot)) : 0;\n",
      "dropped barrier: the block's output base is read before thread 0 writes it"),
    M("scan-barrier", "common.cuh",
      "if (lane == 31) scratch[wid] = v;\n  __syncthreads();", "if (lane == 31) scratch[wid] = v;\n",
      "dropped barrier: warp totals read before they are written"),
    M("scan-second-barrier", "common.cuh",
      "if (lane < nw) scratch[lane] = w;\n  }\n  __syncthreads();",
      "if (lane < nw) scratch[lane] = w;\n  }\n",
      "dropped barrier: warp prefixes read before warp 0 writes them"),
    M("ticket-wait-barrier", "radix.cuh",
      "  __threadfence();\n  __syncthreads();\n  if (tid == 0) {", "  __threadfence();\n  if (tid == 0) {",
      "dropped barrier: thread 0 takes the ticket before the block's histogram adds are done"),
    M("hist-zero-barrier", "radix.cuh",
      "sh_hist[b] = 0u;\n  }\n  __syncthreads();", "sh_hist[b] = 0u;\n  }\n",
      "dropped barrier: histogram zeroing races with other threads' counts"),
    M("ticket-barrier", "radix.cuh",
      "? 1 : 0;\n  }\n  __syncthreads();\n  if (!sh_last)", "? 1 : 0;\n  }\n  if (!sh_last)",
      "dropped barrier: the last-block flag is read before thread 0 writes it"),
    M("select-barrier", "radix.cuh",
      "if (tid == 0) sh_sel[0] = -1;\n  __syncthreads();", "if (tid == 0) sh_sel[0] = -1;\n",
      "dropped barrier: the chosen bucket's reset races with the thread that sets it"),
    M("bitonic-barrier", "sample.cuh",
      "stride >>= 1) {\n      __syncthreads();", "stride >>= 1) {\n",
      "dropped barrier in the bitonic sort of the sample"),
    M("divergent-barrier", "compensate.cu",
      "if (__syncthreads_or(nf) && threadIdx.x == 0)", "if (threadIdx.x == 0 && __syncthreads_or(nf))",
      "barrier in a branch only thread 0 takes (operands swapped)"),
    # -- atomics -------------------------------------------------------------------
    M("shared-atomic-plain", "radix.cuh",
      "atomicAdd(&sh_hist[((pc.word ? inv : key) >> pc.sh) & cmask], 1u);",
      "sh_hist[((pc.word ? inv : key) >> pc.sh) & cmask] += 1u;",
      "shared-memory atomicAdd made a plain increment"),
    M("hist-global-atomic-plain", "radix.cuh",
      "if (v) atomicAdd(&hs_w[b], static_cast<gtopk_u64>(v));", "if (v) hs_w[b] += v;",
      "global atomicAdd into the segment histogram made +="),
    M("out-slots-atomic-plain", "radix.cuh",
      "atomicAdd(&ctr[S + s], te)", "(ctr[S + s] += te) - te",
      "global atomicAdd reserving output slots made +="),
    M("ticket-atomic-plain", "radix.cuh", "atomicAdd(&ctr[s], 1ull)", "ctr[s]++",
      "the last-block ticket taken with a plain increment"),
    M("collect-counter-atomic-plain", "select.cu", "atomicAdd(&counter[s], tot)",
      "(counter[s] += tot) - tot", "global atomicAdd of the threshold count made +="),
    M("flag-atomic-plain", "compensate.cu", "atomicOr(&bad[t], 1u);", "bad[t] |= 1u;",
      "non-finite flag set with a plain |= (same value: a race only)"),
    M("count-atomic-plain", "compensate.cu", "atomicAdd(count, tot);", "*count += tot;",
      "global atomicAdd of the nonzero count made +="),
    # -- fences and volatile ---------------------------------------------------------
    M("release-fence", "radix.cuh",
      "  __threadfence();\n  __syncthreads();\n  if (tid == 0) {\n    const gtopk_u64 t",
      "  __syncthreads();\n  if (tid == 0) {\n    const gtopk_u64 t",
      "dropped __threadfence before the ticket: histogram adds not published"),
    M("acquire-fence", "radix.cuh", "if (!sh_last) return;\n  __threadfence();",
      "if (!sh_last) return;\n", "dropped __threadfence after the ticket: the last block reads "
      "the histogram without acquiring it"),
    M("volatile-dropped", "radix.cuh", "volatile gtopk_u64* hs = hs_w;", "gtopk_u64* hs = hs_w;",
      "volatile dropped on the histogram the last block reads"),
    # -- warp masks and warp-level logic ---------------------------------------------
    M("warp-mask-half", "common.cuh", "__shfl_up_sync(0xFFFFFFFFu, v, o)",
      "__shfl_up_sync(0x0000FFFFu, v, o)", "shuffle mask names half the warp"),
    M("warp-mask-lane0", "common.cuh", "__shfl_up_sync(0xFFFFFFFFu, w, o)",
      "__shfl_up_sync(0xFFFFFFFEu, w, o)", "shuffle mask leaves out lane 0"),
    M("scan-lane-off-by-one", "common.cuh", "if (lane >= o) v += u;", "if (lane > o) v += u;",
      "off-by-one lane test in the warp scan"),
    # -- bounds, sizes, logic ---------------------------------------------------------
    M("collect-bound", "select.cu", "if (i >= n) break;\n    if (V::key(x[lo + i]) >= t)",
      "if (i > n) break;\n    if (V::key(x[lo + i]) >= t)",
      "off-by-one bound: one entry past the segment is read"),
    M("sample-bound", "sample.cuh", "if (p < m) {", "if (p <= m) {",
      "off-by-one bound in the sample"),
    M("scatter-bound", "scatter.cu", "if (t >= n) return;", "if (t > n) return;",
      "off-by-one thread bound: one index past the end is read"),
    M("clear-bound", "select.cu", "if (p >= outo[S]) return;", "if (p > outo[S]) return;",
      "off-by-one bound: one slot past the output is cleared"),
    M("radix-digit", "radix.cuh", "const gtopk_u64 d = ((pp.word ? inv : key) >> pp.sh) & pmask;",
      "const gtopk_u64 d = ((pp.word ? inv : key) >> (pp.sh + 1)) & pmask;",
      "wrong radix digit (shift off by one)"),
    M("sel-shared-too-small", "radix.cuh", "__shared__ gtopk_i64 sh_sel[3];",
      "__shared__ gtopk_i64 sh_sel[2];", "a shared array one element too small"),
    M("sample-shared-too-small", "sample.cuh", "__shared__ gtopk_u64 keys[GTOPK_SAMPLE];",
      "__shared__ gtopk_u64 keys[GTOPK_SAMPLE - 1];", "the sample's shared array one too small"),
    M("merge-duplicate", "merge.cu", "uvalid[p] = dup ? 0 : 1;", "uvalid[p] = 1;",
      "a duplicate index of the second operand is not folded"),
]


def mutated_sources(m: Optional[Mutation]) -> Dict[str, str]:
    """The self-contained sources (cuda.sources()) with mutation ``m`` applied."""
    from gtopk_plugin.kernels import _cuda_source

    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        for p in CUDA_DIR.iterdir():
            (d / p.name).write_text(p.read_text())
        if m is not None:
            text = (d / m.file).read_text()
            if text.count(m.old) != 1:
                raise ValueError(f"mutation {m.name}: {m.old!r} occurs {text.count(m.old)} times "
                                 f"in {m.file}")
            (d / m.file).write_text(text.replace(m.old, m.new))
        return {f: _cuda_source._inline(d / f, {f}) for f in _cuda_source.FILES}


# ---------------------------------------------------------------------------
# The workload: every kernel file, multi-block segments, against the reference


def _same(a, b, what: str) -> None:
    import torch

    if a.dtype != b.dtype or a.shape != b.shape:
        raise AssertionError(f"{what}: {a.dtype}{tuple(a.shape)} != {b.dtype}{tuple(b.shape)}")
    if a.dtype.is_floating_point:
        na, nb = torch.isnan(a), torch.isnan(b)
        ok = torch.equal(na, nb) and torch.equal(a[~na], b[~nb])
        ok = ok and torch.equal(torch.signbit(a[~na]), torch.signbit(b[~nb]))
    else:
        ok = torch.equal(a, b)
    if not ok:
        raise AssertionError(f"{what}: result differs from the reference")


def workload(cuda) -> None:
    """Select (exact and threshold), merge, fused compensation, in-place
    updates and scatter through ``cuda`` (served by the executor), each
    against gtopk_plugin.kernels.reference bit for bit."""
    import torch

    from gtopk_plugin.kernels import reference as ref

    g = torch.Generator().manual_seed(11)
    x = torch.randn(60_000, generator=g)
    x[100:200], x[300:400], x[500], x[501] = 0.5, 0.0, float("nan"), float("inf")
    off = torch.tensor([0, 0, 1, 3, 700, 1000, 20_000, 60_000])
    z = torch.zeros(50_000)
    z[[5, 77, 30_000]] = torch.tensor([1.0, -2.0, 0.5])
    tail = x[:5000].clone()  # its own allocation, a last segment of one sample's size
    for data, o, ks in ((x, off, [0, 1, 1, 50, 300, 1900, 700]),
                        (tail, torch.tensor([0, 1000, 5000]), [10, 40]),
                        (x, off, [5, 5, 2, 697, 1000, 1, 39_000]),
                        (x.half(), off, [1, 1, 3, 20, 30, 2000, 100]),
                        (z, torch.tensor([0, 50_000]), [1000])):
        k = torch.tensor(ks)
        for op in ("select_topk", "select_threshold"):
            for a, b in zip(getattr(cuda, op)(data, o, k), getattr(ref, op)(data, o, k)):
                _same(a, b, op)
    moff, mk = torch.tensor([0, 500, 520, 3000, 200_000]), torch.tensor([40, 0, 200, 1500])
    for dt, it in ((torch.float32, torch.int32), (torch.bfloat16, torch.int64)):
        ia = torch.sort(torch.randperm(200_000, generator=g)[:30_000]).values.to(it)
        ib = torch.sort(torch.randperm(200_000, generator=g)[:25_000]).values.to(it)
        va, vb = torch.randn(30_000, generator=g).to(dt), torch.randn(25_000, generator=g).to(dt)
        va[:50], vb[:50] = -0.25, 0.25
        for a, b in zip(cuda.merge_select(ia, va, ib, vb, moff, mk),
                        ref.merge_select(ia, va, ib, vb, moff, mk)):
            _same(a, b, "merge_select")
    sizes = [0, 3, 700, 20_000, 80_000]
    N = sum(sizes)
    grads = [torch.randn(n, generator=g) for n in sizes]
    grads[3][9] = float("nan")
    grads[4][::7919] = float("inf")  # many threads and blocks flag one gradient
    res = torch.randn(N, generator=g) * 0.5
    layer = torch.tensor([0, 0, 3, 703, 20_703, N])
    for o, ks in ((layer, [1, 1, 50, 300, 3000]), (torch.tensor([0, N]), [3200])):
        acc, racc = torch.full((N,), 7.0), torch.full((N,), 7.0)
        for a, b in zip(cuda.compensate_select_topk(acc, grads, res, o, torch.tensor(ks)),
                        ref.compensate_select_topk(racc, grads, res, o, torch.tensor(ks))):
            _same(a, b, "compensate_select_topk")
        _same(acc, racc, "compensate_select_topk acc")
    flat = torch.cat(grads)
    out, rout = torch.empty(N), torch.empty(N)
    if cuda.compensate(out, flat, res) != ref.compensate(rout, flat, res):
        raise AssertionError("compensate: finiteness differs")
    _same(out, rout, "compensate")
    n = 50_000
    base = torch.randn(n, generator=g)
    base[100:3000] = 0.0
    idx = torch.sort(torch.randperm(n, generator=g)[:1000]).values.to(torch.int32)
    sent = torch.randn(1000, generator=g)
    prev = torch.sort(torch.randperm(n, generator=g)[:800]).values.to(torch.int32)
    prev[:100] = idx[:100]
    a, b = base.clone(), base.clone()
    _same(cuda.subtract_at_(a, idx, sent), ref.subtract_at_(b, idx, sent), "subtract_at_")
    a, b = base.clone(), base.clone()
    _same(cuda.scatter_reset_(a, prev, idx, sent, 4), ref.scatter_reset_(b, prev, idx, sent, 4),
          "scatter_reset_")
    a, b = base.clone(), base.clone()
    if cuda.div_count_(a, 2) != ref.div_count_(b, 2):
        raise AssertionError("div_count_: count differs")
    _same(a, b, "div_count_")
    _same(cuda.scatter_update(n, idx, sent, 2, torch.float32),
          ref.scatter_update(n, idx, sent, 2, torch.float32), "scatter_update")


def run_one(m: Optional[Mutation], schedule: str, seed: int) -> dict:
    """Compile (mutant) sources and run the workload in this process."""
    from cuda_executor import BuildError, Executor, ExecutorError
    from cuda_executor.gtopk import serving

    t0 = time.perf_counter()
    try:
        srcs = mutated_sources(m)
    except ValueError as e:  # the mutation's text is not in its file
        return {"outcome": "invalid", "detail": str(e), "s": 0.0}
    try:
        ex = Executor(schedule=schedule, seed=seed)
        with serving(ex, srcs) as cuda:
            workload(cuda)
    except BuildError as e:
        return {"outcome": "build-error", "detail": str(e)[-2000:], "s": time.perf_counter() - t0}
    except ExecutorError as e:
        return {"outcome": "reported", "detail": str(e)[:3000], "kinds": sorted(set(e.kinds)),
                "s": time.perf_counter() - t0}
    except AssertionError as e:
        return {"outcome": "wrong-result", "detail": str(e)[:2000], "s": time.perf_counter() - t0}
    except Exception as e:  # noqa: BLE001 - the host code choking on a kernel's output
        return {"outcome": "host-error", "detail": f"{type(e).__name__}: {e}"[:2000],
                "s": time.perf_counter() - t0}
    return {"outcome": "passed", "detail": "", "s": time.perf_counter() - t0}


def _subprocess(name: Optional[str], schedule: str, seed: int, timeout: float) -> dict:
    cmd = [sys.executable, "-m", "cuda_executor.mutations", "--worker", name or "",
           "--schedule", schedule, "--seed", str(seed)]
    t0 = time.perf_counter()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=str(ROOT),
                           env=env)
    except subprocess.TimeoutExpired:
        return {"outcome": "timeout", "detail": f"over {timeout:.0f} s", "s": timeout}
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode == 0 and lines:
        return json.loads(lines[-1])
    return {"outcome": "crash", "detail": f"exit {r.returncode}: {(r.stderr or '')[-1500:]}",
            "s": time.perf_counter() - t0}


CAUGHT = ("reported", "wrong-result", "host-error", "crash", "timeout")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cuda_executor.mutations", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="cuda-executor-mutations.json")
    ap.add_argument("--only", nargs="*", help="run these mutations only")
    ap.add_argument("--jobs", type=int, default=1, help="mutants run at once")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per mutant")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--schedule", default="rotate", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=1, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    by_name = {m.name: m for m in MUTATIONS}
    if a.worker is not None:  # one run in this process, a JSON line on stdout
        print(json.dumps(run_one(by_name.get(a.worker), a.schedule, a.seed)))
        return 0
    chosen = [by_name[n] for n in a.only] if a.only else MUTATIONS
    t0 = time.perf_counter()
    baseline = {}
    for sched, seed in (("forward", 0), ("reverse", 0), ("random", 1), ("random", 2)):
        r = _subprocess(None, sched, seed, a.timeout)
        baseline[f"{sched}/{seed}"] = r
        print(f"unmodified kernels, {sched} schedule (seed {seed}): {r['outcome']} "
              f"({r['s']:.0f} s){'' if r['outcome'] == 'passed' else chr(10) + r['detail']}",
              flush=True)
    rows = []
    with ThreadPoolExecutor(max(1, a.jobs)) as pool:
        results = pool.map(lambda m: (m, _subprocess(m.name, "rotate", 1, a.timeout)), chosen)
        for m, r in results:  # in order, as they finish
            caught = r["outcome"] in CAUGHT
            lines = r["detail"].splitlines()
            first = lines[1] if r["outcome"] == "reported" and len(lines) > 1 else \
                lines[0] if lines else ""
            rows.append({**asdict(m), **r, "caught": caught, "first": first})
            print(f"{'CAUGHT' if caught else 'missed'}  {m.name:30s} {r['outcome']:13s} "
                  f"{first[:90]}", flush=True)
    n_caught = sum(r["caught"] for r in rows)
    base_ok = all(r["outcome"] == "passed" for r in baseline.values())
    invalid = [r["name"] for r in rows if r["outcome"] in ("invalid", "build-error")]
    if invalid:
        print(f"INVALID mutations (text not found, or no longer compiles): {invalid}")
    print(f"\n{n_caught} of {len(rows)} mutations caught; unmodified kernels "
          f"{'pass under every schedule' if base_ok else 'FAIL'} ({time.perf_counter() - t0:.0f} s)")
    Path(a.out).write_text(json.dumps({"caught": n_caught, "total": len(rows),
                                       "baseline_passed": base_ok, "baseline": baseline,
                                       "mutations": rows}, indent=1))
    print(f"wrote {a.out}")
    return 0 if base_ok and not invalid else 1


if __name__ == "__main__":
    sys.exit(main())
