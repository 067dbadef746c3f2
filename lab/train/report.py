"""``python -m lab train``: per-rank results -> rows, time to accuracy,
the markdown table and the plot.

Definitions (also in lab/reports/benchmarks.md, "Time to accuracy"):

- a step's time is the slowest rank's (a synchronous step goes at the pace
  of the slowest worker); the wall-clock at step s is the sum of the first
  s step times (evaluations not counted);
- bytes: the busiest rank's bytes sent by the library's accounting (DDP's
  own allreduce and fp16 hook: the ring model 2(P-1)/P x bytes allreduced)
  and, inside namespaces, the worker's ``eth0`` transmit counter (TCP/IP
  headers included).  Each rank's bytes are summed over its steps, and the
  curve takes the largest sum at each step; per step: the busiest rank's
  mean over the steps after the density warm-up.  (A per-step maximum over
  ranks would count twice the bytes of an elastic job, whose ranks send a
  step's late reductions during different later steps.)
- compute: the median over evaluations of the slowest rank's compute-only
  probe (forward + backward + update without communication);
  communication + waiting = median step - compute;
- training-thread CPU: the median over steps of the slowest rank's CPU
  time in the thread that runs the step (``time.thread_time``: forward,
  backward, hooks, the library's selection and merges on that thread;
  not the engines' background threads nor time blocked on the link): what
  the step really computed, beside the probe's compute alone;
- target: the final accuracy of the group's dense run minus 1 pp (elastic
  group: the dense barrier's final accuracy minus 0.5 pp); time to target
  = the wall-clock of the first evaluation at or above it (resolution: one
  evaluation interval).  Also recorded: the time to the baseline's final
  accuracy minus 2 pp (``time_to_minus2pp_s``), a looser target.
"""
from __future__ import annotations

import itertools
import statistics
from typing import List, Optional

from lab.cluster.cpu_account import fractions


def _med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _busiest(series: List[list], warmup: int):
    """(cumulative bytes of the busiest rank at each step, its mean per step
    after ``warmup`` steps); ``series``: per rank, per step bytes (None: not
    counted).  (None, None) when no rank counted any."""
    if all(v is None for s in series for v in s):
        return None, None
    cums = [list(itertools.accumulate(v or 0 for v in s)) for s in series]
    n = len(cums[0])
    w = min(max(0, warmup), n - 1)
    per_step = max((c[-1] - (c[w - 1] if w else 0)) / (n - w) for c in cums)
    return [max(c) for c in zip(*cums)], per_step


def merge(per_rank: list, cfg: dict, label: str) -> dict:
    r0 = per_rank[0]
    times = [max(t) for t in zip(*(r["times"] for r in per_rank))]
    warmup = int(cfg.get("warmup_steps") or 0)
    acc_b, bytes_per_step = _busiest([r["bytes"] for r in per_rank], warmup)
    _, tx_per_step = _busiest([r["tx"] for r in per_rank], warmup)
    compute = [max(c) for c in zip(*(r["compute"] for r in per_rank))]
    cpu = [max(c) for c in zip(*(r["cpu"] for r in per_rank))]
    if acc_b is None:
        acc_b = [0] * len(times)
    wall, cum = [], 0.0
    for t in times:
        cum += t
        wall.append(cum)
    curve = [{"step": e["step"], "wall_s": wall[e["step"] - 1], "bytes": acc_b[e["step"] - 1],
              "accuracy": e["eval"]["accuracy"], "test_loss": e["eval"]["loss"]} for e in r0["evals"]]
    step_med, comp_med = _med(times), _med(compute)
    row = dict(cfg, label=label, steps=len(times), step_times_s=times, losses=r0["losses"], curve=curve,
               final_accuracy=curve[-1]["accuracy"], wall_s=wall[-1], total_bytes=acc_b[-1],
               bytes_per_step=bytes_per_step, tx_bytes_per_step=tx_per_step, step_s=step_med, compute_s=comp_med,
               comm_wait_s=None if step_med is None or comp_med is None else step_med - comp_med,
               compute_probes_s=compute, step_cpu_s=_med(cpu),
               params_equal=len({r["checksum"] for r in per_rank}) == 1,
               loss_first=sum(r0["losses"][:5]) / len(r0["losses"][:5]),
               loss_last=sum(r0["losses"][-5:]) / len(r0["losses"][-5:]))
    row["cpu"] = cpu_demand(per_rank, len(times))
    if "elastic" in r0:
        row["elastic"] = r0["elastic"]
        row["latency_injected"] = [r["latency"] for r in per_rank]
    return row


