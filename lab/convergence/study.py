"""The grid of the convergence study and its execution.

A study is a list of (group, :class:`RunSpec`) pairs; equal specs are run
once and shared between groups.  Groups:

- ``main``: every method x density {0.001, 0.01} x P {4, 8}, error feedback
  on, no warm-up, plain SGD; rTop-k with r in {2, 4, 8}.
- ``no_ef``: error feedback off (P = 4, both densities; top-k, gTop-k,
  rTop-k r = 4, random-k).
- ``warmup``: density warm-up on (same configurations as ``no_ef``).
- ``momentum``: SGD momentum 0.9 in the optimizer after the reduction, and
  DGC momentum correction + factor masking; P = 4, density 0.01, at the same
  effective step lr/(1−m) as ``main`` (lr scaled by 1−m).
- ``demo``: the configuration of ``gtopk-demo`` (digits, P = 4, density
  0.05, global batch 32, lr 0.05, 8 epochs) with momentum 0.9 in the
  optimizer, without momentum, with momentum at lr/10 (the same effective
  step as no momentum), with DGC momentum correction, and with correction +
  factor masking.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
from dataclasses import replace
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from lab.convergence.sim import RunSpec

ALL_TASKS = ("digits", "glyphs", "charlm")
DENSITIES = (0.001, 0.01)
WORKERS = (4, 8)
SEEDS = (0, 1, 2)
R_FACTORS = (2.0, 4.0, 8.0)
# (method, r_factor) in table order
MAIN_METHODS: Tuple[Tuple[str, float], ...] = (
    ("dense", 4.0), ("topk", 4.0), ("gtopk", 4.0), ("rtopk", 2.0), ("rtopk", 4.0), ("rtopk", 8.0),
    ("randomk", 4.0), ("threshold", 4.0))
ABLATION_METHODS = (("topk", 4.0), ("gtopk", 4.0), ("rtopk", 4.0), ("randomk", 4.0))
MOMENTUM_METHODS = (("dense", 4.0), ("topk", 4.0), ("gtopk", 4.0), ("rtopk", 4.0), ("randomk", 4.0),
                    ("threshold", 4.0))
MOMENTUM_MODES = ("opt", "dgc")
# gtopk-demo variants: (momentum mode, lr multiplier)
DEMO_VARIANTS = (("opt", 1.0), ("none", 1.0), ("opt", 0.1), ("corr", 1.0), ("dgc", 1.0))
MOMENTUM = 0.9
DEMO = dict(task="digits", workers=4, density=0.05, batch_size=32, lr=0.05, steps=352)  # 8 epochs x 44
GLOO_CHECK = dict(method="gtopk", density=0.01, workers=4, seed=0)


def canonical(spec: RunSpec) -> RunSpec:
    """Equal runs get equal specs: settings that cannot change a run are
    normalised (dense has no density, residual or warm-up; r only matters
    to rTop-k; momentum correction of dense is plain momentum)."""
    if spec.method != "rtopk":
        spec = replace(spec, r_factor=4.0)
    if spec.method == "dense":
        spec = replace(spec, density=1.0, error_feedback=True, warmup=False)
        if spec.momentum_mode in ("corr", "dgc"):
            spec = replace(spec, momentum_mode="opt")
    return spec


def full_grid(tasks: Sequence[str] = ALL_TASKS, seeds: Sequence[int] = SEEDS,
              steps: Optional[Dict[str, int]] = None,
              demo_seeds: Optional[Sequence[int]] = None) -> List[Tuple[str, RunSpec]]:
    """The study's runs as (group, spec).  ``demo_seeds``: seeds of the
    demo-configuration group (default: ``seeds``; empty: no demo group)."""
    steps = steps or {}
    out: List[Tuple[str, RunSpec]] = []

    def add(group, **kw):
        for s in seeds:
            out.append((group, canonical(RunSpec(seed=s, steps=steps.get(kw["task"]), **kw))))

    for t in tasks:
        for P in WORKERS:
            for d in DENSITIES:
                for m, r in MAIN_METHODS:
                    add("main", task=t, method=m, r_factor=r, density=d, workers=P)
        for d in DENSITIES:
            for m, r in ABLATION_METHODS:
                add("no_ef", task=t, method=m, r_factor=r, density=d, workers=4, error_feedback=False)
                add("warmup", task=t, method=m, r_factor=r, density=d, workers=4, warmup=True)
        for mode in MOMENTUM_MODES:
            for m, r in MOMENTUM_METHODS:
                add("momentum", task=t, method=m, r_factor=r, density=0.01, workers=4,
                    momentum=MOMENTUM, momentum_mode=mode, lr_scale=1 - MOMENTUM)
    demo_seeds = seeds if demo_seeds is None else demo_seeds
    if "digits" in tasks:
        for m, r in MOMENTUM_METHODS:
            base = dict(DEMO, method=m, r_factor=r)
            for mode, lr_scale in DEMO_VARIANTS:
                for s in demo_seeds:
                    spec = RunSpec(seed=s, momentum=MOMENTUM, momentum_mode=mode, **dict(base, lr=base["lr"] * lr_scale))
                    out.append(("demo", canonical(spec)))
    return out


def quick_grid(steps: int = 25) -> List[Tuple[str, RunSpec]]:
    """The CI configuration: every method once per task (P = 4, density
    0.01, seed 0) and one run of each variation (no error feedback,
    warm-up, momentum in the optimizer, DGC)."""
    out = []
    for t in ALL_TASKS:
        for m, r in MAIN_METHODS:
            if m == "rtopk" and r != 4.0:
                continue
            out.append(("main", canonical(RunSpec(task=t, method=m, r_factor=r, density=0.01, workers=4,
                                                  seed=0, steps=steps))))
    out.append(("no_ef", RunSpec(task="digits", method="topk", density=0.01, workers=4, steps=steps,
                                 error_feedback=False)))
    out.append(("warmup", RunSpec(task="digits", method="gtopk", density=0.01, workers=4, steps=steps,
                                  warmup=True)))
    for mode in ("opt", "dgc"):
        out.append(("momentum", RunSpec(task="digits", method="randomk", density=0.01, workers=4, steps=steps,
                                        momentum=MOMENTUM, momentum_mode=mode, lr_scale=1 - MOMENTUM)))
    return out


def unique_specs(grid: Iterable[Tuple[str, RunSpec]]) -> List[RunSpec]:
    seen, out = set(), []
    for _, s in grid:
        if s not in seen:
            seen.add(s)
            out.append(s)
    return out


# ------------------------------------------------------------- execution
_TASK_CACHE: Dict[str, object] = {}


def _task(name: str):
    if name not in _TASK_CACHE:
        from lab.convergence import tasks

        _TASK_CACHE[name] = tasks.get(name)
    return _TASK_CACHE[name]


def _init_worker(nice: int) -> None:
    import torch

    torch.set_num_threads(1)
    if nice:
        try:
            os.nice(nice)
        except OSError:
            pass


def _run_one(args):
    """(spec, result); a run that raises gives ``{"error": traceback}``
    instead of ending the whole study."""
    spec, keep = args
    from lab.convergence import sim

    try:
        return spec, sim.run(_task(spec.task), spec, keep_params=keep)
    except Exception:  # noqa: BLE001 - reported by the caller
        import traceback

        return spec, {"error": traceback.format_exc()}


def cost(spec: RunSpec) -> float:
    """Rough relative cost, for scheduling the longest runs first."""
    per = {"charlm": 3.0, "glyphs": 1.2, "digits": 1.0}.get(spec.task, 1.0)
    return per * (spec.steps or 300) * (1 + spec.workers / 4)


def _journal_load(path: Optional[str]) -> Dict[RunSpec, dict]:
    """Results already in a journal (one JSON line per finished run)."""
    import json

    out: Dict[RunSpec, dict] = {}
    if path and os.path.exists(path):
        with open(path) as f:
            for line in f:
                try:
                    d = json.loads(line)
                    out[RunSpec(**d["spec"])] = d["result"]
                except (ValueError, KeyError, TypeError):
                    continue  # a line cut by a kill
    return out


def _journal_add(path: Optional[str], spec: RunSpec, result: dict) -> None:
    import json

    if not path or "error" in result or "params" in result:
        return
    with open(path, "a") as f:
        f.write(json.dumps({"spec": spec.as_dict(), "result": result}) + "\n")


def execute(specs: Sequence[RunSpec], jobs: int = 1, keep_params: Sequence[RunSpec] = (),
            progress: bool = True, nice: int = 0, journal: Optional[str] = None,
            in_order: bool = False, budget_s: Optional[float] = None) -> Dict[RunSpec, dict]:
    """Run every spec (``jobs`` processes); returns spec -> result.

    ``journal``: a file where every finished run is appended as one JSON
    line, and from which runs already finished are taken instead of rerun
    (a long study killed half-way resumes).  ``in_order``: run in the given
    (priority) order instead of longest first.  ``budget_s``: start no new
    run after this many seconds; the runs left out are simply missing from
    the result."""
    import torch
    from tqdm import tqdm

    keep = set(keep_params)
    results: Dict[RunSpec, dict] = {s: r for s, r in _journal_load(journal).items()
                                    if s in set(specs) and s not in keep}
    order = [s for s in (list(specs) if in_order else sorted(specs, key=cost, reverse=True))
             if s not in results]
    if jobs <= 1 and nice:
        try:
            os.nice(nice)
        except OSError:
            pass
    bar = tqdm(total=len(order), desc="convergence runs", unit="run", disable=not progress,
               dynamic_ncols=True)
    try:
        if jobs <= 1:
            torch.set_num_threads(1)
            t_start = time.monotonic()
            for s in order:
                if budget_s is not None and time.monotonic() - t_start > budget_s:
                    break
                bar.set_postfix_str(f"{s.task} {s.label} P={s.workers} d={s.density:g}")
                results[s] = _run_one((s, s in keep))[1]
                _journal_add(journal, s, results[s])
                bar.update(1)
        else:
            ctx = mp.get_context("spawn")
            done: "queue.Queue" = queue.Queue()
            t_start = time.monotonic()
            with ctx.Pool(jobs, initializer=_init_worker, initargs=(nice,)) as pool:
                # ``jobs`` runs in flight, started in order, none after the budget
                todo, running = list(order), 0
                while todo or running:
                    while todo and running < jobs and (budget_s is None or
                                                       time.monotonic() - t_start <= budget_s):
                        s = todo.pop(0)
                        pool.apply_async(_run_one, ((s, s in keep),), callback=done.put,
                                         error_callback=lambda e, s=s: done.put((s, {"error": repr(e)})))
                        running += 1
                    if not running:
                        break  # the budget is spent and nothing is left in flight
                    s, r = done.get()
                    running -= 1
                    results[s] = r
                    _journal_add(journal, s, r)
                    bar.set_postfix_str(f"{s.task} {s.label} P={s.workers} d={s.density:g}")
                    bar.update(1)
    finally:
        bar.close()
    return results
