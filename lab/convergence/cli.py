"""Command line of the convergence study (``python -m lab.convergence``
or ``python -m lab convergence``)."""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from typing import List, Optional, Sequence

from gtopk_plugin.bench.bench_record import write_json
from lab.convergence import report, study
from lab.convergence.sim import RunSpec

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
RESULTS = os.path.join(ROOT, "lab", "results")
QUICK_STEPS = 20


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m lab convergence",
        description="Convergence study of dense, top-k, gTop-k, rTop-k, random-k and threshold "
                    "reduction with error feedback on three offline tasks (sklearn digits CNN, "
                    "procedural glyphs CNN, character LSTM on the Python docs). Workers are "
                    "simulated exactly with gtopk_plugin.testing.Oracle; one configuration per "
                    "task is rerun on real gloo workers. Writes JSON, PNG plots and markdown.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--group", choices=("all", "momentum", "codecs", "codecs_chunk"), default="all",
                   help="'all': the study of lab/reports/convergence.md (main grid, ablations, momentum 0.9 at "
                        "P=4, gtopk-demo configuration); 'momentum': the momentum group run with the "
                        "library's momentum correction, Nesterov, AdamW, the BatchNorm ResNet "
                        "(lab/convergence/momentum.py; results convergence_momentum.*); 'codecs': "
                        "onebit, powersgd (rank 4) and qsgd with momentum correction or optimizer momentum "
                        "beside dense and gTop-k 1%%/0.1%% on digits and glyphs, P=4 (codecs.py; "
                        "results convergence_codecs.*); 'codecs_chunk': onebit with per-chunk scales "
                        "(chunk sweep on glyphs, then the chosen chunk beside the codecs group's dense and "
                        "per-tensor onebit; results convergence_codecs_chunk.*)")
    p.add_argument("--quick", action="store_true",
                   help=f"small CI configuration: every method once per task, {QUICK_STEPS} steps, one seed")
    p.add_argument("--json", metavar="OUT.json", default=None,
                   help="results file; plots and the markdown tables are written next to it "
                        "(default lab/results/convergence.json, or convergence_quick.json with --quick)")
    p.add_argument("--tasks", nargs="+", choices=study.ALL_TASKS, default=list(study.ALL_TASKS),
                   help="tasks (with --group momentum, 'glyphs' also runs the BatchNorm ResNet on glyphs)")
    p.add_argument("--seeds", type=int, default=None,
                   help=f"seeds per configuration (default {len(study.SEEDS)}; 1 with --group momentum, "
                        f"2 with --group codecs)")
    p.add_argument("--demo-seeds", type=int, default=None,
                   help="seeds of the gtopk-demo configuration group (default: --seeds; 0: leave it out)")
    p.add_argument("--steps", type=int, default=None, help="override every task's number of steps")
    p.add_argument("--long", action="store_true",
                   help="--group momentum: the long budgets where dense has plateaued (momentum.LONG_BUDGET: "
                        "digits 1056, glyphs 2800, charlm 4220, ResNet 1400 steps); results "
                        "convergence_momentum_long.*"),
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                   help="simulation processes (one thread each)")
    p.add_argument("--nice", type=int, default=0, help="niceness added to the simulation processes")
    p.add_argument("--budget-min", type=float, default=None,
                   help="--group momentum/codecs: start no new run after this many minutes (runs in priority "
                        "order; finished runs are kept in a journal next to the JSON and reused)")
    p.add_argument("--no-gloo", action="store_true", help="skip the real gloo runs")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def _strip(result: dict) -> dict:
    return {k: v for k, v in result.items() if k not in ("params", "bytes_per_step_curve")}


