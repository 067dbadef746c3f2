"""``python -m lab train``: time to accuracy, end to end, on the
emulated cluster.

    python -m lab.train --quick                 # CI smoke run: P = 2, tiny model, 20 steps
    python -m lab.train -P 4 --workloads vgg --engines ddp --methods dense,gtopk,topk --steps 400
    python -m lab.train --rates 1gbit,paper     # paper: the compute:communication-matched rate
    python -m lab.train -P 2 --workloads resnet --engines elastic --rates elastic-paper

Real data-parallel training jobs: one process per worker, each in its own
network namespace on a ``tc tbf``-shaped link (the cluster harness,
:mod:`lab.cluster.harness`; plain loopback, labelled "unshaped", where
namespaces cannot be made), through the real engines (see
:mod:`.worker`): torch.distributed gloo + DDP with the library's comm hook,
Horovod's gloo controller + the library's ``DistributedOptimizer``, and the
elastic scheduler with 5 ms ± 0.2 ms per-round latency injected in the
transport (this kernel has no netem).  Every configuration is its own job,
one after the other on the same emulated network; records test accuracy
against wall-clock time and bytes.

Outputs: ``lab/results/train.json`` (settings, machine, per-run
curves and step times), ``train.md`` (the table) and ``train.png``; the
JSON is rewritten after every finished run, so a run cut short leaves its
finished configurations behind (``meta.complete`` says whether it ended).
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time

from gtopk_plugin.bench.bench_record import write_json
from lab.train import report, worker, workloads

RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results")
METHODS = ("dense", "dense-fp16", "topk", "gtopk", "rtopk", "threshold")
DEFAULT_POLICIES = "barrier,norm:0.5,norm:0.8,variance"


def _name(method, density):
    if method == "dense":
        return "dense fp32"
    if method == "dense-fp16":
        return "dense fp16"
    return f"{method} {100 * density:g}% (recipe)"


def horovod_cycles(spec: str) -> list:
    """``--horovod-cycle-ms``: [None] (the environment's cycle, untouched)
    or the values asked: ms, or ``"default"`` (unset: Horovod's own)."""
    out = []
    for v in [v.strip() for v in (spec or "").split(",") if v.strip()]:
        if v == "default":
            out.append(v)
            continue
        try:
            ms = float(v)
        except ValueError:
            ms = -1.0
        if not ms > 0:
            raise SystemExit(f"--horovod-cycle-ms: {v!r} is not a positive number of ms (or 'default')")
        out.append(ms)
    return out or [None]


def _cycle_label(cyc) -> str:
    if cyc is None:
        return ""
    return " cycle 1 ms (default)" if cyc == "default" else f" cycle {cyc:g} ms"


def configs(args) -> list:
    """Every configuration of one (workload, rate, seed), dense first in each engine."""
    from lab.elastic import parse_policies

    out = []
    cycles = horovod_cycles(getattr(args, "horovod_cycle_ms", ""))
    methods = [m for m in args.methods.split(",") if m]
    for m in methods:
        if m not in METHODS:
            raise SystemExit(f"unknown method {m!r}; choose from {', '.join(METHODS)}")
    for eng in [e for e in args.engines.split(",") if e]:
        if eng in ("ddp", "horovod"):
            ms = [m for m in (args.horovod_methods or args.methods).split(",") if m] if eng == "horovod" else methods
            for m in sorted(ms, key=lambda m: m != "dense"):
                for cyc in cycles if eng == "horovod" else [None]:
                    out.append({"engine": eng, "method": m, "density": args.density, "policy": None, "beta": None,
                                "cycle_ms": cyc, "name": f"{_name(m, args.density)}" + _cycle_label(cyc)})
        elif eng == "elastic":
            for red in [r for r in args.elastic_reducers.split(",") if r]:
                for pol in parse_policies(args.policies):
                    out.append({"engine": eng, "method": red, "density": args.density, "policy": pol["policy"],
                                "beta": pol["beta"], "latency_ms": args.latency_ms, "jitter_ms": args.jitter_ms,
                                "bucket_cap_mb": args.elastic_bucket_mb,
                                "name": f"{'dense' if red == 'dense' else _name(red, args.density)} {pol['name']}"
                                        + (f" fused {args.elastic_bucket_mb:g} MiB" if args.elastic_bucket_mb else "")})
        else:
            raise SystemExit(f"unknown engine {eng!r} (ddp, horovod, elastic)")
    return out


def _rate_bits(rate: str) -> float:
    """'40mbit' -> 40e6 (tc's units: kbit, mbit, gbit; bit/s)."""
    for unit, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3), ("bit", 1.0)):
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * scale
    raise SystemExit(f"unknown rate {rate!r}: use tc's units (e.g. 1gbit, 50mbit, 400kbit)")


