"""Tables (terminal and markdown) and plots of the emulated-cluster results."""
from __future__ import annotations

import math
from typing import Dict, List, Optional

from lab.cluster import shapes as S

METHODS = ("dense", "topk", "gtopk")
COLORS = {"dense": "tab:blue", "topk": "tab:red", "gtopk": "tab:green"}
MARKERS = {"dense": "o", "topk": "x", "gtopk": "^"}


def _fmt_bytes(b):
    for unit, s in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= s:
            return f"{b / s:.3g} {unit}"
    return f"{b:.0f} B"


def _ms(t):
    return f"{t * 1e3:.1f}" if t >= 0.01 else f"{t * 1e3:.2f}"


def _label(meta):
    net = (meta or {}).get("network", {})
    if not net.get("shaped"):
        return f"UNSHAPED ({net.get('why', '?')})"
    extra = f", delay {net['delay']}" if net.get("delay") else ""
    return f"shaped: {net['rate']} per link both directions, tbf burst {net['burst']}{extra}"


def _plt():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt
    except ImportError:
        print("matplotlib not installed: no plots (pip install -e '.[bench]')")
        return None


# ---------------------------------------------------------------------------
# measurement 1
# ---------------------------------------------------------------------------
def comm_index(rows) -> Dict[tuple, dict]:
    return {(r["engine"], r["P"], r["numel"], r["dtype"], r["method"], r["density"]): r for r in rows}


def comm_tables(res) -> List[str]:
    """Markdown: one table per (engine, dtype): rows (N, density, P)."""
    idx = comm_index(res["rows"])
    out = []
    engines = sorted({r["engine"] for r in res["rows"]}, key=lambda e: e != "torch")
    for engine in engines:
        for dtype in ("fp32", "fp16"):
            keys = sorted({(r["numel"], r["density"], r["P"]) for r in res["rows"]
                           if r["engine"] == engine and r["dtype"] == dtype and r["density"] is not None})
            if not keys:
                continue
            out.append(f"\n**{engine}, {dtype} values** (ms per exchange: median over steps of the slowest "
                       "rank, in brackets the part spent in the transport; bytes: sent by the busiest worker)\n")
            out.append("| N | density | P | dense ms | Top-k ms (wire) | gTop-k ms (wire) | gTop-k / Top-k "
                       "| gTop-k / dense | dense bytes | Top-k bytes | gTop-k bytes |")
            out.append("|---|---|---|---|---|---|---|---|---|---|---|")
            for N, d, P in keys:
                de = idx.get((engine, P, N, dtype, "dense", None))
                tk = idx.get((engine, P, N, dtype, "topk", d))
                gk = idx.get((engine, P, N, dtype, "gtopk", d))

                def t(r):
                    return _ms(r["time_s"]) if r else "–"

                def tw(r):
                    return f"{_ms(r['time_s'])} ({_ms(r['wire_s'])})" if r else "–"

                def b(r):
                    return _fmt_bytes(r["bytes_sent"]) if r else "–"
                r1 = f"{gk['time_s'] / tk['time_s']:.2f}" if gk and tk else "–"
                r2 = f"1/{de['time_s'] / gk['time_s']:.0f}" if gk and de else "–"
                out.append(f"| {N:,} | {d:g} | {P} | {t(de)} | {tw(tk)} | {tw(gk)} | {r1} | {r2} | {b(de)} | "
                           f"{b(tk)} | {b(gk)} |")
    return out


def link_table(res) -> List[str]:
    rate = None
    out = ["| engine | P | raw TCP ring, slowest worker | dense N | dense ms | dense achieved | efficiency "
           "(≥ 0.85?) | machine CPU busy (softirq) | worker CPU s/step |", "|---|---|---|---|---|---|---|---|---|"]
    link = {l["P"]: l for l in res.get("link", [])}
    dense = [r for r in res["rows"] if r["method"] == "dense"]
    biggest = max((r["numel"] for r in dense), default=None)
    for r in sorted(dense, key=lambda r: (r["engine"] != "torch", r["P"], r["dtype"] != "fp32")):
        if r["numel"] != biggest:
            continue
        l = link.get(r["P"])
        raw = f"{l['min_gbit_s']:.3f} Gbit/s" if l else "–"
        eff = r.get("link_efficiency")
        effs = f"{eff:.2f} ({'yes' if eff >= 0.85 else 'NO'})" if eff is not None else "unshaped"
        busy = (f"{r['machine_busy']:.0%} ({r['machine_softirq']:.0%})"
                if r.get("machine_busy") is not None else "–")
        out.append(f"| {r['engine']} {r['dtype']} | {r['P']} | {raw} | {r['numel']:,} | {_ms(r['time_s'])} | "
                   f"{r['achieved_gbit_s']:.3f} Gbit/s | {effs} | {busy} | {r.get('proc_cpu_s', 0):.2f} |")
    return out


