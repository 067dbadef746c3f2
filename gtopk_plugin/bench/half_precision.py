"""``gtopk-bench half-precision``: the demo model trained with fp32, fp16 and
bf16 gradients through :class:`gtopk_plugin.GradientReducer`, with mass
conservation checked against float64 sums.

    gtopk-bench half-precision [--workers 4] [--steps 2000] [--methods gtopk topk randomk]

For each method (at ``--density``) and gradient dtype, P gloo workers
train ``gtopk-demo``'s CNN from one seed: fp32 (reference); bf16 (model,
activations and gradients in bfloat16); fp16 (``--fp16 model``, default,
as bf16; ``--fp16 grads``: fp32 model, gradients cast to float16 for the
reduction).  SGD (no momentum unless ``--momentum``) applies the reduced
update, so the plain invariant holds (docs/design.md §3):
``Σ_ranks Σ_steps grad = Σ_steps P · update + Σ_ranks residual``.
The ranks check it in float64 every ``--check-every`` steps.

Reports per (method, dtype) the conservation error, first non-finite step,
any error raised, the residuals' dtype and test accuracy, as
gtopk-bench-results/half_precision.json (``--json``) and a PNG
(docs/results.md).  Exit status 1 when an invariant fails.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

from gtopk_plugin.bench import bench_launch as launch
from gtopk_plugin.bench.bench_record import RESULTS, write_json

METHODS = ("gtopk", "topk", "randomk")
DTYPES = ("fp32", "fp16", "bf16")
DEFAULTS = dict(workers=4, steps=2000, density=0.01, batch_size=32, lr=0.05, momentum=0.0, seed=0,
                check_every=20, tolerance=1e-5, fp16="model")


def dtypes_of(label: str, fp16_mode: str):
    """(model dtype, gradient dtype) of a run labelled ``label``."""
    import torch

    if label == "fp32":
        return torch.float32, torch.float32
    if label == "bf16":
        return torch.bfloat16, torch.bfloat16
    return (torch.float16 if fp16_mode == "model" else torch.float32), torch.float16


def _flat64(tensors):
    """One float64 numpy vector of ``tensors`` (an exact widening)."""
    import torch

    return torch.cat([t.detach().reshape(-1).to(torch.float64) for t in tensors]).numpy()


def train_run(ctx, method: str, label: str, payload: dict, data) -> dict:
    """One run on this rank: ``payload["steps"]`` steps of the demo model with
    gradients of ``label``'s dtype; returns this rank's record."""
    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import gtopk_plugin as gp
    from gtopk_plugin.demo.train import _epoch_batches, build_model

    P, rank, seed = ctx.size, ctx.rank, payload["seed"]
    model_dtype, grad_dtype = dtypes_of(label, payload["fp16"])
    torch.manual_seed(seed)  # the same initial weights on every rank and for every dtype
    model = build_model().to(model_dtype)
    x_tr = torch.from_numpy(data["x_train"]).to(model_dtype)
    y_tr = torch.from_numpy(data["y_train"])
    x_te, y_te = torch.from_numpy(data["x_test"]).to(model_dtype), torch.from_numpy(data["y_test"])
    opt = torch.optim.SGD(model.parameters(), lr=payload["lr"], momentum=payload["momentum"])
    red = gp.GradientReducer(method=method, density=payload["density"], seed=seed, transport=ctx.transport)
    names = [n for n, _ in model.named_parameters()]
    params = dict(model.named_parameters())
    numel = sum(p.numel() for p in params.values())
    fed, applied = np.zeros(numel), np.zeros(numel)  # float64
    divisor = P  # op="average"
    steps, check_every, bs = payload["steps"], payload["check_every"], payload["batch_size"]
    per_epoch = len(y_tr) // bs

    def residual64():
        res = red.memory.residuals
        return _flat64([res[n] if n in res else torch.zeros_like(params[n], dtype=torch.float32)
                        for n in names])

    def check(step):
        """Collective: the relative conservation error after ``step`` steps
        and whether every rank holds the same Σ update."""
        sums = torch.from_numpy(np.stack([fed - residual64(), fed]))
        dist.all_reduce(sums)  # float64 sums over ranks
        spread = torch.from_numpy(np.stack([applied, -applied]))
        dist.all_reduce(spread, op=dist.ReduceOp.MAX)
        net, total = sums[0].numpy(), sums[1].numpy()
        scale = float(np.abs(total).max())
        err = float(np.abs(net - divisor * applied).max()) / scale if scale > 0 else 0.0
        same = bool(torch.equal(spread[0], -spread[1]))
        return {"step": step, "rel_error": err, "ranks_agree": same}

    curve, first_nonfinite, first_bad_grad, error, loss, losses = [], None, None, None, None, []
    done = 0
    t0 = time.perf_counter()
    for step in range(steps):
        epoch, i = divmod(step, per_epoch)
        if i == 0:
            batches = _epoch_batches(len(y_tr), bs, seed, epoch)
        shard = torch.tensor_split(batches[i], P)[rank]
        opt.zero_grad(set_to_none=False)
        loss = F.cross_entropy(model(x_tr[shard]), y_tr[shard])
        loss.backward()
        grads = {n: params[n].grad.to(grad_dtype) for n in names}
        if first_bad_grad is None and not all(bool(torch.isfinite(g).all()) for g in grads.values()):
            first_bad_grad = step  # the model's own gradient (a diverging run), not the reducer's state
        try:
            upd = red.reduce(grads)
        except Exception as e:  # noqa: BLE001 - recorded: every rank raises the same error
            error = {"step": step, "type": type(e).__name__, "message": str(e)[:500]}
            if first_nonfinite is None and first_bad_grad is None and "NonFinite" in type(e).__name__:
                first_nonfinite = step  # finite gradients in, non-finite state: the reducer's fault
            break
        g64 = _flat64([grads[n] for n in names])
        u64 = _flat64([upd[n] for n in names])
        fed += g64
        applied += u64
        done = step + 1
        state_finite = all(bool(torch.isfinite(r).all()) for r in red.memory.residuals.values())
        if first_nonfinite is None and not (np.isfinite(u64).all() and state_finite):
            first_nonfinite = step
        for n in names:
            params[n].grad.copy_(upd[n])  # widened into an fp32 p.grad with --fp16 grads
        for g in opt.param_groups:
            g["lr"] = payload["lr"] * 0.5 * (1.0 + math.cos(math.pi * step / steps))
        opt.step()
        losses.append(float(loss))
        if done % check_every == 0 or done == steps:
            c = check(done)
            curve.append(c)
            ctx.progress(method=method, dtype=label, step=done, rel_error=c["rel_error"],
                         loss=sum(losses[-check_every:]) / len(losses[-check_every:]))
    wall = time.perf_counter() - t0
    final = check(done) if done and (not curve or curve[-1]["step"] != done) else (curve[-1] if curve else None)

    model.eval()
    with torch.no_grad():
        acc = float((model(x_te).argmax(1) == y_te).double().mean())
        flat = torch.cat([p.detach().reshape(-1).to(torch.float64) for p in model.parameters()])
    agree = torch.stack([flat, -flat])
    dist.all_reduce(agree, op=dist.ReduceOp.MAX)
    tail = losses[-max(1, per_epoch):]
    res_abs = float(np.abs(residual64()).max()) if done else 0.0
    return {"method": method, "dtype": label, "model_dtype": str(model_dtype)[6:],
            "grad_dtype": str(grad_dtype)[6:], "steps": done, "wall_s": wall, "curve": curve,
            "final": final, "first_nonfinite_step": first_nonfinite, "error": error,
            "first_nonfinite_grad_step": first_bad_grad,
            "residual_dtypes": sorted({str(r.dtype)[6:] for r in red.memory.residuals.values()}),
            "residual_max_abs": res_abs, "update_max_abs_last": float(np.abs(u64).max()) if done else 0.0,
            "test_accuracy": acc, "final_loss": sum(tail) / len(tail) if tail else None,
            "models_agree": bool(torch.equal(agree[0], -agree[1]))}


def worker(ctx, payload):
    """Every (method, dtype) run in turn on this rank; returns its records."""
    return [train_run(ctx, m, d, payload, payload["data"]) for m in payload["methods"] for d in payload["dtypes"]]


# ------------------------------------------------------------------ parent
def summarise(per_rank, args) -> dict:
    """Per (method, dtype): the ranks' records merged, with the verdict; per
    method: the accuracy gaps to fp32 (percentage points)."""
    runs = []
    for c, r0 in enumerate(per_rank[0]):
        recs = [r[c] for r in per_rank]
        nonfinite = [x["first_nonfinite_step"] for x in recs if x["first_nonfinite_step"] is not None]
        bad_grads = [x["first_nonfinite_grad_step"] for x in recs if x.get("first_nonfinite_grad_step") is not None]
        errors = [x["error"] for x in recs if x["error"]]
        curve = r0["curve"]
        final = r0["final"] or {"rel_error": None, "ranks_agree": True}
        worst = max((p["rel_error"] for p in curve), default=None)
        row = {k: r0[k] for k in ("method", "dtype", "model_dtype", "grad_dtype", "steps", "test_accuracy",
                                  "final_loss", "residual_dtypes")}
        row.update(
            rel_conservation_error=final["rel_error"], rel_conservation_error_max=worst,
            first_nonfinite_step=min(nonfinite) if nonfinite else None, error=errors[0] if errors else None,
            first_nonfinite_grad_step=min(bad_grads) if bad_grads else None,
            residual_max_abs=max(x["residual_max_abs"] for x in recs),
            update_max_abs_last=r0["update_max_abs_last"],
            ranks_agree=all(p["ranks_agree"] for p in curve) and final["ranks_agree"],
            models_agree=all(x["models_agree"] for x in recs),
            wall_s=max(x["wall_s"] for x in recs),
            curve=[[p["step"], p["rel_error"]] for p in curve])
        row["ok"] = (row["error"] is None and row["first_nonfinite_step"] is None
                     and row["first_nonfinite_grad_step"] is None and row["steps"] == args.steps
                     and worst is not None and worst <= args.tolerance and row["ranks_agree"]
                     and row["models_agree"])
        runs.append(row)
    gaps = {}
    for m in args.methods:
        acc = {r["dtype"]: r["test_accuracy"] for r in runs if r["method"] == m}
        if "fp32" in acc:
            gaps[m] = {f"{d}_minus_fp32_pp": 100.0 * (acc[d] - acc["fp32"]) for d in acc if d != "fp32"}
    return {"runs": runs, "accuracy_gap_pp": gaps}


def failures(summary, tolerance: float) -> list:
    """One line per (method, dtype) whose invariants failed."""
    bad = []
    for r in summary["runs"]:
        if r["ok"]:
            continue
        why = []
        if r["error"]:
            why.append(f"raised {r['error']['type']} at step {r['error']['step']}: {r['error']['message']}")
        if r["first_nonfinite_grad_step"] is not None:
            why.append(f"the model's own gradient non-finite from step {r['first_nonfinite_grad_step']} "
                       "(the training diverged)")
        if r["first_nonfinite_step"] is not None:
            why.append(f"non-finite update or residual from step {r['first_nonfinite_step']}")
        if r["rel_conservation_error_max"] is None or not r["rel_conservation_error_max"] <= tolerance:
            why.append(f"relative conservation error {r['rel_conservation_error_max']}")
        if not r["ranks_agree"] or not r["models_agree"]:
            why.append("ranks disagree")
        bad.append(f"{r['method']} {r['dtype']}: " + ("; ".join(why) or f"ran {r['steps']} steps"))
    return bad


def table(summary) -> str:
    hdr = (f"{'method':>8} {'dtype':>5} {'model/grad':>17} {'conservation':>12} {'worst':>9} "
           f"{'non-finite':>10} {'bad grad':>8} {'max|res|':>9} {'test acc':>8} {'loss':>7} {'wall s':>7}  ok")
    lines = [hdr]
    for r in summary["runs"]:
        nf = "none" if r["first_nonfinite_step"] is None else str(r["first_nonfinite_step"])
        bg = "none" if r["first_nonfinite_grad_step"] is None else str(r["first_nonfinite_grad_step"])
        ce = "n/a" if r["rel_conservation_error"] is None else f"{r['rel_conservation_error']:.2e}"
        cw = "n/a" if r["rel_conservation_error_max"] is None else f"{r['rel_conservation_error_max']:.2e}"
        lines.append(f"{r['method']:>8} {r['dtype']:>5} {r['model_dtype'] + '/' + r['grad_dtype']:>17} "
                     f"{ce:>12} {cw:>9} {nf:>10} {bg:>8} {r['residual_max_abs']:>9.3g} "
                     f"{100 * r['test_accuracy']:>7.2f}% {r['final_loss'] or float('nan'):>7.4f} "
                     f"{r['wall_s']:>7.1f}  {r['ok']}")
    lines.append("")
    lines.append("test accuracy gap to the fp32 run (percentage points):")
    for m, g in summary["accuracy_gap_pp"].items():
        lines.append(f"  {m:>8}: " + ", ".join(f"{k.split('_')[0]} {v:+.2f}" for k, v in g.items()))
    return "\n".join(lines)


def plot(summary, path: str, tolerance: float) -> bool:
    """Relative conservation error vs step, one panel per method, one line
    per dtype; ``False`` without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install -e '.[bench]')")
        return False
    methods = list(dict.fromkeys(r["method"] for r in summary["runs"]))
    fig, axes = plt.subplots(1, len(methods), figsize=(5.2 * len(methods), 3.8), squeeze=False, sharey=True)
    for ax, m in zip(axes[0], methods):
        for r in summary["runs"]:
            if r["method"] == m and r["curve"]:
                steps, err = zip(*r["curve"])
                ax.plot(steps, [max(e, 1e-12) for e in err], label=f"{r['dtype']} ({r['grad_dtype']} grads)")
        ax.axhline(tolerance, color="k", ls="--", lw=0.8, label=f"{tolerance:g}")
        ax.set_yscale("log")
        ax.set_title(m)
        ax.set_xlabel("step")
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("relative conservation error (0 drawn at 1e-12)")
    fig.suptitle("gtopk-bench half-precision: max|Σfed − P·Σupdate − Σresidual| / max|Σfed| (float64)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def build_parser() -> argparse.ArgumentParser:
    d = DEFAULTS
    ap = argparse.ArgumentParser(prog="gtopk-bench half-precision", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=d["workers"], help=f"P (default {d['workers']})")
    ap.add_argument("--steps", type=int, default=d["steps"], help=f"training steps per run (default {d['steps']})")
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES)
    ap.add_argument("--fp16", choices=("grads", "model"), default=d["fp16"],
                    help="fp16 run: an fp32 model with gradients cast to fp16 (grads), or the model in "
                         f"fp16 (model) (default {d['fp16']})")
    ap.add_argument("--density", type=float, default=d["density"], help=f"(default {d['density']})")
    ap.add_argument("--batch-size", type=int, default=d["batch_size"],
                    help=f"global batch, split across workers (default {d['batch_size']})")
    ap.add_argument("--lr", type=float, default=d["lr"], help=f"peak of the cosine schedule (default {d['lr']})")
    ap.add_argument("--momentum", type=float, default=d["momentum"],
                    help=f"SGD momentum, applied to the reduced update (default {d['momentum']})")
    ap.add_argument("--seed", type=int, default=d["seed"], help=f"(default {d['seed']})")
    ap.add_argument("--check-every", type=int, default=d["check_every"],
                    help=f"steps between cross-rank conservation checks (default {d['check_every']})")
    ap.add_argument("--tolerance", type=float, default=d["tolerance"],
                    help=f"largest relative conservation error that passes (default {d['tolerance']:g})")
    ap.add_argument("--timeout", type=float, default=4 * 3600.0, help="seconds for the whole job")
    ap.add_argument("--json", default=os.path.join(RESULTS, "half_precision.json"),
                    help="output (default gtopk-bench-results/half_precision.json; the PNG goes beside it)")
    ap.add_argument("--silent", action="store_true", help="no progress lines")
    return ap


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.workers < 1 or args.steps < 1 or args.check_every < 1:
        ap.error("--workers, --steps and --check-every must be positive")
    if args.batch_size < args.workers:
        ap.error("--batch-size must be at least --workers")
    from gtopk_plugin.demo.train import load_data

    payload = {k: getattr(args, k) for k in ("methods", "dtypes", "fp16", "steps", "density", "batch_size",
                                            "lr", "momentum", "seed", "check_every")}

    def progress(rank, msg):
        if not args.silent:
            print(f"  {msg['method']:>8} {msg['dtype']}: step {msg['step']:>5}  rel. conservation error "
                  f"{msg['rel_error']:.2e}  loss {msg['loss']:.4f}", flush=True)

    t0 = time.time()
    try:
        per_rank = launch.run_workers(args.workers, worker, dict(payload, data=load_data()),
                                      timeout=args.timeout, progress=progress)
    except launch.WorkerFailed as e:
        print(f"gtopk-bench half-precision: a worker failed:\n{e}", file=sys.stderr)
        return 1
    summary = summarise(per_rank, args)
    settings = dict(payload, workers=args.workers, op="average", tolerance=args.tolerance,
                    wall_s=round(time.time() - t0, 1))
    write_json(args.json, "half_precision", settings, summary, packages=("torch", "numpy"))
    png = os.path.splitext(args.json)[0] + ".png"
    plotted = plot(summary, png, args.tolerance)
    print(table(summary))
    print(f"wrote {args.json}" + (f" and {png}" if plotted else ""))
    bad = failures(summary, args.tolerance)
    if bad:
        print("gtopk-bench half-precision: FAILED\n  " + "\n  ".join(bad), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
