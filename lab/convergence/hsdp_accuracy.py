"""Accuracy of the FSDP2/HSDP replica reduction on the convergence study's
image tasks: ``python -m lab hsdp-accuracy``.

Real FSDP2 HSDP (``fully_shard`` on every layer with parameters, then the
root) on a (2 replicas x 2 shards) gloo mesh of 4 CPU processes, for:

- ``dense``: stock HSDP (no ``sparse_replica_reduction`` call), SGD with
  momentum 0.9 in the optimizer;
- ``gtopk``: ``sparse_replica_reduction(method="gtopk", density=0.01,
  momentum_correction=True, optimizer=opt, warmup=DGC warm-up)`` -- the
  library's recipe (docs/recipes.md).

Budget, learning rate (cosine decay to 0), global batch and warm-up are the
momentum group's (:data:`lab.convergence.momentum.BUDGET`); the 4 ranks
each take a quarter of the global batch, as the study's P = 4 workers do
(:meth:`Task.shard`), so the mean over ranks is the global batch's mean.
Every rank evaluates (an FSDP forward is collective); rank 0 reports.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time
from typing import Dict, List, Optional, Sequence

from lab.convergence import gloo, momentum, sim

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TASKS = momentum.IMAGE_TASKS
METHODS = ("dense", "gtopk")
MESH = (2, 2)  # (replicate, shard)
DENSITY = 0.01
GOAL_PP = 1.0
COMMAND = "python -m lab hsdp-accuracy"


def budget(task: str, steps: Optional[int] = None, long: bool = False) -> dict:
    """steps, lr, warm-up epochs of ``task``: the momentum group's short
    budget, or with ``long`` its long one (:data:`momentum.LONG_BUDGET`: dense
    has plateaued, DGC's four-epoch warm-up); ``steps`` cuts the budget (the
    warm-up shrinks in proportion)."""
    b = momentum.BUDGET[task]
    out = dict(steps=b["steps"], lr=b["lr"], warmup_epochs=b["warmup_epochs"])
    if long:
        out.update(steps=momentum.LONG_BUDGET[task]["steps"],
                   warmup_epochs=momentum.LONG_BUDGET[task]["warmup_epochs"])
    if steps is not None and steps < out["steps"]:
        out["warmup_epochs"] *= steps / out["steps"]
        out["steps"] = steps
    return out


def _shard_model(model, mesh) -> None:
    from torch.distributed.fsdp import fully_shard

    for m in list(model.modules()):
        if m is not model and any(True for _ in m.parameters(recurse=False)):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)


def worker(ctx, task_name: str, method: str, seed: int, steps: int, lr: float, warmup_epochs: float,
           eval_every: Optional[int]) -> Optional[dict]:
    """Launcher target: train one run on this rank; rank 0 returns the
    history (test metric per evaluation) and the mean training loss per step."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from gtopk_plugin.torch_fsdp import sparse_replica_reduction
    from lab.convergence import tasks

    rank, P = ctx.rank, ctx.size
    mesh = init_device_mesh("cpu", MESH, mesh_dim_names=("replicate", "shard"))
    task = tasks.get(task_name)
    bs = task.batch_size
    model = sim.initial_model(task, seed)  # the same weights on every rank before sharding
    _shard_model(model, mesh)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum.MOMENTUM)
    reduction = None
    if method != "dense":
        wu = sim.dgc_warmup(warmup_epochs, sim.steps_per_epoch(task, bs), momentum.RECIPE["warmup_start"])
        reduction = sparse_replica_reduction(model, method=method, density=DENSITY, mesh=mesh,
                                             momentum_correction=True, optimizer=opt, warmup=wu, seed=seed)
    every = eval_every or task.eval_every
    # every rank evaluates: an FSDP forward is collective
    hist, record = gloo.history_recorder(task, model)
    record(0)
    losses, sent = [], []
    ctx.barrier()
    t0 = time.perf_counter()
    for step in range(steps):
        batch = task.batch_indices(seed, step, bs)
        loss = task.loss(model, task.shard(batch, rank, P))
        opt.zero_grad()
        loss.backward()
        for g in opt.param_groups:
            g["lr"] = lr * 0.5 * (1.0 + math.cos(math.pi * step / steps))  # sim.lr_at's cosine
        opt.step()
        losses.append(loss.item())
        if reduction is not None:
            sent.append(reduction.last_step_traffic["bytes_sent"])
        if (step + 1) % every == 0 or step + 1 == steps:
            record(step + 1)
    wall = time.perf_counter() - t0
    tot = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(tot)
    out = None
    if rank == 0:
        out = {"history": hist, "final": hist["metric"][-1], "train_loss": (tot / P).tolist(),
               "bytes_sent_per_step_rank0": (sum(sent) / len(sent)) if sent else None,
               "wall_s": wall, "diverged": not all(math.isfinite(x) for x in losses)}
    ctx.barrier()
    return out


