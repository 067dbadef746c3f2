"""Summaries, goal checks, plots and the markdown report of a study."""
from __future__ import annotations

import math
import statistics
from dataclasses import replace
from typing import Dict, List, Optional, Sequence, Tuple

from lab.convergence.sim import RunSpec, method_label
from lab.convergence.study import ABLATION_METHODS, DEMO_VARIANTS, DENSITIES, MAIN_METHODS, MOMENTUM_METHODS, WORKERS

MODES = ("none", "opt", "corr", "dgc")
MODE_TEXT = {"none": "no momentum", "opt": "momentum in optimizer", "corr": "momentum correction",
             "dgc": "correction + masking"}


def config_of(spec: RunSpec) -> RunSpec:
    return replace(spec, seed=0)


def _agg(values: Sequence[float]) -> dict:
    vals = [float(v) for v in values]
    finite = [v for v in vals if math.isfinite(v)]
    return {"mean": statistics.fmean(finite) if finite else math.inf,
            "std": statistics.stdev(finite) if len(finite) > 1 else 0.0,
            "min": min(vals), "max": max(vals), "values": vals}


def summarize(grid, results: Dict[RunSpec, dict]) -> List[dict]:
    """One row per (group, configuration): the final metric over seeds
    (mean, sample std, min, max), traffic, curves averaged over seeds."""
    by: Dict[Tuple[str, RunSpec], List[RunSpec]] = {}
    for group, spec in grid:
        lst = by.setdefault((group, config_of(spec)), [])
        if spec not in lst:
            lst.append(spec)
    rows = []
    for (group, cfg), specs in by.items():
        rs = [results[s] for s in specs if s in results]
        if not rs:
            continue
        r0 = rs[0]
        hist_steps = r0["history"]["step"]
        curves = [r["history"]["metric"] for r in rs if r["history"]["step"] == hist_steps]
        bytes_c = [r["history"]["bytes"] for r in rs if r["history"]["step"] == hist_steps]
        row = {"group": group, "task": cfg.task, "metric": r0["metric"], "label": cfg.label,
               "method": cfg.method, "r_factor": cfg.r_factor, "density": cfg.density,
               "workers": cfg.workers, "error_feedback": cfg.error_feedback, "warmup": cfg.warmup,
               "momentum": cfg.momentum, "momentum_mode": cfg.momentum_mode, "lr": r0["lr"],
               "codec_warmup_epochs": cfg.codec_warmup_epochs,
               "steps": r0["steps"], "batch_size": r0["batch_size"], "seeds": [s.seed for s in specs],
               "final": _agg([r["final"] for r in rs]),
               "final_eval_loss": _agg([r["final_eval_loss"] for r in rs]),
               "initial_eval_loss": r0["initial_eval_loss"],
               "bytes_per_step": statistics.fmean(r["bytes_per_step"] for r in rs),
               "total_bytes": statistics.fmean(r["total_bytes"] for r in rs),
               "diverged": sum(bool(r["diverged"]) for r in rs),
               "wall_s": sum(r["wall_s"] for r in rs),
               "curve": {"step": hist_steps,
                         "mean": [_nanmean(c) for c in zip(*curves)],
                         "min": [min(c) for c in zip(*curves)], "max": [max(c) for c in zip(*curves)],
                         "bytes": [statistics.fmean(b) for b in zip(*bytes_c)]}}
        rows.append(row)
    return rows


def _nanmean(xs):
    f = [x for x in xs if math.isfinite(x)]
    return statistics.fmean(f) if f else math.nan


def find(rows, **kw) -> Optional[dict]:
    for r in rows:
        if all(r.get(k) == v for k, v in kw.items()):
            return r
    return None


# ------------------------------------------------------------- goal checks
def _better(metric: str, a: float, b: float) -> bool:
    """a at least as good as b."""
    return a >= b if metric == "accuracy" else a <= b


