"""Command line of the emulated-cluster benchmark (``python -m lab cluster``,
``python -m lab.cluster``).

    python -m lab.cluster [comm] --workers 2 4 8 --rate 1gbit --numel 1000000 25000000 \\
        --density 0.001 0.01 --methods dense,topk,gtopk --steps 10 --json OUT.json
        (--methods also takes the codecs: onebit, qsgd, powersgd with --hyper powersgd.rank=4)
    python -m lab.cluster comm --nodes 2 4 --local 2 --numel 25000000 --density 0.001 \
        --methods gtopk,topk --repeat 3     # flat vs hierarchical on emulated nodes (hier.py, nodes.py)
    python -m lab.cluster replay --workers 2 4 8 --models resnet50,vgg16 --selection paper
    python -m lab.cluster model --comm C.json --replay R.json
    python -m lab.cluster reproduce          # all three, the published settings
    python -m lab.cluster ddp [--quick]      # DDP: PyTorch's hooks vs ours (lab/cluster/ddp.py)
    python -m lab.cluster cleanup [--all]    # leftovers of killed runs (also: --cleanup)
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
from typing import List

from gtopk_plugin.compress import available

from gtopk_plugin.bench import bench_launch as launch
from gtopk_plugin.bench.bench_record import write_json
from lab.cluster import codecs, ddp, harness, hvd_engines, measure, model as abm, netns, report
from lab.cluster import shapes as S

RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results")
DEFAULT_MODELS = ["resnet20", "vgg16-cifar", "resnet50", "alexnet", "lstm-ptb", "vgg16"]
BIG = 10_000_000  # N at or above which --big-steps applies


def _list(conv):
    def parse(s):
        return [conv(x) for x in s.replace(",", " ").split()]
    return parse


def _methods(s):
    """``--methods``: names in the compressor registry (the one source of truth)."""
    names = _list(str)(s)
    unknown = [m for m in names if m not in available()]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown method(s) {', '.join(unknown)}; "
                                         f"choose from {', '.join(available())}")
    return names


def _net_args(ap):
    g = ap.add_argument_group("network")
    g.add_argument("--rate", default="1gbit", help="per-link rate, both directions (tc syntax; default 1gbit; 'none': namespaces without shaping)")
    g.add_argument("--burst", default="128kb", help="tbf burst (default 128kb)")
    g.add_argument("--tbf-latency", default="50ms", help="tbf queue limit as latency (default 50ms)")
    g.add_argument("--delay", default="0ms", help="one-way delay per link (netem; default 0ms)")
    g.add_argument("--jitter", default="0ms", help="delay jitter (netem; default 0ms)")
    g.add_argument("--sysctl", action="append", default=[], metavar="KEY=VALUE",
                   help="sysctl set inside every worker namespace (repeatable), e.g. "
                   "net.ipv4.tcp_notsent_lowat=131072")
    g.add_argument("--no-netns", action="store_true", help="run on plain loopback (results labelled unshaped)")
    g.add_argument("--max-load", type=float, default=0.0,
                   help="wait (up to --max-wait s) until the 1-min load average is below this (0: don't wait)")
    g.add_argument("--max-busy", type=float, default=0.0,
                   help="wait until normal-priority CPU use is below this fraction (0: don't wait)")
    g.add_argument("--max-wait", type=float, default=600.0)
    g.add_argument("--quiet", action="store_true", help="no progress bar")
    g.add_argument("--echo", action="store_true", help="show the workers' output")
    g.add_argument("--timeout", type=float, default=3600.0, help="seconds per worker job")


ENGINES = ("torch",) + hvd_engines.HOROVOD_ENGINES


def _engines(spec: str, progress) -> List[str]:
    """``--engines``: torch.distributed gloo (``torch``), Horovod with the
    exchange on its gloo side channel (``horovod``, the optimizer's
    default) and Horovod with every exchange step a Horovod op
    (``horovod-ops``); the Horovod ones are dropped, with a note, where
    Horovod does not import."""
    want = [e for e in spec.replace(",", " ").split() if e]
    bad = [e for e in want if e not in ENGINES]
    if bad:
        raise SystemExit(f"unknown engine(s) {', '.join(bad)}; choose from {', '.join(ENGINES)}")
    ok, why = harness.horovod_status()
    out = []
    for e in want:
        if e in hvd_engines.HOROVOD_ENGINES and not ok:
            progress.note(f"{why} -> torch.distributed gloo only")
            continue
        out.append(e)
    return out


def _describe_net(args, P):
    net = harness.network(P, args)
    return net, net.describe()


# ---------------------------------------------------------------------------
# measurement 1
# ---------------------------------------------------------------------------
def cmd_comm(args) -> dict:
    workers = harness.flat(args.workers)
    numels = harness.flat(args.numel)
    steps = {str(N): (args.big_steps if N >= BIG else args.steps) for N in numels}
    methods = harness.flat(args.methods)
    progress = harness.Progress(0, "comm", disable=args.quiet)
    engines = _engines(args.engines, progress)
    hyper = codecs.parse_hyper(args.hyper)

    def per_job(dts):
        return sum(len([d for d in dts if d in codecs.CODEC_DTYPES] if codecs.is_codec(m) else dts)
                   * (len(harness.flat(args.density)) if codecs.uses_density(m) else 1) for m in methods) * len(numels)
    progress.total = len(workers) * args.repeat * sum(per_job(_engine_dtypes(args, e)) for e in engines)
    if progress._bar is not None:
        progress._bar.total = progress.total
    kern = harness.warm_kernels(progress)
    rate_bps = None if str(args.rate).lower() in ("none", "0", "off") else harness.parse_rate(args.rate)
    out = {"meta": None, "link": [], "rows": [], "qdisc": {}, "elapsed": [], "settings": {"hyper": hyper}}
    with harness.signals_as_exceptions():
        for P in workers:
            load = harness.wait_for_quiet(args.max_load, args.max_wait, progress, args.max_busy)
            net = harness.network(P, args)
            desc = net.describe()
            if out["meta"] is None:
                out["meta"] = harness.run_meta(args, desc)
                out["meta"]["kernels"] = kern
                if not desc["shaped"]:
                    progress.note(f"NOT SHAPED: {desc.get('why')}; falling back to loopback, every result "
                                  "is labelled 'unshaped'")
            with net:
                rows_P = []
                for ei, engine in enumerate(_passes(engines, args.repeat)):
                    dtypes = _engine_dtypes(args, engine)
                    if not dtypes:
                        continue
                    t_job, load_job = time.time(), harness.loadavg()
                    payload = dict(engine=engine, numels=numels, densities=harness.flat(args.density), dtypes=dtypes,
                                   methods=methods, steps=steps, warmup=args.warmup, hyper=hyper)
                    if ei == 0 and args.link_mb > 0:
                        payload["linktest"] = dict(addrs=[net.addr(r) for r in range(P)], port=5201,
                                                   port_per_rank=not desc["shaped"],
                                                   nbytes=int(args.link_mb * 1e6), reps=3)
                    per_rank = harness.run_job(net, P, measure.comm_grid, payload, engine,
                                               progress, timeout=args.timeout, echo=args.echo)
                    rows_P = _combine(rows_P, _merge_comm(per_rank, desc, rate_bps, load))
                    out["elapsed"].append({"P": P, "engine": engine, "seconds": round(time.time() - t_job, 1),
                                           "loadavg_start": load_job, "loadavg_end": harness.loadavg()})
                    if per_rank[0]["link"] is not None:
                        out["link"].append(_merge_link(P, per_rank, rate_bps, desc))
                out["rows"] += rows_P
                out["qdisc"][str(P)] = harness.summarise_qdisc(net.qdisc_stats())
    progress.close()
    out["meta"]["loadavg_end"] = harness.loadavg()
    return out


def _passes(engines: List[str], repeat: int) -> List[str]:
    """The engines' jobs in order: ``repeat`` passes over ``engines``,
    every other pass reversed, so a drift in the shared machine's load
    falls on every engine alike (A B C C B A A B C ...)."""
    out = []
    for i in range(max(1, repeat)):
        out += engines if i % 2 == 0 else engines[::-1]
    return out


_KEY = ("engine", "P", "numel", "dtype", "method", "density")


def _combine(rows: List[dict], new: List[dict]) -> List[dict]:
    """``rows`` with ``new`` added: a configuration measured again (a
    later pass of ``--repeat``) gets its steps appended and its medians
    recomputed over all of them; ``passes`` counts the jobs it came from.
    The machine-load fields (``machine_busy``, ``loadavg``) stay the first
    pass's; the per-job load is in ``elapsed``."""
    index = {tuple(r[k] for k in _KEY): r for r in rows}
    for r in new:
        old = index.get(tuple(r[k] for k in _KEY))
        if old is None:
            r = dict(r, passes=1)
            rows.append(r)
            index[tuple(r[k] for k in _KEY)] = r
            continue
        old["times"] += r["times"]
        old["wire_times"] += r["wire_times"]
        old["time_s"] = statistics.median(old["times"])
        old["wire_s"] = statistics.median(old["wire_times"])
        old["passes"] += 1
        for k in ("bytes_sent", "bytes_received"):
            if old[k] != r[k]:
                raise RuntimeError(f"{k} differ between passes of {r['engine']} {r['method']}: "
                                   f"{old[k]} vs {r[k]}")
        for k in ("proc_cpu_s", "ops_per_step"):
            vals = [x for x in (old[k], r[k]) if x is not None]
            old[k] = max(vals) if vals else None
        old["achieved_gbit_s"] = old["bytes_sent"] * 8 / old["time_s"] / 1e9
        if "link_efficiency" in old:  # same bytes: efficiency goes as 1 / time
            old["link_efficiency"] = r["link_efficiency"] * r["time_s"] / old["time_s"]
    return rows


