"""docs/results.md, rendered from the summary JSON in docs/results/.

    python -m lab render-results             # docs/results.md from docs/results/*.json
    python -m lab render-results --check     # exit 1 when docs/results.md is not what it renders
    python -m lab render-results --collect   # first: docs/results/*.json and *.png from lab/results/

The studies (``gtopk-bench NAME``, ``python -m lab NAME``; lab/README.md)
write their full output (every step, every repetition) to lab/results/,
which git ignores.  ``--collect`` keeps of each what the results page shows
-- the table rows, the machine, the plot -- as one small JSON (and PNG) per
section in docs/results/; the page is rendered from those alone, so it never
holds a number that is not in the data.  ``--from DIR`` collects from
another folder; a section whose study output is missing keeps its data.
"""
from __future__ import annotations

import argparse
import difflib
import json
import os
import shutil
import sys
from typing import Callable, Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "docs", "results")
PAGE = os.path.join(ROOT, "docs", "results.md")
RAW = os.path.join(ROOT, "lab", "results")


# -- formatting ---------------------------------------------------------------
def _bytes(v) -> str:
    v = float(v)
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(v) >= div:
            return f"{v / div:.3g} {unit}"
    return f"{v:.0f} B"


FORMATS: Dict[str, Callable] = {
    "str": str,
    "int": lambda v: f"{int(v):,}",
    "bytes": _bytes,
    "ms": lambda v: f"{float(v):,.0f}" if abs(float(v)) >= 100 else f"{float(v):.3g}",
    "x": lambda v: f"{float(v):.2f}×",
    "pct": lambda v: f"{100 * float(v):.1f} %",
    "pp": lambda v: f"{float(v):+.2f}",
    "g": lambda v: f"{float(v):g}",
    "e": lambda v: f"{float(v):.1e}",
    "yes": lambda v: "yes" if v else "**no**",
    "density": lambda v: "—" if v is None else f"{100 * float(v):g} %",
}


def _cell(v, fmt: str) -> str:
    if v is None and fmt != "density":
        return "—"
    return FORMATS[fmt](v)


def table(rows: List[dict], columns: List[tuple]) -> List[str]:
    """Markdown table of ``rows`` (dicts) with ``columns``: (header, key, format)."""
    out = ["| " + " | ".join(h for h, _, _ in columns) + " |",
           "|" + "|".join("---" if f == "str" else "---:" for _, _, f in columns) + "|"]
    for r in rows:
        out.append("| " + " | ".join(_cell(r.get(k), f) for _, k, f in columns) + " |")
    return out


