"""The convergence study's codecs group:
``python -m lab.convergence --group codecs``.

The quantizers and the low-rank codec beside gTop-k and dense, on the image
tasks, at the momentum group's budget (steps, SGD lr with momentum 0.9,
cosine decay; :data:`.momentum.BUDGET`), P = 4:

- ``onebit`` (EF-signSGD), ``powersgd`` at rank 4, ``qsgd`` (7 levels,
  buckets of 32), each two ways:
  ``corr`` -- the library's momentum correction (``GradientReducer(momentum_correction=0.9)``:
  each worker's velocity goes through error feedback; momentum factor
  masking only applies to sparse selections, so it is a no-op here), SGD
  without momentum applies the decoded update;
  ``opt`` -- plain error feedback, ``SGD(momentum=0.9)`` applies the decoded
  update (what users of PyTorch's ``powerSGD_hook`` do);
- the baselines, specs equal to the momentum group's: dense (momentum SGD)
  and gTop-k at density 0.01 and 0.001 with the recipe (correction +
  masking + warm-up).

Codec runs are simulated by P real ``GradientReducer`` ranks on threads
(:class:`gtopk_plugin.collectives.threads.ThreadGroup`: exact with respect
to gloo), selector runs by ``testing.Oracle``; :func:`gloo_check` reruns
short codec runs on real gloo workers and compares the final weights bit for
bit.  Bytes per step are what one worker sends (reducers' counters for the
codecs, the exact formulas for the rest); bytes-to-accuracy is the
cumulative bytes at the first evaluation where the seed-mean curve reaches a
target.
"""
from __future__ import annotations

import statistics
from dataclasses import replace
from typing import List, Optional, Sequence, Tuple

from lab.convergence import momentum as mom
from lab.convergence.sim import RunSpec

TASKS = ("digits", "glyphs")
CODECS = (("onebit", None), ("powersgd", 4), ("qsgd", None))
MODES = ("warm", "corr", "opt")
MODE_TEXT = {"warm": "library momentum correction and a dense warm-up over the recipe's warm-up epochs "
                     "(start_iter)",
             "corr": "library momentum correction (velocity through error feedback)",
             "opt": "momentum in the optimizer, on the decoded update"}
WORKERS = 4
LONG_STEPS = 1400  # glyphs, 15 epochs: the momentum group's long budget


def codec_spec(task: str, method: str, rank: Optional[int], mode: str, seed: int,
               steps: Optional[int] = None) -> RunSpec:
    b = mom.BUDGET[task]
    return RunSpec(task=task, method=method, rank=rank, workers=WORKERS, seed=seed,
                   steps=steps or b["steps"], lr=b["lr"], lr_schedule="cosine",
                   momentum=mom.MOMENTUM, momentum_mode="corr" if mode == "warm" else mode,
                   codec_warmup_epochs=b["warmup_epochs"] if mode == "warm" else 0.0)


def baseline_specs(task: str, seed: int, steps: Optional[int] = None) -> List[Tuple[str, RunSpec]]:
    """dense, gTop-k 1% and 0.1% exactly as the momentum group runs them."""
    return [("dense", mom.spec(task, "dense", WORKERS, 0.01, seed, "recipe", steps)),
            ("gtopk", mom.spec(task, "gtopk", WORKERS, 0.01, seed, "recipe", steps)),
            ("gtopk", mom.spec(task, "gtopk", WORKERS, 0.001, seed, "recipe", steps))]


