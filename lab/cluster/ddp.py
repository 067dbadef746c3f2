"""DDP on the emulated cluster against PyTorch's own communication hooks
("the comparison DDP users make"): ``python -m lab cluster ddp``.

P worker network namespaces on 1 Gbit/s ``tbf`` links (the harness's
:mod:`netns` cluster; plain loopback, labelled ``unshaped``, where
namespaces cannot be made), one process and one thread per worker, each
training the same MLP (~10.5M parameters, batch 16 per worker) with
``torch.nn.parallel.DistributedDataParallel`` once per row:

* DDP's built-in allreduce (no hook), ``fp16_compress_hook``,
  ``bf16_compress_hook`` and ``powerSGD_hook`` (rank 4, compressing from the
  third step on).  PowerSGD runs with ONE DDP bucket (``bucket_cap_mb`` above
  the model's size): on gloo it aborts with more than one.  DDP refuses to
  register a hook *named* ``bf16_compress_hook`` without CUDA + NCCL (or
  XPU); gloo reduces bfloat16 on CPU, so the unchanged torch function is
  registered through a counting wrapper of another name.
* our :func:`gtopk_plugin.torch_ddp.sparse_hook` with gTop-k 1 % and 0.1 %,
  Top-k 0.1 % and the registry's ``onebit`` codec.

Every row's DDP model lives in the same worker processes and the rows take
turns, a few steps each, round after round, so a change in the shared
machine's load falls on all rows alike.  A step is timed from the forward
pass to the end of ``optimizer.step()`` (forward + backward with its
communication + update), between barriers; per step the slowest rank
counts, then the median over steps.

Bytes per step and worker: our hooks report the reducer's own accounting
(``SparseState.last_step_traffic["bytes_sent"]``, payload + headers, which
equals the transport's counters over the step); PyTorch's allreduces are
counted with the ring model ``2(P-1)/P`` times the bytes each hook hands to
``dist.all_reduce`` (DDP's built-in one: the gradients' bytes).  Inside
namespaces the worker's ``eth0`` transmit counter over the step (TCP/IP
headers and the barrier included) is recorded next to it for every row.
"""
from __future__ import annotations

import functools
import hashlib
import os
import statistics
import time

from lab.cluster import harness
from lab.cluster.netns import tx_bytes

#: (row name, kind, hook spec); kind "torch", "ours" or "floor" (a hook that
#: returns the local gradients unreduced: the same step without any
#: communication, the least any hook can take on this machine at this load;
#: its parameters drift apart across ranks, as nothing is averaged).
ROWS = [
    ("no communication (floor)", "floor", {"hook": "noop"}),
    ("allreduce (DDP default)", "torch", {"hook": None}),
    ("fp16_compress_hook", "torch", {"hook": "fp16"}),
    ("bf16_compress_hook", "torch", {"hook": "bf16"}),
    ("powerSGD_hook rank 4", "torch", {"hook": "powersgd", "rank": 4}),
    ("sparse_hook gtopk 1%", "ours", {"method": "gtopk", "density": 0.01}),
    ("sparse_hook gtopk 0.1%", "ours", {"method": "gtopk", "density": 0.001}),
    # the same, each DDP bucket reduced on its own (coalesce_buckets=False):
    # what one consistency check and one exchange per round per STEP saves
    ("sparse_hook gtopk 0.1% per bucket", "ours", {"method": "gtopk", "density": 0.001,
                                                   "coalesce_buckets": False}),
    ("sparse_hook topk 0.1%", "ours", {"method": "topk", "density": 0.001}),
    ("sparse_hook onebit", "ours", {"method": "onebit"}),
]
FULL_WIDTHS = [1024, 2048, 2048, 2048, 10]   # 10,512,394 parameters
QUICK_WIDTHS = [32, 64, 64, 10]
BATCH = 16
DDP_BUCKET_MB = 25.0        # DDP's default cap, given explicitly (no 1 MiB first bucket)
POWERSGD_START = 2          # the smallest start_powerSGD_iter DDP allows with error feedback
SEED = 0                    # model init; batch of (rank, i) seeded 1000 + 100 * rank + i
GOAL = 0.4                  # best sparse hook <= 0.4 x best PyTorch hook


def mlp(widths):
    import torch.nn as nn

    layers = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


