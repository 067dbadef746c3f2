"""Entry point, summary, table and plot of the hierarchical rows
(:mod:`.hier`): ``python -m lab convergence-hier``.

Per (task, P, method): final test accuracy flat and hierarchical (mean ±
sample std over seeds), the paired gap hierarchical − flat per seed (same
seed: same initial weights and batches), and bytes per step: inter-node
bytes a node leader sends (hierarchical) vs bytes a flat worker sends.
"Not worse than flat" holds when the mean paired gap is ≥ −0.5 pp (the
order of the seed-to-seed spread of one configuration here); the table
also shows whether it is ≥ 0.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from typing import Dict, List, Optional

from gtopk_plugin.bench.bench_record import write_json
from lab.convergence import hier, momentum
from lab.convergence.sim import RunSpec

TOLERANCE_PP = 0.5
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _key(spec: RunSpec, nodes: int) -> str:
    return json.dumps([spec.as_dict(), nodes], sort_keys=True)


def execute(cases, journal: Optional[str], progress: bool = True) -> Dict[str, dict]:
    """Run every (spec, nodes) in order, one process; finished runs are
    appended to ``journal`` (JSON lines) and taken from it on a rerun."""
    done: Dict[str, dict] = {}
    if journal and os.path.exists(journal):
        with open(journal) as f:
            for line in f:
                d = json.loads(line)
                done[d["key"]] = d["result"]
    for i, (s, nodes) in enumerate(cases):
        k = _key(s, nodes)
        if k in done:
            continue
        r = hier.run_one(s, nodes)
        r = {x: r[x] for x in ("final", "history", "bytes_per_step", "diverged", "initial_eval_loss",
                                "final_eval_loss", "train_loss", "wall_s", "cpu_s", "steps", "metric")}
        done[k] = r
        if journal:
            with open(journal, "a") as f:
                f.write(json.dumps({"key": k, "result": r}) + "\n")
        if progress:
            kind = "flat" if nodes == s.workers else f"{nodes}x{s.workers // nodes}"
            print(f"[{i + 1}/{len(cases)}] {s.task} {s.label} P={s.workers} {kind} seed {s.seed}: "
                  f"{100 * r['final']:.2f}% ({r['wall_s']:.0f} s)", flush=True)
    return done


def summarize(cases, done: Dict[str, dict]) -> List[dict]:
    rows = []
    groups: Dict[tuple, dict] = {}
    for s, nodes in cases:
        k = _key(s, nodes)
        if k not in done:
            continue
        g = groups.setdefault((s.task, s.workers, s.method), {"flat": {}, "hier": {}, "nodes": None})
        if nodes == s.workers:
            g["flat"][s.seed] = done[k]
        else:
            g["hier"][s.seed] = done[k]
            g["nodes"] = nodes
    for (t, P, m), g in groups.items():
        seeds = sorted(set(g["flat"]) & set(g["hier"]))
        if not seeds:
            continue
        fl = [g["flat"][sd]["final"] for sd in seeds]
        hi = [g["hier"][sd]["final"] for sd in seeds]
        gaps = [100 * (h - f) for h, f in zip(hi, fl)]
        mean_gap = statistics.fmean(gaps)
        fb = statistics.fmean(g["flat"][sd]["bytes_per_step"] for sd in seeds)
        hb = statistics.fmean(g["hier"][sd]["bytes_per_step"] for sd in seeds)
        rows.append({
            "task": t, "workers": P, "nodes": g["nodes"], "local": P // g["nodes"], "method": m, "seeds": seeds,
            "density": hier.DENSITY, "steps": g["flat"][seeds[0]]["steps"],
            "flat": _agg(fl), "hier": _agg(hi), "gaps_pp": gaps, "gap_mean_pp": mean_gap,
            "gap_std_pp": statistics.stdev(gaps) if len(gaps) > 1 else 0.0,
            "flat_bytes_per_worker_step": fb, "hier_inter_bytes_per_node_step": hb, "bytes_ratio": hb / fb,
            "holds": mean_gap >= -TOLERANCE_PP, "holds_strict": mean_gap >= 0.0,
            "curves": {"flat": _mean_curve([g["flat"][sd] for sd in seeds]),
                       "hier": _mean_curve([g["hier"][sd] for sd in seeds])}})
    return rows


def _agg(v):
    return {"mean": statistics.fmean(v), "std": statistics.stdev(v) if len(v) > 1 else 0.0, "values": v}


def _mean_curve(rs):
    steps = rs[0]["history"]["step"]
    return {"step": steps, "mean": [statistics.fmean(c) for c in zip(*(r["history"]["metric"] for r in rs))]}


def _pm(a):
    return f"{100 * a['mean']:.2f}" + (f" ± {100 * a['std']:.2f}" if len(a["values"]) > 1 else "")


def markdown(rows, meta, png) -> str:
    head = ["task", "P (nodes × local)", "method", "seeds", "flat acc %", "hierarchical acc %",
            "gap hier − flat (pp, per seed)", "bytes/step: flat per worker", "hier inter-node per node",
            "ratio", "not worse (≥ −0.5 pp)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        per = ", ".join(f"{x:+.2f}" for x in r["gaps_pp"])
        lines.append("| " + " | ".join([
            r["task"], f"{r['workers']} ({r['nodes']} × {r['local']})", r["method"],
            ",".join(map(str, r["seeds"])), _pm(r["flat"]), _pm(r["hier"]),
            f"{r['gap_mean_pp']:+.2f} ({per})", f"{r['flat_bytes_per_worker_step']:.0f}",
            f"{r['hier_inter_bytes_per_node_step']:.0f}", f"{r['bytes_ratio']:.2f}",
            ("yes" if r["holds"] else "**no**") + ("" if r["holds_strict"] else " (below flat)")]) + " |")
    out = ["### Hierarchical vs flat: the momentum recipe, density 0.01 (k per node = k per flat worker)",
           "\n".join(lines)]
    if png:
        out.append(f"![hierarchical vs flat]({png})")
    if meta.get("gloo_check"):
        t = ["| configuration | final weights bit-identical | max abs (formula − counted) inter-node bytes/step |",
             "|---|---|---|"]
        for c in meta["gloo_check"]:
            eq = "yes" if c["params_bitwise_equal"] else f"no ({c['params_max_abs_diff']:.3g})"
            t.append(f"| {c['config']} | {eq} | {c['bytes_formula_max_abs_diff']:.3g} |")
        out += ["### Simulation vs the real HierarchicalReducer on gloo", "\n".join(t)]
    out.append(f"_Generated by `python -m lab convergence-hier` on {meta['date']}: {meta['runs']} runs, "
               f"{meta['run_wall_s'] / 60:.1f} min of run wall time on one process (shared 2-core machine), torch {meta['torch']}._")
    return "\n\n".join(out) + "\n"


def plot(rows, path) -> Optional[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["task"], r["workers"]) for r in rows})
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), squeeze=False)
    for ax, (t, P) in zip(axes[0], panels):
        for r in rows:
            if (r["task"], r["workers"]) != (t, P):
                continue
            c = "C3" if r["method"] == "gtopk" else "C0"
            for kind, ls in (("flat", "-"), ("hier", "--")):
                cv = r["curves"][kind]
                where = "flat" if kind == "flat" else f"{r['nodes']}x{r['local']}"
                lab = f"{r['method']} {where}"
                ax.plot(cv["step"], [100 * v for v in cv["mean"]], color=c, ls=ls, lw=1.2, label=lab)
        ax.set_ylim(40, 100)
        ax.set_title(f"{t}, P={P}, d=0.01 (recipe)", fontsize=9)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=70)
    plt.close(fig)
    return path


def _gloo_check():
    print("gloo check: the real HierarchicalReducer vs the simulation ...", flush=True)
    out = hier.gloo_check()
    for c in out:
        print(f"  {c['config']}: bit-identical {c['params_bitwise_equal']}, "
              f"bytes formula diff {c['bytes_formula_max_abs_diff']}", flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lab convergence-hier", description=__doc__)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--tasks", nargs="+", default=list(hier.TASKS), choices=hier.TASKS)
    ap.add_argument("--quick", action="store_true", help="CI: three 12-step runs on digits")
    ap.add_argument("--steps", type=int, default=None, help="override the momentum group's budget")
    ap.add_argument("--no-gloo", action="store_true", help="skip the check against real gloo workers")
    ap.add_argument("--report-only", action="store_true",
                    help="no new runs: summarize the runs in the journal (and the saved gloo check)")
    ap.add_argument("--gloo-only", action="store_true", help="only the gloo check, saved for the report")
    ap.add_argument("--json", default=None)
    ap.add_argument("--nice", type=int, default=0)
    args = ap.parse_args(argv)
    if args.nice:
        os.nice(args.nice)
    import torch

    torch.set_num_threads(1)  # one process on a shared machine (as study.execute's jobs)
    json_path = os.path.abspath(args.json or os.path.join(
        ROOT, "lab", "results", "convergence_hier_quick.json" if args.quick else "convergence_hier.json"))
    outdir, prefix = os.path.dirname(json_path), os.path.splitext(os.path.basename(json_path))[0]
    os.makedirs(outdir, exist_ok=True)
    cases = hier.quick_specs(args.steps or 12) if args.quick else \
        hier.specs(tuple(range(args.seeds)), args.tasks, args.steps)
    journal = None if args.quick else json_path.replace(".json", ".journal.jsonl")
    gloo_path = json_path.replace(".json", "_gloo.json")
    if args.gloo_only:
        write_json(gloo_path, "convergence hierarchical gloo check", document={"checks": _gloo_check()})
        print(f"wrote {gloo_path}")
        return 0
    t0 = time.perf_counter()
    done = execute([] if args.report_only else cases, journal)
    wall = time.perf_counter() - t0
    rows = summarize(cases, done)
    meta = {"quick": args.quick, "argv": sys.argv[1:] if argv is None else list(argv),
            "date": datetime.datetime.now().isoformat(timespec="seconds"), "python": platform.python_version(),
            "torch": __import__("torch").__version__, "runs": len(done), "wall_s": wall,
            "run_wall_s": sum(r["wall_s"] for r in done.values()),
            "recipe": momentum.RECIPE, "budget": {t: momentum.BUDGET[t] for t in args.tasks},
            "tolerance_pp": TOLERANCE_PP}
    if not args.quick and os.path.exists(gloo_path):
        with open(gloo_path) as f:
            meta["gloo_check"] = json.load(f)["checks"]
    elif not args.quick and not args.no_gloo:
        meta["gloo_check"] = _gloo_check()
        write_json(gloo_path, "convergence hierarchical gloo check", document={"checks": meta["gloo_check"]})
    png = plot(rows, os.path.join(outdir, prefix + ".png"))
    rel = os.path.basename(png) if png else None
    runs = [{"spec": s.as_dict(), "nodes": n, **{k: v for k, v in done[_key(s, n)].items() if k != "train_loss"}}
            for s, n in cases if _key(s, n) in done]
    write_json(json_path, "convergence hierarchical", document={"meta": meta, "summary": rows, "runs": runs})
    with open(os.path.join(outdir, prefix + ".md"), "w") as f:
        f.write(markdown(rows, meta, rel))
    for r in rows:
        print(f"{r['task']:>7} P={r['workers']} {r['method']:<5} flat {_pm(r['flat'])} hier {_pm(r['hier'])} "
              f"gap {r['gap_mean_pp']:+.2f} pp, bytes {r['bytes_ratio']:.2f}x: "
              f"{'holds' if r['holds'] else 'does NOT hold'}")
    print(f"wrote {json_path}, {prefix}.md, {prefix}.png")
    return 0
