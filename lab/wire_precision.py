"""Reduced-precision wire: mass conservation, bytes per step and the effect
on training (docs/design.md §2).

    python -m lab.wire_precision [--steps 200] [--world 3 4 7] [--train-world 4]

Wires side by side in one run on real gloo processes per P: fp32 (the
gradients' own dtype), fp16, bf16, int8 (1-byte codes plus one exponent
byte per message, nearest rounding) and int8s (the same, stochastic
rounding).

1. Conservation, for every method (gtopk, topk, dense, randomk) and wire:
   ``--steps`` reduce() calls, op="sum", gradients spanning ~1e-3 to ~1e3,
   and the relative conservation error  max_i |Σ_ranks Σ_steps g −
   Σ_steps result − Σ_ranks residual|_i / max_i Σ_ranks |Σ_steps g|_i
   computed in float64 by the parent; plus the busiest rank's payload bytes
   sent per step and its ratio to the fp32 and fp16 wires.
2. Training (``--train-world`` workers, ``--train-steps`` steps): a small
   MLP classifier on a synthetic teacher task, each worker its own data,
   SGD on the reduced (average) gradient, density 0.05 for the sparse
   methods; final training loss and held-out accuracy per (method, wire).
   One seed: differences below ~1 pp are noise.

Writes lab/results/wire_precision.json and prints the tables.
"""
from __future__ import annotations

import argparse
import os

import torch

from gtopk_plugin.bench.bench_launch import run_workers
from gtopk_plugin.bench.bench_record import write_json

METHODS = ("gtopk", "topk", "dense", "randomk")
TRAIN_METHODS = ("dense", "gtopk", "topk")
WIRES = {"fp32": (None, "nearest"), "fp16": (torch.float16, "nearest"), "bf16": (torch.bfloat16, "nearest"),
         "int8": (torch.int8, "nearest"), "int8s": (torch.int8, "stochastic")}
SHAPES = {"a": (150,), "b": (6, 9)}
HERE = os.path.dirname(os.path.abspath(__file__))


def _grads(rank: int, step: int):
    g = torch.Generator().manual_seed(step * 7919 + rank * 104_729)
    return {n: torch.randn(s, generator=g) * torch.exp(1.5 * torch.randn(s, generator=g))
            for n, s in SHAPES.items()}


def _flat(d):
    return torch.cat([d[n].reshape(-1).double() for n in sorted(d)])


def _reducer(gp, method, wire, transport, op, density):
    dt, rounding = WIRES[wire]
    kw = {} if method == "dense" else {"density": density}
    return gp.GradientReducer(method, op=op, value_dtype=dt, wire_rounding=rounding, seed=1,
                              transport=transport, **kw)


def worker(ctx, payload):
    """Per config: Σ_steps own gradients, Σ_steps results (every rank gets
    the same), final residual — as float64 lists — and bytes of the last step."""
    import gtopk_plugin as gp

    out = []
    for method, wire in payload["configs"]:
        red = _reducer(gp, method, wire, ctx.transport, "sum", 0.1)
        g_sum = r_sum = 0
        for s in range(payload["steps"]):
            g = _grads(ctx.rank, s)
            g_sum = g_sum + _flat(g)
            r_sum = r_sum + _flat(red.reduce(g))
        res = _flat(red.state_dict()["residuals"])
        out.append({"grad": g_sum.tolist(), "result": r_sum.tolist(), "residual": res.tolist(),
                    "bytes_sent": red.last_stats.payload_bytes_sent + red.last_stats.header_bytes_sent})
    return out


def _task(seed=0, d=32, classes=10, n=512):
    """A fixed random teacher (2-layer tanh net) labels Gaussian inputs."""
    g = torch.Generator().manual_seed(seed)
    w1, w2 = torch.randn(d, 64, generator=g), torch.randn(64, classes, generator=g)

    def data(s, count=n):
        gg = torch.Generator().manual_seed(s)
        x = torch.randn(count, d, generator=gg)
        return x, (torch.tanh(x @ w1) @ w2).argmax(1)
    return data


