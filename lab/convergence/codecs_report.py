"""Tables, goal checks, bytes-to-accuracy and the plot of the codecs group
(:mod:`.codecs`)."""
from __future__ import annotations

import math
import statistics
from typing import Dict, List, Optional

from lab.convergence import report
from lab.convergence.report import fmt, fmt_bytes, _table

GOAL_PP = 2.0          # onebit and powersgd(r=4) within 2 pp of dense
TARGETS_PP = (2.0, 5.0)  # bytes-to-accuracy targets: dense's final mean minus these
MODES = ("warm", "corr", "opt")
MODE_NAMES = {"dense": "optimizer", "recipe": "recipe (corr. + masking + warm-up)",
              "warm": "correction + dense warm-up", "corr": "correction", "opt": "in optimizer"}


def summarize(grid, results: Dict) -> List[dict]:
    """report.summarize's rows (final over seeds, bytes, mean curves with
    cumulative bytes) with the momentum mode named."""
    rows = report.summarize(grid, results)
    for r in rows:
        r["mode"] = ("dense" if r["method"] == "dense" else
                     "recipe" if r["momentum_mode"] == "dgc" else
                     "warm" if r.get("codec_warmup_epochs") else r["momentum_mode"])
    return rows


def name(r: dict) -> str:
    if r["method"] == "gtopk":
        return f"gtopk {100 * r['density']:g}%"
    return r["label"]


GROUPS = ("codecs", "long", "resnet")


def panels(rows) -> List[tuple]:
    """(group, task) pairs present, in report order."""
    have = {(r["group"], r["task"]) for r in rows}
    return [(g, t) for g in GROUPS for t in sorted({t for gg, t in have if gg == g})]


def find(rows, task, label, mode=None, density=None, group=None) -> Optional[dict]:
    for r in rows:
        if r["task"] == task and r["label"] == label and (mode is None or r["mode"] == mode) \
                and (density is None or r["density"] == density) and (group is None or r["group"] == group):
            return r
    return None


def goals(rows: List[dict]) -> List[dict]:
    """onebit and powersgd(r=4) vs dense, every codec mode, per task:
    gap of the seed means (pp), the seeds' values, holds iff gap ≤ 2 pp."""
    out = []
    for group, task in panels(rows):
        dense = find(rows, task, "dense", group=group)
        if not dense:
            continue
        for label in ("onebit", "powersgd(r=4)", "qsgd"):
            for mode in MODES:
                r = find(rows, task, label, mode, group=group)
                if not r:
                    continue
                d, x = dense["final"]["mean"], r["final"]["mean"]
                gap = 100 * (d - x)
                out.append({"group": group, "task": task, "steps": r["steps"], "method": label, "mode": mode,
                            "dense": d, "codec": x,
                            "dense_values": dense["final"]["values"], "codec_values": r["final"]["values"],
                            "codec_std": r["final"]["std"], "gap_pp": gap, "holds": bool(gap <= GOAL_PP),
                            "goal_method": label != "qsgd", "seeds": r["seeds"],
                            "bytes_ratio": r["bytes_per_step"] / dense["bytes_per_step"]})
    return out


def bytes_to(r: dict, target: float) -> Optional[float]:
    """Cumulative bytes (one worker) at the first evaluation where the
    seed-mean curve reaches ``target`` (accuracy); None if never."""
    for m, b in zip(r["curve"]["mean"], r["curve"]["bytes"]):
        if m is not None and math.isfinite(m) and m >= target:
            return b
    return None


def bytes_to_accuracy(rows: List[dict]) -> List[dict]:
    """Per panel and target (:func:`targets`): every configuration's bytes
    to reach it, and the ratio to gTop-k 1%'s / 0.1%'s bytes to reach it."""
    out = []
    for group, task in panels(rows):
        dense = find(rows, task, "dense", group=group)
        if not dense:
            continue
        tr = [r for r in rows if r["task"] == task and r["group"] == group]
        g1 = find(rows, task, "gtopk", density=0.01, group=group)
        g01 = find(rows, task, "gtopk", density=0.001, group=group)
        for tname, target in targets(dense, g1):
            ref1 = bytes_to(g1, target) if g1 else None
            ref01 = bytes_to(g01, target) if g01 else None
            for r in tr:
                b = bytes_to(r, target)
                out.append({"group": group, "task": task, "target_name": tname, "target": target,
                            "config": name(r), "mode": r["mode"], "bytes": b, "vs_gtopk_1": _ratio(b, ref1),
                            "vs_gtopk_0.1": _ratio(b, ref01)})
    return out