# ---------------------------------------------------------------------------
# worker side
# ---------------------------------------------------------------------------
class _AllreduceCounter:
    """Counts the bytes PyTorch's Python hooks hand to ``dist.all_reduce``
    (the hooks look the function up on the module at call time)."""

    def __init__(self):
        import torch.distributed as dist

        self.dist, self.orig, self.nbytes, self.buckets = dist, dist.all_reduce, 0, 0
        self.phases = {}  # our hooks: the reducer's seconds per phase, summed over buckets
        dist.all_reduce = self._counted

    def _counted(self, tensor, *a, **kw):
        self.nbytes += tensor.numel() * tensor.element_size()
        return self.orig(tensor, *a, **kw)

    def bucket_hook(self, hook, rename=False):
        @functools.wraps(hook)
        def counted(state, bucket):
            self.buckets += 1
            before = getattr(state, "last_stats", None)
            fut = hook(state, bucket)
            # sparse_hook reduces inside some calls (every call, or only at the
            # step's last bucket when it coalesces): count the stats of the
            # reduce calls made in this one
            st = getattr(state, "last_stats", None)
            if st is not None and st is not before:
                for k, v in (st.seconds or {}).items():
                    self.phases[k] = self.phases.get(k, 0.0) + v
            return fut
        if rename:
            # DDP refuses a hook *named* bf16_compress_hook unless CUDA+NCCL
            # (or XPU) is present, although gloo reduces bfloat16 on CPU.
            counted.__name__ = counted.__qualname__ = f"counted_{hook.__name__}"
        return counted


def _noop_hook(state, bucket):
    """No communication: the bucket's local gradients as they are."""
    import torch

    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def _build(name, kind, spec, widths, P, counter):
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as dh
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gtopk_plugin as gp

    torch.manual_seed(SEED)
    model = mlp(widths)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    one_bucket = spec.get("hook") == "powersgd"
    cap = max(DDP_BUCKET_MB, 2 * nbytes / 2**20) if one_bucket else DDP_BUCKET_MB
    ddp = DDP(model, bucket_cap_mb=cap)
    state = None
    if kind == "ours":
        state = gp.torch_ddp.SparseState(method=spec["method"], density=spec.get("density", 0.01),
                                         named_parameters=model.named_parameters(),
                                         coalesce_buckets=spec.get("coalesce_buckets", True))
        ddp.register_comm_hook(state, counter.bucket_hook(gp.torch_ddp.sparse_hook))
    elif spec["hook"] == "noop":
        ddp.register_comm_hook(None, counter.bucket_hook(_noop_hook))
    elif spec["hook"] in ("fp16", "bf16"):
        hook = dh.fp16_compress_hook if spec["hook"] == "fp16" else dh.bf16_compress_hook
        ddp.register_comm_hook(None, counter.bucket_hook(hook, rename=spec["hook"] == "bf16"))
    elif spec["hook"] == "powersgd":
        state = ps.PowerSGDState(process_group=None, matrix_approximation_rank=spec["rank"],
                                 start_powerSGD_iter=POWERSGD_START, random_seed=SEED)
        ddp.register_comm_hook(state, counter.bucket_hook(ps.powerSGD_hook))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    return {"name": name, "kind": kind, "ddp": ddp, "opt": opt, "state": state, "grad_bytes": nbytes,
            "bucket_cap_mb": round(cap, 3), "hooked": spec.get("hook") is not None or kind == "ours"}


def _step(ctx, row, batch, P, iface, counter):
    """One timed training step of ``row``: (seconds, bytes by accounting,
    transport counter bytes or None, eth0 tx bytes or None, buckets)."""
    import torch.nn.functional as F

    ddp, opt = row["ddp"], row["opt"]
    state = row["state"] if row["kind"] == "ours" else None
    tr = state.reducer.transport if state is not None else None
    before = tr.counters.copy() if tr is not None else None
    counter.nbytes, counter.buckets, counter.phases = 0, 0, {}
    ctx.barrier()
    tx0 = tx_bytes(iface)
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=False)
    loss = F.cross_entropy(ddp(batch[0]), batch[1])
    loss.backward()
    opt.step()
    dt = time.perf_counter() - t0
    ctx.barrier()
    tx1 = tx_bytes(iface)
    if state is not None:
        acct = int(state.last_step_traffic["bytes_sent"])
        d = tr.counters.copy().minus(before)
        transport = int(d.payload_bytes_sent + d.header_bytes_sent)
    else:
        allreduced = counter.nbytes if row["hooked"] else row["grad_bytes"]
        acct = 2 * (P - 1) * allreduced // P
        transport = None
    return (dt, acct, transport, (None if tx0 is None else tx1 - tx0), counter.buckets, float(loss),
            dict(counter.phases))


