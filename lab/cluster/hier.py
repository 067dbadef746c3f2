"""Flat against hierarchical reduction on an emulated cluster of nodes:
``python -m lab cluster comm --nodes 2 4 --local 2``.

Every configuration (``nodes`` × ``local`` workers on a
:class:`~.nodes.NodeCluster`: unshaped inside a node, one shaped uplink per
node) runs one worker job.  Each worker holds model-like gradients of N
elements (``bytes_per_step.layer_shapes``, standard normal draws seeded
1000 + rank, the same every step) and reduces them step after step with
the library's reducers, each row a fresh reducer:

* ``flat``: :class:`gtopk_plugin.GradientReducer` over all P workers;
* ``hier``: :class:`gtopk_plugin.two_level.hierarchical_reducer.HierarchicalReducer` with
  ``local_size=local`` (dense inside the node, the method between nodes).

The rows take turns in passes (``--repeat``; every other pass reversed:
A B C C B A ...), a warm-up step and ``--big-steps`` timed steps per row
and pass, so a drift in the shared machine's load falls on every row
alike.  Per step the slowest rank counts; the tables give the median over
all passes' steps and the spread (min–max over steps, and each pass's
median).

Times come from the reducers' own phase clocks (``last_stats.seconds``):
the *exchange* of a flat row is its ``communicate`` phase; of a
hierarchical row, every phase that communicates (``intra``, ``inter``,
...; the reducer's phase names are recorded as they are).  ``total`` is
the whole ``reduce()`` call (selection included).

Bytes: the reducers' accounting (``last_stats``; for hierarchical rows
also its intra-/inter-node split), and independently a per-peer tally in
every worker: the transport's point-to-point sends and receives are
attributed to the peer's node (exact), its allreduces by gloo's ring (each
rank sends 2(P−1)/P of the buffer to its right neighbour in the group):
``inter`` = bytes to or from a worker of another node.  The uplinks' own
counters over each job (``link_bytes``, frames with their headers, every
row and warm-up step together) are recorded beside them.
"""
from __future__ import annotations

import math
import statistics
import time
from typing import Dict, List

from lab.cluster import harness, nodes as N_



# ---------------------------------------------------------------------------
# worker side
# ---------------------------------------------------------------------------
class PeerTally:
    """Bytes this process sent to / received from workers of its own node
    (``intra``) and of other nodes (``inter``), over every
    TorchDistributedTransport in the process (the hierarchical reducer's
    sub-group transports included): their ``_raw_*`` methods are wrapped."""

    def __init__(self, node_of_rank: List[int], me: int):
        self.node_of, self.me = node_of_rank, me
        self.muted = False
        self.reset()

    def reset(self):
        self.b = {"intra_sent": 0, "intra_received": 0, "inter_sent": 0, "inter_received": 0}

    def add(self, peer: int, nbytes: int, direction: str):
        if self.muted:  # the consistency check: control bytes, not the data path's
            return
        level = "intra" if self.node_of[peer] == self.node_of[self.me] else "inter"
        self.b[f"{level}_{direction}"] += int(nbytes)

    def install(self):
        from gtopk_plugin.collectives.torch_distributed import TorchDistributedTransport as T

        tally = self

        def nb(t):
            return t.numel() * t.element_size()

        def wrap(name, fn):
            setattr(T, name, fn)

        orig = {n: getattr(T, n) for n in ("_raw_sendrecv", "_raw_send", "_raw_recv", "_raw_allreduce_sum_",
                                           "control_allreduce_max")}

        def sendrecv(self, dst, send, src, recv):
            tally.add(self._global(dst), nb(send), "sent")
            tally.add(self._global(src), nb(recv), "received")
            return orig["_raw_sendrecv"](self, dst, send, src, recv)

        def send(self, peer, t):
            tally.add(self._global(peer), nb(t), "sent")
            return orig["_raw_send"](self, peer, t)

        def recv(self, peer, t):
            tally.add(self._global(peer), nb(t), "received")
            return orig["_raw_recv"](self, peer, t)

        def allreduce(self, t):
            P, r = self.size, self.rank
            if P > 1:  # gloo's ring: 2(P-1)/P of the buffer to the right, as much from the left
                ring = 2 * (P - 1) * nb(t) // P
                tally.add(self._global((r + 1) % P), ring, "sent")
                tally.add(self._global((r - 1) % P), ring, "received")
            return orig["_raw_allreduce_sum_"](self, t)

        def control(self, t):
            # its pairwise rounds (Transport.control_allreduce_max) are
            # control traffic, which the reducers' byte counts leave out too
            tally.muted = True
            try:
                return orig["control_allreduce_max"](self, t)
            finally:
                tally.muted = False

        for name, fn in (("_raw_sendrecv", sendrecv), ("_raw_send", send), ("_raw_recv", recv),
                         ("_raw_allreduce_sum_", allreduce), ("control_allreduce_max", control)):
            wrap(name, fn)
        return self