# -- the page: one entry per section -----------------------------------------
#: key -> title, the command that regenerates it, what it shows, its tables
#: (name in the JSON, caption, columns), and whether a plot belongs to it.
SECTIONS = [
    dict(key="bytes_per_step", title="Bytes per worker per step",
         command="gtopk-bench bytes-per-step --workers 4 8 --numel 1000000 --density 0.001 0.01",
         text="Bytes each worker sends per step for 1M fp32 gradients at P = 8, counted by the "
              "transport (exact on any network; loopback gloo, so the times only rank the methods).",
         tables=[("rows", None, [("method", "method", "str"), ("density", "density", "density"),
                                 ("k", "k", "int"), ("bytes sent", "bytes_sent", "bytes"),
                                 ("of dense", "of_dense", "pct"), ("comm ms", "comm_ms", "ms")])],
         plot=True),
    dict(key="selection", title="Selection speed (CPU kernels)",
         command="gtopk-bench selection",
         text="Median time of one selection, one thread, against `torch.topk` and the one-read "
              "floor (`x.sum()`).",
         tables=[("grid", None, [("N", "n", "int"), ("density", "density", "density"),
                                 ("floor ms", "floor_ms", "ms"), ("torch.topk ms", "topk_ms", "ms"),
                                 ("exact ms", "exact_ms", "ms"), ("threshold ms", "threshold_ms", "ms"),
                                 ("topk / exact", "topk_over_exact", "x"),
                                 ("exact / floor", "exact_over_floor", "x")]),
                 ("resnet50", "ResNet-50's 161 gradients, one call against a loop of `torch.topk`:",
                  [("density", "density", "density"), ("floor ms", "floor_ms", "ms"),
                   ("topk loop ms", "loop_topk_ms", "ms"), ("exact ms", "exact_ms", "ms"),
                   ("loop / exact", "loop_over_exact", "x")])],
         plot=True),
    dict(key="step", title="One reduce() against the memory floor",
         command="gtopk-bench step",
         text="Local work of one `GradientReducer.reduce()` (everything but the wait for peers) "
              "over the time of one read of the gradients, one worker, one thread.",
         tables=[("rows", None, [("layout", "layout", "str"), ("method", "method", "str"),
                                 ("floor ms", "floor_ms", "ms"), ("local ms", "local_ms", "ms"),
                                 ("local / floor", "local_over_floor", "x"),
                                 ("kernel / floor", "kernel_over_floor", "x")])],
         plot=True),
    dict(key="ddp_step", title="DDP step (loopback)",
         command="gtopk-bench ddp-step --workers 2 --rounds 20",
         text="One DDP training step of a 10.5M-parameter MLP on 2 loopback gloo workers: DDP's "
              "allreduce and PyTorch's own hooks against the sparse hook.  On loopback the link is "
              "free, so this is each hook's local cost; the emulated cluster below measures what "
              "they save.",
         tables=[("rows", None, [("variant", "variant", "str"), ("median step ms", "median_ms", "ms"),
                                 ("vs allreduce", "vs_allreduce", "x"), ("hook ms", "hook_ms", "ms")])]),
    dict(key="horovod_overhead", title="Horovod step",
         command="gtopk-bench horovod-overhead --workers 4 --rounds 20 --steps 5",
         text="`horovodrun --gloo`, P = 4.  The optimizer with `Compression.none` against stock "
              "`hvd.DistributedOptimizer` (median over step pairs of the time ratio):",
         tables=[("models", None, [("model", "model", "str"), ("parameters", "numel", "int"),
                                   ("stock ms", "stock_ms", "ms"), ("ours ms", "ours_ms", "ms"),
                                   ("ours / stock", "ratio", "x")]),
                 ("bytes", "Every compression on the 1.1M-parameter MLP, density 1 %, bytes per worker "
                           "per step (Horovod's `none` and `fp16` included):",
                  [("compression", "compression", "str"), ("bytes sent", "bytes_sent", "bytes"),
                   ("of dense", "of_dense", "pct"), ("step ms", "step_ms", "ms"),
                   ("step / none", "ratio_to_none", "x")])]),
    dict(key="half_precision", title="Half-precision gradients",
         command="gtopk-bench half-precision --workers 4 --steps 2000",
         text="The demo model on 4 gloo workers with fp32, fp16 and bf16 gradients at density 1 %: "
              "the sums of what every rank fed and got back agree (relative conservation error), "
              "state stays finite and ranks agree.",
         tables=[("rows", None, [("method", "method", "str"), ("gradients", "dtype", "str"),
                                 ("test accuracy", "accuracy", "pct"),
                                 ("max conservation error", "conservation_error", "e"),
                                 ("finite", "finite", "yes"), ("ranks agree", "ranks_agree", "yes")])],
         plot=True),
    dict(key="overlap", title="DDP: the exchange beside backward",
         command="gtopk-bench overlap",
         text="DDP on 1 Gbit/s shaped links, one thread per worker, the 10.5M-parameter MLP: PyTorch's "
              "hooks and the sparse hook synchronous and asynchronous (gTop-k 1 %).  Exposed: the step "
              "less the no-op hook's step (no communication); on a CPU the selection competes with "
              "backward for the worker's core, so only the wire time can hide.",
         tables=[("rows", None, [("P", "P", "int"), ("hook", "hook", "str"), ("step ms", "step_ms", "ms"),
                                 ("exchange alone ms", "exchange_ms", "ms"), ("exposed ms", "exposed_ms", "ms"),
                                 ("vs no-op", "x_noop", "x"), ("vs best PyTorch hook", "x_best_pytorch", "x")])]),
    dict(key="hsdp_step", title="FSDP2 (HSDP) step",
         command="gtopk-bench hsdp-step",
         text="FSDP2 HSDP of a 10.5M-parameter MLP, batch 16 per rank, on emulated nodes of 2 ranks: "
              "inside a node unshaped, between nodes 1 Gbit/s (tc tbf).  Stock HSDP's replica "
              "all-reduce (fp32, bf16) against `sparse_replica_reduction`; the floor shards inside the "
              "node only (no replica reduction at all).  Per round: the range of the ratio to stock "
              "round by round (the variants of a round run back to back).",
         tables=[("rows", None, [("nodes", "nodes", "int"), ("variant", "variant", "str"),
                                 ("step ms", "step_ms", "ms"), ("vs stock", "vs_stock", "x"),
                                 ("per round", "per_round", "str"),
                                 ("replica bytes sent per rank", "bytes_sent", "bytes")])]),
    dict(key="hsdp_accuracy", title="FSDP2 (HSDP) accuracy",
         command="python -m lab hsdp-accuracy && python -m lab hsdp-accuracy --tasks glyphs --long",
         text="Real FSDP2 HSDP on a (2 replicas × 2 shards) gloo mesh: stock HSDP with SGD momentum "
              "against `sparse_replica_reduction(method=\"gtopk\", density=0.01)` with the recipe "
              "(momentum correction, DGC warm-up), mean of seeds 0 and 1.",
         tables=[("rows", None, [("task", "task", "str"), ("steps", "steps", "int"),
                                 ("dense", "dense", "pct"), ("gTop-k 1 %", "gtopk", "pct"),
                                 ("gap pp", "gap_pp", "pp"), ("within 1 pp", "holds", "yes")])]),
    dict(key="cluster_comm", title="Emulated 1 GbE cluster: the exchange alone",
         command="python -m lab cluster reproduce",
         text="One exchange of 25M fp32 values between P network namespaces on 1 Gbit/s shaped "
              "links (torch.distributed gloo): the dense ring against Top-k's allgather and gTop-k's "
              "butterfly.",
         tables=[("rows", None, [("P", "P", "int"), ("method", "method", "str"),
                                 ("density", "density", "density"), ("ms", "time_ms", "ms"),
                                 ("bytes sent", "bytes_sent", "bytes"), ("vs dense", "speedup", "x")])],
         plot=True),
    dict(key="cluster_ddp", title="Emulated cluster: DDP against PyTorch's compression hooks",
         command="python -m lab cluster ddp",
         text="A DDP step (10.5M parameters, P = 4, 1 Gbit/s links) with PyTorch's own hooks and "
              "with the sparse hook; the floor is the step without communication.",
         tables=[("rows", None, [("hook", "name", "str"), ("median step ms", "median_ms", "ms"),
                                 ("bytes per step", "bytes_per_step", "bytes"),
                                 ("vs best PyTorch hook", "vs_best_pytorch", "x")])],
         plot=True),
    dict(key="train", title="Time to accuracy",
         command="python -m lab train -P 8 --workloads vgg --engines ddp --methods dense,gtopk,topk "
                 "--rates paper --paper-compute-ms 140 --seeds 2 --steps 800 --eval-every 50 "
                 "--json lab/results/train_p8_vgg_paper_800.json",
         text="Real training (DDP, a VGG-like CNN whose wide classifier holds ~99 % of its 5.3M "
              "parameters, 800 steps) on 8 emulated workers, the link rate set so that the dense step "
              "communicates as long, relative to compute, as in the gTop-k paper's GPU cluster.",
         tables=[("rows", None, [("method", "method", "str"), ("seeds", "seeds", "str"),
                                 ("final accuracy", "accuracy", "pct"), ("step s", "step_s", "ms"),
                                 ("bytes per step", "bytes_per_step", "bytes"),
                                 ("step vs dense", "speedup", "x")])],
         plot=True),
    dict(key="convergence", title="Convergence",
         command="python -m lab convergence --seeds 2 --demo-seeds 1",
         text="Final test accuracy (charlm: validation perplexity, lower is better) after the same "
              "number of steps, P = 4, density 1 %, error feedback on, mean over seeds; workers "
              "simulated exactly (checked against real gloo workers).",
         tables=[("methods", None, [("task", "task", "str"), ("dense", "dense", "str"),
                                    ("gTop-k", "gtopk", "str"), ("Top-k", "topk", "str"),
                                    ("rTop-k (r=4)", "rtopk(r=4)", "str"), ("random-k", "randomk", "str"),
                                    ("threshold", "threshold", "str")]),
                 ("goal", "gTop-k against dense at density 1 % (image tasks):",
                  [("task", "task", "str"), ("P", "workers", "int"), ("dense", "dense", "pct"),
                   ("gTop-k", "gtopk", "pct"), ("gap pp", "gap_pp", "pp"), ("within 1 pp", "holds", "yes")])],
         plot=True),
    dict(key="elastic", title="Elastic scheduler",
         command="python -m lab elastic",
         text="P = 2 workers on shaped links with 5 ms per communication round: the relaxed "
              "barrier's policies against the strict barrier (3 seeds).",
         tables=[("rows", None, [("reducer", "reducer", "str"), ("policy", "policy", "str"),
                                 ("step ms", "step_ms", "ms"), ("vs barrier", "ratio_vs_barrier", "x"),
                                 ("accuracy", "accuracy", "pct"), ("Δ pp", "delta_pp", "pp"),
                                 ("breaks per step", "breaks_per_step", "g")])],
         plot=True),
    dict(key="two_level", title="Two-level reduction",
         command="python -m lab cluster comm --nodes 2 4 --local 2 --numel 25000000 --density 0.001 "
                 "--methods gtopk,topk --repeat 3 && python -m lab convergence-hier --seeds 5",
         text="Nodes of 2 workers on shaped inter-node links: one exchange of 25M values, flat "
              "against hierarchical (`hier`: shared memory inside a node, `hier-gloo`: gloo inside "
              "a node):",
         tables=[("exchange", None, [("method", "method", "str"), ("layout", "layout", "str"),
                                     ("nodes", "nodes", "int"), ("exchange ms", "exchange_ms", "ms"),
                                     ("bytes sent", "bytes_sent", "bytes")]),
                 ("convergence", "Convergence, flat against two-level (the recipe, 5 seeds):",
                  [("task", "task", "str"), ("P", "workers", "int"), ("method", "method", "str"),
                   ("flat", "flat", "pct"), ("two-level", "hier", "pct"), ("gap pp", "gap_pp", "pp"),
                   ("inter-node bytes", "bytes_ratio", "x")])],
         plot=True),
]