def _engine_dtypes(args, engine: str) -> List[str]:
    if engine in hvd_engines.HOROVOD_ENGINES:
        return [d for d in args.dtypes if d in args.horovod_dtypes]
    return args.dtypes


def _merge_comm(per_rank, desc, rate_bps, load):
    rows = []
    for i, row in enumerate(per_rank[0]["rows"]):
        rr = [pr["rows"][i] for pr in per_rank]
        times = [max(x) for x in zip(*(r["times"] for r in rr))]
        wire = [max(x) for x in zip(*(r["wire_times"] for r in rr))]
        row = dict(row, times=times, time_s=statistics.median(times), wire_times=wire,
                   wire_s=statistics.median(wire),
                   bytes_sent=max(r["bytes_sent"] for r in rr),
                   bytes_received=max(r["bytes_received"] for r in rr),
                   proc_cpu_s=max(r["proc_cpu_s"] for r in rr),
                   ops_per_step=max((r.get("ops_per_step") or 0 for r in rr), default=0) or None,
                   shaped=desc["shaped"], label="shaped" if desc["shaped"] else "unshaped",
                   rate=desc.get("rate"), loadavg=load)
        row["achieved_gbit_s"] = row["bytes_sent"] * 8 / row["time_s"] / 1e9
        if row["method"] == "dense" and rate_bps:
            row["link_efficiency"] = row["bytes_sent"] * 8 / row["time_s"] / rate_bps
        rows.append(row)
    return rows