def targets(dense: dict, g1: Optional[dict]) -> List[tuple]:
    """(name, accuracy) targets of a panel: dense's final mean less 2 and
    5 pp, and gTop-k 1%'s own final mean (what gTop-k reaches with its
    bytes)."""
    out = [(f"dense − {pp:g} pp", dense["final"]["mean"] - pp / 100) for pp in TARGETS_PP]
    if g1:
        out.append(("gTop-k 1% final", g1["final"]["mean"]))
    return out


def _ratio(b, ref):
    if b is None:
        return None if ref is not None else math.nan  # neither reached: undefined
    if ref is None:
        return 0.0  # reached where gTop-k did not
    if ref == 0:
        return 1.0 if b == 0 else math.inf  # reached before any step
    return b / ref


def _fmt_ratio(x) -> str:
    if x is None:
        return "not reached"
    if isinstance(x, float) and math.isnan(x):
        return "–"
    if x == 0.0:
        return "gTop-k never"
    return f"{x:.2f}×"


ORDER = ("dense", "gtopk 1%", "gtopk 0.1%", "onebit", "powersgd(r=4)", "qsgd")


def _sort_key(r):
    n = name(r)
    return (ORDER.index(n) if n in ORDER else 99, r["mode"])


def _vals(metric, agg) -> str:
    return ", ".join(f"{100 * v:.1f}" if metric == "accuracy" else f"{v:.2f}" for v in agg["values"])


def markdown(rows: List[dict], goal: List[dict], b2a: List[dict], timing: List[dict], meta: dict,
             plot: Optional[str]) -> str:
    parts = ["### Codecs group: onebit, PowerSGD and QSGD beside dense and gTop-k (P = 4)"]
    budget = meta.get("budget", {})
    parts.append(_table(["task", "steps", "epochs", "SGD lr (m=0.9, cosine)", "seeds"],
                        [[t, str(b["steps"]), f"{b['epochs']:.1f}", f"{b['lr']:g}", ", ".join(map(str, meta["seeds"]))]
                         for t, b in budget.items()]))
    parts.append("#### Goal: onebit and powersgd(r=4) within 2 pp of dense (qsgd for reference)")
    parts.append(_table(
        ["task", "steps", "method", "momentum", "dense (per seed)", "codec (per seed)", "codec mean ± std", "gap",
         "bytes vs dense", "within 2 pp"],
        [[g["task"], str(g["steps"]), g["method"], MODE_NAMES[g["mode"]],
          f"{100 * statistics.fmean(g['dense_values']):.1f} ({_vals('accuracy', {'values': g['dense_values']})})",
          _vals("accuracy", {"values": g["codec_values"]}),
          f"{100 * g['codec']:.1f} ± {100 * g['codec_std']:.1f}", f"{g['gap_pp']:+.1f} pp",
          f"{100 * g['bytes_ratio']:.1f}%", "yes" if g["holds"] else "**no**"] for g in goal]))
    for group, task in panels(rows):
        tr = sorted([r for r in rows if r["task"] == task and r["group"] == group], key=_sort_key)
        metric = tr[0]["metric"]
        parts.append(f"#### {task}, {tr[0]['steps']} steps: final test accuracy %, bytes per worker per step, "
                     f"bytes to accuracy")
        mine = [x for x in b2a if x["task"] == task and x["group"] == group]
        tnames = list(dict.fromkeys(x["target_name"] for x in mine))
        tgt = {tn: [x for x in mine if x["target_name"] == tn] for tn in tnames}
        head = ["method", "momentum", "final % (mean ± std)", "bytes/step", "vs dense"]
        for tn in tnames:
            head += [f"bytes to {100 * tgt[tn][0]['target']:.1f}% ({tn})", "vs gTop-k 1% / 0.1%"]
        dense = find(rows, task, "dense", group=group)
        body = []
        for r in tr:
            cells = [name(r), MODE_NAMES.get(r["mode"], r["mode"]),
                     fmt(metric, r["final"]),
                     fmt_bytes(r["bytes_per_step"]),
                     f"{100 * r['bytes_per_step'] / dense['bytes_per_step']:.1f}%" if dense else "–"]
            for tn in tnames:
                x = next((y for y in tgt[tn] if y["config"] == name(r) and y["mode"] == r["mode"]), None)
                cells += ["not reached" if not x or x["bytes"] is None else fmt_bytes(x["bytes"]),
                          "–" if not x or r["method"] == "gtopk" else
                          f"{_fmt_ratio(x['vs_gtopk_1'])} / {_fmt_ratio(x['vs_gtopk_0.1'])}"]
            body.append(cells)
        parts.append(_table(head, body))
    for layout, title in (("task", "the tasks' 38,282-parameter CNN"),
                          ("1000x1000", "one 1000 × 1000 linear layer + bias (1,001,000 entries)")):
        tl = [t for t in timing if t.get("layout", "task") == layout]
        if not tl:
            continue
        parts.append(f"#### Reduction cost per step, {title} (P = 4 ranks on threads)")
        parts.append(_table(
            ["method", "bytes sent / worker / step (counted)", "vs dense", "reducer CPU / worker / step (median)",
             "transfer at 1 Gbit/s", "at 10 Gbit/s", "message rounds"],
            [[t["config"], fmt_bytes(t["bytes_sent"]), f"{100 * t['bytes_ratio']:.1f}%",
              f"{1e3 * t['cpu_s']:.2f} ms", f"{1e3 * t['bytes_sent'] * 8 / 1e9:.2f} ms",
              f"{1e3 * t['bytes_sent'] * 8 / 1e10:.3f} ms", str(t["rounds"])] for t in tl]))
    if plot:
        parts.append(f"![codecs group]({plot})")
    if meta.get("gloo_check"):
        parts.append("#### Threaded simulation vs real gloo workers")
        parts.append(_table(["configuration", "final weights bit-identical", "max abs Δ bytes/step (sim − counted)"],
                            [[c["config"], "yes" if c["params_bitwise_equal"] else f"no ({c['params_max_abs_diff']:.3g})",
                              f"{c['bytes_formula_max_abs_diff']:.3g}"] for c in meta["gloo_check"]]))
    return "\n\n".join(parts) + "\n"


