"""``python -m lab horovod-idle``: what Horovod's background loop sends while no
op is in flight, per ``HOROVOD_CYCLE_TIME``, on a shaped link.

    python -m lab.horovod_idle                          # P = 4, 4.6 Mbit/s and 1 Gbit/s
    python -m lab.horovod_idle --rates 4600kbit --cycles default,5,10,20

Horovod 0.28's background thread runs one cycle every ``HOROVOD_CYCLE_TIME``
ms (default 1) and, with its response cache on (the default), every cycle
ends in a cross-rank bitwise allreduce of the cache bits -- whether or not
any op was enqueued.  The library's sparse exchange runs on a gloo side
channel (docs/horovod.md), so in a sparse job this coordination is all that
Horovod's loop does, and on a slow link it competes with the exchange.

Each (rate, cycle) is one ``horovodrun``-style job (Horovod's gloo
controller, one network namespace per rank, ``tc tbf`` links: the cluster
harness).  After one warm-up allreduce every rank sleeps ``--idle-s``
seconds and reads its interface's byte counter before and after (the bytes
Horovod sent while idle); then it times ``--ops`` 1-element
``hvd.allreduce`` calls (a dense op's negotiation) and ``hvd.join()`` calls
(the one Horovod op of a sparse step), medians.  Prints the table and
writes ``lab/results/horovod_idle.json``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import List

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def idle_worker(ctx, payload) -> dict:
    """One rank: idle bytes/s on the interface, then op latencies (ms)."""
    import horovod.torch as hvd
    import torch

    from lab.cluster.netns import tx_bytes

    iface = payload["iface"]
    hvd.allreduce(torch.zeros(1), name="idle.warm")  # every rank is up and past its first negotiation
    time.sleep(0.5)
    b0, t0 = tx_bytes(iface), time.perf_counter()
    time.sleep(payload["idle_s"])
    b1, t1 = tx_bytes(iface), time.perf_counter()
    allreduce, join = [], []
    for i in range(payload["ops"]):
        s = time.perf_counter()
        hvd.allreduce(torch.zeros(1), name=f"idle.op{i}")
        allreduce.append(time.perf_counter() - s)
    for _ in range(payload["ops"]):
        s = time.perf_counter()
        hvd.join()
        join.append(time.perf_counter() - s)
    return {"idle_bytes_per_s": None if b0 is None else (b1 - b0) / (t1 - t0),
            "allreduce_ms": 1e3 * statistics.median(allreduce), "join_ms": 1e3 * statistics.median(join),
            "cycle_env": os.environ.get("HOROVOD_CYCLE_TIME")}


def main(argv=None) -> int:
    from lab.cluster import harness, netns
    from gtopk_plugin.bench.bench_record import write_json
    from lab.train.cli import horovod_cycles

    ap = argparse.ArgumentParser(prog="python -m lab horovod-idle", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", "-P", type=int, default=4)
    ap.add_argument("--rates", default="4600kbit,1gbit", help="tc tbf rates, comma-separated")
    ap.add_argument("--cycles", default="default,5,10,20",
                    help="HOROVOD_CYCLE_TIME values in ms, comma-separated ('default': Horovod's own, 1 ms)")
    ap.add_argument("--idle-s", type=float, default=5.0)
    ap.add_argument("--ops", type=int, default=20)
    ap.add_argument("--json", default=os.path.join(RESULTS, "horovod_idle.json"))
    args = ap.parse_args(argv)
    if not harness.horovod_netns_preflight("python -m lab horovod-idle", "interface byte counters"):
        return 2
    cycles = horovod_cycles(args.cycles)
    rows: List[dict] = []
    print("| link | HOROVOD_CYCLE_TIME | idle KB/s per rank (median, min-max) | share of the link | "
          "1-elem allreduce ms | join ms |")
    print("|---|---|---|---|---|---|")
    for rate in [r for r in args.rates.split(",") if r]:
        with netns.NetCluster(args.workers, rate=rate) as net:
            for cyc in cycles:
                payload = {"iface": net.iface, "idle_s": args.idle_s, "ops": args.ops}
                with harness.horovod_cycle_env(cyc):
                    per_rank = harness.run_job(net, args.workers, idle_worker, payload, "horovod", timeout=600)
                idle = [r["idle_bytes_per_s"] for r in per_rank]
                med = statistics.median(idle)
                row = {"rate": rate, "cycle_ms": cyc, "idle_bytes_per_s": idle, "idle_median": med,
                       "link_share": med / (harness.parse_rate(rate) / 8),
                       "allreduce_ms": statistics.median(r["allreduce_ms"] for r in per_rank),
                       "join_ms": statistics.median(r["join_ms"] for r in per_rank),
                       "cycle_seen": per_rank[0]["cycle_env"]}
                rows.append(row)
                print(f"| {rate} | {'default (1)' if cyc == 'default' else f'{cyc:g}'} | {med / 1e3:.1f} "
                      f"({min(idle) / 1e3:.1f}-{max(idle) / 1e3:.1f}) | {100 * row['link_share']:.1f} % | "
                      f"{row['allreduce_ms']:.1f} | {row['join_ms']:.1f} |", flush=True)
    settings = {"P": args.workers, "rates": args.rates, "cycles": args.cycles, "idle_s": args.idle_s,
                "ops": args.ops, "loadavg": harness.loadavg()}
    write_json(args.json, "horovod_idle", settings, rows, packages=("torch", "horovod"))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
