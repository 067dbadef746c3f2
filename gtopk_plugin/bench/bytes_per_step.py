"""Bytes per worker per step, and communication time, for every method side
by side, measured on real gloo process groups on this machine (loopback).

    gtopk-bench bytes-per-step --workers 4 8 --numel 1000000 --density 0.001 0.01
    gtopk-bench bytes-per-step --methods gtopk topk randomk --wires fp32 fp16 int8 \
        --json bytes_per_step_int8.json

``--wires``: values on the wire (``value_dtype``: fp32 = the gradients'
own, fp16, bf16, int8 = 1-byte codes plus one exponent byte per message);
codecs set their own wire format and run with fp32 only.

Prints a table per (P, density) and writes JSON + PNG to gtopk-bench-results/.
Loopback is not a slow network: the byte counts are exact and carry over to
any network; the times only rank methods on this machine (the emulated
1 GbE cluster of the repository's lab measures time on a shaped link).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

from gtopk_plugin.compress import available

from gtopk_plugin.bench import bench_launch as launch
from gtopk_plugin.bench.bench_record import RESULTS, write_json

METHODS = list(available(builtin=True))  # every compressor of the package (workers know no others)
WIRES = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16, "int8": torch.int8}


def layer_shapes(numel: int):
    """A model-like layout: a few conv/linear layers of decreasing size plus
    biases, totalling ``numel`` elements."""
    fracs = [0.5, 0.25, 0.15, 0.0999]
    shapes = {f"layer{i}.weight": (max(1, int(numel * f)),) for i, f in enumerate(fracs)}
    rest = numel - sum(s[0] for s in shapes.values())
    shapes["layers.bias"] = (max(1, rest),)
    return shapes


def measure(ctx, args):
    """Worker body (run by gtopk_plugin.bench.bench_launch on every rank of a gloo group)."""
    import torch.distributed as dist

    import gtopk_plugin as gp
    from gtopk_plugin import registry

    shapes = layer_shapes(args["numel"])
    g = torch.Generator().manual_seed(ctx.rank)
    grads = [{n: torch.randn(s, generator=g) for n, s in shapes.items()} for _ in range(2)]
    rows = []
    combos = [(m, w) for m in args["methods"] for w in args.get("wires", ["fp32"])
              if w == "fp32" or registry.get(m).kind != "codec"]
    for density in args["density"]:
        for method, wire in combos:
            red = gp.GradientReducer(method=method, density=density, value_dtype=WIRES[wire])
            stats = []
            for s in range(args["warmup"] + args["steps"]):
                dist.barrier()
                red.reduce(grads[s % 2])
                if s >= args["warmup"]:
                    stats.append(red.last_stats)
            st = stats[-1]
            rows.append(dict(P=ctx.size, density=density, method=method, wire=wire, numel=st.numel, k=st.k,
                             bytes_sent=st.bytes_sent, bytes_received=st.bytes_received,
                             rounds=st.rounds, messages=st.messages_sent, dense_bytes=st.dense_bytes,
                             comm_ms=statistics.median(x.seconds.get("communicate", 0) for x in stats) * 1e3,
                             total_ms=statistics.median(x.seconds["total"] for x in stats) * 1e3))
    return rows


def run(P, args):
    """P gloo workers on loopback (gtopk_plugin.bench.bench_launch); every rank reports and
    the table shows the max over ranks (the slowest link)."""
    try:
        per_rank = launch.run_workers(P, measure, vars(args),
                                      engine="torch", ifname="lo", timeout=1800)
    except launch.WorkerFailed as e:
        raise SystemExit(f"a worker failed at P={P}:\n{e}")
    return launch.merge_max(per_rank, ("bytes_sent", "bytes_received", "comm_ms", "total_ms"))


def print_table(rows):
    hdr = f"{'P':>2} {'density':>8} {'method':>9} {'wire':>4} {'k':>8} {'sent B/step':>12} {'recv B/step':>12} " \
          f"{'vs dense':>9} {'rounds':>6} {'comm ms':>8} {'total ms':>8}"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        ratio = r["dense_bytes"] / max(1, r["bytes_sent"])
        print(f"{r['P']:>2} {r['density']:>8g} {r['method']:>9} {r.get('wire', 'fp32'):>4} {r['k']:>8} "
              f"{r['bytes_sent']:>12,} "
              f"{r['bytes_received']:>12,} {ratio:>8.1f}x {r['rounds']:>6} {r['comm_ms']:>8.2f} "
              f"{r['total_ms']:>8.2f}")


def plot(rows, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install -e '.[bench]')")
        return
    densities = sorted({r["density"] for r in rows})
    fig, axes = plt.subplots(1, len(densities), figsize=(6 * len(densities), 4), squeeze=False)
    for ax, d in zip(axes[0], densities):
        for m, w in dict.fromkeys((r["method"], r.get("wire", "fp32")) for r in rows):
            pts = sorted((r["P"], r["bytes_sent"]) for r in rows
                         if r["density"] == d and r["method"] == m and r.get("wire", "fp32") == w)
            if pts:
                ax.plot([p for p, _ in pts], [b for _, b in pts], marker="o", label=m if w == "fp32" else f"{m}/{w}")
        ax.set_yscale("log")
        ax.set_xlabel("workers P")
        ax.set_ylabel("bytes sent per worker per step")
        ax.set_title(f"density {d:g}, N = {rows[0]['numel']:,}")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--numel", type=int, default=1_000_000)
    ap.add_argument("--density", type=float, nargs="+", default=[0.001, 0.01])
    ap.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    ap.add_argument("--wires", nargs="+", default=["fp32"], choices=list(WIRES))
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--json", default=os.path.join(RESULTS, "bytes_per_step.json"))
    args = ap.parse_args(argv)
    rows = []
    for P in args.workers:
        rows += run(P, args)
    print_table(rows)
    write_json(args.json, "bytes_per_step", document={"args": vars(args), "rows": rows, "torch": torch.__version__})
    png = os.path.splitext(args.json)[0] + ".png"
    plot(rows, png)
    print(f"wrote {args.json} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