def burst_for(rate: str, burst: str = "auto") -> str:
    """The tbf burst: as asked, or ('auto') 128 kB -- 1 ms of a 1 Gbit/s link
    -- scaled down with the rate below 1 Gbit/s, at least 16 kB.  With a
    fixed 128 kB credit about half of a 311 kB step went through a 60
    Mbit/s link at line rate (lab/reports/benchmarks.md), and that link was not
    the one the rate names."""
    if burst != "auto":
        return burst
    return f"{max(16, int(128 * min(1.0, _rate_bits(rate) / 1e9)))}kb"


def _net_opts(args, rate):
    return argparse.Namespace(rate=rate, burst=burst_for(rate, args.burst), tbf_latency="50ms", delay="0ms",
                              jitter="0ms", no_netns=args.no_netns, sysctl=[])


def calibrate(ctx, p) -> float:
    """Worker (engine none): median compute-only step of the workload with
    P workers sharing the machine (for ``--rates paper``)."""
    import torch
    import torch.nn.functional as F

    from lab.train.worker import _compute_only

    torch.set_num_threads(1)
    torch.manual_seed(p["seed"])
    m = workloads.build_model(p["workload"], p["model"])
    x = torch.randn(p["batch"], 1, workloads.SIZE, workloads.SIZE)
    y = torch.randint(0, 10, (p["batch"],))
    F.cross_entropy(m(x), y).backward()
    ts = [_compute_only(m, x, y, p["lr"]) for _ in range(p["reps"])]
    return sorted(ts)[len(ts) // 2]


def _paper_rate(args, s, wl, P, progress, elastic: bool = False):
    """``--rates paper`` (the gTop-k paper's regime) or ``elastic-paper`` (the
    elastic paper's): calibrate our compute, then the arithmetic of
    :mod:`.paper_rate` or :mod:`.elastic_rate`."""
    from lab.cluster import harness
    from lab.train import elastic_rate, paper_rate

    if args.paper_compute_ms:
        # e.g. the compute probe of an earlier run at this load (the calibration job
        # runs the compute alone and can read low: lab/reports/benchmarks.md)
        per = [args.paper_compute_ms / 1e3]
    else:
        pl = dict(workload=wl, model=s["model"], batch=s["batch"], lr=s["lr"], seed=0, reps=3 if args.quick else 8)
        per = harness.run_job(harness.Loopback(P, "calibration"), P, calibrate, pl, "none", None, timeout=600)
    info = workloads.describe(wl, s["model"], s["batch"])
    ring = elastic_rate.ring_bytes(info["parameters"], P)
    if elastic:
        pr = elastic_rate.matched_rate(max(per), ring)
        progress.note(f"elastic-paper-matched link for {wl}: {pr['statement']}")
        return pr
    m = workloads.build_model(wl, s["model"])
    pr = paper_rate.matched_rate(info["step_flops_per_worker"], 6 * sum(1 for _ in m.modules()), max(per), ring)
    progress.note(f"paper-matched link for {wl}: {pr['regime_statement']}; GPU view: {pr['statement']}")
    return pr


def run(args) -> dict:
    import torch

    from lab.cluster import harness

    P = args.workers
    cfgs = configs(args)
    hv_ok, hv_why = harness.horovod_status()
    if any(c["engine"] == "horovod" for c in cfgs) and not hv_ok:
        print(f"python -m lab train: {hv_why}: Horovod configurations left out", file=sys.stderr)
        cfgs = [c for c in cfgs if c["engine"] != "horovod"]
    wls = [w for w in args.workloads.split(",") if w]
    rates = [r for r in args.rates.split(",") if r]
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    per_run = -(-args.steps // args.eval_every)
    progress = harness.Progress(len(wls) * len(rates) * len(seeds) * len(cfgs) * per_run, "train",
                                disable=args.quiet)
    res = {"meta": {"date": datetime.datetime.now().isoformat(timespec="seconds"), "argv": sys.argv,
                    "host": platform.node(), "cpus": os.cpu_count(), "torch": torch.__version__,
                    "horovod": hv_why, "loadavg_start": harness.loadavg(), "network": None, "complete": False,
                    "latency": (f"elastic rows: {args.latency_ms:g} ± {args.jitter_ms:g} ms per communication "
                                "round injected in the transport (lab.elastic.DelayedTransport): this "
                                "kernel has no netem; other rows: no added latency"),
                    "workloads": {}, "paper_rate": {}},
           "settings": {"P": P, "steps": args.steps, "eval_every": args.eval_every, "density": args.density,
                        "seeds": seeds, "rates": rates, "quick": args.quick, "warmup_frac": args.warmup_frac,
                        "optimizer": "SGD momentum 0.9 + weight decay, cosine lr to 0 over the budget; sparse: "
                                     "momentum correction + masking + DensityWarmup (docs/momentum.md)"},
           "rows": []}
    t_all = time.time()
    with harness.signals_as_exceptions():
        for wl in wls:
            s = workloads.settings(wl, args.quick)
            if args.lr:
                s["lr"] = args.lr
            res["meta"]["workloads"][wl] = dict(workloads.describe(wl, s["model"], s["batch"]), **s)
            for rate in rates:
                label_rate = rate
                if rate == "paper":
                    pr = _paper_rate(args, s, wl, P, progress)
                    res["meta"]["paper_rate"][wl] = pr
                    rate, label_rate = pr["rate_regime"], f"paper-matched {pr['rate_regime_bits'] / 1e6:.1f}mbit"
                elif rate == "elastic-paper":
                    pr = _paper_rate(args, s, wl, P, progress, elastic=True)
                    res["meta"]["paper_rate"][f"{wl}:elastic"] = pr
                    rate, label_rate = pr["rate"], f"elastic-paper-matched {pr['rate_bits'] / 1e6:.1f}mbit"
                net = harness.network(P, _net_opts(args, rate))
                desc = net.describe()
                res["meta"]["network"] = desc
                if not desc["shaped"]:
                    progress.note(f"NOT SHAPED: {desc.get('why')}; results labelled 'unshaped'")
                    label_rate = f"unshaped ({rate} asked)"
                with net:
                    for seed in seeds:
                        for cfg in cfgs:
                            payload = dict(workload=wl, model=s["model"], n_train=s["n_train"], n_test=s["n_test"],
                                           data_seed=0, seed=seed, batch=s["batch"], lr=s["lr"],
                                           weight_decay=s["weight_decay"], steps=args.steps,
                                           eval_every=args.eval_every, iface=net.iface, run=cfg,
                                           warmup_steps=int(args.warmup_frac * args.steps))
                            engine = "horovod" if cfg["engine"] == "horovod" else "torch"
                            t0 = time.time()
                            load0 = harness.loadavg()
                            with harness.horovod_cycle_env(cfg.get("cycle_ms")):
                                per_rank = harness.run_job(net, P, worker.train, payload, engine, progress,
                                                           timeout=args.timeout, echo=args.echo)
                            row = report.merge(per_rank, dict(cfg, workload=wl, rate=rate, rate_label=label_rate,
                                                              seed=seed, P=P, warmup_steps=payload["warmup_steps"]),
                                               desc["label"])
                            row.update(job_seconds=round(time.time() - t0, 1), loadavg=[load0, harness.loadavg()])
                            res["rows"].append(row)
                            report.summarise(res["rows"])
                            res["meta"]["seconds"] = round(time.time() - t_all, 1)
                            _write(args, res, final=False)
    progress.close()
    res["meta"].update(loadavg_end=harness.loadavg(), seconds=round(time.time() - t_all, 1), complete=True)
    report.summarise(res["rows"])
    return res


def _write(args, res, final: bool):
    write_json(args.json, "train", document=res, packages=("torch", "gtopk_plugin", "horovod"))
    base = os.path.splitext(args.json)[0]
    with open(base + ".md", "w") as f:
        f.write(report.markdown(res["rows"]))
    if final and not args.no_plot:
        return report.plot(res, base + ".png")
    return None


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m lab train", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="CI smoke run: P=2, tiny VGG, 20 steps; ddp dense + gtopk, horovod gtopk, elastic gtopk norm:0.5")
    g = ap.add_argument_group("what runs")
    g.add_argument("--workers", "-P", type=int, default=4)
    g.add_argument("--workloads", default="vgg,resnet", help="vgg (communication-bound), resnet (balanced)")
    g.add_argument("--engines", default="ddp,horovod,elastic")
    g.add_argument("--methods", default=",".join(METHODS), help=f"of {', '.join(METHODS)} (ddp and horovod)")
    g.add_argument("--horovod-methods", default=None, help="methods of the horovod engine (default: --methods)")
    g.add_argument("--horovod-cycle-ms", default="",
                   help="HOROVOD_CYCLE_TIME of the horovod jobs, comma-separated ms ('default': unset, "
                        "Horovod's own 1 ms; not given: the environment's); each horovod method runs once per "
                        "value, e.g. default,10 (its background loop coordinates every cycle, idle or not: "
                        "docs/horovod.md)")
    g.add_argument("--density", type=float, default=0.01)
    g.add_argument("--elastic-reducers", default="dense,gtopk")
    g.add_argument("--policies", default=DEFAULT_POLICIES)
    g.add_argument("--latency-ms", type=float, default=5.0, help="elastic rows: per-round latency (transport-side)")
    g.add_argument("--jitter-ms", type=float, default=0.2)
    g.add_argument("--elastic-bucket-mb", type=float, default=0.0,
                   help="elastic rows: fuse layers' reductions into buckets of this many MiB (0: per layer)")
    g = ap.add_argument_group("training")
    g.add_argument("--steps", type=int, default=600, help="steps per run (the fixed budget)")
    g.add_argument("--eval-every", type=int, default=25)
    g.add_argument("--seeds", type=int, default=2)
    g.add_argument("--first-seed", type=int, default=0,
                   help="seeds run: first-seed, first-seed + 1, ... (to add a seed to an earlier run)")
    g.add_argument("--lr", type=float, default=None, help="peak lr (default: the workload's)")
    g.add_argument("--warmup-frac", type=float, default=0.1,
                   help="density warm-up over this share of the budget (DGC: 4 epochs)")
    g = ap.add_argument_group("network")
    g.add_argument("--rates", default="1gbit,paper",
                   help="tc tbf rates, comma-separated; 'paper': the gTop-k paper's compute:communication-"
                        "matched rate; 'elastic-paper': the elastic paper's (for the elastic rows)")
    g.add_argument("--paper-compute-ms", type=float, default=None,
                   help="'paper' rate: our compute per step in ms (default: a calibration job measures it)")
    g.add_argument("--burst", default="auto",
                   help="tbf burst; auto: 128kb at 1 Gbit/s and above, scaled with the rate below, >= 16kb")
    g.add_argument("--no-netns", action="store_true", help="plain loopback (results labelled unshaped)")
    g = ap.add_argument_group("output")
    g.add_argument("--json", default=os.path.join(RESULTS, "train.json"))
    g.add_argument("--no-plot", action="store_true")
    g.add_argument("--quiet", action="store_true")
    g.add_argument("--echo", action="store_true", help="show the workers' output")
    g.add_argument("--timeout", type=float, default=7200.0, help="seconds per job")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.workers, args.workloads, args.steps, args.eval_every, args.seeds = 2, "vgg", 20, 5, 1
        args.engines, args.methods, args.elastic_reducers, args.policies = "ddp,horovod,elastic", "dense,gtopk", \
            "gtopk", "norm:0.5"
        args.rates, args.timeout = "1gbit", min(args.timeout, 120.0)
        args.horovod_methods = "gtopk"
    from gtopk_plugin.bench import bench_launch as launch
    from lab.cluster import netns
    try:
        res = run(args)
    except netns.NetnsError as e:
        print(f"python -m lab train: {e}", file=sys.stderr)
        return 2
    except launch.WorkerFailed as e:
        print(f"python -m lab train: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("python -m lab train: interrupted; namespaces and workers removed (finished runs are in the JSON)",
              file=sys.stderr)
        return 130
    png = _write(args, res, final=True)
    print(report.markdown(res["rows"]))
    print(f"wrote {args.json}, {os.path.splitext(args.json)[0]}.md" + (f" and {png}" if png else "")
          + f" in {res['meta']['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