def goals(rows: List[dict], tasks: Sequence[str]) -> dict:
    """Goal 1: gTop-k within 1 pp of dense at density 0.01 on the image
    tasks.  Goal 2: rTop-k >= top-k >= random-k at equal k (every task,
    density, P and r of the main grid)."""
    g1 = []
    for t in tasks:
        for P in WORKERS:
            dense = find(rows, group="main", task=t, method="dense", workers=P)
            gt = find(rows, group="main", task=t, method="gtopk", density=0.01, workers=P)
            if not dense or not gt or dense["metric"] != "accuracy":
                continue
            gap = 100 * (dense["final"]["mean"] - gt["final"]["mean"])
            g1.append({"task": t, "workers": P, "dense": dense["final"]["mean"], "gtopk": gt["final"]["mean"],
                       "dense_std": dense["final"]["std"], "gtopk_std": gt["final"]["std"],
                       "gap_pp": gap, "holds": gap <= 1.0})
    g2 = []
    for group, P_list, r_list in (("main", WORKERS, (2.0, 4.0, 8.0)), ("no_ef", (4,), (4.0,))):
        for t in tasks:
            for P in P_list:
                for d in DENSITIES:
                    top = find(rows, group=group, task=t, method="topk", density=d, workers=P)
                    rnd = find(rows, group=group, task=t, method="randomk", density=d, workers=P)
                    if not top or not rnd:
                        continue
                    m = top["metric"]
                    entry = {"group": group, "task": t, "workers": P, "density": d, "metric": m,
                             "topk": top["final"], "randomk": rnd["final"],
                             "topk_ge_randomk": _better(m, top["final"]["mean"], rnd["final"]["mean"]),
                             "rtopk": {}}
                    for r in r_list:
                        rt = find(rows, group=group, task=t, method="rtopk", r_factor=r, density=d, workers=P)
                        if rt:
                            entry["rtopk"][f"{r:g}"] = {
                                "final": rt["final"],
                                "ge_topk": _better(m, rt["final"]["mean"], top["final"]["mean"]),
                                "ge_randomk": _better(m, rt["final"]["mean"], rnd["final"]["mean"])}
                    g2.append(entry)
    return {"gtopk_within_1pp_of_dense": g1, "rtopk_ge_topk_ge_randomk": g2}


# ---------------------------------------------------------------- format
def fmt(metric: str, agg: dict, spread: bool = True) -> str:
    if agg is None:
        return "–"
    m, s = agg["mean"], agg["std"]
    if not math.isfinite(m):
        return "diverged"
    if metric == "accuracy":
        return f"{100 * m:.1f} ± {100 * s:.1f}" if spread else f"{100 * m:.1f}"
    return f"{m:.2f} ± {s:.2f}" if spread else f"{m:.2f}"


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000.0
    return f"{n:.1f} GB"


