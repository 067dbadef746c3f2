"""HSDP training step on emulated nodes: FSDP2's own replica all-reduce
(fp32, and with ``reduce_dtype=bfloat16``) against the sparse replica
reduction (``gtopk_plugin.torch_fsdp``), side by side in one run.

    gtopk-bench hsdp-step --nodes 2 4 --local 2 --rate 1gbit

Each "node" is a network namespace holding ``--local`` ranks: they reach
each other through the namespace's loopback (unshaped), and the other nodes
through one veth into a bridge, shaped with ``tc tbf`` to ``--rate`` in both
directions and shared by the node's ranks, as a node's one NIC is.  Needs
root and iproute2; otherwise every rank runs on the host's loopback and the
rows say ``unshaped``.  Every rank builds one copy of a ~10.5M-parameter
MLP per variant, sharded with ``fully_shard`` on a (nodes, local) mesh, and
the variants take turns round by round (the order rotates, so a change in
load falls on all of them alike).  A step is forward + backward (with the
reductions) + SGD step between barriers; reported: the median over ranks
and rounds, its ratio to stock HSDP, the range of that ratio round by round
(paired: the variants of a round ran back to back), and the replica
reduction's bytes.
The floor row shards inside the node only (no replica reduction at all).
Writes ``gtopk-bench-results/hsdp_step.json``.  A benchmark, not a test.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

from gtopk_plugin.bench import shaped_net
from gtopk_plugin.bench.bench_record import RESULTS, write_json

WIDTHS = [1024, 2048, 2048, 2048, 10]  # 10,512,394 parameters
BATCH = 16  # per rank
VARIANTS = {  # name -> how the model reduces across nodes
    "HSDP (fp32 all-reduce)": {"kind": "stock"},
    "HSDP reduce_dtype=bf16": {"kind": "stock", "reduce_dtype": "bfloat16"},
    "gtopk 1%": {"kind": "ours", "method": "gtopk", "density": 0.01},
    "gtopk 0.1%": {"kind": "ours", "method": "gtopk", "density": 0.001},
    "no replica reduction (floor)": {"kind": "floor"},
}
BASELINE, FLOOR = "HSDP (fp32 all-reduce)", "no replica reduction (floor)"
GOAL = 0.5  # gtopk 1% step <= 0.5 x stock HSDP's at 2 nodes


def _mlp():
    import torch

    torch.manual_seed(0)
    layers = []
    for a, b in zip(WIDTHS[:-1], WIDTHS[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def _build(mesh, spec):
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import gtopk_plugin.torch_fsdp as fsdp

    model = _mlp()
    where = mesh["shard"] if spec["kind"] == "floor" else mesh
    mp = MixedPrecisionPolicy(reduce_dtype=getattr(torch, spec["reduce_dtype"])) if "reduce_dtype" in spec \
        else MixedPrecisionPolicy()
    for m in list(model)[::2] + [model]:
        fully_shard(m, mesh=where, mp_policy=mp)
    state = None
    if spec["kind"] == "ours":
        state = fsdp.sparse_replica_reduction(model, method=spec["method"], density=spec["density"])
    return model, torch.optim.SGD(model.parameters(), lr=0.01), state


def worker(ctx, args):
    import torch
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (args["nodes"], args["local"]), mesh_dim_names=("replicate", "shard"))
    runs = {name: _build(mesh, spec) + ([],) for name, spec in VARIANTS.items()}
    traffic = {}
    g = torch.Generator().manual_seed(ctx.rank)
    order = list(runs)
    for rnd in range(args["warmup"] + args["rounds"]):
        for name in order[rnd % len(order):] + order[:rnd % len(order)]:
            model, opt, state, times = runs[name]
            x = torch.randn(args["batch"], WIDTHS[0], generator=g)
            y = torch.randint(0, WIDTHS[-1], (args["batch"],), generator=g)
            ctx.barrier()
            t0 = time.perf_counter()
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            if rnd >= args["warmup"]:
                times.append(time.perf_counter() - t0)
            if state is not None:
                traffic[name] = state.last_step_traffic
    n_params = sum(p.numel() for p in _mlp().parameters())
    return {"params": n_params, "times": {n: r[3] for n, r in runs.items()}, "traffic": traffic}


def run_topology(nodes: int, local: int, args) -> dict:
    """One launch of nodes x local ranks; per variant the median step (ms)."""
    from gtopk_plugin.bench import bench_launch

    payload = {"nodes": nodes, "local": local, "rounds": args.rounds, "warmup": args.warmup, "batch": args.batch}
    net, why = shaped_net.network(nodes, args.rate)  # None: loopback ('--rate none', or no namespaces)
    link = f"{args.rate} between nodes (tc tbf), unshaped inside" if net else f"unshaped loopback ({why})"
    P = nodes * local
    if net is not None:  # one shaped namespace per node, holding its ranks (they share the node's link)
        with net:
            reps = bench_launch.run_workers(P, worker, payload, master_addr=net.addr(0), ifname=net.iface,
                                            prefix=lambda r: net.prefix(r // local), timeout=args.timeout)
    else:
        reps = bench_launch.run_workers(P, worker, payload, timeout=args.timeout)
    med = {n: statistics.median(t for r in reps for t in r["times"][n]) * 1e3 for n in VARIANTS}
    # each round's step (median over ranks): the variants of one round ran
    # back to back, so their ratio is paired and its spread shows the noise
    per_round = {n: [statistics.median(r["times"][n][i] for r in reps) for i in range(args.rounds)]
                 for n in VARIANTS}
    rows = {}
    for n in VARIANTS:
        tr = reps[0]["traffic"].get(n) or {}
        paired = sorted(a / b for a, b in zip(per_round[n], per_round[BASELINE]))
        # the time a variant adds to the floor: its replica reduction, as a
        # share of what stock HSDP's takes
        rows[n] = {"median_ms": med[n], "vs_stock": med[n] / med[BASELINE],
                   "vs_stock_per_round": {"median": statistics.median(paired), "min": paired[0],
                                          "max": paired[-1]},
                   "above_floor_vs_stock": (med[n] - med[FLOOR]) / (med[BASELINE] - med[FLOOR]),
                   "replica_bytes_sent": tr.get("bytes_sent"), "replica_dense_bytes": tr.get("dense_bytes")}
    return {"nodes": nodes, "local": local, "link": link, "params": reps[0]["params"], "rows": rows}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--local", type=int, default=2, help="ranks per node (the shard dimension)")
    ap.add_argument("--rate", default="1gbit", help="tc rate of each node's link ('none': loopback, unshaped)")
    ap.add_argument("--batch", type=int, default=BATCH, help="samples per rank and step")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=3600.0)
    ap.add_argument("--out", default=os.path.join(RESULTS, "hsdp_step.json"))
    args = ap.parse_args(argv)
    results = []
    for nodes in args.nodes:
        res = run_topology(nodes, args.local, args)
        results.append(res)
        print(f"\nHSDP step, {nodes} nodes x {args.local} ranks, {res['link']}, {res['params'] / 1e6:.1f}M-parameter "
              f"MLP, batch {args.batch} per rank, one thread per rank (median over ranks and {args.rounds} rounds)")
        print(f"{'variant':<30} {'ms':>8} {'x stock':>8} {'per round':>11} {'above floor':>12}   "
              "replica bytes sent per rank (dense)")
        for n, r in res["rows"].items():
            b = "" if r["replica_bytes_sent"] is None else \
                f"{r['replica_bytes_sent']:,} ({r['replica_dense_bytes']:,})"
            pr = r["vs_stock_per_round"]
            print(f"{n:<30} {r['median_ms']:8.1f} {r['vs_stock']:8.2f} {pr['min']:5.2f}-{pr['max']:<5.2f} "
                  f"{r['above_floor_vs_stock']:12.2f}   {b}")
    two = next((r for r in results if r["nodes"] == 2), None)
    if two is not None:
        ratio = two["rows"]["gtopk 1%"]["vs_stock"]
        print(f"\ngoal: gtopk 1% <= {GOAL} x stock HSDP at 2 nodes: {ratio:.2f} "
              f"({'met' if ratio <= GOAL else 'not met'})")
    write_json(args.out, "hsdp_step",
               settings={"nodes": args.nodes, "local": args.local, "rate": args.rate, "rounds": args.rounds,
                         "warmup": args.warmup, "batch": args.batch, "widths": WIDTHS, "threads_per_rank": 1,
                         "optimizer": "SGD lr 0.01", "goal": GOAL},
               results=results, packages=("torch",))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