#: the hierarchical layouts and their intra-node fabrics
FABRICS = {"hier": "shared_memory", "hier-gloo": "engine"}


def _reducer(method, layout, p, ctx):
    kw = dict(method=method, density=p["density"], **((p.get("hyper") or {}).get(method) or {}))
    if layout == "flat":
        from gtopk_plugin import GradientReducer
        return GradientReducer(transport=ctx.transport, **kw)
    from gtopk_plugin.two_level.hierarchical_reducer import HierarchicalReducer
    # ranks r // local on node r; the node's dense data through shared
    # memory ("hier": insisting, so a run that cannot have it fails loudly)
    # or through the node's gloo group over its bridge ("hier-gloo")
    return HierarchicalReducer(local_size=p["local"], intra_fabric=FABRICS[layout], **kw)


def _stats(st) -> Dict:
    out = {k: getattr(st, k) for k in ("bytes_sent", "bytes_received", "k", "rounds", "control_bytes")}
    for k in ("intra_bytes_sent", "intra_bytes_received", "inter_bytes_sent", "inter_bytes_received"):
        if hasattr(st, k):
            out[k] = int(getattr(st, k))
    out["seconds"] = {k: float(v) for k, v in (st.seconds or {}).items()}
    out["fabric"] = getattr(st, "intra_fabric", None)
    return out


def pair_probe(ctx, p) -> Dict:
    """Gloo's point-to-point throughput between two workers of one node and
    between two nodes, under this run's load: every rank swaps ``nbytes``
    with a node-mate (local index ^ 1), then with its twin on the paired
    node (node ^ 1), ``reps`` times each; seconds per swap.  Needs an even
    ``local`` and an even number of nodes (else skipped: ``{}``)."""
    import torch

    L, n, r = p["local"], p["nodes"], ctx.rank
    if L % 2 or n % 2 or not p.get("link_mb"):
        return {}
    blob = torch.zeros(int(p["link_mb"] * 1e6), dtype=torch.uint8)
    node, li = divmod(r, L)
    out = {}
    for what, peer in (("intra", node * L + (li ^ 1)), ("inter", (node ^ 1) * L + li)):
        times = []
        for _ in range(3):
            ctx.barrier()
            t0 = time.perf_counter()
            ctx.transport.exchange(peer, blob, blob.numel())
            times.append(time.perf_counter() - t0)
        out[what] = times
    return {"nbytes": blob.numel(), **out}


def node_sum_floor(ctx, p, reps: int = 5) -> List[float]:
    """The least a dense node sum costs on this machine: every rank, all at
    once (a barrier before each repetition), adds its shard of its node's
    ``local`` gradients -- private buffers of N/local fp32 already in place,
    so no copy into shared memory and no mapping: one read of N and one
    write of N/local per rank, the memory traffic of a sharded node sum and
    nothing else (for local > 2 the chain of adds re-reads the shard: an
    upper bound).  Seconds per repetition on this rank; the parent takes
    the slowest rank.  Every emulated node shares this machine's cores and
    memory bus, as they share them in the hierarchical rows."""
    import torch

    L, shard = p["local"], p["numel"] // p["local"]
    parts = [torch.full((shard,), float(j + 1)) for j in range(L)]  # written: no page faults timed
    out = torch.zeros(shard)
    times = []
    for _ in range(reps + 1):  # the first is a warm-up
        ctx.barrier()
        t0 = time.perf_counter()
        if L == 1:
            out.copy_(parts[0])
        else:
            torch.add(parts[0], parts[1], out=out)
        for q in parts[2:]:
            out.add_(q)
        times.append(time.perf_counter() - t0)
    del parts, out
    return times[1:]


