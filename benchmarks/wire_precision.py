"""Mass conservation with a reduced-precision wire (issue #14, DESIGN.md §3).

    python -m benchmarks.wire_precision [--steps 200] [--world 3 4 7]

For every method (gtopk, topk, dense, randomk) and wire (fp32, fp16, bf16),
side by side in one run on real gloo processes per P: 200 reduce() calls,
op="sum", gradients spanning ~1e-3 to ~1e3, and the relative conservation
error  max_i |Σ_ranks Σ_steps g − Σ_steps result − Σ_ranks residual|_i /
max_i Σ_ranks |Σ_steps g|_i  computed in float64 by the parent.  Writes
benchmarks/results/wire_precision.json and prints a table.
"""
from __future__ import annotations

import argparse
import os

import torch

from .launch import run_workers
from .record import write_json

METHODS = ("gtopk", "topk", "dense", "randomk")
WIRES = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}
SHAPES = {"a": (150,), "b": (6, 9)}
HERE = os.path.dirname(os.path.abspath(__file__))


def _grads(rank: int, step: int):
    g = torch.Generator().manual_seed(step * 7919 + rank * 104_729)
    return {n: torch.randn(s, generator=g) * torch.exp(1.5 * torch.randn(s, generator=g))
            for n, s in SHAPES.items()}


def _flat(d):
    return torch.cat([d[n].reshape(-1).double() for n in sorted(d)])


def worker(ctx, payload):
    """Per config: Σ_steps own gradients, Σ_steps results (every rank gets
    the same), final residual — as float64 lists."""
    import gtopk_plugin as gp

    out = []
    for method, wire in payload["configs"]:
        kw = {} if method == "dense" else {"density": 0.1}
        red = gp.GradientReducer(method, op="sum", value_dtype=WIRES[wire], transport=ctx.transport, **kw)
        g_sum = r_sum = 0
        for s in range(payload["steps"]):
            g = _grads(ctx.rank, s)
            g_sum = g_sum + _flat(g)
            r_sum = r_sum + _flat(red.reduce(g))
        res = _flat(red.state_dict()["residuals"])
        out.append({"grad": g_sum.tolist(), "result": r_sum.tolist(), "residual": res.tolist()})
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--world", type=int, nargs="+", default=[3, 4, 7])
    ap.add_argument("--out", default=os.path.join(HERE, "results", "wire_precision.json"))
    args = ap.parse_args(argv)
    configs = [(m, w) for m in METHODS for w in WIRES]
    rows = []
    for P in args.world:
        per_rank = run_workers(P, worker, {"configs": configs, "steps": args.steps})
        for c, (m, w) in enumerate(configs):
            g = sum(torch.tensor(r[c]["grad"], dtype=torch.float64) for r in per_rank)
            res = sum(torch.tensor(r[c]["residual"], dtype=torch.float64) for r in per_rank)
            result = torch.tensor(per_rank[0][c]["result"], dtype=torch.float64)
            scale = float(sum(torch.tensor(r[c]["grad"]).abs() for r in per_rank).max())
            err = float((g - result - res).abs().max()) / scale
            rows.append({"P": P, "method": m, "wire": w, "rel_conservation_error": err})
    print(f"{'P':>3} {'method':>8} " + " ".join(f"{w:>10}" for w in WIRES))
    for P in args.world:
        for m in METHODS:
            errs = {r["wire"]: r["rel_conservation_error"] for r in rows if r["P"] == P and r["method"] == m}
            print(f"{P:>3} {m:>8} " + " ".join(f"{errs[w]:>10.1e}" for w in WIRES))
    write_json(args.out, "wire_precision", {"steps": args.steps, "world": args.world, "density": 0.1,
                                            "op": "sum", "shapes": SHAPES}, rows, packages=("torch",))


if __name__ == "__main__":
    main()