def grid(seeds: Sequence[int] = (0, 1), tasks: Sequence[str] = TASKS, resnet: bool = False,
         steps: Optional[dict] = None, long: bool = False) -> List[Tuple[str, RunSpec]]:
    """(group, spec) in priority order: what the 2 pp goal needs (dense,
    onebit and powersgd both ways) for every seed first, then the gTop-k
    baselines, then qsgd, then (``long``) glyphs at :data:`LONG_STEPS` with
    the correction, then (``resnet``) the BatchNorm ResNet."""
    steps = steps or {}
    out: List[Tuple[str, RunSpec]] = []
    for s in seeds:
        for t in tasks:
            out.append(("codecs", baseline_specs(t, s, steps.get(t))[0][1]))
            for m, r in CODECS[:2]:
                for mode in MODES:
                    out.append(("codecs", codec_spec(t, m, r, mode, s, steps.get(t))))
    for s in seeds:
        for t in tasks:
            out += [("codecs", sp) for _, sp in baseline_specs(t, s, steps.get(t))[1:]]
    for s in seeds:
        for t in tasks:
            for mode in MODES:
                out.append(("codecs", codec_spec(t, "qsgd", None, mode, s, steps.get(t))))
    if long:
        # glyphs at 3x the budget (the momentum group's long run): slow or worse?
        for s in seeds:
            out.append(("long", baseline_specs("glyphs", s, LONG_STEPS)[0][1]))
            for m, r in CODECS[:2]:
                for mode in ("warm", "corr"):
                    out.append(("long", codec_spec("glyphs", m, r, mode, s, LONG_STEPS)))
            out.append(("long", baseline_specs("glyphs", s, LONG_STEPS)[1][1]))
    if resnet:
        t = "glyphs_resnet"
        for s in seeds:
            out.append(("resnet", baseline_specs(t, s, steps.get(t))[0][1]))
            for m, r in CODECS[:2]:
                for mode in ("warm", "corr"):
                    out.append(("resnet", codec_spec(t, m, r, mode, s, steps.get(t))))
            out.append(("resnet", baseline_specs(t, s, steps.get(t))[1][1]))
    # the other momentum mode where budget allows (last: the recommendation per family)
    for s in seeds:
        if long:
            for m, r in CODECS[:2]:
                out.append(("long", codec_spec("glyphs", m, r, "opt", s, LONG_STEPS)))
        if resnet:
            for m, r in CODECS[:2]:
                out.append(("resnet", codec_spec("glyphs_resnet", m, r, "opt", s, steps.get("glyphs_resnet"))))
    return out


def quick_grid(steps: int = 8) -> List[Tuple[str, RunSpec]]:
    """CI: every codec both ways and the baselines on digits, a few steps."""
    out = [("codecs", sp) for _, sp in baseline_specs("digits", 0, steps)[:2]]
    for m, r in CODECS:
        for mode in MODES:
            out.append(("codecs", codec_spec("digits", m, r, mode, 0, steps)))
    return out


def variant(s: RunSpec) -> str:
    if s.method == "dense":
        return "dense"
    if s.method in ("gtopk", "topk"):
        return "recipe"
    return "warm" if s.codec_warmup_epochs else s.momentum_mode


def config_key(s: RunSpec) -> RunSpec:
    return replace(s, seed=0)


# ------------------------------------------------------------ measurements
TIMING_CONFIGS = (("dense", dict(method="dense")), ("topk 1%", dict(method="topk", density=0.01)),
                  ("gtopk 1%", dict(method="gtopk", density=0.01)),
                  ("gtopk 0.1%", dict(method="gtopk", density=0.001)), ("onebit", dict(method="onebit")),
                  ("powersgd(r=4)", dict(method="powersgd", rank=4)), ("qsgd", dict(method="qsgd")))


BIG_LAYER = {"fc.weight": (1000, 1000), "fc.bias": (1000,)}