def _merge_link(P, per_rank, rate_bps, desc):
    gbps = [pr["link"]["nbytes"] * 8 / statistics.median(pr["link"]["times"]) / 1e9 for pr in per_rank]
    return {"P": P, "per_rank_gbit_s": gbps, "min_gbit_s": min(gbps), "mean_gbit_s": sum(gbps) / len(gbps),
            "efficiency_min": (min(gbps) * 1e9 / rate_bps) if rate_bps and desc["shaped"] else None,
            "sndbuf": per_rank[0]["link"]["sndbuf"], "rcvbuf": per_rank[0]["link"]["rcvbuf"],
            "shaped": desc["shaped"]}


# ---------------------------------------------------------------------------
# measurement 2
# ---------------------------------------------------------------------------
def replay_settings(models, selection):
    compute, select, notes = {}, {}, {}
    for m in models:
        compute[m], cnote = S.paper_compute(m)
        select[m], snote = S.paper_selection(m)
        notes[m] = {"compute": cnote, "selection": snote if selection == "paper" else selection}
    return compute, select, notes


def cmd_replay(args) -> dict:
    workers = harness.flat(args.workers)
    models = harness.flat(args.models)
    methods = harness.flat(args.methods)
    for m in models:
        S.shapes(m)  # validate names early
    progress = harness.Progress(len(workers) * len(models) * len(methods), "replay", disable=args.quiet)
    engines = _engines(args.engines, progress)
    progress.total *= len(engines)
    if progress._bar is not None:
        progress._bar.total = progress.total
    kern = harness.warm_kernels(progress)  # selection runs in every mode (once per model in paper/none)
    compute, select, notes = replay_settings(models, args.selection)
    steps = {m: (args.big_steps if S.numel(m) >= 50_000_000 or compute[m] > 1.0 else args.steps) for m in models}
    out = {"meta": None, "rows": [], "skipped": [], "elapsed": [], "settings": {
        "compute_s": compute, "paper_select_s": select, "notes": notes, "selection": args.selection,
        "density": args.density, "steps": steps, "batch": S.PAPER_BATCH}}
    with harness.signals_as_exceptions():
        for P in workers:
            load = harness.wait_for_quiet(args.max_load, args.max_wait, progress, args.max_busy)
            fit = []
            avail = harness.mem_available()
            for m in models:
                need = P * 12 * S.numel(m)  # measured peak RSS: ~9.4 bytes per parameter (vgg16, P=2)
                if avail is not None and need > 0.85 * avail:
                    out["skipped"].append({"P": P, "model": m, "why": f"needs ~{need / 2**30:.1f} GiB, "
                                           f"{avail / 2**30:.1f} GiB available"})
                    progress.note(f"P={P}: skipping {m} (~{need / 2**30:.1f} GiB needed, "
                                  f"{avail / 2**30:.1f} GiB available)")
                    for _ in methods * len(engines):
                        progress.step(f"skip {m}")
                else:
                    fit.append(m)
            if not fit:
                continue
            net = harness.network(P, args)
            desc = net.describe()
            if out["meta"] is None:
                out["meta"] = harness.run_meta(args, desc)
                out["meta"]["kernels"] = kern
                if not desc["shaped"]:
                    progress.note(f"NOT SHAPED: {desc.get('why')}; falling back to loopback, every result "
                                  "is labelled 'unshaped'")
            with net:
                for engine in engines:
                    t_job = time.time()
                    payload = dict(engine=engine, models=fit, methods=methods, density=args.density,
                                   selection=args.selection,
                                   compute=compute, select_s=select, steps=steps, warmup=args.warmup)
                    per_rank = harness.run_job(net, P, measure.replay, payload, engine,
                                               progress, timeout=args.timeout, echo=args.echo)
                    out["rows"] += _merge_replay(per_rank, desc, load)
                    out["elapsed"].append({"P": P, "engine": engine, "seconds": round(time.time() - t_job, 1)})
    progress.close()
    if out["meta"] is not None:
        out["meta"]["loadavg_end"] = harness.loadavg()
    return out


