"""Bytes and step time per compression of gtopk_plugin's Horovod-TensorFlow
layer, under real ``horovodrun --gloo`` jobs.

    python -m lab.horovod_tf --workers 2 4 --rounds 10 --steps 5

One job per P trains one copy of an MLP (784-1024-256-10, 1.07M parameters,
the ``mlp-1.1M`` of gtopk_plugin/bench/horovod_overhead.py) per compression with a
``DistributedGradientTape`` step inside ``tf.function``; the compressions
take turns step by step (the order rotates every round, so drift in machine
load hits all alike).  Reported per compression: the median step time, its
ratio to ``Compression.none`` (Horovod's own dense allreduce), and the bytes
this worker sent in the last step (``last_step_traffic``; for none/fp16 the
ring-allreduce model) with the ratio dense/sent.  Under load the pooled
medians drift with the machine; the per-round ratios are the side-by-side
figure: in each round every compression's median over its ``--steps``
steps divided by ``none``'s in the same round, reported as the median over
rounds with its quartiles.  Where
``lab/results/horovod_overhead.json`` holds the PyTorch layer's bytes
for the same model, density and P, they are printed beside ours: the same
selection and schedule must move the same bytes.  Writes
``lab/results/horovod_tf.json`` and a PNG.  Needs TensorFlow and
Horovod built with it (``GTOPK_HOROVOD_TF=1 bash scripts/install_horovod.sh``).
A benchmark, not a test: this 2-core machine runs all P workers.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

from gtopk_plugin.compress import available

from gtopk_plugin.bench.bench_launch import horovodrun
from gtopk_plugin.bench.bench_record import dump, write_json

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
WIDTHS = [784, 1024, 256, 10]  # mlp-1.1M of gtopk_plugin/bench/horovod_overhead.py
# Horovod's own two, then every compressor in the registry ("dense" is Horovod's "none")
COMPRESSIONS = ["none", "fp16"] + [m for m in available(builtin=True) if m != "dense"]
# "<method>@horovod": the same compression with its exchanges as Horovod ops
# (exchange="horovod", the layer's path before the gloo side channel)
CHOICES = COMPRESSIONS + [f"{m}@horovod" for m in COMPRESSIONS[2:]]


def worker(args):
    """Runs inside horovodrun."""
    import tensorflow as tf

    import horovod.tensorflow as hvd
    from gtopk_plugin.tensorflow import Compression, DistributedGradientTape

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    hvd.init()
    rank, P = hvd.rank(), hvd.size()

    def make_model():
        tf.keras.utils.set_random_seed(0)
        layers = [tf.keras.Input((WIDTHS[0],))]
        layers += [tf.keras.layers.Dense(w, activation="relu") for w in WIDTHS[1:-1]]
        return tf.keras.Sequential(layers + [tf.keras.layers.Dense(WIDTHS[-1])])

    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    runs = {}
    for cname in args.compressions:
        model = make_model()
        opt = tf.keras.optimizers.SGD(0.01)
        method, _, exchange = cname.partition("@")
        comp = Compression.from_name(method, args.density, **({"exchange": exchange} if exchange else {}))

        def step_fn(x, y, model=model, opt=opt, comp=comp):
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            tape = DistributedGradientTape(tape, compression=comp)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        runs[cname] = (tf.function(step_fn), comp, model)

    def batch(step):
        g = tf.random.Generator.from_seed(step * 131 + rank)
        return (g.normal([args.batch, WIDTHS[0]]),
                g.uniform([args.batch], 0, WIDTHS[-1], dtype=tf.int64))

    times = {c: [] for c in runs}
    step = 0
    for _ in range(args.warmup):  # traces every step function
        for c, (fn, _, _) in runs.items():
            fn(*batch(step)).numpy()
        step += 1
    names = list(runs)
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for s in range(args.steps):
            x, y = batch(step + s)
            for c in order:
                t0 = time.perf_counter()
                runs[c][0](x, y).numpy()  # .numpy(): wait for the step
                times[c].append(time.perf_counter() - t0)
        step += args.steps
    out = {"P": P, "numel": int(sum(v.shape.num_elements() for v in runs[names[0]][2].trainable_variables)),
           "compressions": {}}
    def per_round(c):  # the median of each round's steps (compressions interleaved within a round)
        return [statistics.median(times[c][r * args.steps:(r + 1) * args.steps]) for r in range(args.rounds)]

    base = per_round("none") if "none" in runs else None
    for c, (_, comp, _) in runs.items():
        row = {"median_step_s": statistics.median(times[c]), "steps": len(times[c])}
        if base is not None:  # side by side: this round's median over none's in the same round
            ratios = sorted(a / b for a, b in zip(per_round(c), base))
            row.update(round_ratios=ratios, ratio_median=statistics.median(ratios),
                       ratio_q1=ratios[(len(ratios) - 1) // 4], ratio_q3=ratios[(3 * (len(ratios) - 1) + 3) // 4])
        if hasattr(comp, "last_step_traffic"):
            row.update(comp.last_step_traffic)
        else:  # Horovod's dense allreduce: the ring model (fp16 halves the bytes)
            esz = 2 if c == "fp16" else 4
            ring = 2 * (P - 1) * out["numel"] * esz // P
            row.update(bytes_sent=ring, bytes_received=ring, dense_bytes=2 * (P - 1) * out["numel"] * 4 // P,
                       control_bytes=0, model="ring")
        out["compressions"][c] = row
    if rank == 0:
        dump(args.out, out, digits=None)  # to the launcher, exact
    hvd.shutdown()


def run_job(P, args, out):
    argv = ["-m", __spec__.name, "--worker", "--out", out, "--rounds", str(args.rounds),
            "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch", str(args.batch),
            "--density", str(args.density), "--compressions"] + list(args.compressions)
    t0, load0 = time.time(), os.getloadavg()
    horovodrun(P, argv, timeout=args.timeout)
    with open(out) as f:
        res = json.load(f)
    res["job_seconds"] = time.time() - t0
    res["loadavg_before"], res["loadavg_after"] = list(load0), list(os.getloadavg())
    return res


def torch_bytes(P, density):
    """The PyTorch Horovod layer's bytes for mlp-1.1M at (P, density), from
    lab/results/horovod_overhead.json, or {}."""
    try:
        with open(os.path.join(RESULTS, "horovod_overhead.json")) as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return {}
    if doc.get("settings", {}).get("density") != density:
        return {}
    return {c: t["bytes_sent"] for c, t in doc.get("results", {}).get(str(P), {}).get("bytes", {}).items()}


def plot(results, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    Ps = sorted(results, key=int)
    names = list(results[Ps[0]]["compressions"])
    w = 0.8 / len(Ps)
    for i, P in enumerate(Ps):
        rows = results[P]["compressions"]
        xs = [j + i * w for j in range(len(names))]
        a.bar(xs, [rows[c]["bytes_sent"] for c in names], w, label=f"P = {P}")
        b.bar(xs, [1e3 * rows[c]["median_step_s"] for c in names], w, label=f"P = {P}")
    for ax, title in ((a, "bytes sent per worker per step (log)"), (b, "median step time, ms")):
        ax.set_xticks([j + 0.4 - w / 2 for j in range(len(names))])
        ax.set_xticklabels(names, rotation=30)
        ax.set_title(title)
        ax.legend()
    a.set_yscale("log")
    fig.suptitle("Horovod-TensorFlow, mlp-1.1M, tf.function tape step (2-core machine, all workers on it)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--steps", type=int, default=5, help="timed steps per compression per round")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--batch", type=int, default=32, help="per worker")
    p.add_argument("--density", type=float, default=0.01)
    p.add_argument("--compressions", nargs="+", default=COMPRESSIONS, choices=CHOICES)
    p.add_argument("--timeout", type=int, default=1800)
    p.add_argument("--json", default=os.path.join(RESULTS, "horovod_tf.json"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before any TensorFlow import
    if args.worker:
        return worker(args)

    results = {}
    with tempfile.TemporaryDirectory(prefix="gtopk-hvdtf-bench-") as d:
        for P in args.workers:
            print(f"horovodrun -np {P} ...", flush=True)
            results[str(P)] = run_job(P, args, os.path.join(d, f"P{P}.json"))

    for P, res in results.items():
        tb = torch_bytes(int(P), args.density)
        rows = res["compressions"]
        base = rows.get("none", {}).get("median_step_s")
        print(f"\nP = {P}: mlp-1.1M ({res['numel']:,} parameters), density {args.density}, "
              f"tf.function tape step, {rows[next(iter(rows))]['steps']} steps each (job {res['job_seconds']:.0f} s, "
              f"loadavg {res['loadavg_before'][0]:.1f} -> {res['loadavg_after'][0]:.1f})")
        print(f"{'compression':<15} {'step ms':>8} {'vs none':>8} {'per-round ratio: median [q1, q3]':>33} "
              f"{'sent B':>10} {'dense/sent':>10} {'control B':>9} {'PyTorch sent B':>14}")
        for c, t in rows.items():
            ratio = t["dense_bytes"] / t["bytes_sent"] if t["bytes_sent"] else float("nan")
            rel = t["median_step_s"] / base if base else float("nan")
            spread = (f"{t['ratio_median']:.2f}x [{t['ratio_q1']:.2f}, {t['ratio_q3']:.2f}]"
                      if "ratio_median" in t else "-")
            torch_b = f"{tb[c]:,}" if c in tb else "-"
            print(f"{c:<15} {1e3 * t['median_step_s']:8.1f} {rel:7.2f}x {spread:>33} {t['bytes_sent']:>10,} "
                  f"{ratio:>9.1f}x {t['control_bytes']:>9} {torch_b:>14}")
    write_json(args.json, "horovod_tf", {k: v for k, v in vars(args).items() if k not in ("worker", "out")},
               results, packages=("horovod", "tensorflow"))
    png = plot(results, os.path.splitext(args.json)[0] + ".png")
    print(f"\nwrote {args.json}" + (f" and {png}" if png else ""))


if __name__ == "__main__":
    main()