def train_worker(ctx, payload):
    """Per (method, wire): train the same MLP from the same init on this
    rank's data; final loss (mean over ranks' last 10 steps' batches is the
    parent's business: here this rank's) and held-out accuracy."""
    import gtopk_plugin as gp

    data = _task()
    x_test, y_test = data(10_000, 2000)
    out = []
    for method, wire in payload["configs"]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
        opt = torch.optim.SGD(model.parameters(), lr=payload["lr"])
        red = _reducer(gp, method, wire, ctx.transport, "average", payload["density"])
        losses = []
        for s in range(payload["steps"]):
            x, y = data(1000 * ctx.rank + s, 64)
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            upd = red.reduce({n: p.grad for n, p in model.named_parameters()})
            for n, p in model.named_parameters():
                p.grad.copy_(upd[n])
            opt.step()
            losses.append(float(loss))
        with torch.no_grad():
            acc = float((model(x_test).argmax(1) == y_test).double().mean())
        tail = losses[-20:]
        out.append({"final_loss": sum(tail) / len(tail), "accuracy": acc,
                    "bytes_sent": red.last_stats.payload_bytes_sent + red.last_stats.header_bytes_sent})
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--world", type=int, nargs="+", default=[3, 4, 7])
    ap.add_argument("--train-world", type=int, default=4)
    ap.add_argument("--train-steps", type=int, default=300)
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
            rows.append({"P": P, "method": m, "wire": w, "rel_conservation_error": err,
                         "bytes_sent": max(r[c]["bytes_sent"] for r in per_rank)})
    for r in rows:
        ref = {x["wire"]: x["bytes_sent"] for x in rows if x["P"] == r["P"] and x["method"] == r["method"]}
        r["bytes_vs_fp32"] = r["bytes_sent"] / ref["fp32"]
        r["bytes_vs_fp16"] = r["bytes_sent"] / ref["fp16"]
    print("relative conservation error | busiest rank's bytes sent per step (ratio to fp32)")
    print(f"{'P':>3} {'method':>8} " + " ".join(f"{w:>20}" for w in WIRES))
    for P in args.world:
        for m in METHODS:
            cells = {r["wire"]: r for r in rows if r["P"] == P and r["method"] == m}
            print(f"{P:>3} {m:>8} " + " ".join(
                f"{cells[w]['rel_conservation_error']:>7.1e} {cells[w]['bytes_sent']:>6} "
                f"{cells[w]['bytes_vs_fp32']:>5.3f}" for w in WIRES))

    train_configs = [(m, w) for m in TRAIN_METHODS for w in WIRES]
    tp = {"configs": train_configs, "steps": args.train_steps, "lr": 0.1, "density": 0.05}
    per_rank = run_workers(args.train_world, train_worker, tp)
    train_rows = []
    for c, (m, w) in enumerate(train_configs):
        train_rows.append({"P": args.train_world, "method": m, "wire": w,
                           "final_loss": sum(r[c]["final_loss"] for r in per_rank) / len(per_rank),
                           "accuracy": per_rank[0][c]["accuracy"],
                           "bytes_sent": max(r[c]["bytes_sent"] for r in per_rank)})
    print(f"\ntraining, P = {args.train_world}, {args.train_steps} steps, density {tp['density']}: "
          "final loss (mean of the last 20 steps) / held-out accuracy / bytes sent per step")
    for r in train_rows:
        print(f"{r['method']:>8} {r['wire']:>6} {r['final_loss']:>8.4f} {r['accuracy']:>7.4f} {r['bytes_sent']:>8}")
    write_json(args.out, "wire_precision", {"steps": args.steps, "world": args.world, "density": 0.1,
                                            "op": "sum", "shapes": SHAPES, "train": dict(tp, configs=None,
                                            world=args.train_world)},
               {"conservation": rows, "training": train_rows}, packages=("torch",))


if __name__ == "__main__":
    main()