def _table(head: List[str], rows: List[List[str]]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def _unit(metric: str) -> str:
    return "test accuracy %" if metric == "accuracy" else "validation perplexity (lower is better)"


def markdown(rows: List[dict], goal: dict, meta: dict, gloo: Dict[str, dict], plots: Dict[str, str]) -> str:
    tasks = meta["tasks"]
    parts = []
    parts.append(_table(
        ["task", "data", "model", "parameters", "steps", "global batch", "lr (no momentum)", "metric"],
        [[t, meta["task_info"][t]["source"], meta["task_info"][t]["model"],
          f"{meta['task_info'][t]['params']:,}", str(meta["task_info"][t]["steps"]),
          str(meta["task_info"][t]["batch_size"]), f"{meta['task_info'][t]['lr']:g}",
          meta["task_info"][t]["metric"]] for t in tasks]))
    if "glyph_samples" in plots:
        parts.append(f"Glyphs: the ten clean class glyphs (top row) and training samples "
                     f"(label above each):\n\n![glyph samples]({plots['glyph_samples']})")
    cols = [(P, d) for P in WORKERS for d in DENSITIES]
    for t in tasks:
        tr = [r for r in rows if r["task"] == t and r["group"] == "main"]
        if not tr:
            continue
        metric = tr[0]["metric"]
        parts.append(f"### {t}: final {_unit(metric)}, mean ± std over seeds "
                     f"{tr[0]['seeds']}, error feedback on, no warm-up, no momentum")
        body = []
        for m, r in MAIN_METHODS:
            cells = []
            for P, d in cols:
                row = find(tr, method=m, r_factor=r, workers=P, density=1.0 if m == "dense" else d)
                cells.append(fmt(metric, row["final"]) if row else "–")
            if any(c != "–" for c in cells):
                body.append([method_label(m, r)] + cells)
        parts.append(_table(["method"] + [f"P={P}, d={d:g}" for P, d in cols], body))
        body = []
        for m, r in MAIN_METHODS:
            if m == "rtopk" and r != 4.0:
                continue
            cells = []
            for P, d in cols:
                row = find(tr, method=m, r_factor=r, workers=P, density=1.0 if m == "dense" else d)
                dense = find(tr, method="dense", workers=P)
                if row and dense:
                    cells.append(f"{fmt_bytes(row['bytes_per_step'])} ({dense['bytes_per_step'] / row['bytes_per_step']:.0f}×)"
                                 if row["bytes_per_step"] else "0")
                else:
                    cells.append("–")
            if any(c != "–" for c in cells):
                body.append(["rtopk (any r)" if m == "rtopk" else method_label(m, r)] + cells)
        parts.append("Bytes sent per worker per step (× less than dense ring allreduce); "
                     "threshold varies with the count it selects:")
        parts.append(_table(["method"] + [f"P={P}, d={d:g}" for P, d in cols], body))
        if t in plots:
            parts.append(f"![{t}]({plots[t]})")

    # goals
    parts.append("### Goal 1: gTop-k within 1 pp of dense at density 0.01 (image tasks)")
    parts.append(_table(["task", "P", "dense", "gTop-k", "gap (pp)", "within 1 pp"],
                        [[g["task"], str(g["workers"]), fmt("accuracy", {"mean": g["dense"], "std": g["dense_std"]}),
                          fmt("accuracy", {"mean": g["gtopk"], "std": g["gtopk_std"]}), f"{g['gap_pp']:+.1f}",
                          "yes" if g["holds"] else "**no**"] for g in goal["gtopk_within_1pp_of_dense"]]))
    parts.append("### Goal 2: rTop-k ≥ top-k ≥ random-k at equal k")
    body = []
    for e in goal["rtopk_ge_topk_ge_randomk"]:
        rts = " ".join(f"r={r}: {fmt(e['metric'], v['final'], False)} {'✓' if v['ge_topk'] else '✗'}"
                       for r, v in e["rtopk"].items())
        body.append([e["task"], "on" if e["group"] == "main" else "off", str(e["workers"]), f"{e['density']:g}",
                     fmt(e["metric"], e["topk"]), fmt(e["metric"], e["randomk"]),
                     "yes" if e["topk_ge_randomk"] else "**no**", rts])
    parts.append(_table(["task", "EF", "P", "density", "top-k", "random-k", "top-k ≥ random-k",
                         "rTop-k (✓: ≥ top-k)"], body))

    # ablations
    parts.append("### Error feedback and density warm-up (P = 4)")
    body = []
    for t in tasks:
        for d in DENSITIES:
            for m, r in ABLATION_METHODS:
                base = find(rows, group="main", task=t, method=m, r_factor=r, density=d, workers=4)
                noef = find(rows, group="no_ef", task=t, method=m, r_factor=r, density=d, workers=4)
                wu = find(rows, group="warmup", task=t, method=m, r_factor=r, density=d, workers=4)
                if not base:
                    continue
                mt = base["metric"]
                body.append([t, f"{d:g}", method_label(m, r), fmt(mt, base["final"]),
                             fmt(mt, noef["final"]) if noef else "–", fmt(mt, wu["final"]) if wu else "–"])
    if body:
        parts.append(_table(["task", "density", "method", "EF on (main)", "EF off", "EF on + warm-up"], body))
    if "ablations" in plots:
        parts.append(f"![ablations]({plots['ablations']})")

    # momentum
    body = []
    mom_modes = ("none", "opt", "dgc")
    for t in tasks:
        for m, r in MOMENTUM_METHODS:
            cells, mt = [], None
            for mode in mom_modes:
                if mode == "none":
                    row = find(rows, group="main", task=t, method=m, r_factor=r, workers=4,
                               density=1.0 if m == "dense" else 0.01)
                else:
                    mode_q = "opt" if (m == "dense" and mode != "opt") else mode
                    row = find(rows, group="momentum", task=t, method=m, r_factor=r, momentum_mode=mode_q)
                mt = mt or (row["metric"] if row else None)
                cells.append(fmt(row["metric"], row["final"]) if row else "–")
            if any(c != "–" for c in cells[1:]):
                body.append([t, method_label(m, r)] + cells)
    if body:
        parts.append("### Momentum 0.9 (P = 4, density 0.01, error feedback on, same effective step lr/(1−m))")
        parts.append(_table(["task", "method"] + [MODE_TEXT[m] for m in mom_modes], body))
    body = []
    for m, r in MOMENTUM_METHODS:
        cells = []
        for mode, scale in DEMO_VARIANTS:
            q = "opt" if (m == "dense" and mode in ("corr", "dgc")) else mode
            row = None
            for x in rows:
                if (x["group"] == "demo" and x["method"] == m and x["r_factor"] == r and x["momentum_mode"] == q
                        and abs(x["lr"] - 0.05 * scale) < 1e-12):
                    row = x
            cells.append(fmt(row["metric"], row["final"]) if row else "–")
        if any(c != "–" for c in cells):
            body.append([method_label(m, r)] + cells)
    if body:
        parts.append("### The gtopk-demo configuration (digits, P = 4, density 0.05, batch 32, 8 epochs)")
        parts.append(_table(["method", "momentum 0.9 in optimizer, lr 0.05 (demo)", "no momentum, lr 0.05",
                             "momentum 0.9 in optimizer, lr 0.005", "momentum correction, lr 0.05",
                             "correction + masking, lr 0.05"], body))
        if "momentum" in plots:
            parts.append(f"![momentum]({plots['momentum']})")

    # gloo
    if gloo:
        parts.append("### Simulation vs real gloo workers")
        body = []
        for t, c in gloo.items():
            body.append([t, c["config"], f"{c['metric_max_abs_diff']:.3g}", f"{c['train_loss_max_abs_diff']:.3g}",
                         "yes" if c["params_bitwise_equal"] else f"no (max abs Δ {c['params_max_abs_diff']:.3g})",
                         f"{c['bytes_formula_max_abs_diff']:.3g}", f"{c['real_wall_s']:.0f} s"])
        parts.append(_table(["task", "configuration", "max abs Δ metric", "max abs Δ train loss",
                             "final weights bit-identical", "max abs (formula − counted) bytes/step",
                             "gloo wall time"], body))
        if "gloo" in plots:
            parts.append(f"![gloo]({plots['gloo']})")
    return "\n\n".join(parts) + "\n"


# ----------------------------------------------------------------- plots
def plot_all(rows: List[dict], gloo: Dict[str, dict], tasks: Sequence[str], outdir: str, prefix: str) -> Dict[str, str]:
    import os

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = {}
    if "glyphs" in tasks:
        from lab.convergence.glyphs import sample_figure

        paths["glyph_samples"] = sample_figure(os.path.join(outdir, f"{prefix}_glyph_samples.png"))
    colors = {"dense": "k", "topk": "C0", "gtopk": "C3", "rtopk(r=2)": "C4", "rtopk(r=4)": "C1",
              "rtopk(r=8)": "C5", "randomk": "C2", "threshold": "C7"}
    cols = [(P, d) for P in WORKERS for d in DENSITIES]
    for t in tasks:
        tr = [r for r in rows if r["task"] == t and r["group"] == "main"]
        if not tr:
            continue
        metric = tr[0]["metric"]
        scale = 100 if metric == "accuracy" else 1
        fig, axes = plt.subplots(2, len(cols), figsize=(4.2 * len(cols), 7), squeeze=False)
        for j, (P, d) in enumerate(cols):
            for m, r in MAIN_METHODS:
                row = find(tr, method=m, r_factor=r, workers=P, density=1.0 if m == "dense" else d)
                if not row:
                    continue
                c = row["curve"]
                lab = row["label"]
                for i, xs in enumerate((c["step"], [max(b, 1.0) for b in c["bytes"]])):
                    ax = axes[i][j]
                    ax.plot(xs, [v * scale for v in c["mean"]], color=colors.get(lab), label=lab, lw=1.4)
                    ax.fill_between(xs, [v * scale for v in c["min"]], [v * scale for v in c["max"]],
                                    color=colors.get(lab), alpha=0.15, lw=0)
            axes[0][j].set_title(f"{t}: P={P}, density {d:g}")
            axes[0][j].set_xlabel("step")
            axes[1][j].set_xlabel("bytes sent per worker (cumulative)")
            axes[1][j].set_xscale("log")
            for i in range(2):
                axes[i][j].set_ylabel("test accuracy (%)" if metric == "accuracy" else "validation perplexity")
                if metric == "perplexity":
                    axes[i][j].set_yscale("log")
                axes[i][j].grid(alpha=0.3)
        axes[0][0].legend(fontsize=8)
        fig.suptitle(f"{t}: mean over seeds, band = min..max (error feedback on, no warm-up)")
        fig.tight_layout()
        p = os.path.join(outdir, f"{prefix}_{t}.png")
        fig.savefig(p, dpi=80)
        plt.close(fig)
        paths[t] = p

    # ablations: grouped bars
    abl = [(t, d) for t in tasks for d in DENSITIES
           if find(rows, group="no_ef", task=t, density=d) or find(rows, group="warmup", task=t, density=d)]
    if abl:
        fig, axes = plt.subplots(1, len(abl), figsize=(3.6 * len(abl), 3.8), squeeze=False)
        for j, (t, d) in enumerate(abl):
            ax = axes[0][j]
            for k, (grp, name) in enumerate((("main", "EF on"), ("no_ef", "EF off"), ("warmup", "EF + warm-up"))):
                xs, ys, es = [], [], []
                for i, (m, r) in enumerate(ABLATION_METHODS):
                    row = find(rows, group=grp, task=t, method=m, r_factor=r, density=d, workers=4)
                    if row and math.isfinite(row["final"]["mean"]):
                        sc = 100 if row["metric"] == "accuracy" else 1
                        xs.append(i + (k - 1) * 0.27)
                        ys.append(row["final"]["mean"] * sc)
                        es.append(row["final"]["std"] * sc)
                ax.bar(xs, ys, 0.27, yerr=es, label=name)
            ax.set_xticks(range(len(ABLATION_METHODS)))
            ax.set_xticklabels([method_label(m, r) for m, r in ABLATION_METHODS], rotation=45, fontsize=7)
            ax.set_title(f"{t}, density {d:g}", fontsize=9)
            if find(rows, task=t) and find(rows, task=t)["metric"] == "perplexity":
                ax.set_yscale("log")
        axes[0][0].legend(fontsize=7)
        fig.tight_layout()
        p = os.path.join(outdir, f"{prefix}_ablations.png")
        fig.savefig(p, dpi=80)
        plt.close(fig)
        paths["ablations"] = p

    # momentum (demo configuration): curves per mode
    demo = [r for r in rows if r["group"] == "demo"]
    if demo:
        modes = (("opt", 0.05, "momentum 0.9, lr 0.05 (demo)"), ("none", 0.05, "no momentum, lr 0.05"),
                 ("opt", 0.005, "momentum 0.9, lr 0.005"), ("corr", 0.05, "momentum correction, lr 0.05"),
                 ("dgc", 0.05, "correction + masking, lr 0.05"))
        fig, axes = plt.subplots(1, len(modes), figsize=(4.2 * len(modes), 3.8), squeeze=False)
        for j, (mode, lr, title) in enumerate(modes):
            ax = axes[0][j]
            for m, r in MOMENTUM_METHODS:
                q = "opt" if (m == "dense" and mode in ("corr", "dgc")) else mode
                for row in demo:
                    if (row["method"] == m and row["r_factor"] == r and row["momentum_mode"] == q
                            and abs(row["lr"] - lr) < 1e-12):
                        c = row["curve"]
                        ax.plot(c["step"], [100 * v for v in c["mean"]], color=colors.get(row["label"]),
                                label=row["label"])
                        ax.fill_between(c["step"], [100 * v for v in c["min"]], [100 * v for v in c["max"]],
                                        color=colors.get(row["label"]), alpha=0.15, lw=0)
            ax.set_title(title, fontsize=9)
            ax.set_xlabel("step")
            ax.set_ylim(0, 100)
            ax.grid(alpha=0.3)
        axes[0][0].set_ylabel("digits test accuracy (%)")
        axes[0][0].legend(fontsize=7)
        fig.suptitle("gtopk-demo configuration (P=4, density 0.05): momentum and error feedback")
        fig.tight_layout()
        p = os.path.join(outdir, f"{prefix}_momentum.png")
        fig.savefig(p, dpi=80)
        plt.close(fig)
        paths["momentum"] = p

    if gloo:
        fig, axes = plt.subplots(1, len(gloo), figsize=(4.2 * len(gloo), 3.6), squeeze=False)
        for j, (t, c) in enumerate(gloo.items()):
            ax = axes[0][j]
            ax.plot(c["steps"], c["simulated_metric"], "-", label="simulated (Oracle)")
            ax.plot(c["steps"], c["real_metric"], "o", mfc="none", label="real gloo workers")
            ax.set_title(f"{t}: {c['config']}", fontsize=9)
            ax.set_xlabel("step")
            ax.set_ylabel(c["metric"])
            ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=8)
        fig.tight_layout()
        p = os.path.join(outdir, f"{prefix}_gloo.png")
        fig.savefig(p, dpi=80)
        plt.close(fig)
        paths["gloo"] = p
    return paths