def _condense_loss(losses: List[float], every: int) -> List[float]:
    """Mean training loss over each evaluation interval (keeps the JSON small)."""
    return [sum(losses[i:i + every]) / len(losses[i:i + every]) for i in range(0, len(losses), every)]


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.group == "momentum":
        from lab.convergence import momentum

        if args.seeds is None:
            args.seeds = 1  # the momentum group's default (CPU budget; lab/reports/convergence.md)
        return momentum.main(args)
    if args.group == "codecs_chunk":
        from lab.convergence import codecs

        return codecs.chunk_main(args)
    if args.group == "codecs":
        from lab.convergence import codecs

        if args.seeds is None:
            args.seeds = 2
        return codecs.main(args)
    if args.seeds is None:
        args.seeds = len(study.SEEDS)
    t_start = time.perf_counter()
    json_path = os.path.abspath(args.json or os.path.join(
        RESULTS, "convergence_quick.json" if args.quick else "convergence.json"))
    outdir = os.path.dirname(json_path)
    os.makedirs(outdir, exist_ok=True)
    prefix = os.path.splitext(os.path.basename(json_path))[0]

    if args.quick:
        grid = [(g, s) for g, s in study.quick_grid(args.steps or QUICK_STEPS) if s.task in args.tasks]
    else:
        steps = {t: args.steps for t in args.tasks} if args.steps else None
        grid = study.full_grid(args.tasks, seeds=tuple(range(args.seeds)), steps=steps,
                               demo_seeds=None if args.demo_seeds is None else tuple(range(args.demo_seeds)))
    specs = study.unique_specs(grid)
    gloo_specs = {}
    if not args.no_gloo:
        for t in (["digits"] if args.quick and "digits" in args.tasks else [] if args.quick else args.tasks):
            st = (args.steps or QUICK_STEPS) if args.quick else args.steps
            s = study.canonical(RunSpec(task=t, steps=st, **study.GLOO_CHECK))
            gloo_specs[t] = s
            if s not in specs:
                specs.append(s)
                grid.append(("gloo", s))
    print(f"convergence study: {len(specs)} simulated runs on {args.jobs} process(es)"
          f"{'' if args.no_gloo else f', {len(gloo_specs)} gloo run(s)'}; tasks {', '.join(args.tasks)}",
          flush=True)
    t0 = time.perf_counter()
    results = study.execute(specs, jobs=args.jobs, keep_params=list(gloo_specs.values()),
                            progress=not args.no_progress, nice=args.nice)
    sim_wall = time.perf_counter() - t0
    failed = {s: r["error"] for s, r in results.items() if "error" in r}
    for s, err in failed.items():
        print(f"run failed: {s}\n{err}", file=sys.stderr)
    results = {s: r for s, r in results.items() if "error" not in r}
    grid = [(g, s) for g, s in grid if s in results]

    gloo_cmp = {}
    t1 = time.perf_counter()
    for t, s in gloo_specs.items():
        from lab.convergence import gloo

        if s not in results:
            continue
        print(f"gloo check: {t} {s.label} d={s.density:g} P={s.workers} on real gloo workers ...", flush=True)
        real = gloo.run(s)
        c = gloo.compare(results[s], real)
        c.update(config=f"{s.label}, d={s.density:g}, P={s.workers}, seed {s.seed}", metric=results[s]["metric"])
        gloo_cmp[t] = c
        print(f"  max |Δ metric| {c['metric_max_abs_diff']:.3g}, weights bit-identical: "
              f"{c['params_bitwise_equal']}, bytes formula vs counters max |Δ| "
              f"{c['bytes_formula_max_abs_diff']:.3g}", flush=True)
    gloo_wall = time.perf_counter() - t1

    rows = report.summarize(grid, results)
    goals = report.goals(rows, args.tasks)
    task_info = {}
    for t in args.tasks:
        task = study._task(t)
        steps = (args.steps or QUICK_STEPS) if args.quick else (args.steps or task.steps)
        task_info[t] = {"source": task.info.get("source"), "model": task.info.get("model"),
                        "params": task.n_params(), "steps": steps, "batch_size": task.batch_size, "lr": task.lr,
                        "metric": task.metric, "eval_every": task.eval_every,
                        **{k: v for k, v in task.info.items() if k not in ("source", "model")}}
        if t == "glyphs":
            from lab.convergence import glyphs
            task_info[t]["difficulty"] = glyphs.difficulty_report() if not args.quick else None
    meta = {"quick": args.quick, "tasks": args.tasks, "argv": list(argv) if argv is not None else sys.argv[1:],
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "python": platform.python_version(), "torch": __import__("torch").__version__,
            "machine": platform.machine(), "cpus": os.cpu_count(), "jobs": args.jobs,
            "grid": {"densities": study.DENSITIES, "workers": study.WORKERS, "r_factors": study.R_FACTORS,
                     "seeds": args.seeds if not args.quick else 1, "demo_seeds": args.demo_seeds, "momentum": study.MOMENTUM,
                     "demo": study.DEMO, "gloo_check": study.GLOO_CHECK},
            "task_info": task_info, "runs": len(specs),
            "wall_s": {"simulation": sim_wall, "gloo": gloo_wall},
            # CPU seconds of the simulated runs: wall time on an otherwise idle
            # machine is about cpu_s / jobs (the wall times above include contention)
            "cpu_s": {"simulation": sum(r.get("cpu_s", 0.0) for r in results.values())}}
    runs = []
    for (group, s) in grid:
        r = results[s]
        d = _strip(r)
        d["group"] = group
        d["train_loss"] = _condense_loss(r["train_loss"], study._task(s.task).eval_every)
        runs.append(d)
    plots = report.plot_all(rows, gloo_cmp, args.tasks, outdir, prefix)
    md = report.markdown(rows, goals, meta, gloo_cmp, {k: os.path.relpath(v, outdir) for k, v in plots.items()})
    meta["wall_s"]["total"] = time.perf_counter() - t_start
    cpu = meta["cpu_s"]["simulation"]
    md += (f"\n_Generated by `python -m lab.convergence {' '.join(meta['argv'])}` on {meta['date']}: "
           f"{len(specs)} simulated runs in {sim_wall / 60:.1f} min wall on {args.jobs} process(es) "
           f"({cpu / 60:.1f} CPU-min, i.e. about {cpu / 60 / max(1, args.jobs):.0f} min on {args.jobs} idle "
           f"cores), gloo checks {gloo_wall:.0f} s; torch {meta['torch']}, Python {meta['python']}._\n")
    meta["failed_runs"] = [s.as_dict() for s in failed]
    out = {"meta": meta, "goals": goals, "summary": [{k: v for k, v in r.items()} for r in rows],
           "gloo_check": gloo_cmp, "runs": runs, "plots": plots}
    write_json(json_path, "convergence", document=out, default=_json_default)
    md_path = os.path.join(outdir, prefix + ".md")
    with open(md_path, "w") as f:
        f.write(md)
    print()
    print(_console_summary(rows, goals))
    print(f"\nwrote {json_path}, {md_path}, {len(plots)} plot(s) "
          f"({meta['wall_s']['total']:.0f} s)")
    if failed:
        print(f"{len(failed)} run(s) failed (tracebacks above)", file=sys.stderr)
        return 1
    return 0


def _json_default(o):
    if isinstance(o, float):
        return None
    if hasattr(o, "tolist"):
        return o.tolist()
    if isinstance(o, tuple):
        return list(o)
    return str(o)


def _console_summary(rows, goals) -> str:
    lines = []
    for r in rows:
        if r["group"] != "main":
            continue
        lines.append(f"{r['task']:>7} P={r['workers']} d={r['density']:<6g} {r['label']:<11} "
                     f"{report.fmt(r['metric'], r['final']):>15}  {report.fmt_bytes(r['bytes_per_step']):>9}/step"
                     f"  eval loss {r['initial_eval_loss']:.3f} -> {r['final_eval_loss']['mean']:.3f}")
    for g in goals["gtopk_within_1pp_of_dense"]:
        lines.append(f"goal 1 {g['task']} P={g['workers']}: gTop-k {100 * g['gtopk']:.1f}% vs dense "
                     f"{100 * g['dense']:.1f}% (gap {g['gap_pp']:+.1f} pp): {'holds' if g['holds'] else 'does NOT hold'}")
    return "\n".join(lines)