def plot(rows: List[dict], path: str) -> Optional[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pan = panels(rows)
    if not pan:
        return None
    colors = {"dense": "k", "gtopk 1%": "C3", "gtopk 0.1%": "C1", "onebit": "C0", "powersgd(r=4)": "C2",
              "qsgd": "C4"}
    fig, axes = plt.subplots(len(pan), 2, figsize=(11, 3.6 * len(pan)), squeeze=False)
    for row, (group, task) in zip(axes, pan):
        tr = sorted([r for r in rows if r["task"] == task and r["group"] == group], key=_sort_key)
        for r in tr:
            c = r["curve"]
            ys = [100 * m for m in c["mean"]]
            ls = {"opt": "--", "warm": ":"}.get(r["mode"], "-")
            lab = f"{name(r)}{ {'opt': ' (opt)', 'warm': ' (warm-up)'}.get(r['mode'], '')}"
            row[0].plot(c["step"], ys, color=colors.get(name(r)), ls=ls, lw=1.2, label=lab)
            xb = [max(b, 1.0) / 1e6 for b in c["bytes"]]
            row[1].plot(xb[1:], ys[1:], color=colors.get(name(r)), ls=ls, lw=1.2, label=lab)
        row[0].set_title(f"{task}, {tr[0]['steps']} steps, P=4: accuracy vs step", fontsize=9)
        row[1].set_title(f"{task}, {tr[0]['steps']} steps, P=4: accuracy vs MB sent per worker", fontsize=9)
        row[1].set_xscale("log")
        for ax in row:
            ax.set_ylim(40, 100)
            ax.grid(alpha=0.3)
        row[0].set_xlabel("step")
        row[1].set_xlabel("MB sent per worker (cumulative)")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=70)
    plt.close(fig)
    return path


# ------------------------------------------- onebit with per-chunk scales
def _reference(base: List[dict], results: Dict, task: str, steps: int, method: str) -> Dict[int, float]:
    """seed -> final accuracy of dense or per-tensor onebit (correction):
    the codecs group's committed rows, and runs of the same specs in
    ``results`` (extra seeds)."""
    out: Dict[int, float] = {}
    for b in base:
        if b["task"] == task and b["steps"] == steps and b["method"] == method and \
                (method == "dense" or b["mode"] == "corr"):
            out.update(zip(b["seeds"], b["final"]["values"]))
    for s, r in results.items():
        if s.task == task and s.steps == steps and s.method == method and s.chunk is None and s.merge is None:
            out[s.seed] = r["final"]
    return out