def _load(key: str, data: str) -> Optional[dict]:
    path = os.path.join(data, key + ".json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def render(data: str = DATA) -> str:
    """The results page from the JSON (and PNG) in ``data``."""
    machine = _load("machine", data) or {}
    out = ["# Results", "",
           "What the library measures on one machine: bytes, local cost, step time on emulated "
           "slow links, and accuracy.  Every table comes from the JSON in [results/](results/) "
           "and is rendered by `python -m lab render-results`; each section names the command "
           "that regenerates its data.  `gtopk-bench` writes to `gtopk-bench-results/`, the lab's "
           "studies ([lab/README.md](../lab/README.md)) to `lab/results/`; "
           "`python -m lab render-results --collect --from DIR` takes a rerun's output into the page.", ""]
    if machine:
        out += ["**Machine.** " + machine["description"], ""]
    out += ["Sections: " + " · ".join(f"[{s['title']}](#{_anchor(s['title'])})" for s in SECTIONS) + ".", "",
            "The emulated clusters (`python -m lab cluster`, `train`, `elastic`) need root for the network "
            "namespaces; without it they run on plain loopback and label their rows unshaped.", ""]
    for s in SECTIONS:
        doc = _load(s["key"], data)
        out += [f"## {s['title']}", "", s["text"], ""]
        if doc is None:
            out += ["_No data yet: run the command below, then `python -m lab render-results --collect`._", ""]
        else:
            for name, caption, cols in s["tables"]:
                if caption:
                    out += [caption, ""]
                out += table(doc["tables"][name], cols) + [""]
            if s.get("plot") and os.path.exists(os.path.join(data, s["key"] + ".png")):
                out += [f"![{s['title']}](results/{s['key']}.png)", ""]
        out += [f"Regenerate: `{s['command']}`.", ""]
    return "\n".join(out).rstrip("\n") + "\n"


def _anchor(title: str) -> str:
    keep = "".join(c for c in title.lower() if c.isalnum() or c in " -")
    return keep.replace(" ", "-")


# -- collecting: the rows each section shows, from the studies' output -------
def _read(raw: str, name: str, optional: bool = False) -> Optional[dict]:
    path = os.path.join(raw, name)
    if not os.path.exists(path):
        if optional:
            return None
        raise FileNotFoundError(f"no {name} in {raw}")
    with open(path) as f:
        return json.load(f)


def _bytes_per_step(raw):
    d = _read(raw, "bytes_per_step.json")
    P = max(r["P"] for r in d["rows"])
    rows = [dict(method=r["method"], density=None if r["method"] == "dense" else r["density"],
                 k=None if r["method"] == "dense" else r["k"],
                 bytes_sent=r["bytes_sent"], of_dense=r["bytes_sent"] / r["dense_bytes"], comm_ms=r["comm_ms"])
            for r in d["rows"] if r["P"] == P and (r["method"] != "dense" or r["density"] == min(
                x["density"] for x in d["rows"]))]
    return {"P": P, "numel": d["args"]["numel"]}, {"rows": rows}, "bytes_per_step.png"


def _selection(raw):
    d = _read(raw, "selection.json")
    keys = ("n", "density", "floor_ms", "topk_ms", "exact_ms", "threshold_ms", "topk_over_exact", "exact_over_floor")
    grid = [{k: r[k] for k in keys} for r in d["grid"] if r["threads"] == 1]
    keys = ("density", "floor_ms", "loop_topk_ms", "exact_ms", "loop_over_exact")
    res = [{k: r[k] for k in keys} for r in d["resnet50"] if r["threads"] == 1]
    return {}, {"grid": grid, "resnet50": res}, "selection.png"


def _step(raw):
    d = _read(raw, "step.json")
    keys = ("layout", "method", "floor_ms", "local_ms", "local_over_floor", "kernel_over_floor")
    rows = [{k: r[k] for k in keys} for r in d["results"] if r["workers"] == 1 and r["threads"] == 1]
    return {}, {"rows": rows}, "step.png"


def _ddp_step(raw):
    d = _read(raw, "ddp_step.json")
    rows = [dict(variant=k, median_ms=v["median_ms"], vs_allreduce=v["vs_allreduce"],
                 hook_ms=(v.get("hook_ms") or {}).get("hook")) for k, v in d["results"].items()]
    return {"settings": d["settings"]}, {"rows": rows}, None


def _horovod_overhead(raw):
    d = _read(raw, "horovod_overhead.json")["results"]
    P = max(k for k in d if k.isdigit())
    r = d[P]
    models = [dict(model=m, numel=v["numel"], stock_ms=1e3 * v["median_step_s"]["stock"],
                   ours_ms=1e3 * v["median_step_s"]["ours"], ratio=v["ratio"]) for m, v in r["models"].items()]
    rows = [dict(compression=c, bytes_sent=v["bytes_sent"], of_dense=v["bytes_sent"] / v["dense_bytes"],
                 step_ms=1e3 * v["median_step_s"], ratio_to_none=v.get("ratio_to_none"))
            for c, v in r["bytes"].items()]
    return {"P": int(P)}, {"models": models, "bytes": rows}, None


def _half_precision(raw):
    d = _read(raw, "half_precision.json")
    rows = [dict(method=r["method"], dtype=r["dtype"], accuracy=r["test_accuracy"],
                 conservation_error=r["rel_conservation_error_max"],
                 finite=r["first_nonfinite_step"] is None and r["error"] is None,
                 ranks_agree=r["ranks_agree"] and r["models_agree"]) for r in d["results"]["runs"]]
    return {"settings": {k: d["settings"][k] for k in ("steps", "density", "workers")}}, {"rows": rows}, \
        "half_precision.png"


def _cluster_comm(raw):
    d = _read(raw, "cluster_comm.json")
    N = max(r["numel"] for r in d["rows"])
    sel = [r for r in d["rows"] if r["engine"] == "torch" and r["dtype"] == "fp32" and r["numel"] == N]
    dense = {r["P"]: r["time_s"] for r in sel if r["method"] == "dense"}
    rows = [dict(P=r["P"], method=r["method"], density=r["density"], time_ms=1e3 * r["time_s"],
                 bytes_sent=r["bytes_sent"], speedup=dense[r["P"]] / r["time_s"]) for r in sel]
    return {"network": d["meta"]["network"]["rate"]}, {"rows": rows}, "cluster_comm.png"


def _cluster_ddp(raw):
    d = _read(raw, "cluster_ddp.json")
    best = d["summary"]["best_pytorch_ms"]
    rows = [dict(name=r["name"], median_ms=r["median_ms"], bytes_per_step=r["bytes_per_step"],
                 vs_best_pytorch=r["median_ms"] / best) for r in d["rows"]]
    return {}, {"rows": rows}, "cluster_ddp.png"


TRAIN_FILES = ("train_p8_vgg_paper_800_dense.json", "train_p8_vgg_paper_800.json",
               "train_p8_vgg_paper_800_s17_seed1.json")


def _train(raw):
    # one run per (method, seed): a later file's run replaces an earlier one's
    runs = list({(r["name"], r["seed"]): r for f in TRAIN_FILES
                 for r in (_read(raw, f, optional=True) or {"rows": []})["rows"]}.values())
    by: Dict[str, List[dict]] = {}
    for r in sorted(runs, key=lambda r: r["seed"]):
        by.setdefault(r["name"], []).append(r)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    dense = mean([r["step_s"] for r in by["dense fp32"]])
    rows = [dict(method=name, seeds=", ".join(str(r["seed"]) for r in rs),
                 accuracy=mean([r["final_accuracy"] for r in rs]), step_s=mean([r["step_s"] for r in rs]),
                 bytes_per_step=mean([r["bytes_per_step"] for r in rs]),
                 speedup=dense / mean([r["step_s"] for r in rs])) for name, rs in by.items()]
    return {"rate": runs[0]["rate_label"]}, {"rows": rows}, "train_p8_vgg_paper_800.png"


def _convergence(raw):
    d = _read(raw, "convergence.json")
    cells: Dict[str, dict] = {}
    for s in d["summary"]:
        if s["group"] == "main" and s["workers"] == 4 and s["density"] in (0.01, 1.0):
            m = s["final"]["mean"]
            cells.setdefault(s["task"], {"task": s["task"]})[s["label"]] = \
                (f"{m:.1f}" if m < 1000 else f"{m:.1e}") if s["metric"] == "perplexity" else f"{100 * m:.1f} %"
    goal = [{k: g[k] for k in ("task", "workers", "dense", "gtopk", "gap_pp", "holds")}
            for g in d["goals"]["gtopk_within_1pp_of_dense"]]
    for g in goal:
        g["gap_pp"] = round(g["gap_pp"], 2)
    return {}, {"methods": list(cells.values()), "goal": goal}, "convergence_glyphs.png"


def _elastic(raw):
    d = _read(raw, "elastic.json")
    rows = [dict(reducer=s["reducer"], policy=s["name"], step_ms=1e3 * s["step_time_median_s"],
                 ratio_vs_barrier=s["ratio_vs_barrier"], accuracy=s["accuracy_mean"],
                 delta_pp=s["accuracy_delta_pp_mean"], breaks_per_step=s["breaks_per_step"])
            for s in d["summary"]]
    return {}, {"rows": rows}, "elastic.png"


def _two_level(raw):
    d = _read(raw, "cluster_nodes.json")
    ex = [dict(method=r["method"], layout=r["layout"], nodes=r["nodes"], exchange_ms=1e3 * r["exchange_s"],
               bytes_sent=r["bytes_sent"]) for r in sorted(d["rows"], key=lambda r: (r["nodes"], r["method"]))]
    h = _read(raw, "convergence_hier.json", optional=True)
    conv = [dict(task=s["task"], workers=s["workers"], method=s["method"], flat=s["flat"]["mean"],
                 hier=s["hier"]["mean"], gap_pp=s["gap_mean_pp"], bytes_ratio=s["bytes_ratio"])
            for s in (h or {"summary": []})["summary"]]
    return {}, {"exchange": ex, "convergence": conv}, "cluster_nodes.png"


def _overlap(raw):
    d = _read(raw, "overlap.json")
    rows = []
    for t in ("overlap", "mlp"):
        tab = d["results"].get(t)
        for name, r in (tab or {"rows": {}})["rows"].items():
            if "per bucket" in name:
                continue  # the default bucket policies only (the bench prints the per-bucket rows)
            rows.append(dict(P=tab["P"], hook=name, step_ms=r["step"], exchange_ms=r["exchange"] or None,
                             exposed_ms=r["exposed"] if r["exchange"] else None, x_noop=r["x_noop"],
                             x_best_pytorch=r["x_best_pytorch"]))
    return {"settings": d["settings"]}, {"rows": rows}, None


def _hsdp_step(raw):
    d = _read(raw, "hsdp_step.json")
    def per_round(r):
        pr = r.get("vs_stock_per_round")
        return "—" if pr is None else f"{pr['min']:.2f}–{pr['max']:.2f}×"

    rows = [dict(nodes=t["nodes"], variant=name, step_ms=r["median_ms"], vs_stock=r["vs_stock"],
                 per_round=per_round(r), bytes_sent=r["replica_bytes_sent"])
            for t in d["results"] for name, r in t["rows"].items()]
    return {"settings": d["settings"]}, {"rows": rows}, None


def _hsdp_accuracy(raw):
    rows = []
    for f in ("hsdp_accuracy.json", "hsdp_accuracy_long.json"):
        d = _read(raw, f, optional=True)
        for g in (d or {"rows": []})["rows"]:
            if g["method"] != "mean gap":
                continue
            runs = [r for r in d["rows"] if r["task"] == g["task"] and r["method"] in ("dense", "gtopk")]
            mean = lambda m: sum(r["accuracy"] for r in runs if r["method"] == m) / 100 / \
                sum(1 for r in runs if r["method"] == m)  # noqa: E731
            rows.append(dict(task=g["task"], steps=runs[0]["steps"], dense=mean("dense"), gtopk=mean("gtopk"),
                             gap_pp=g["gap_pp"], holds=g["within_goal"]))
    if not rows:
        raise FileNotFoundError(f"no hsdp_accuracy*.json in {raw}")
    return {}, {"rows": rows}, None


COLLECT = {"bytes_per_step": _bytes_per_step, "selection": _selection, "step": _step, "ddp_step": _ddp_step,
           "horovod_overhead": _horovod_overhead, "half_precision": _half_precision,
           "cluster_comm": _cluster_comm, "cluster_ddp": _cluster_ddp, "train": _train,
           "convergence": _convergence, "elastic": _elastic, "two_level": _two_level, "overlap": _overlap,
           "hsdp_step": _hsdp_step, "hsdp_accuracy": _hsdp_accuracy}


def _machine(raw) -> Optional[dict]:
    sel = _read(raw, "selection.json", optional=True)
    rec = _read(raw, "horovod_overhead.json", optional=True)
    if sel is None or rec is None:
        return None
    m, h = sel["machine"], rec["machine"]
    desc = (f"A virtual machine with {m['cores']} cores of an {m['cpu']} (no GPU), Linux, Python "
            f"{m['python']}, torch {m['torch']} (CPU), Horovod {h.get('horovod', '—')} with gloo; "
            "every process of a job shares those cores.  Emulated clusters: one network namespace per "
            "worker on a bridge, links shaped with tc (tbf) to the stated rate; times are medians "
            "over repetitions, and ratios measured in the same run are what carry over to other "
            "machines.")
    return {"cpu": m["cpu"], "cores": m["cores"], "python": m["python"], "torch": m["torch"],
            "horovod": h.get("horovod"), "description": desc}


def _round(obj, digits: int = 4):
    if isinstance(obj, float):
        return float(f"{obj:.{digits}g}")
    if isinstance(obj, dict):
        return {k: _round(v, digits) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_round(v, digits) for v in obj]
    return obj


def _write(path: str, doc: dict) -> None:
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, ensure_ascii=False)
        f.write("\n")