def _merge_replay(per_rank, desc, load):
    rows = []
    for i, row in enumerate(per_rank[0]):
        rr = [pr[i] for pr in per_rank]
        its = [max(x) for x in zip(*(r["iter_times"] for r in rr))]
        comms = [max(x) for x in zip(*(r["comm_times"] for r in rr))]
        sels = [max(x) for x in zip(*(r["select_times"] for r in rr))]
        wires = [max(x) for x in zip(*(r["wire_times"] for r in rr))]
        t = statistics.median(its)
        row = dict(row, iter_times=its, comm_times=comms, select_times=sels, time_s=t,
                   comm_s=statistics.median(comms), select_s=statistics.median(sels),
                   wire_s=statistics.median(wires),
                   efficiency=row["compute_s"] / t, shaped=desc["shaped"],
                   label="shaped" if desc["shaped"] else "unshaped", loadavg=load)
        b = S.PAPER_BATCH.get(row["model"])
        row["throughput_per_worker"] = b / t if b else None
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------
# measurement 3
# ---------------------------------------------------------------------------
DEFAULT_FEATURES = "messages,bytes,work_load"


def parse_features(spec: str) -> dict:
    """"dense=messages,bytes;topk=..." -> {method: features}; a spec without
    "=" applies to every method."""
    out = {}
    for part in spec.split(";"):
        if not part.strip():
            continue
        if "=" in part:
            m, f = part.split("=", 1)
            out[m.strip()] = tuple(x for x in f.replace(",", " ").split())
        else:
            f = tuple(x for x in part.replace(",", " ").split())
            out.update({m: f for m in ("dense", "topk", "gtopk")})
    for fs in out.values():
        bad = [x for x in fs if x not in abm.FEATURES]
        if bad:
            raise SystemExit(f"unknown fit feature(s) {bad}; known: {', '.join(abm.FEATURES)}")
    return out