def goal1(res) -> List[str]:
    idx = comm_index(res["rows"])
    out = []
    for engine in sorted({r["engine"] for r in res["rows"]}, key=lambda e: e != "torch"):
        for dtype in ("fp32", "fp16"):
            de = idx.get((engine, 8, 25_000_000, dtype, "dense", None))
            tk = idx.get((engine, 8, 25_000_000, dtype, "topk", 0.001))
            gk = idx.get((engine, 8, 25_000_000, dtype, "gtopk", 0.001))
            if not (de and tk and gk):
                continue
            a, b = gk["time_s"] / tk["time_s"], gk["time_s"] / de["time_s"]
            aw = gk["wire_s"] / tk["wire_s"] if tk["wire_s"] > 0 else float("nan")
            out.append(f"- {engine}, {dtype}: gTop-k {_ms(gk['time_s'])} ms, Top-k {_ms(tk['time_s'])} ms, dense "
                       f"{_ms(de['time_s'])} ms → gTop-k/Top-k = {a:.2f} (goal ≤ 0.5: "
                       f"{'met' if a <= 0.5 else 'NOT met'}; transport time only: {aw:.2f}), gTop-k/dense = "
                       f"1/{1 / b:.0f} (goal ≤ 1/100: {'met' if b <= 0.01 else 'NOT met'})")
    return out


ENGINE_NAMES = {"torch": "torch.distributed (gloo)", "horovod": "Horovod, gloo side channel",
                "horovod-ops": "Horovod ops (`exchange=\"horovod\"`)"}
LINE_STYLES = {"torch": "-", "horovod": "--", "horovod-ops": ":"}
FILL = {"torch": "full", "horovod": "none", "horovod-ops": "left"}  # tells engines apart at a single P


def engines_table(res) -> List[str]:
    """Markdown: the engines side by side for every sparse configuration
    measured on more than one engine, each against torch.distributed (the
    same bytes on every engine: the transports count by the same rules)."""
    idx = comm_index(res["rows"])
    order = [e for e in ENGINE_NAMES if any(r["engine"] == e for r in res["rows"])]
    keys = sorted({(r["P"], r["numel"], r["dtype"], r["method"], r["density"]) for r in res["rows"]
                   if r["density"] is not None}, key=lambda k: (k[3], k[1], k[4], k[0], k[2]))
    out = ["| method | N | density | P | dtype | engine | exchange ms (wire) | / torch.distributed | bytes sent "
           "per step | ops per step |", "|---|---|---|---|---|---|---|---|---|---|"]
    for P, N, dtype, m, d in keys:
        rows = [(e, idx.get((e, P, N, dtype, m, d))) for e in order]
        rows = [(e, r) for e, r in rows if r]
        if len(rows) < 2:
            continue
        base = idx.get(("torch", P, N, dtype, m, d))
        for e, r in rows:
            ratio = f"{r['time_s'] / base['time_s']:.2f}×" if base else "–"
            ops = r.get("ops_per_step")
            out.append(f"| {m} | {N:,} | {d:g} | {P} | {dtype} | {ENGINE_NAMES.get(e, e)} | {_ms(r['time_s'])} "
                       f"({_ms(r['wire_s'])}) | {ratio} | {r['bytes_sent']:,} | {ops if ops is not None else '–'} |")
    return out if len(out) > 2 else []


def goal_horovod(res) -> List[str]:
    """Issue #15: at 25M, density 0.001, P = 8, Horovod's gTop-k exchange
    ≤ 1.3× the torch.distributed one (fp32)."""
    idx = comm_index(res["rows"])
    base = idx.get(("torch", 8, 25_000_000, "fp32", "gtopk", 0.001))
    out = []
    for e in ("horovod", "horovod-ops"):
        r = idx.get((e, 8, 25_000_000, "fp32", "gtopk", 0.001))
        if not (base and r):
            continue
        q = r["time_s"] / base["time_s"]
        same = "same bytes" if r["bytes_sent"] == base["bytes_sent"] else "BYTES DIFFER"
        out.append(f"- {ENGINE_NAMES[e]}: gTop-k {_ms(r['time_s'])} ms vs torch.distributed "
                   f"{_ms(base['time_s'])} ms → {q:.2f}× (goal ≤ 1.3×: {'met' if q <= 1.3 else 'NOT met'}; "
                   f"{same}, {r['bytes_sent']:,} B)")
    return out