def collect(raw: str = RAW, data: str = DATA) -> List[str]:
    """Write docs/results/<section>.json (and .png) from the studies' output
    in ``raw``; returns the sections collected (others keep their data)."""
    os.makedirs(data, exist_ok=True)
    done = []
    machine = _machine(raw)
    if machine:
        _write(os.path.join(data, "machine.json"), machine)
    for key, fn in COLLECT.items():
        try:
            meta, tables, png = fn(raw)
        except FileNotFoundError as e:
            print(f"{key}: kept ({e})", file=sys.stderr)
            continue
        except (TypeError, KeyError, ValueError, IndexError) as e:  # its output is partial
            print(f"{key}: kept, not collected ({type(e).__name__}: {e})", file=sys.stderr)
            continue
        _write(os.path.join(data, key + ".json"), _round({"section": key, "meta": meta, "tables": tables}))
        if png and os.path.exists(os.path.join(raw, png)):
            shutil.copyfile(os.path.join(raw, png), os.path.join(data, key + ".png"))
        done.append(key)
    return done


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lab render-results", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--collect", action="store_true",
                    help="first collect docs/results/*.json and *.png from the studies' output (--from)")
    ap.add_argument("--from", dest="raw", default=RAW, help="the studies' output folder (default lab/results)")
    ap.add_argument("--check", action="store_true", help="compare, do not write: exit 1 when the page differs")
    ap.add_argument("--data", default=DATA, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=PAGE, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.collect:
        print("collected: " + ", ".join(collect(args.raw, args.data)))
    page = render(args.data)
    if args.check:
        old = open(args.out).read() if os.path.exists(args.out) else ""
        if old != page:
            sys.stdout.writelines(difflib.unified_diff(old.splitlines(True), page.splitlines(True),
                                                       args.out, "rendered"))
            return 1
        return 0
    with open(args.out, "w") as f:
        f.write(page)
    print(f"wrote {args.out} ({page.count(chr(10))} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