def cmd_model(args, comm=None, replay=None) -> dict:
    if comm is None:
        with open(args.comm) as f:
            comm = json.load(f)
    if replay is None and args.replay and os.path.exists(args.replay):
        with open(args.replay) as f:
            replay = json.load(f)
    feats = parse_features(args.features)
    cores = (comm.get("meta") or {}).get("cpus")
    groups = abm.points_from_comm(comm["rows"], cores)
    fits = {key: abm.fit(pts, key[0], key[1], feats.get(key[1], ("messages", "bytes")))
            for key, pts in sorted(groups.items())}
    out = {"features": feats, "fits": [f.to_dict() for f in fits.values()], "replay_check": [],
           "extrapolation": []}
    # predictions of measurement 2
    if replay is not None:
        rcores = (replay.get("meta") or {}).get("cpus") or cores
        for r in replay["rows"]:
            f = fits.get((r["engine"], r["method"]))
            if f is None:
                continue
            N, K = r["numel"], r.get("k")
            comm_pred = f.predict(r["P"], N, K, load=abm.load_factor(r["P"], rcores))
            it_pred = r["compute_s"] + r["select_s"] + comm_pred
            out["replay_check"].append(dict(
                engine=r["engine"], model=r["model"], method=r["method"], P=r["P"],
                comm_measured_s=r["comm_s"], comm_predicted_s=comm_pred,
                iter_measured_s=r["time_s"], iter_predicted_s=it_pred,
                iter_rel_err=(it_pred - r["time_s"]) / r["time_s"],
                comm_rel_err=(comm_pred - r["comm_s"]) / r["comm_s"] if r["comm_s"] > 0 else None,
                efficiency_measured=r["efficiency"], efficiency_predicted=r["compute_s"] / it_pred))
        settings = replay["settings"]
        models = sorted({r["model"] for r in replay["rows"]}, key=lambda m: S.numel(m))
        selection = settings["selection"]
        for engine in sorted({r["engine"] for r in replay["rows"]}):
            for m in models:
                comp = settings["compute_s"][m]
                sizes = S.sizes(m)
                from gtopk_plugin.reducer import k_for
                K = sum(k_for(settings["density"], s) for s in sizes)
                for method in ("dense", "topk", "gtopk"):
                    f = fits.get((engine, method))
                    if f is None:
                        continue
                    sel = settings["paper_select_s"][m] if (selection == "paper" and method != "dense") else 0.0
                    if selection == "measured" and method != "dense":
                        ms = [r["select_s"] for r in replay["rows"] if r["model"] == m and r["method"] == method]
                        sel = statistics.median(ms) if ms else 0.0
                    for P in [2 ** i for i in range(0, 11)]:
                        c = f.predict(P, S.numel(m), K, load=1.0) if P > 1 else 0.0  # a machine per worker
                        s_ = sel if P > 1 else 0.0
                        out["extrapolation"].append(dict(engine=engine, model=m, method=method, P=P,
                                                         comm_s=c, iter_s=comp + s_ + c,
                                                         efficiency=abm.efficiency(comp, s_, c)))
    return out


# ---------------------------------------------------------------------------
def _write(obj, path, what: str):
    write_json(path, f"cluster {what}", document=obj, packages=("torch", "gtopk_plugin"))


def cmd_cleanup(args) -> int:
    removed = netns.cleanup(all_runs=args.all)
    print(f"removed {len(removed)} leftover(s)" + (": " + ", ".join(removed) if removed else ""))
    left = netns.list_namespaces()
    if left:
        print(f"still present (runs in progress; --all removes them too): {', '.join(left)}")
    return 0