def nodes_grid(ctx, p):
    """Worker body: ``p``: numel, density, local, node_of_rank, rows
    ([method, layout]), steps, warmup, passes, hyper."""
    import torch
    from gtopk_plugin.bench.bytes_per_step import layer_shapes

    probe = pair_probe(ctx, p)
    floor = node_sum_floor(ctx, p)
    tally = PeerTally(p["node_of_rank"], ctx.rank).install()
    g = torch.Generator().manual_seed(1000 + ctx.rank)
    grads = {n: torch.randn(s, generator=g) for n, s in layer_shapes(p["numel"]).items()}
    out = {tuple(r): [] for r in p["rows"]}
    job_tally = dict.fromkeys(tally.b, 0)
    done = 0
    for pas in range(p["passes"]):
        order = p["rows"] if pas % 2 == 0 else p["rows"][::-1]
        for method, layout in order:
            red = _reducer(method, layout, p, ctx)
            steps = []
            for s in range(p["warmup"] + p["steps"]):
                ctx.barrier()
                tally.reset()
                t0 = time.perf_counter()
                red.reduce(grads)
                dt = time.perf_counter() - t0
                for k, v in tally.b.items():
                    job_tally[k] += v
                if s >= p["warmup"]:
                    topo = getattr(red, "topology", None)
                    steps.append(dict(_stats(red.last_stats), wall_s=dt, peer=dict(tally.b), pass_=pas,
                                      leader=True if topo is None else bool(topo.is_leader)))
            out[(method, layout)] += steps
            del red
            done += 1
            ctx.progress(done=done, total=p["passes"] * len(p["rows"]),
                         what=f"{p['nodes']}x{p['local']} {layout} {method} pass {pas + 1}")
    return {"rows": [{"method": m, "layout": lay, "steps": v} for (m, lay), v in out.items()],
            "job_tally": job_tally, "probe": probe, "node_sum_floor": floor}


# ---------------------------------------------------------------------------
# parent side
# ---------------------------------------------------------------------------
def exchange_seconds(layout: str, seconds: Dict[str, float]) -> float:
    """A step's exchange on one rank: the flat reducer's ``communicate``
    phase; on a node leader of the hierarchical one its ``intra`` phases
    (the node's dense allreduce and the result's broadcast) plus its inner
    reducer's ``communicate`` (the exchange between nodes): the same parts
    as the flat one, selection and bookkeeping left out."""
    if layout == "flat":
        return seconds.get("communicate", 0.0)
    return seconds.get("intra", 0.0) + seconds.get("communicate", 0.0)  # any hierarchical layout


def _median_of_slowest(per_rank: List[List[float]]) -> float:
    """Repetitions timed on every rank at once: the median over repetitions
    of the slowest rank's time."""
    return statistics.median(max(times) for times in zip(*per_rank))


def hier_available():
    import importlib
    try:
        getattr(importlib.import_module("gtopk_plugin.two_level.hierarchical_reducer"), "HierarchicalReducer")
    except Exception as e:  # noqa: BLE001 - any failure: rows not measured, said so
        return False, f"{type(e).__name__}: {e}"
    return True, "gtopk_plugin.two_level.hierarchical_reducer.HierarchicalReducer"