def run_one(task: str, method: str, seed: int, steps: Optional[int] = None,
            eval_every: Optional[int] = None, timeout: float = 3600.0, long: bool = False) -> dict:
    """One run on 4 gloo processes; rank 0's result plus its settings."""
    from gtopk_plugin._launch import launcher

    b = budget(task, steps, long)
    t0 = time.perf_counter()
    out = launcher.run(MESH[0] * MESH[1], worker, task, method, seed, b["steps"], b["lr"],
                       b["warmup_epochs"], eval_every, timeout=timeout)[0]
    out.update(task=task, method=method, seed=seed, total_wall_s=time.perf_counter() - t0, **b)
    return out


def _key(task, method, seed, steps, long=False) -> str:
    return json.dumps([task, method, seed, steps] + (["long"] if long else []))


def summarize(runs: List[dict]) -> List[dict]:
    """Per task: dense and gTop-k per seed, the paired gap (gTop-k − dense,
    same seed: same initial weights and batches) and its mean in pp."""
    rows = []
    for task in dict.fromkeys(r["task"] for r in runs):
        by = {(r["method"], r["seed"]): r for r in runs if r["task"] == task}
        seeds = sorted({s for _, s in by})
        gaps = [100 * (by["gtopk", s]["final"] - by["dense", s]["final"]) for s in seeds
                if ("gtopk", s) in by and ("dense", s) in by]
        for s in seeds:
            for m in METHODS:
                if (m, s) in by:
                    r = by[m, s]
                    gap = None if m == "dense" or ("dense", s) not in by else \
                        100 * (r["final"] - by["dense", s]["final"])
                    rows.append({"task": task, "method": m, "seed": s, "accuracy": 100 * r["final"],
                                 "gap_pp": gap, "steps": r["steps"], "wall_s": r["total_wall_s"]})
        if gaps:
            rows.append({"task": task, "method": "mean gap", "seed": None, "accuracy": None,
                         "gap_pp": statistics.mean(gaps), "within_goal": statistics.mean(gaps) >= -GOAL_PP})
    return rows