def print_comm(res):
    print(f"\n{_label(res['meta'])}")
    for line in link_table(res) + comm_tables(res):
        print(line)
    for line in goal1(res):
        print(line)
    side = engines_table(res)
    if side:
        print("\nEngines side by side:\n")
        for line in side + [""] + goal_horovod(res):
            print(line)


def plot_comm(res, path) -> Optional[str]:
    plt = _plt()
    if plt is None or not res["rows"]:
        return None
    numels = sorted({r["numel"] for r in res["rows"]})
    dens = sorted({r["density"] for r in res["rows"] if r["density"] is not None})
    fig, axes = plt.subplots(len(numels), max(1, len(dens)), figsize=(5.5 * max(1, len(dens)), 4 * len(numels)),
                             squeeze=False)
    for i, N in enumerate(numels):
        for j, d in enumerate(dens or [None]):
            ax = axes[i][j]
            for engine, ls in LINE_STYLES.items():
                for m in METHODS:
                    pts = sorted((r["P"], r["time_s"]) for r in res["rows"]
                                 if r["engine"] == engine and r["numel"] == N and r["dtype"] == "fp32"
                                 and r["method"] == m and (r["density"] == d or m == "dense"))
                    if pts:
                        ax.plot([p for p, _ in pts], [t * 1e3 for _, t in pts], ls, marker=MARKERS[m],
                                fillstyle=FILL[engine], markersize=8, color=COLORS[m], label=f"{m} ({engine})")
            ax.set_yscale("log")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("workers P")
            ax.set_ylabel("ms per exchange (fp32)")
            ax.set_title(f"N = {N:,}, density {d:g}" if d else f"N = {N:,}")
            ax.grid(True, which="both", ls=":")
            ax.legend(fontsize=7)
    fig.suptitle(f"Measurement 1 — {_label(res['meta'])}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------
# measurement 2
# ---------------------------------------------------------------------------
def replay_table(res) -> List[str]:
    idx = {(r["engine"], r["model"], r["P"], r["method"]): r for r in res["rows"]}
    out = ["| engine | model | params | P | dense s/iter (eff.) | Top-k s/iter (eff.) | gTop-k s/iter (eff.) "
           "| gTop-k comm ms |", "|---|---|---|---|---|---|---|---|"]
    for engine, m, P in sorted({(r["engine"], r["model"], r["P"]) for r in res["rows"]},
                               key=lambda x: (x[0], S.numel(x[1]), x[2])):
        cells = []
        for meth in METHODS:
            r = idx.get((engine, m, P, meth))
            cells.append(f"{r['time_s']:.3f} ({r['efficiency']:.2f})" if r else "–")
        g = idx.get((engine, m, P, "gtopk"))
        out.append(f"| {engine} | {m} | {S.numel(m) / 1e6:.1f}M | {P} | " + " | ".join(cells) +
                   f" | {_ms(g['comm_s']) if g else '–'} |")
    return out


def goal2(res) -> List[str]:
    out = []
    for r in sorted(res["rows"], key=lambda r: r["model"]):
        if r["P"] == 8 and r["method"] == "gtopk" and r["model"] in ("resnet50", "vgg16", "vgg16-cifar"):
            out.append(f"- {r['engine']} {r['model']}: gTop-k scaling efficiency at P=8 = {r['efficiency']:.3f} "
                       f"(goal ≥ 0.9: {'met' if r['efficiency'] >= 0.9 else 'NOT met'}; selection "
                       f"{r['selection']}: {r['select_s'] * 1e3:.0f} ms, comm {r['comm_s'] * 1e3:.0f} ms, "
                       f"compute {r['compute_s'] * 1e3:.0f} ms)")
    return out


def print_replay(res):
    print(f"\n{_label(res['meta'])}; selection: {res['settings']['selection']}")
    for line in replay_table(res) + goal2(res):
        print(line)
    for s in res.get("skipped", []):
        print(f"skipped: P={s['P']} {s['model']}: {s['why']}")


# ---------------------------------------------------------------------------
# measurement 3
# ---------------------------------------------------------------------------
def fit_table(mres) -> List[str]:
    out = ["| engine | method | α (ms/message) | β (ns/byte) | 1/β | γ (ns per unit of work) | points "
           "| median abs. error | max abs. error |", "|---|---|---|---|---|---|---|---|---|"]
    for f in mres["fits"]:
        bw = f"{f['bandwidth_gbit_s']:.3f} Gbit/s" if f["bandwidth_gbit_s"] else "–"
        out.append(f"| {f['engine']} | {f['method']} | {f['alpha_s'] * 1e3:.3f} | {f['beta_s_per_byte'] * 1e9:.3f} | "
                   f"{bw} | {f['gamma_s_per_work'] * 1e9:.3f} | {f['points']} | {f['median_abs_rel_err'] * 100:.1f}% | "
                   f"{f['max_abs_rel_err'] * 100:.1f}% |")
    return out


def check_table(mres) -> List[str]:
    out = ["| engine | model | method | P | measured s/iter | predicted | error | comm measured ms | comm predicted ms |",
           "|---|---|---|---|---|---|---|---|---|"]
    for c in sorted(mres["replay_check"], key=lambda c: (c["engine"], S.numel(c["model"]), c["method"], c["P"])):
        out.append(f"| {c['engine']} | {c['model']} | {c['method']} | {c['P']} | {c['iter_measured_s']:.3f} | "
                   f"{c['iter_predicted_s']:.3f} | {c['iter_rel_err'] * 100:+.1f}% | {_ms(c['comm_measured_s'])} | "
                   f"{_ms(c['comm_predicted_s'])} |")
    return out


def goal3(mres) -> List[str]:
    cs = mres["replay_check"]
    if not cs:
        return ["- no replay data: predictions not checked"]
    within = [c for c in cs if abs(c["iter_rel_err"]) <= 0.2]
    worst = max(cs, key=lambda c: abs(c["iter_rel_err"]))
    cc = [c for c in cs if c["comm_rel_err"] is not None]
    cw = [c for c in cc if abs(c["comm_rel_err"]) <= 0.2]
    return [f"- iteration time: {len(within)}/{len(cs)} predictions within 20% (goal: all; "
            f"{'met' if len(within) == len(cs) else 'NOT met'}); worst {worst['model']} {worst['method']} "
            f"P={worst['P']}: {worst['iter_rel_err'] * 100:+.1f}%",
            f"- communication time alone (a harder test: compute is not there to dilute errors): "
            f"{len(cw)}/{len(cc)} within 20%"]


def extrapolation_table(mres, engine="torch") -> List[str]:
    Ps = (8, 16, 32, 64, 128, 1024)
    ex = {(e["model"], e["method"], e["P"]): e for e in mres["extrapolation"] if e["engine"] == engine}
    models = sorted({e["model"] for e in mres["extrapolation"]}, key=S.numel)
    out = ["| model | method | " + " | ".join(f"P={P}" for P in Ps) + " | paper P=16 / 32 |",
           "|---|---|" + "---|" * len(Ps) + "---|"]
    for m in models:
        for meth in METHODS:
            if (m, meth, 8) not in ex:
                continue
            pe = S.paper_efficiency(m, meth)
            paper = f"{pe[16]:.2f} / {pe[32]:.2f}" if pe else "–"
            out.append(f"| {m} | {meth} | " + " | ".join(f"{ex[(m, meth, P)]['efficiency']:.2f}" for P in Ps) +
                       f" | {paper} |")
    return out


def plot_model(mres, replay, base) -> List[str]:
    plt = _plt()
    if plt is None:
        return []
    paths = []
    # predicted vs measured
    fig, ax = plt.subplots(figsize=(5.5, 5))
    lo, hi = 1e9, 0
    for c in mres["replay_check"]:
        ax.scatter(c["iter_measured_s"], c["iter_predicted_s"], color=COLORS[c["method"]], marker=MARKERS[c["method"]],
                   s=30)
        lo, hi = min(lo, c["iter_measured_s"]), max(hi, c["iter_measured_s"])
    for c in mres["replay_check"]:
        if c["comm_measured_s"] > 0:
            ax.scatter(c["comm_measured_s"], c["comm_predicted_s"], facecolors="none",
                       edgecolors=COLORS[c["method"]], marker="o", s=18)
            lo = min(lo, c["comm_measured_s"])
    if hi > 0:
        xs = [lo / 1.5, hi * 1.5]
        ax.plot(xs, xs, "k-", lw=0.8)
        ax.fill_between(xs, [x * 0.8 for x in xs], [x * 1.2 for x in xs], color="grey", alpha=0.2, label="±20%")
    for m in METHODS:
        ax.scatter([], [], color=COLORS[m], marker=MARKERS[m], label=f"{m}: iteration")
    ax.scatter([], [], facecolors="none", edgecolors="k", marker="o", label="communication only")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured seconds (P ≤ 8, replay)")
    ax.set_ylabel("α-β predicted seconds")
    ax.set_title("α-β model (fitted on measurement 1) vs measurement 2", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(True, which="both", ls=":")
    fig.tight_layout()
    p = base + "_fit.png"
    fig.savefig(p, dpi=100)
    plt.close(fig)
    paths.append(p)
    # efficiency curves
    models = sorted({e["model"] for e in mres["extrapolation"]}, key=S.numel)
    if models:
        cols = 3
        rows = math.ceil(len(models) / cols)
        fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows), squeeze=False)
        for ax, m in zip([a for r in axes for a in r], models):
            for meth in METHODS:
                pts = sorted((e["P"], e["efficiency"]) for e in mres["extrapolation"]
                             if e["model"] == m and e["method"] == meth and e["engine"] == "torch")
                if pts:
                    ax.plot([p for p, _ in pts], [v for _, v in pts], "-", color=COLORS[meth], label=f"{meth} α-β")
                if replay:
                    meas = sorted((r["P"], r["efficiency"]) for r in replay["rows"]
                                  if r["model"] == m and r["method"] == meth and r["engine"] == "torch")
                    if meas:
                        ax.plot([p for p, _ in meas], [v for _, v in meas], MARKERS[meth], color=COLORS[meth],
                                ms=7, label=f"{meth} measured")
                pe = S.paper_efficiency(m, meth)
                if pe:
                    ax.plot(list(pe), list(pe.values()), MARKERS[meth], mfc="none", color=COLORS[meth], ms=9,
                            ls=":", lw=0.8, label=f"{meth} paper")
            ax.set_xscale("log", base=2)
            ax.set_ylim(0, 1.05)
            ax.set_xlabel("workers P")
            ax.set_ylabel("scaling efficiency")
            ax.set_title(f"{m} ({S.numel(m) / 1e6:.1f}M params)", fontsize=9)
            ax.grid(True, which="both", ls=":")
            ax.legend(fontsize=6, ncol=2)
        for ax in [a for r in axes for a in r][len(models):]:
            ax.axis("off")
        fig.tight_layout()
        p = base + "_scaling.png"
        fig.savefig(p, dpi=100)
        plt.close(fig)
        paths.append(p)
    return paths