def _merge(per_rank, nodes, local, node_of):
    rows = []
    for i, row in enumerate(per_rank[0]["rows"]):
        rr = [pr["rows"][i]["steps"] for pr in per_rank]
        n = len(rr[0])
        lead = [r for r in rr if r[0]["leader"]]  # the ranks whose phases are the exchange's
        ex = [max(exchange_seconds(row["layout"], r[s]["seconds"]) for r in lead) for s in range(n)]
        wall = [max(r[s]["wall_s"] for r in rr) for s in range(n)]
        phases = sorted({k for r in lead for st in r for k in st["seconds"]})
        ph = {k: statistics.median([max(r[s]["seconds"].get(k, 0.0) for r in lead) for s in range(n)])
              for k in phases}
        others = [r for r in rr if not r[0]["leader"]]
        if others:  # a non-leader's intra phase includes waiting for its leader's whole inner reduce
            ph["intra (non-leaders)"] = statistics.median(
                [max(r[s]["seconds"].get("intra", 0.0) for r in others) for s in range(n)])
        passes = sorted({st["pass_"] for st in rr[0]})
        per_pass = [statistics.median([ex[s] for s in range(n) if rr[0][s]["pass_"] == q]) for q in passes]
        last = [r[-1] for r in rr]  # bytes: the same every step (exact counts)

        def per_node(key, src):
            tot = [0] * nodes
            for rank, st in enumerate(last):
                v = st["peer"][key] if src == "peer" else st.get(key)
                if v is None:
                    return None
                tot[node_of[rank]] += v
            return tot
        out = dict(method=row["method"], layout=row["layout"], nodes=nodes, local=local, P=nodes * local,
                   k=last[0]["k"], exchange_times=ex, exchange_s=statistics.median(ex),
                   exchange_per_pass=per_pass, wall_times=wall, wall_s=statistics.median(wall),
                   phases_s=ph, bytes_sent=max(st["bytes_sent"] for st in last),
                   bytes_received=max(st["bytes_received"] for st in last),
                   rounds=last[0]["rounds"], per_rank_stats=[{k: v for k, v in st.items() if k != "pass_"}
                                                             for st in last])
        for key in ("inter_sent", "inter_received", "intra_sent", "intra_received"):
            out[f"peer_{key}_per_node"] = per_node(key, "peer")
            out[f"stats_{key}_per_node"] = per_node(key.replace("_", "_bytes_", 1), "stats")
        rows.append(out)
    return rows


def expected_inter_per_node(row) -> int:
    """The expected formula for gTop-k at power-of-two sizes: hierarchical
    log2(nodes)·k·8 per node; flat log2(P)·k·8 per *worker*, of which the
    rounds with a partner on another node, log2(P) − log2(local), cross the
    uplink, for each of the node's ``local`` workers."""
    k, n, L = row["k"], row["nodes"], row["local"]
    if row["layout"] in FABRICS:
        return int(math.log2(n)) * k * 8
    return L * (int(math.log2(n * L)) - int(math.log2(L))) * k * 8