def markdown(rows: List[dict], settings: dict) -> str:
    lines = ["# HSDP accuracy: gTop-k replica reduction against stock HSDP", "",
             f"Regenerate: `{settings['command']}` ({settings['machine']}; seeds "
             f"{', '.join(map(str, settings['seeds']))}; total {settings['total_wall_s']:.0f} s).", "",
             "Real FSDP2 HSDP on a (2 replicas x 2 shards) gloo mesh of 4 CPU processes. "
             "dense: stock HSDP, SGD momentum 0.9. gtopk: `sparse_replica_reduction(method=\"gtopk\", "
             "density=0.01, momentum_correction=True, optimizer=opt, warmup=DGC)` (docs/recipes.md). "
             "Budget per task (global batch 64, cosine lr to 0, the convergence study's momentum group): "
             + "; ".join(f"{t}: {b['steps']} steps, lr {b['lr']}, warm-up {b['warmup_epochs']:g} epochs"
                         for t, b in settings["budget"].items()) + ". " + (
                 "These are the momentum group's long budgets, where dense has plateaued."
                 if settings.get("long") else
                 "These are the momentum group's short budgets: at them the simulated flat P = 4 run "
                 "(lab/reports/convergence.md) left glyphs gTop-k about 6 pp behind dense too; within "
                 "1 pp needed the long budgets (`--long`)."), "",
             "| task | method | seed | test accuracy (%) | gap to dense (pp) |", "|---|---|---|---|---|"]
    for r in rows:
        acc = "" if r["accuracy"] is None else f"{r['accuracy']:.2f}"
        gap = "" if r["gap_pp"] is None else f"{r['gap_pp']:+.2f}"
        if r["method"] == "mean gap":
            ok = "within" if r["within_goal"] else "NOT within"
            lines.append(f"| {r['task']} | **mean gap** | | | **{gap}** ({ok} {GOAL_PP:g} pp) |")
        else:
            lines.append(f"| {r['task']} | {r['method']} | {r['seed']} | {acc} | {gap} |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lab hsdp-accuracy", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", nargs="+", default=list(TASKS), choices=["digits", "glyphs", "glyphs_resnet"])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--steps", nargs="+", default=[], metavar="[TASK=]N",
                    help="cut the budget to N steps (every task, or TASK=N for one)")
    ap.add_argument("--long", action="store_true",
                    help="the momentum group's long budgets (digits 1056, glyphs 2800 steps, four-epoch "
                         "warm-up); results hsdp_accuracy_long.*")
    ap.add_argument("--out", default=None, help="JSON (default lab/results/hsdp_accuracy[_long].json)")
    ap.add_argument("--report", default=None,
                    help="markdown table (default lab/reports/hsdp_accuracy[_long].md; '' : none)")
    args = ap.parse_args(argv)
    stem = "hsdp_accuracy_long" if args.long else "hsdp_accuracy"
    if args.out is None:
        args.out = os.path.join(ROOT, "lab", "results", stem + ".json")
    if args.report is None:
        args.report = os.path.join(ROOT, "lab", "reports", stem + ".md")
    cut = {}
    for item in args.steps:
        name, _, n = item.rpartition("=")
        for t in ([name] if name else args.tasks):
            cut[t] = int(n)

    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    journal = os.path.splitext(args.out)[0] + ".jsonl"  # finished runs; a rerun skips them
    done: Dict[str, dict] = {}
    if os.path.exists(journal):
        with open(journal) as f:
            for line in f:
                try:
                    d = json.loads(line)
                    done[d["key"]] = d["result"]
                except (ValueError, KeyError):
                    continue
    t0 = time.perf_counter()
    runs = []
    for task in args.tasks:
        for seed in args.seeds:
            for method in METHODS:
                k = _key(task, method, seed, cut.get(task), args.long)
                if k not in done:
                    done[k] = run_one(task, method, seed, cut.get(task), long=args.long)
                    with open(journal, "a") as f:
                        f.write(json.dumps({"key": k, "result": done[k]}) + "\n")
                r = done[k]
                print(f"{task} {method} seed {seed}: {100 * r['final']:.2f}% "
                      f"({r['steps']} steps, {r['total_wall_s']:.0f} s)", flush=True)
                runs.append(r)
    rows = summarize(runs)
    settings = {"command": COMMAND + "".join(
                    f" --{k} {' '.join(map(str, v)) if isinstance(v, list) else v}"
                    for k, v in (("tasks", args.tasks), ("seeds", args.seeds), ("steps", args.steps))
                    if v != {"tasks": list(TASKS), "seeds": [0, 1], "steps": []}.get(k))
                    + (" --long" if args.long else ""),
                "long": args.long,
                "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch "
                           f"{__import__('torch').__version__}",
                "mesh": list(MESH), "density": DENSITY, "seeds": args.seeds,
                "budget": {t: budget(t, cut.get(t), args.long) for t in args.tasks},
                "total_wall_s": sum(r["total_wall_s"] for r in runs),
                "when": datetime.datetime.now().isoformat(timespec="seconds")}
    with open(args.out, "w") as f:
        json.dump({"benchmark": "hsdp_accuracy", "settings": settings, "rows": rows, "runs": runs}, f, indent=1)
    md = markdown(rows, settings)
    if args.report:
        with open(args.report, "w") as f:
            f.write(md)
    print(md)
    print(f"wrote {args.out}" + (f" and {args.report}" if args.report else ""))
    print(f"(this invocation: {time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