def chunk_rows(results: Dict, base: List[dict]) -> List[dict]:
    """One row per (task, steps, chunk, merge) of the onebit runs with
    chunked scales or the two-phase merge (``results``: spec -> run
    result), beside dense and per-tensor onebit (correction) on the same
    seeds (the codecs group's committed summary ``base``, plus the runs of
    those specs in ``results``): gap to dense in pp of the seed means,
    within 2 pp or not."""
    groups: Dict[tuple, list] = {}
    for s, r in results.items():
        if s.method == "onebit" and (s.chunk is not None or s.merge is not None):
            groups.setdefault((s.task, s.steps, s.chunk, s.merge), []).append((s.seed, r))
    out = []
    for (task, steps, chunk, merge), runs in sorted(groups.items(), key=lambda kv: (
            kv[0][0], kv[0][1], kv[0][3] or "", kv[0][2] or 0)):
        runs.sort(key=lambda x: x[0])
        seeds = [s for s, _ in runs]
        vals = [r["final"] for _, r in runs]
        dense = _reference(base, results, task, steps, "dense")
        per = _reference(base, results, task, steps, "onebit")
        dv = [dense[s] for s in seeds if s in dense]
        pv = [per[s] for s in seeds if s in per]
        db = next((b["bytes_per_step"] for b in base if b["task"] == task and b["method"] == "dense"), None)
        pb = next((b["bytes_per_step"] for b in base if b["task"] == task and b["method"] == "onebit"), None)
        mean = statistics.fmean(vals)
        row = dict(task=task, steps=steps, chunk=chunk or 0, merge=merge or "allgather_payloads", seeds=seeds,
                   values=vals, mean=mean, std=statistics.stdev(vals) if len(vals) > 1 else None,
                   bytes_per_step=runs[0][1]["bytes_per_step"],
                   dense_values=dv, dense_bytes=db, per_tensor_values=pv, per_tensor_bytes=pb)
        if len(dv) == len(vals):
            row["gap_pp"] = 100 * (statistics.fmean(dv) - mean)
            row["holds"] = row["gap_pp"] <= GOAL_PP
        if len(pv) == len(vals):
            row["vs_per_tensor_pp"] = 100 * (mean - statistics.fmean(pv))
        out.append(row)
    return out


def chunk_markdown(rows: List[dict], meta: dict) -> str:
    def pct(vs):
        return ", ".join(f"{100 * v:.1f}" for v in vs) if vs else "–"

    def mstd(vs):
        if not vs:
            return "–"
        return f"{100 * statistics.fmean(vs):.1f}" + (f" ± {100 * statistics.stdev(vs):.1f}" if len(vs) > 1 else "")

    lines = ["### onebit with per-chunk scales (`chunk=`) beside per-tensor onebit and dense (P = 4)", "",
             "Library momentum correction (velocity through error feedback), SGD lr and cosine decay of the "
             "codecs group; dense and per-tensor onebit on the same seeds: the codecs group's committed runs "
             "(convergence_codecs.json, seeds 0 and 1) and, for glyphs at 465 steps, seeds 2 and 3 run here.  "
             "Chunk 0: one scale per tensor (two-phase rows).  Gap: dense's seed mean minus the row's, "
             f"goal ≤ {GOAL_PP:g} pp.  Std: sample std over the seeds.", "",
             "| task | steps | chunk | aggregation | seeds | onebit % (per seed) | mean ± std | per-tensor onebit % "
             "| dense % | gap to dense | vs per-tensor | bytes/step (per-tensor, dense) | within 2 pp |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        gap = f"{r['gap_pp']:+.1f} pp" if "gap_pp" in r else "–"
        vs = f"{r['vs_per_tensor_pp']:+.1f} pp" if "vs_per_tensor_pp" in r else "–"
        byt = (f"{fmt_bytes(r['bytes_per_step'])} ({fmt_bytes(r['per_tensor_bytes'])}, "
               f"{fmt_bytes(r['dense_bytes'])}; {100 * r['bytes_per_step'] / r['dense_bytes']:.1f}% of dense)"
               if r["dense_bytes"] and r["per_tensor_bytes"] else fmt_bytes(r["bytes_per_step"]))
        agg = "two-phase" if r["merge"] == "reduce_scatter_payloads" else "allgather"
        held = "–" if "holds" not in r else ("yes" if r["holds"] else "**no**")
        lines.append(f"| {r['task']} | {r['steps']} | {r['chunk']} | {agg} | {', '.join(map(str, r['seeds']))} | "
                     f"{pct(r['values'])} | {mstd(r['values'])} | {mstd(r['per_tensor_values'])} | "
                     f"{mstd(r['dense_values'])} | {gap} | {vs} | {byt} | {held} |")
    lines.append("")
    if meta.get("chosen") is not None:
        lines.append(f"Chunk chosen by the sweep (glyphs, {meta.get('sweep_steps')} steps, seed 0): "
                     f"{meta['chosen']} (best final accuracy; within 0.3 pp the larger chunk).")
        lines.append("")
    return "\n".join(lines)