def ddp_rows(ctx, p):
    """Worker: every row's DDP model, ``warmup`` untimed steps each, then
    ``rounds`` x ``per_round`` timed steps each, the rows taking turns."""
    import torch

    torch.set_num_threads(1)
    P, iface, widths = ctx.size, p["iface"], p["widths"]
    counter = _AllreduceCounter()
    names = [r[0] for r in ROWS if r[0] in p["rows"]]
    rows = [_build(n, k, s, widths, P, counter) for n, k, s in ROWS if n in names]
    g = torch.Generator().manual_seed(1000 + 100 * ctx.rank)
    batches = [(torch.randn(BATCH, widths[0], generator=g), torch.randint(0, widths[-1], (BATCH,), generator=g))
               for _ in range(4)]
    out = {r["name"]: {"times": [], "bytes": [], "transport_bytes": [], "tx_bytes": [], "buckets": [],
                       "loss": [], "phases": []} for r in rows}
    i = 0
    for phase, reps in (("warmup", p["warmup"]), ("timed", p["per_round"])):
        for rnd in range(1 if phase == "warmup" else p["rounds"]):
            order = rows[rnd % len(rows):] + rows[:rnd % len(rows)]  # who goes first rotates
            for row in order:
                for _ in range(reps):
                    res = _step(ctx, row, batches[i % len(batches)], P, iface, counter)
                    i += 1
                    if phase == "timed":
                        o = out[row["name"]]
                        for key, v in zip(("times", "bytes", "transport_bytes", "tx_bytes", "buckets", "loss",
                                                          "phases"),
                                          res):
                            o[key].append(v)
            ctx.progress(what=f"{phase} round {rnd + 1}")
    for row in rows:
        h = hashlib.sha256()
        for prm in row["ddp"].module.parameters():
            h.update(prm.detach().contiguous().numpy().tobytes())
        o = out[row["name"]]
        # the reducer's current (rebuilt) buckets, in elements
        sizes = [b.buffer().numel() for b in row["ddp"].reducer._get_zeros_like_grad_buckets()]
        o.update(ddp_bucket_sizes=sizes, hooked=row["hooked"])
        o.update(params_sha256=h.hexdigest(), bucket_cap_mb=row["bucket_cap_mb"], grad_bytes=row["grad_bytes"],
                 kind=row["kind"], numel=sum(q.numel() for q in row["ddp"].module.parameters()))
    return out


# ---------------------------------------------------------------------------
# parent side
# ---------------------------------------------------------------------------
def add_arguments(ap, results_dir):
    ap.add_argument("--workers", "-P", type=int, default=None, help="worker namespaces (default 4; --quick: 2)")
    ap.add_argument("--warmup", type=int, default=None, help=f"untimed steps per row (default 3; PowerSGD "
                    f"compresses from step {POWERSGD_START} on)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds of timed steps (default 6)")
    ap.add_argument("--per-round", type=int, default=None, help="timed steps per row and round (default 3)")
    ap.add_argument("--rows", default=",".join(r[0] for r in ROWS),
                    help="comma-separated row names (default: all)")
    ap.add_argument("--quick", action="store_true",
                    help=f"smoke run: P=2, MLP {QUICK_WIDTHS}, 3 steps per row (2 untimed + 1 timed)")
    ap.add_argument("--json", default=os.path.join(results_dir, "cluster_ddp.json"))


def _settings(args):
    q = args.quick
    P = args.workers or (2 if q else 4)
    return dict(P=P, widths=QUICK_WIDTHS if q else FULL_WIDTHS, batch=BATCH,
                warmup=args.warmup if args.warmup is not None else (2 if q else 3),
                rounds=args.rounds or (1 if q else 6), per_round=args.per_round or (1 if q else 3),
                rows=[r.strip() for r in args.rows.split(",") if r.strip()], threads=1, seed=SEED,
                ddp_bucket_cap_mb=DDP_BUCKET_MB, powersgd_start_iter=POWERSGD_START)