def _parser_comm(ap):
    ap.add_argument("--workers", "-P", type=_list(int), nargs="+", default=[[2, 4, 8]])
    ap.add_argument("--numel", "-N", type=_list(int), nargs="+", default=[[1_000_000, 25_000_000]])
    ap.add_argument("--density", "-d", type=_list(float), nargs="+", default=[[0.001, 0.01]])
    ap.add_argument("--dtypes", type=lambda s: s.replace(",", " ").split(), default=["fp32", "fp16"])
    ap.add_argument("--methods", type=_methods, nargs="+", default=[["dense", "topk", "gtopk"]])
    ap.add_argument("--steps", "-S", type=int, default=6, help=f"timed steps for N < {BIG:,}")
    ap.add_argument("--big-steps", type=int, default=3, help=f"timed steps for N >= {BIG:,}")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--hyper", action="append", default=None, metavar="METHOD.NAME=VALUE",
                    help="a codec's hyper-parameter (repeatable; default powersgd.rank=4)")
    ap.add_argument("--engines", default="torch,horovod,horovod-ops",
                    help="any of torch (torch.distributed gloo), horovod (Horovod, the exchange on its gloo side "
                    "channel: the optimizer's default) and horovod-ops (every exchange step a Horovod op: "
                    "exchange='horovod'); the Horovod ones when Horovod imports")
    ap.add_argument("--repeat", type=int, default=1,
                    help="passes over the engines, every other one in reverse order (A B C C B A ...); "
                    "each configuration's steps are pooled over its passes")
    ap.add_argument("--horovod-dtypes", type=lambda s: s.replace(",", " ").split(), default=["fp32"],
                    help="value dtypes measured with Horovod (default fp32: its CPU fp16 sum is slow and "
                    "the run stays short)")
    ap.add_argument("--link-mb", type=float, default=50.0, help="MB per raw TCP link test (0: skip)")
    ap.add_argument("--json", default=None, help="default: results/cluster_comm.json (with --nodes: "
                    "results/cluster_nodes.json)")
    g = ap.add_argument_group("nodes (lab/cluster/nodes.py, hier.py)")
    g.add_argument("--nodes", type=_list(int), nargs="+", default=None,
                   help="emulate nodes: workers of a node share an unshaped bridge, each node one shaped uplink "
                   "(--rate); P = nodes x --local; rows flat vs hierarchical (--layouts)")
    g.add_argument("--local", type=int, default=2, help="workers per node (with --nodes)")
    g.add_argument("--layouts", default="flat,hier,hier-gloo", help="flat (GradientReducer over all P), "
                   "hier (HierarchicalReducer: dense inside a node through shared memory, the method between "
                   "nodes) and/or hier-gloo (the same, the node's dense sum over its gloo group)")
    g.add_argument("--intra-rate", default="none", help="shape the links inside a node too (default none)")
    _net_args(ap)


def _parser_replay(ap):
    ap.add_argument("--workers", "-P", type=_list(int), nargs="+", default=[[2, 4, 8]])
    ap.add_argument("--models", type=_list(str), nargs="+", default=[DEFAULT_MODELS])
    ap.add_argument("--methods", type=_methods, nargs="+", default=[["dense", "topk", "gtopk"]])
    ap.add_argument("--density", type=float, default=0.001)
    ap.add_argument("--selection", choices=["paper", "measured", "none"], default="paper",
                    help="selection time: the paper's (sleep), our kernels' (measured), or none")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--big-steps", type=int, default=2, help="steps for models >= 50M parameters or > 1 s compute")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--engines", default="torch")
    ap.add_argument("--json", default=os.path.join(RESULTS, "cluster_replay.json"))
    _net_args(ap)


def _parser_model(ap):
    ap.add_argument("--comm", default=os.path.join(RESULTS, "cluster_comm.json"))
    ap.add_argument("--replay", default=os.path.join(RESULTS, "cluster_replay.json"))
    ap.add_argument("--features", default=DEFAULT_FEATURES,
                    help="fit features, for all methods or per method as 'dense=...;topk=...' (messages, bytes, "
                    "work_load, numel); default: " + DEFAULT_FEATURES)
    ap.add_argument("--json", default=os.path.join(RESULTS, "cluster_model.json"))
    ap.add_argument("--summary", default=os.path.join(RESULTS, "cluster_summary.md"))


