"""``python -m lab soak``: long runs of every method on real gloo process groups.

Evidence that nothing grows with the number of steps: for each
method (dense, topk, gtopk, rtopk, randomk, threshold) a small MLP trains for
10,000 steps on a *stationary* problem (a fixed random teacher network plus
noise; every step draws a fresh batch, so the gradient distribution does not
change once the student has converged) at P = 3, one process per rank on
loopback gloo, through :class:`gtopk_plugin.GradientReducer` with error
feedback.  Every ``--sample-every`` steps each rank records

- its resident set size (``/proc/self/statm``: pages actually resident, not
  the peak),
- the L2 norm of its error-feedback residuals (all tensors together),
- the loss and the median step time of the window.

Checks (per rank, per method; the run fails with a clear message otherwise):

- **memory**: RSS at the last step within ``--rss-tolerance`` (5%) of RSS at
  step ``steps/10`` (1k of 10k: allocator warm-up is over by then);
- **residuals bounded**: every sample finite, and the largest residual norm
  of the second half of the run at most ``--residual-growth`` (2×) the
  largest of steps [steps/10, steps/2).  Error feedback on a stationary
  problem keeps the residual bounded (its norm settles where what leaves per
  step matches what enters); unbounded growth would show as a trend that
  this ratio catches.

Step times are recorded (median per window) to show drift, never asserted
(docs/design.md §8: benchmarks do not gate on timing).  Output: compact JSON
(per method and rank: the checkpoints and the verdicts; one curve per method,
the max over ranks, downsampled to ``--curve-points``) through
:func:`gtopk_plugin.bench.bench_record.write_json`, and a PNG beside it.

``--quick`` runs a few hundred steps (the test suite runs it).
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

from gtopk_plugin.compress import available

from gtopk_plugin.bench import bench_launch as launch
from gtopk_plugin.bench.bench_record import write_json

METHODS = list(available(builtin=True))  # every compressor of the package (workers know no others)
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
WIDTHS = (32, 64, 64, 10)


def rss_bytes() -> int:
    """Resident set size of this process now (Linux ``/proc/self/statm``)."""
    with open("/proc/self/statm") as f:
        resident_pages = int(f.read().split()[1])
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


def _mlp(seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    layers = []
    for i in range(len(WIDTHS) - 1):
        lin = torch.nn.Linear(WIDTHS[i], WIDTHS[i + 1])
        with torch.no_grad():
            lin.weight.copy_(torch.randn(lin.weight.shape, generator=g) / math.sqrt(WIDTHS[i]))
            lin.bias.zero_()
        layers.append(lin)
        if i < len(WIDTHS) - 2:
            layers.append(torch.nn.Tanh())
    return torch.nn.Sequential(*layers)


def soak_one(ctx, method: str, args: dict) -> dict:
    """One method on this rank: train, sample, return the samples."""
    import torch

    import gtopk_plugin as gp

    teacher = _mlp(1234)           # the same on every rank: one stationary problem
    model = _mlp(7)                # the same start on every rank
    for p in teacher.parameters():
        p.requires_grad_(False)
    red = gp.GradientReducer(method=method, density=args["density"], transport=ctx.transport,
                             seed=args["seed"])
    lr = args["lr"]
    params = list(model.named_parameters())
    steps, every = args["steps"], args["sample_every"]
    gen = torch.Generator().manual_seed(10_000 * ctx.rank + args["seed"])
    samples = []
    window, losses = [], []
    for s in range(1, steps + 1):
        t0 = time.perf_counter()
        x = torch.randn(args["batch"], WIDTHS[0], generator=gen)
        y = teacher(x) + 0.1 * torch.randn(args["batch"], WIDTHS[-1], generator=gen)
        model.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        upd = red.reduce({n: p.grad for n, p in params})
        with torch.no_grad():
            for n, p in params:
                p.sub_(upd[n], alpha=lr)
        window.append(time.perf_counter() - t0)
        losses.append(float(loss))
        if s % every == 0:
            res_sq = math.fsum(float(r.double().square().sum()) for r in red.memory.residuals.values())
            samples.append({"step": s, "rss": rss_bytes(), "residual_norm": math.sqrt(res_sq),
                            "loss": statistics.fmean(losses), "step_ms": statistics.median(window) * 1e3})
            window, losses = [], []
            if s % (every * 20) == 0:
                ctx.progress(method=method, step=s, rss_mb=samples[-1]["rss"] / 2**20,
                             residual_norm=samples[-1]["residual_norm"], loss=samples[-1]["loss"])
    return {"samples": samples}


def worker(ctx, args):
    """Worker body (gtopk_plugin.bench.bench_launch): every method in turn on this rank."""
    import torch
    torch.manual_seed(0)
    return {m: soak_one(ctx, m, args) for m in args["methods"]}


def verdict(samples, steps, rss_tolerance, residual_growth) -> dict:
    """The checks of one (method, rank) from its samples (see the module
    docstring)."""
    by_step = {x["step"]: x for x in samples}
    ref_step = min((x["step"] for x in samples if x["step"] >= steps // 10), default=None)
    last = samples[-1]
    ref = by_step[ref_step]
    rss_ratio = last["rss"] / ref["rss"]
    norms = [x["residual_norm"] for x in samples]
    early = [x["residual_norm"] for x in samples if steps // 10 <= x["step"] < steps // 2]
    late = [x["residual_norm"] for x in samples if x["step"] >= steps // 2]
    finite = all(math.isfinite(v) for v in norms)
    early_max, late_max = max(early, default=0.0), max(late, default=0.0)
    # dense keeps no residual: 0 <= 2 * 0 holds
    bounded = finite and late_max <= residual_growth * early_max + 1e-12
    return {"rss_ref_step": ref_step, "rss_ref_bytes": ref["rss"], "rss_last_step": last["step"],
            "rss_last_bytes": last["rss"], "rss_ratio": rss_ratio,
            "rss_ok": abs(rss_ratio - 1.0) <= rss_tolerance,
            "residual_norm_max_early": early_max, "residual_norm_max_late": late_max,
            "residual_norm_last": norms[-1], "residual_ok": bounded,
            "loss_first": samples[0]["loss"], "loss_last": last["loss"],
            "step_ms_median_first_tenth": statistics.median(
                x["step_ms"] for x in samples if x["step"] <= max(steps // 10, samples[0]["step"])),
            "step_ms_median_last_tenth": statistics.median(
                x["step_ms"] for x in samples if x["step"] > steps - max(steps // 10, 1))}


def downsample(curve, points):
    if len(curve) <= points:
        return curve
    stride = len(curve) / points
    picked = [curve[min(len(curve) - 1, int(i * stride))] for i in range(points)]
    if picked[-1] is not curve[-1]:
        picked[-1] = curve[-1]
    return picked


def summarise(per_rank, args) -> dict:
    """Per method: verdicts per rank and a max-over-ranks curve."""
    out = {}
    for m in args["methods"]:
        ranks = [per_rank[r][m]["samples"] for r in range(len(per_rank))]
        verdicts = [verdict(s, args["steps"], args["rss_tolerance"], args["residual_growth"]) for s in ranks]
        curve = []
        for i, x in enumerate(ranks[0]):
            curve.append({"step": x["step"],
                          "rss_mb": round(max(r[i]["rss"] for r in ranks) / 2**20, 3),
                          "residual_norm": max(r[i]["residual_norm"] for r in ranks),
                          "loss": statistics.fmean(r[i]["loss"] for r in ranks),
                          "step_ms": max(r[i]["step_ms"] for r in ranks)})
        out[m] = {"ranks": verdicts, "ok": all(v["rss_ok"] and v["residual_ok"] for v in verdicts),
                  "curve": downsample(curve, args["curve_points"])}
    return out


def failures(summary) -> list:
    msgs = []
    for m, s in summary.items():
        for r, v in enumerate(s["ranks"]):
            if not v["rss_ok"]:
                msgs.append(f"{m} rank {r}: RSS {v['rss_last_bytes'] / 2**20:.1f} MiB at step "
                            f"{v['rss_last_step']} vs {v['rss_ref_bytes'] / 2**20:.1f} MiB at step "
                            f"{v['rss_ref_step']} (ratio {v['rss_ratio']:.4f})")
            if not v["residual_ok"]:
                msgs.append(f"{m} rank {r}: residual norm not bounded (max {v['residual_norm_max_late']:.4g} "
                            f"in the second half vs {v['residual_norm_max_early']:.4g} before)")
    return msgs


def plot(summary, path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install -e '.[bench]')")
        return False
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.2))
    for m, s in summary.items():
        c = s["curve"]
        steps = [x["step"] for x in c]
        axes[0].plot(steps, [x["rss_mb"] for x in c], label=m)
        axes[1].plot(steps, [x["residual_norm"] for x in c], label=m)
        axes[2].plot(steps, [x["step_ms"] for x in c], label=m)
    axes[0].set_ylabel("RSS (MiB), max over ranks")
    axes[1].set_ylabel("‖residual‖₂, max over ranks")
    axes[1].set_yscale("symlog", linthresh=1e-3)
    axes[2].set_ylabel("median step time per window (ms)")
    for ax in axes:
        ax.set_xlabel("step")
        ax.legend(fontsize=8)
    fig.suptitle("python -m lab soak: P = 3 gloo ranks, stationary teacher-student MLP")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def run(args) -> dict:
    payload = {k: getattr(args, k) for k in ("methods", "steps", "sample_every", "density", "lr", "batch",
                                            "seed", "rss_tolerance", "residual_growth", "curve_points")}

    def progress(rank, msg):
        if not args.silent:
            print(f"  {msg['method']:>9} step {msg['step']:>6}: RSS {msg['rss_mb']:.1f} MiB, "
                  f"‖residual‖ {msg['residual_norm']:.4g}, loss {msg['loss']:.4g}", flush=True)

    per_rank = launch.run_workers(args.workers, worker, payload, engine="torch",
                                  ifname="lo", timeout=args.timeout, progress=progress)
    return {"payload": payload, "summary": summarise(per_rank, payload)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--sample-every", type=int, default=50)
    ap.add_argument("--density", type=float, default=0.05)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rss-tolerance", type=float, default=0.05)
    ap.add_argument("--residual-growth", type=float, default=2.0)
    ap.add_argument("--curve-points", type=int, default=100)
    ap.add_argument("--timeout", type=float, default=3 * 3600)
    ap.add_argument("--quick", action="store_true", help="100 steps, sampled every 5 (a smoke run)")
    ap.add_argument("--json", default=None, help="default: lab/results/soak.json (soak_quick.json "
                                                 "with --quick)")
    ap.add_argument("--silent", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.sample_every = 100, 5
    if args.steps < 20 * args.sample_every:
        ap.error("--steps must be at least 20 × --sample-every (the checks compare windows)")
    path = args.json or os.path.join(RESULTS, "soak_quick.json" if args.quick else "soak.json")
    t0 = time.time()
    try:
        res = run(args)
    except launch.WorkerFailed as e:
        print(f"python -m lab soak: a worker failed:\n{e}", file=sys.stderr)
        return 1
    summary = res["summary"]
    settings = dict(res["payload"], workers=args.workers, quick=args.quick, wall_s=round(time.time() - t0, 1))
    write_json(path, "soak", settings, summary, packages=("torch", "gtopk_plugin"))
    png = os.path.splitext(path)[0] + ".png"
    plotted = plot(summary, png)
    hdr = f"{'method':>9} {'RSS@ref MiB':>11} {'RSS@end MiB':>11} {'ratio':>7} {'‖r‖ early':>10} " \
          f"{'‖r‖ late':>10} {'loss end':>9} {'ms first':>8} {'ms last':>8}  ok"
    if not args.silent:
        print(hdr)
        for m, s in summary.items():
            v = max(s["ranks"], key=lambda x: abs(x["rss_ratio"] - 1))
            print(f"{m:>9} {v['rss_ref_bytes'] / 2**20:>11.2f} {v['rss_last_bytes'] / 2**20:>11.2f} "
                  f"{v['rss_ratio']:>7.4f} {max(x['residual_norm_max_early'] for x in s['ranks']):>10.4g} "
                  f"{max(x['residual_norm_max_late'] for x in s['ranks']):>10.4g} {v['loss_last']:>9.4g} "
                  f"{v['step_ms_median_first_tenth']:>8.2f} {v['step_ms_median_last_tenth']:>8.2f}  {s['ok']}")
        print(f"wrote {path}" + (f" and {png}" if plotted else ""))
    bad = failures(summary)
    if bad:
        print("python -m lab soak: FAILED\n  " + "\n  ".join(bad), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