def _phases(rr):
    """Our hooks: median over steps of the slowest rank's reducer seconds per
    phase (summed over the step's buckets), in ms; None for other rows."""
    keys = sorted(set().union(*(ph for r in rr for ph in r["phases"])))
    if not keys:
        return None
    return {k: statistics.median(max(r["phases"][i].get(k, 0.0) for r in rr)
                                 for i in range(len(rr[0]["phases"]))) * 1e3 for k in keys}


def merge(per_rank, desc):
    """Per row: the slowest rank per step, the median over steps."""
    rows = []
    for name in per_rank[0]:
        rr = [pr[name] for pr in per_rank]
        times = [max(x) for x in zip(*(r["times"] for r in rr))]
        tx = [max(x) for x in zip(*(r["tx_bytes"] for r in rr))] if rr[0]["tx_bytes"][0] is not None else None
        r0 = rr[0]
        rows.append(dict(
            name=name, kind=r0["kind"], numel=r0["numel"], bucket_cap_mb=r0["bucket_cap_mb"], times=times,
            median_ms=statistics.median(times) * 1e3,
            bytes_per_step=max(statistics.median(r["bytes"]) for r in rr),
            bytes_per_rank_step=[r["bytes"] for r in rr],
            transport_bytes_per_rank_step=[r["transport_bytes"] for r in rr],
            tx_bytes_per_step=statistics.median(tx) if tx else None,
            buckets_per_step=len(r0["ddp_bucket_sizes"]),
            hook_calls_per_step=r0["buckets"][-1] if r0["hooked"] else None,
            ddp_bucket_sizes=r0["ddp_bucket_sizes"],
            loss_last=r0["loss"][-1] if r0["loss"] else None,
            hook_phases_ms=_phases(rr),
            params_sha256=[r["params_sha256"] for r in rr],
            params_identical=len({r["params_sha256"] for r in rr}) == 1,
            label=desc["label"]))
    best_torch = min((r["median_ms"] for r in rows if r["kind"] == "torch"), default=None)
    for r in rows:
        r["ratio_to_best_pytorch"] = r["median_ms"] / best_torch if best_torch else None
    return rows


def summary(rows):
    t = [r for r in rows if r["kind"] == "torch"]
    o = [r for r in rows if r["kind"] == "ours"]
    if not t or not o:
        return None
    bt, bo = min(t, key=lambda r: r["median_ms"]), min(o, key=lambda r: r["median_ms"])
    ratio = bo["median_ms"] / bt["median_ms"]
    floor = [r["median_ms"] for r in rows if r["kind"] == "floor"]
    out = {"best_pytorch": bt["name"], "best_pytorch_ms": bt["median_ms"], "best_sparse": bo["name"],
           "best_sparse_ms": bo["median_ms"], "ratio": ratio, "goal": GOAL, "goal_met": ratio <= GOAL}
    if floor:
        # the goal asks for less than a step without communication takes here?
        out.update(floor_ms=floor[0], floor_ratio=floor[0] / bt["median_ms"],
                   goal_reachable_here=floor[0] <= GOAL * bt["median_ms"])
    return out


def run(args) -> dict:
    s = _settings(args)
    P = s["P"]
    progress = harness.Progress(1 + s["rounds"], "ddp", disable=args.quiet)
    load = harness.wait_for_quiet(args.max_load, args.max_wait, progress, args.max_busy)
    import torch
    net = harness.network(P, args)
    desc = net.describe()
    if not desc["shaped"]:
        progress.note(f"NOT SHAPED: {desc.get('why')}; every result is labelled 'unshaped'")
    progress.note(f"powerSGD_hook runs with ONE DDP bucket (bucket_cap_mb above the model's size): "
                  f"on gloo it aborts with more than one; every other row: bucket_cap_mb={DDP_BUCKET_MB:g}")
    meta = {"argv": list(__import__("sys").argv), "cpus": os.cpu_count(), "torch": torch.__version__,
            "network": desc, "loadavg_start": load,
            "latency": "no added latency: this kernel has no netem, and the DDP comparison adds none "
                       "(the links' own sub-millisecond latency)"}
    t0 = time.time()
    payload = dict(s, iface=net.iface)
    with harness.signals_as_exceptions(), net:
        per_rank = harness.run_job(net, P, ddp_rows, payload, "torch", progress, timeout=args.timeout,
                                   echo=args.echo)
    progress.close()
    meta.update(loadavg_end=harness.loadavg(), seconds=round(time.time() - t0, 1))
    rows = merge(per_rank, desc)
    return {"meta": meta, "settings": s, "rows": rows, "summary": summary(rows)}