def summary(comm, replay, mres) -> str:
    lines = ["# Emulated 1 GbE cluster: results", ""]
    meta = comm.get("meta") or {}
    lines += [f"- network: {_label(meta)}",
              f"- machine: {meta.get('cpus')} CPUs, torch {meta.get('torch')}, kernels: {meta.get('kernels')}, "
              f"load average at start {meta.get('loadavg_start')}, end {meta.get('loadavg_end')}",
              f"- {meta.get('horovod')}", ""]
    lines += ["## 1. Communication only", "", "Link efficiency (dense ring allreduce of the largest N; "
              "raw TCP: every worker sends to its ring neighbour at once):", ""]
    lines += link_table(comm) + comm_tables(comm) + ["", "Goal (25M, density 0.001, P=8):", ""] + goal1(comm)
    if engines_table(comm):
        lines += ["", "Engines side by side:", ""] + engines_table(comm) + [""] + goal_horovod(comm)
    if replay:
        st = replay["settings"]
        lines += ["", "## 2. Model replay", "",
                  f"Selection: {st['selection']}; density {st['density']}; efficiency = compute / iteration "
                  "(one worker: compute only).", ""]
        lines += replay_table(replay) + ["", "Goal (P=8):", ""] + goal2(replay)
        for s in replay.get("skipped", []):
            lines.append(f"- skipped P={s['P']} {s['model']}: {s['why']}")
    lines += ["", "## 3. α-β model", "", "Fits (measurement 1, relative least squares):", ""] + fit_table(mres)
    if mres["replay_check"]:
        lines += ["", "Predictions of measurement 2:", ""] + check_table(mres) + [""] + goal3(mres)
    if mres["extrapolation"]:
        lines += ["", "Predicted scaling efficiency (torch engine; paper's measured values at the end):", ""]
        lines += extrapolation_table(mres)
    return "\n".join(lines) + "\n"