def cpu_demand(per_rank: list, steps: int) -> Optional[dict]:
    """The job's CPU per step: every rank's process CPU summed, the
    machine's busy share over rank 0's step windows and, where the kernel
    keeps schedstat, the training thread's wait for a core (None for
    results recorded before these counters existed)."""
    r0 = per_rank[0]
    if "proc_cpu" not in r0 or not steps:
        return None
    workers = sum(sum(r["proc_cpu"]) for r in per_rank) / steps
    ticks, hz, cores = r0.get("machine_ticks"), r0.get("ticks_per_s"), r0.get("cores")
    busy, softirq = fractions(ticks)
    machine = None
    if busy is not None and hz:
        machine = (sum(ticks.values()) - ticks["idle"] - ticks["iowait"]) / hz / steps
    out = dict(workers_s_per_step=workers, machine_busy=busy, machine_softirq=softirq,
               machine_s_per_step=machine, cores=cores,
               cpu_bound_step_s=None if machine is None or not cores else machine / cores)
    runq = [r.get("runq") for r in per_rank]
    if all(q is not None and None not in q for q in runq):
        # the training thread's wait for a core: like step_cpu_s, the median over steps of the largest rank's
        out["runqueue_s"] = _med([max(q) for q in zip(*runq)])
    return out


def group_key(r):
    return (r["workload"], r["rate_label"], r["seed"], "elastic" if r["engine"] == "elastic" else r["engine"])


def _time_to(row, target) -> Optional[float]:
    for pt in row["curve"]:
        if pt["accuracy"] >= target:
            return pt["wall_s"]
    return None


def summarise(rows: List[dict]) -> List[dict]:
    """Adds target, time_to_target_s and the ratios to dense (elastic: to the
    dense barrier) and to Top-k of the same group, in place; returns rows."""
    for key in dict.fromkeys(group_key(r) for r in rows):
        g = [r for r in rows if group_key(r) == key]
        if key[3] == "elastic":
            base = next((r for r in g if r["method"] == "dense" and r["policy"] == "barrier"), None)
            margin = 0.005
        else:
            base = next((r for r in g if r["method"] == "dense"), None)
            margin = 0.01
        if base is None:
            continue
        target = base["final_accuracy"] - margin
        topk = next((r for r in g if r["method"] == "topk"), None)
        tb = _time_to(base, target)
        tk = _time_to(topk, target) if topk else None
        t2b = _time_to(base, base["final_accuracy"] - 0.02)
        for r in g:
            t = _time_to(r, target)
            t2 = _time_to(r, base["final_accuracy"] - 0.02)
            # a looser second target: where the sparse runs have not reached -1 pp in the budget
            r.update(time_to_minus2pp_s=t2, speedup_minus2pp_vs_baseline=(t2b / t2) if t2 and t2b else None)
            r.update(target=target, target_margin_pp=100 * margin, baseline=base["name"], time_to_target_s=t,
                     speedup_vs_baseline=(tb / t) if t and tb else None,
                     speedup_vs_topk=(tk / t) if t and tk else None,
                     wall_reduction_vs_baseline=(1 - t / tb) if t and tb else None,
                     acc_delta_pp=100 * (r["final_accuracy"] - base["final_accuracy"]))
    return rows


def _f(v, fmt, dash="–"):
    return dash if v is None else format(v, fmt)


def _ms(v):
    return _f(None if v is None else 1e3 * v, '.0f')