def _ph(r):
    ph = r.get("hook_phases_ms")
    return f"{ph['total']:.1f} ({ph.get('communicate', 0.0):.1f})" if ph and "total" in ph else "–"


def table(res) -> str:
    lines = ["| row | median ms | × best PyTorch hook | bytes/step (accounting) | eth0 tx bytes/step | "
             "buckets | in reduce(): total (communicate) ms | params equal on all ranks |",
             "|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        tx = f"{r['tx_bytes_per_step']:,.0f}" if r["tx_bytes_per_step"] is not None else "–"
        ratio = r["ratio_to_best_pytorch"]  # None when --rows leaves out every PyTorch hook
        lines.append(f"| {r['name']} | {r['median_ms']:.1f} | {'–' if ratio is None else f'{ratio:.2f}'} | "
                     f"{r['bytes_per_step']:,.0f} | {tx} | {r['buckets_per_step']} | {_ph(r)} "
                     f"| {'n/a (nothing averaged)' if r['kind'] == 'floor' else 'yes' if r['params_identical'] else 'NO'} |")
    return "\n".join(lines)


def report(res) -> str:
    s, m, sm = res["settings"], res["meta"], res["summary"]
    net = m["network"]
    head = (f"DDP, P={s['P']} {'shaped ' + str(net.get('rate')) if net['shaped'] else 'UNSHAPED'} "
            f"({net['topology']}), MLP {s['widths']} ({res['rows'][0]['numel']:,} parameters), batch "
            f"{s['batch']}/worker, 1 thread/worker, {s['rounds'] * s['per_round']} timed steps per row "
            f"after {s['warmup']} untimed; load average {m['loadavg_start']} -> {m['loadavg_end']}")
    out = [head, "", table(res), "",
           "bytes/step: ours = the reducer's accounting (payload + headers); PyTorch's = ring model "
           "2(P-1)/P x bytes allreduced. powerSGD_hook ran with ONE DDP bucket (on gloo it aborts with "
           "more than one). Sparse methods are CPU-bound: machine load penalises them most."]
    if sm:
        out.append(f"best sparse ({sm['best_sparse']}) / best PyTorch ({sm['best_pytorch']}) = "
                   f"{sm['ratio']:.2f} (goal <= {GOAL}: {'met' if sm['goal_met'] else 'NOT met'})")
        if "floor_ms" in sm:
            out.append(f"a step without communication takes {sm['floor_ratio']:.2f} x the best PyTorch hook "
                       f"here: the goal is {'' if sm['goal_reachable_here'] else 'NOT '}reachable at this load")
    return "\n".join(out)


def plot(res, path):
    from lab.cluster.report import _plt

    plt = _plt()
    if plt is None:
        return None
    rows = res["rows"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = [r["name"] for r in rows]
    colors = [{"torch": "tab:gray", "ours": "tab:blue"}.get(r["kind"], "tab:green") for r in rows]
    a.barh(names, [r["median_ms"] for r in rows], color=colors)
    a.set_xlabel("median step ms (slowest rank)")
    a.invert_yaxis()
    b.barh(names, [max(r["bytes_per_step"], 1) for r in rows], color=colors)
    b.set_xscale("log")
    b.set_xlabel("bytes sent per worker and step")
    b.invert_yaxis()
    b.set_yticklabels([])
    s, net = res["settings"], res["meta"]["network"]
    fig.suptitle(f"DDP hooks, P={s['P']}, {net['label']} {net.get('rate') or ''}, "
                 f"{res['rows'][0]['numel']:,} params (grey: PyTorch, blue: gtopk_plugin, green: no communication)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