def timing(task_name: Optional[str] = "glyphs", steps: int = 30, shapes: Optional[dict] = None) -> List[dict]:
    """Every family's reduction on the task model's gradient shapes (or
    ``shapes``), P = 4 real ``GradientReducer`` ranks on threads (default
    kernels): bytes one worker sends per step (the counters), the ranks'
    median thread CPU time per ``reduce()`` (waits excluded), message
    rounds."""
    import time

    import torch

    from gtopk_plugin import GradientReducer
    from gtopk_plugin.collectives.threads import ThreadGroup

    from lab.convergence import study

    if shapes is None:
        shapes = {n: p.shape for n, p in study._task(task_name).build_model().named_parameters()}
    out = []
    for label, kw in TIMING_CONFIGS:
        with ThreadGroup(WORKERS) as group:
            reds = [GradientReducer(transport=t, **kw) for t in group.transports]
            cpu, sent, rounds = [], [], []
            for step in range(steps):
                def one(r):
                    g = torch.Generator().manual_seed(1000 * step + r)
                    grads = {n: torch.randn(*s, generator=g) for n, s in shapes.items()}
                    tr = group.transports[r]
                    t0, x0 = time.thread_time(), tr.transport_cpu_s
                    reds[r].reduce(grads)
                    # the compressor's own work: the in-process stand-in for
                    # the network (copies, emulated sums) left out
                    return time.thread_time() - t0 - (tr.transport_cpu_s - x0)

                cpu.append(statistics.fmean(group.map(one)))
                sent.append(statistics.fmean(red.last_stats.bytes_sent for red in reds))
                rounds.append(reds[0].last_stats.rounds)
        out.append({"config": label, "cpu_s": sorted(cpu)[len(cpu) // 2], "bytes_sent": sent[-1],
                    "rounds": rounds[-1], "numel": sum(int(torch.Size(s).numel()) for s in shapes.values())})
    dense = out[0]["bytes_sent"]
    for t in out:
        t["bytes_ratio"] = t["bytes_sent"] / dense
    return out


GLOO_STEPS = 20


def gloo_specs() -> List[RunSpec]:
    return [codec_spec("digits", "onebit", None, "corr", 0, GLOO_STEPS),
            # the dense warm-up (start_iter = 2) and the switch to onebit
            replace(codec_spec("digits", "onebit", None, "warm", 0, GLOO_STEPS), codec_warmup_epochs=0.1),
            codec_spec("digits", "powersgd", 4, "opt", 0, GLOO_STEPS)]


def gloo_check() -> List[dict]:
    """Short codec runs simulated on threads vs the same runs on P real gloo
    processes (``GradientReducer`` with the same keywords): final weights bit
    for bit, bytes per step against the reducers' counters."""
    from lab.convergence import gloo, sim, study

    out = []
    for s in gloo_specs():
        c = gloo.compare(gloo.simulated(sim.run, study._task(s.task), s, keep_params=True), gloo.run(s))
        out.append({"config": f"{s.task} {s.label} P={s.workers} {MODE_TEXT[variant(s)]}, "
                              f"{s.lr_schedule} lr, {s.steps} steps",
                    "params_bitwise_equal": c["params_bitwise_equal"],
                    "params_max_abs_diff": c["params_max_abs_diff"],
                    "bytes_formula_max_abs_diff": c["bytes_formula_max_abs_diff"]})
    return out


# ------------------------------------------------------------------ main
def main(args) -> int:
    """Run the codecs group (``args`` from cli.build_parser)."""
    import datetime
    import os
    import platform
    import sys
    import time

    from gtopk_plugin.bench.bench_record import write_json
    from lab.convergence import codecs_report as rep
    from lab.convergence import study

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    json_path = os.path.abspath(args.json or os.path.join(
        root, "lab", "results", "convergence_codecs_quick.json" if args.quick else "convergence_codecs.json"))
    outdir = os.path.dirname(json_path)
    os.makedirs(outdir, exist_ok=True)
    prefix = os.path.splitext(os.path.basename(json_path))[0]
    seeds = tuple(range(args.seeds))
    if args.quick:
        g = quick_grid(args.steps or 8)
    else:
        steps = {t: args.steps for t in TASKS + ("glyphs_resnet",)} if args.steps else None
        g = grid(seeds, [t for t in args.tasks if t in TASKS], resnet="glyphs" in args.tasks, steps=steps,
                 long="glyphs" in args.tasks and not args.steps)
    specs = study.unique_specs(g)
    journal = None if args.quick else json_path.replace(".json", ".journal.jsonl")
    reused = len([s for s in study._journal_load(journal) if s in set(specs)])
    print(f"codecs group: {len(specs)} runs ({reused} in the journal) on {args.jobs} process(es)", flush=True)
    t0 = time.perf_counter()
    results = study.execute(specs, jobs=args.jobs, progress=not args.no_progress, nice=args.nice,
                            journal=journal, in_order=True,
                            budget_s=None if args.budget_min is None else 60 * args.budget_min)
    wall = time.perf_counter() - t0
    failed = {s: r["error"] for s, r in results.items() if "error" in r}
    for s, err in failed.items():
        print(f"run failed: {s}\n{err}", file=sys.stderr)
    results = {s: r for s, r in results.items() if "error" not in r}
    g = [(grp, s) for grp, s in g if s in results]
    rows = rep.summarize(g, results)
    goal, b2a = rep.goals(rows), rep.bytes_to_accuracy(rows)
    budget = {}
    for t in sorted({s.task for _, s in g}):
        task = study._task(t)
        st = next(s.steps for _, s in g if s.task == t)
        spe = task.n_train // task.batch_size
        budget[t] = dict(steps=st, lr=mom.BUDGET[t]["lr"], epochs=st / spe, params=task.n_params())
    meta = {"quick": args.quick, "argv": sys.argv[1:], "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "python": platform.python_version(), "torch": __import__("torch").__version__,
            "jobs": args.jobs, "runs": len(results), "seeds": list(seeds) if not args.quick else [0],
            "budget": budget, "wall_s": wall, "reused_from_journal": reused,
            "cpu_s": sum(r.get("cpu_s", 0.0) for r in results.values()),
            "failed": [s.as_dict() for s in failed],
            "not_run": [s.as_dict() for s in specs if s not in results and s not in failed]}
    tim = [] if args.quick else [dict(t, layout="task") for t in timing("glyphs")] + \
        [dict(t, layout="1000x1000") for t in timing(None, 8, BIG_LAYER)]
    if not args.quick and not args.no_gloo:
        print("gloo check: short codec runs repeated on real gloo workers ...", flush=True)
        meta["gloo_check"] = gloo_check()
    png = rep.plot(rows, os.path.join(outdir, prefix + ".png"))
    rel = os.path.basename(png) if png else None
    md = rep.markdown(rows, goal, b2a, tim, meta, rel)
    md += (f"\n_Generated by `python -m lab.convergence --group codecs` on {meta['date']}: "
           f"{len(results)} runs ({reused} taken from the journal), "
           f"{sum(r.get('wall_s', 0.0) for r in results.values()) / 60:.0f} min of run wall time in all on "
           f"{args.jobs} process(es) of a shared 2-core machine ({meta['cpu_s'] / 60:.1f} CPU-min), "
           f"torch {meta['torch']}._\n")
    write_json(json_path, "convergence codecs", default=mom._json_default,
               document={"meta": meta, "goals": goal, "bytes_to_accuracy": b2a, "timing": tim,
                         "summary": [{k: v for k, v in r.items()} for r in rows]})
    with open(os.path.join(outdir, prefix + ".md"), "w") as f:
        f.write(md)
    for gl in goal:
        print(f"{gl['task']:>13} {gl['method']:<14} {gl['mode']:<4} dense {100 * gl['dense']:.1f} codec "
              f"{100 * gl['codec']:.1f} gap {gl['gap_pp']:+.1f} pp: {'holds' if gl['holds'] else 'does NOT hold'}")
    print(f"wrote {json_path}, {prefix}.md{', ' + png if png else ''}")
    return 1 if failed else 0


# ------------------------------------------- onebit with per-chunk scales
CHUNK_SWEEP = (64, 256, 1024)


def chunk_spec(task: str, chunk: int, seed: int, steps: Optional[int] = None,
               merge: Optional[str] = None) -> RunSpec:
    """onebit with ``chunk`` entries per scale, the library's momentum
    correction, otherwise :func:`codec_spec`'s run."""
    return replace(codec_spec(task, "onebit", None, "corr", seed, steps), chunk=chunk, merge=merge)


def chunk_sweep_specs() -> List[RunSpec]:
    """The sweep that picks the chunk: glyphs at the budget, seed 0."""
    return [chunk_spec("glyphs", c, 0) for c in CHUNK_SWEEP]


def pick_chunk(results: dict) -> int:
    """The sweep's best final accuracy; within 0.3 pp the larger chunk
    (fewer scale bytes)."""
    acc = {s.chunk: results[s]["final"] for s in chunk_sweep_specs() if s in results}
    best = max(acc.values())
    return max(c for c, a in acc.items() if a >= best - 0.003)


def chunk_specs(chunk: int) -> List[Tuple[str, RunSpec]]:
    """(group, spec) in priority order after the sweep: glyphs (budget and
    :data:`LONG_STEPS`) seeds 0 and 1, the two-phase variant on glyphs,
    then digits and the ResNet."""
    return [("codecs", chunk_spec("glyphs", chunk, 1)),
            ("long", chunk_spec("glyphs", chunk, 0, LONG_STEPS)),
            ("long", chunk_spec("glyphs", chunk, 1, LONG_STEPS)),
            ("codecs", chunk_spec("glyphs", chunk, 0, merge="reduce_scatter_payloads")),
            ("codecs", chunk_spec("digits", chunk, 0)), ("codecs", chunk_spec("digits", chunk, 1)),
            ("resnet", chunk_spec("glyphs_resnet", chunk, 0)), ("resnet", chunk_spec("glyphs_resnet", chunk, 1))] + \
        [("codecs", chunk_spec("glyphs", c, 1)) for c in CHUNK_SWEEP if c != chunk] + \
        [("codecs", replace(codec_spec("glyphs", "onebit", None, "corr", 0), merge="reduce_scatter_payloads"))] + \
        [("codecs", sp) for s in EXTRA_SEEDS for sp in (
            baseline_specs("glyphs", s)[0][1], codec_spec("glyphs", "onebit", None, "corr", s),
            chunk_spec("glyphs", chunk, s))]


# glyphs at the budget has the widest seed spread: two more seeds of dense,
# per-tensor and chunked onebit (the codecs group ran seeds 0 and 1)
EXTRA_SEEDS = (2, 3)


def chunk_main(args) -> int:
    """``--group codecs_chunk``: the sweep, then the chosen chunk's runs in
    priority order (``--budget-min``: start no run after that), resumable
    from a journal; writes convergence_codecs_chunk.{json,md} beside the
    codecs group's convergence_codecs.json, whose dense and per-tensor
    onebit rows are the reference (not rerun)."""
    import datetime
    import json
    import os
    import sys
    import time

    from gtopk_plugin.bench.bench_record import write_json
    from lab.convergence import codecs_report as rep
    from lab.convergence import study

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    res_dir = os.path.join(root, "lab", "results")
    json_path = os.path.abspath(args.json or os.path.join(res_dir, "convergence_codecs_chunk.json"))
    journal = json_path.replace(".json", ".journal.jsonl")
    with open(os.path.join(res_dir, "convergence_codecs.json")) as f:
        base = json.load(f)["summary"]
    t0 = time.monotonic()
    budget = None if args.budget_min is None else 60 * args.budget_min

    def left():
        return None if budget is None else max(0.0, budget - (time.monotonic() - t0))

    sweep = chunk_sweep_specs()
    results = study.execute(sweep, jobs=1, nice=args.nice, journal=journal, in_order=True,
                            progress=not args.no_progress, budget_s=left())
    chosen = pick_chunk(results)
    rest = [s for _, s in chunk_specs(chosen)]
    results.update(study.execute(rest, jobs=1, nice=args.nice, journal=journal, in_order=True,
                                 progress=not args.no_progress, budget_s=left()))
    results = {s: r for s, r in results.items() if "error" not in r}
    rows = rep.chunk_rows(results, base)
    meta = {"argv": sys.argv[1:], "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "torch": __import__("torch").__version__, "runs": len(results), "chosen": chosen,
            "sweep": list(CHUNK_SWEEP), "sweep_steps": sweep[0].steps or mom.BUDGET["glyphs"]["steps"],
            "run_wall_s": sum(r.get("wall_s", 0.0) for r in results.values()),
            "not_run": [s.as_dict() for s in sweep + rest if s not in results]}
    md = rep.chunk_markdown(rows, meta)
    md += (f"\n_Generated by `python -m lab.convergence --group codecs_chunk` on {meta['date']}: "
           f"{len(results)} runs, {meta['run_wall_s'] / 60:.0f} min of run wall time on one niced process of a "
           f"shared 2-core machine, torch {meta['torch']}._\n")
    write_json(json_path, "convergence codecs chunk", default=mom._json_default,
               document={"meta": meta, "rows": rows,
                         "runs": [dict(spec=s.as_dict(), final=r["final"], bytes_per_step=r["bytes_per_step"],
                                       wall_s=r.get("wall_s")) for s, r in results.items()]})
    with open(json_path.replace(".json", ".md"), "w") as f:
        f.write(md)
    print(md)
    return 0