def markdown(rows: List[dict]) -> str:
    lines = ["| workload | link | seed | engine | method | final acc % | Δ vs base (pp) | target % | "
             "time to target s | × base | × Top-k | to −2 pp s (× base) | wall s | MB/step (accounting) | MB/step (eth0) | "
             "step ms | compute ms | comm+wait ms | training-thread CPU ms | training thread waiting for a core ms | "
             "workers' CPU ms/step | machine busy % | CPU-bound step ms | params equal |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        tgt = r.get("target")
        c = r.get("cpu") or {}
        lines.append(
            f"| {r['workload']} | {r['rate_label']} | {r['seed']} | {r['engine']} | {r['name']} | "
            f"{100 * r['final_accuracy']:.2f} | {_f(r.get('acc_delta_pp'), '+.2f')} | "
            f"{_f(None if tgt is None else 100 * tgt, '.2f')} | {_f(r.get('time_to_target_s'), '.1f', 'not reached' if tgt is not None else '–')} | "
            f"{_f(r.get('speedup_vs_baseline'), '.2f')} | {_f(r.get('speedup_vs_topk'), '.2f')} | "
            f"{_f(r.get('time_to_minus2pp_s'), '.1f', 'not reached' if tgt is not None else '–')}"
            f"{'' if r.get('speedup_minus2pp_vs_baseline') is None else ' (' + format(r['speedup_minus2pp_vs_baseline'], '.2f') + ')'} | "
            f"{r['wall_s']:.1f} | {_f(None if r['bytes_per_step'] is None else r['bytes_per_step'] / 1e6, '.3f')} | "
            f"{_f(None if r['tx_bytes_per_step'] is None else r['tx_bytes_per_step'] / 1e6, '.3f')} | "
            f"{1e3 * r['step_s']:.0f} | {_f(None if r['compute_s'] is None else 1e3 * r['compute_s'], '.0f')} | "
            f"{_f(None if r['comm_wait_s'] is None else 1e3 * r['comm_wait_s'], '.0f')} | "
            f"{_f(None if r.get('step_cpu_s') is None else 1e3 * r['step_cpu_s'], '.0f')} | "
            f"{_ms(c.get('runqueue_s'))} | {_ms(c.get('workers_s_per_step'))} | "
            f"{_f(None if c.get('machine_busy') is None else 100 * c['machine_busy'], '.0f')} | "
            f"{_ms(c.get('cpu_bound_step_s'))} | "
            f"{'yes' if r['params_equal'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def plot(res: dict, path: str) -> Optional[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = res["rows"]
    keys = list(dict.fromkeys(group_key(r) for r in rows))
    fig, axes = plt.subplots(len(keys), 3, figsize=(16, 3.8 * len(keys)), squeeze=False)
    for i, key in enumerate(keys):
        g = [r for r in rows if group_key(r) == key]
        a, b, c = axes[i]
        for r in g:
            xs = [0.0] + [p["wall_s"] for p in r["curve"]]
            ys = [10.0] + [100 * p["accuracy"] for p in r["curve"]]
            a.plot(xs, ys, label=r["name"], lw=1.2)
            b.plot([max(1.0, p["bytes"]) for p in r["curve"]], [100 * p["accuracy"] for p in r["curve"]],
                   label=r["name"], lw=1.2)
            L = r["losses"]
            w = max(1, len(L) // 30)
            c.plot([sum(L[max(0, j - w + 1):j + 1]) / len(L[max(0, j - w + 1):j + 1]) for j in range(len(L))],
                   label=r["name"], lw=1)
        tgt = g[0].get("target")
        for ax in (a, b):
            if tgt is not None:
                ax.axhline(100 * tgt, color="0.5", ls=":", lw=1)
            ax.set_ylabel("test accuracy %")
        a.set_xlabel("wall-clock s (training steps only)")
        b.set_xscale("log")
        b.set_xlabel("bytes sent per worker (cumulative)")
        c.set_xlabel("step")
        c.set_ylabel("training loss (rank 0, smoothed)")
        a.legend(fontsize=7)
        wl, rate, seed, eng = key
        a.set_title(f"{wl}, {rate}, seed {seed}, {eng}: accuracy vs time", fontsize=9)
        b.set_title("accuracy vs bytes (dotted: target)", fontsize=9)
        c.set_title("training loss", fontsize=9)
    fig.suptitle(f"python -m lab train, P={res['settings']['P']}, {res['meta']['network']['label']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