def cmd_nodes(args) -> dict:
    from lab.cluster import codecs

    node_counts, local = harness.flat(args.nodes), int(args.local)
    methods = harness.flat(args.methods)
    layouts = [x for x in args.layouts.replace(",", " ").split() if x]
    progress = harness.Progress(0, "nodes", disable=args.quiet)
    ok_h, why_h = hier_available()
    bad = [x for x in layouts if x != "flat" and x not in FABRICS]
    if bad:
        raise SystemExit(f"--layouts: unknown {bad}; choose from flat, {', '.join(FABRICS)}")
    if any(x in FABRICS for x in layouts) and not ok_h:
        progress.note(f"hierarchical rows not measured: {why_h}")
        layouts = [x for x in layouts if x not in FABRICS]
    rows = [[m, lay] for m in methods for lay in layouts if not (lay in FABRICS and m == "dense")]
    progress.total = len(node_counts) * len(rows) * args.repeat
    if progress._bar is not None:
        progress._bar.total = progress.total
    kern = harness.warm_kernels(progress)
    hyper = codecs.parse_hyper(args.hyper)
    N = harness.flat(args.numel)[0]
    density = harness.flat(args.density)[0]
    steps = args.big_steps if N >= 10_000_000 else args.steps
    out = {"meta": None, "rows": [], "jobs": [], "qdisc": {},
           "settings": {"numel": N, "density": density, "local": local, "nodes": node_counts,
                        "steps": steps, "warmup": args.warmup, "passes": args.repeat, "rows": rows,
                        "hierarchical": why_h, "seed": "grads: torch.randn, Generator seed 1000 + rank",
                        "hyper": hyper}}
    with harness.signals_as_exceptions():
        for n in node_counts:
            load = harness.wait_for_quiet(args.max_load, args.max_wait, progress, args.max_busy)
            net = N_.network(n, local, args)
            desc = net.describe()
            if out["meta"] is None:
                out["meta"] = harness.run_meta(args, desc)
                out["meta"]["kernels"] = kern
                if not desc["shaped"]:
                    progress.note(f"NOT SHAPED: {desc.get('why')}; every result is labelled 'unshaped'")
            node_of = [r // local for r in range(n * local)]
            with net:
                lb0 = net.link_bytes() if hasattr(net, "link_bytes") else None
                t0, load0 = time.time(), harness.loadavg()
                payload = dict(numel=N, density=density, local=local, nodes=n, node_of_rank=node_of, rows=rows,
                               steps=steps, warmup=args.warmup, passes=args.repeat, hyper=hyper,
                               link_mb=args.link_mb)
                per_rank = harness.run_job(net, n * local, nodes_grid, payload, "torch", progress,
                                           timeout=args.timeout, echo=args.echo)
                lb1 = net.link_bytes() if lb0 is not None else None
                for r in _merge(per_rank, n, local, node_of):
                    out["rows"].append(dict(r, label=desc.get("label"), shaped=desc["shaped"], loadavg=load))
                tallies = [pr["job_tally"] for pr in per_rank]
                job = {"nodes": n, "local": local, "seconds": round(time.time() - t0, 1),
                       "loadavg_start": load0, "loadavg_end": harness.loadavg()}
                if lb0 is not None:
                    job["uplink_bytes"] = {d: [b - a for a, b in zip(lb0[d], lb1[d])] for d in lb0}
                    job["tally_inter_sent_per_node"] = [sum(t["inter_sent"] for r, t in enumerate(tallies)
                                                            if node_of[r] == j) for j in range(n)]
                if per_rank[0]["probe"]:  # each swap moves nbytes each way; the slowest rank counts
                    nb = per_rank[0]["probe"]["nbytes"]
                    job["probe_gbit_s"] = {w: nb * 8 / _median_of_slowest([pr["probe"][w] for pr in per_rank]) / 1e9
                                           for w in ("intra", "inter")}
                    job["probe_mb"] = nb / 1e6
                if per_rank[0].get("node_sum_floor"):
                    job["node_sum_floor_s"] = _median_of_slowest([pr["node_sum_floor"] for pr in per_rank])
                out["jobs"].append(job)
                out["qdisc"][f"{n}x{local}"] = harness.summarise_qdisc(net.qdisc_stats())
    progress.close()
    out["meta"]["loadavg_end"] = harness.loadavg()
    return out


# ---------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------
def _ms(t):
    return f"{t * 1e3:.1f}" if t >= 0.01 else f"{t * 1e3:.2f}"


def _nb(v):
    return "–" if v is None else f"{max(v):,}"


def table(res) -> List[str]:
    out = ["| nodes × local | method | layout | exchange ms: median (min–max) | per pass | reduce() total ms "
           "| phases ms (median) | bytes sent / worker (accounting) | inter-node B sent / node (tally; "
           "reducer) | expected | intra-node B sent / node (tally; reducer) |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(res["rows"], key=lambda r: (r["P"], r["method"], r["layout"])):
        exp = f"{expected_inter_per_node(r):,}" if r["method"] == "gtopk" else "–"
        ph = ", ".join(f"{k} {_ms(v)}" for k, v in r["phases_s"].items() if k != "total")
        out.append(f"| {r['nodes']} × {r['local']} | {r['method']} | {r['layout']} | {_ms(r['exchange_s'])} "
                   f"({_ms(min(r['exchange_times']))}–{_ms(max(r['exchange_times']))}) | "
                   f"{', '.join(_ms(x) for x in r['exchange_per_pass'])} | {_ms(r['wall_s'])} | {ph} | "
                   f"{r['bytes_sent']:,} | {_nb(r['peer_inter_sent_per_node'])}; "
                   f"{_nb(r['stats_inter_sent_per_node'])} | {exp} | {_nb(r['peer_intra_sent_per_node'])}; "
                   f"{_nb(r['stats_intra_sent_per_node'])} |")
    return out


def goals(res) -> List[str]:
    out = [f"- {j['nodes']} × {j['local']}: gloo swaps of {j['probe_mb']:g} MB, every worker at once, per worker "
           f"each way: with a node-mate {j['probe_gbit_s']['intra']:.2f} Gbit/s, with a worker of another node "
           f"{j['probe_gbit_s']['inter']:.2f} Gbit/s (its node's {j['local']} workers share the uplink)" for j in res.get("jobs", []) if j.get("probe_gbit_s")]
    idx = {(r["P"], r["method"], r["layout"]): r for r in res["rows"]}
    for (P, m, lay), h in sorted(idx.items()):
        f = idx.get((P, m, "flat"))
        if lay not in FABRICS or f is None:
            continue
        q = h["exchange_s"] / f["exchange_s"]
        qt = h["wall_s"] / f["wall_s"]
        goal = f" (goal ≤ 0.7: {'met' if q <= 0.7 else 'NOT met'})" if m == "gtopk" else ""
        out.append(f"- {h['nodes']} × {h['local']} {m}: {lay} exchange {_ms(h['exchange_s'])} ms vs flat "
                   f"{_ms(f['exchange_s'])} ms → {q:.2f}×{goal}; whole reduce() {qt:.2f}×")
        job = next((j for j in res.get("jobs", []) if (j["nodes"], j["local"]) == (h["nodes"], h["local"])), {})
        floor = job.get("node_sum_floor_s")
        if m != "gtopk" or floor is None:
            continue
        budget = 0.7 * f["exchange_s"] - h["phases_s"].get("communicate", 0.0)
        line = f"  - the node sum's floor here: {_ms(floor)} ms"
        if budget > 0:
            line = (f"  - the node sum's floor here (every rank adding its shard of its node's {h['local']} "
                    f"gradients in place, all nodes at once): {_ms(floor)} ms; the goal leaves 0.7 × flat − "
                    f"between nodes = {_ms(budget)} ms for every intra-node phase together "
                    f"({floor / budget:.1f}× over)")
        else:
            line += "; the exchange between nodes alone already exceeds 0.7 × flat"
        out.append(line)
    return out


COLORS = {"gtopk": "tab:green", "topk": "tab:red", "dense": "tab:blue"}


def plot(res, path):
    """Left: exchange ms per configuration, the hierarchical bars split
    into the leader's intra-node phases (light) and the inter-node
    exchange; right: bytes per node per step over its uplink."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = res["rows"]
    if not rows:
        return None
    confs = sorted({(r["nodes"], r["local"]) for r in rows})
    series = sorted({(r["method"], r["layout"]) for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.4))
    w = 0.8 / len(series)
    for i, (m, lay) in enumerate(series):
        color, hatch = COLORS.get(m, "tab:gray"), {"hier": "//", "hier-gloo": ".."}.get(lay)
        for j, (n, L) in enumerate(confs):
            r = next((r for r in rows if (r["nodes"], r["local"], r["method"], r["layout"]) == (n, L, m, lay)), None)
            if r is None:
                continue
            x = j + (i - (len(series) - 1) / 2) * w
            lab = f"{m} {lay}" if j == 0 else None
            if lay in FABRICS:
                intra = r["phases_s"].get("intra", 0.0) * 1e3
                axes[0].bar(x, intra, w, color=color, alpha=0.35, hatch=hatch,
                            label=f"{m} {lay}: intra-node (dense sum + broadcast)" if j == 0 else None)
                axes[0].bar(x, r["phases_s"].get("communicate", 0.0) * 1e3, w, bottom=intra, color=color,
                            hatch=hatch, label=f"{m} {lay}: between nodes" if j == 0 else None)
            else:
                axes[0].bar(x, r["exchange_s"] * 1e3, w, color=color, label=lab)
            axes[0].errorbar(x, r["exchange_s"] * 1e3, yerr=[[(r["exchange_s"] - min(r["exchange_times"])) * 1e3],
                                                             [(max(r["exchange_times"]) - r["exchange_s"]) * 1e3]],
                             color="black", capsize=2, lw=1)
            axes[1].bar(x, max(r["peer_inter_sent_per_node"]) / 1e6, w, color=color, hatch=hatch, label=lab)
    for ax, yl in ((axes[0], "exchange ms (median; bar: min–max over steps)"),
                   (axes[1], "MB per node per step over its uplink")):
        ax.set_xticks(range(len(confs)))
        ax.set_xticklabels([f"{n} nodes × {L}" for n, L in confs])
        ax.set_ylabel(yl)
        ax.grid(True, axis="y", ls=":")
        ax.legend(fontsize=7)
    s = res["settings"]
    fig.suptitle(f"Flat vs hierarchical, N = {s['numel']:,}, density {s['density']:g}, 1 Gbit/s uplink per node, "
                 "inside a node shared memory (hier) or an unshaped bridge (hier-gloo); 2 shared cores",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