def main(argv=None) -> int:
    try:
        return _main(argv)
    except netns.NetnsError as e:
        print(f"python -m lab cluster: {e}", file=sys.stderr)
        return 2
    except launch.WorkerFailed as e:
        print(f"python -m lab cluster: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("python -m lab cluster: interrupted; namespaces and workers removed", file=sys.stderr)
        return 130


def _main_nodes(args) -> int:
    from lab.cluster import hier
    args.json = args.json or os.path.join(RESULTS, "cluster_nodes.json")
    res = hier.cmd_nodes(args)
    _write(res, args.json, "nodes")
    print("\n".join(hier.table(res) + [""] + hier.goals(res)))
    png = hier.plot(res, os.path.splitext(args.json)[0] + ".png")
    print(f"wrote {args.json}" + (f" and {png}" if png else ""))
    return 0


def _main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--cleanup" in argv:
        argv.remove("--cleanup")
        argv = ["cleanup"] + argv
    cmd = argv[0] if argv and argv[0] in ("comm", "replay", "model", "reproduce", "cleanup", "ddp") else "comm"
    if argv and argv[0] == cmd:
        argv = argv[1:]
    ap = argparse.ArgumentParser(prog=f"python -m lab cluster {cmd}", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    if cmd == "cleanup":
        ap.add_argument("--all", action="store_true", help="also namespaces of runs still alive")
        return cmd_cleanup(ap.parse_args(argv))
    if cmd == "comm":
        _parser_comm(ap)
        args = ap.parse_args(argv)
        if args.hyper is None:
            args.hyper = list(codecs.DEFAULT_HYPER)
        if args.nodes:
            return _main_nodes(args)
        args.json = args.json or os.path.join(RESULTS, "cluster_comm.json")
        res = cmd_comm(args)
        _write(res, args.json, "comm")
        report.print_comm(res)
        png = report.plot_comm(res, os.path.splitext(args.json)[0] + ".png")
        fam = codecs.families_table(res)
        if fam:
            print("\nCompressor families side by side (torch, fp32):\n" + "\n".join(fam))
            fpng = codecs.plot_families(res, os.path.splitext(args.json)[0] + "_families.png")
            png = f"{png}, {fpng}" if png and fpng else (png or fpng)
        print(f"wrote {args.json}" + (f" and {png}" if png else ""))
        return 0
    if cmd == "ddp":
        ddp.add_arguments(ap, RESULTS)
        _net_args(ap)
        args = ap.parse_args(argv)
        res = ddp.run(args)
        _write(res, args.json, "ddp")
        print(ddp.report(res))
        png = ddp.plot(res, os.path.splitext(args.json)[0] + ".png")
        print(f"wrote {args.json}" + (f" and {png}" if png else ""))
        return 0
    if cmd == "replay":
        _parser_replay(ap)
        args = ap.parse_args(argv)
        res = cmd_replay(args)
        _write(res, args.json, "replay")
        report.print_replay(res)
        print(f"wrote {args.json}")
        return 0
    if cmd == "model":
        _parser_model(ap)
        args = ap.parse_args(argv)
        comm = json.load(open(args.comm))
        replay = json.load(open(args.replay)) if os.path.exists(args.replay) else None
        res = cmd_model(args, comm, replay)
        _write(res, args.json, "model")
        pngs = report.plot_model(res, replay, os.path.splitext(args.json)[0])
        md = report.summary(comm, replay, res)
        with open(args.summary, "w") as f:
            f.write(md)
        print(md)
        print(f"wrote {args.json}, {args.summary}" + "".join(f", {p}" for p in pngs))
        return 0
    # reproduce: the three measurements with the published settings
    ap.add_argument("--out-dir", default=RESULTS)
    ap.add_argument("--workers", "-P", type=_list(int), nargs="+", default=[[2, 4, 8]])
    ap.add_argument("--engines", default="torch,horovod,horovod-ops")
    ap.add_argument("--selection", choices=["paper", "measured", "none"], default="paper")
    ap.add_argument("--models", type=_list(str), nargs="+", default=[DEFAULT_MODELS])
    _net_args(ap)
    args = ap.parse_args(argv)
    t0 = time.time()
    d = args.out_dir
    common = ["--rate", args.rate, "--burst", args.burst, "--tbf-latency", args.tbf_latency,
              "--delay", args.delay, "--jitter", args.jitter, "--max-load", str(args.max_load),
              "--max-busy", str(args.max_busy),
              "--max-wait", str(args.max_wait), "--timeout", str(args.timeout)]
    common += (["--no-netns"] if args.no_netns else []) + (["--quiet"] if args.quiet else [])
    for kv in args.sysctl:
        common += ["--sysctl", kv]
    ws = ["--workers"] + [str(w) for w in harness.flat(args.workers)]
    rc = main(["comm", *ws, "--engines", args.engines, "--json", os.path.join(d, "cluster_comm.json"), *common])
    rc = rc or main(["replay", *ws, "--selection", args.selection, "--models", ",".join(harness.flat(args.models)),
                     "--json", os.path.join(d, "cluster_replay.json"), *common])
    rc = rc or main(["model", "--comm", os.path.join(d, "cluster_comm.json"),
                     "--replay", os.path.join(d, "cluster_replay.json"),
                     "--json", os.path.join(d, "cluster_model.json"),
                     "--summary", os.path.join(d, "cluster_summary.md")])
    print(f"reproduce: done in {(time.time() - t0) / 60:.1f} min")
    return rc

