"""Elastic consistency scheduler on the emulated cluster: step time and
accuracy after a fixed budget of steps, barrier vs norm-bounded (β = 0.3,
0.5, 0.8) vs variance-bounded, with the dense and the gTop-k reducer.

    python -m lab.elastic                       # the published settings (P = 2)
    python -m lab.elastic --quick               # P = 2, tiny model, a few steps (smoke test)
    python -m lab.elastic --workers 2 4 --seeds 3 --steps 300 --rate 100mbit

What runs.  P workers (``gtopk_plugin.bench.bench_launch``, one process and one thread
each) in the network namespaces of ``lab/cluster`` (a bridge, every
link capped by ``tc tbf`` at ``--rate`` in both directions), each training
the same small ResNet-style CNN (:class:`SmallResNet`) on its shard of the
procedurally generated "glyphs" images (``lab/convergence/glyphs.py``,
nothing downloaded) through :class:`gtopk_plugin.elastic.ElasticScheduler`.
Every configuration (reducer × policy) of a seed starts from the same
initial weights and sees the same batches, so accuracies are paired.

Side by side.  All configurations of a seed live in one job.  Training runs
in blocks of ``--block`` steps; each block visits every configuration once,
in an order rotated from block to block, so slow drifts of the machine (other
work, thermal) fall on every configuration alike.  At the end of a block the
configuration is drained (``finish()``, not timed) and the first
``--skip`` steps of every block (which start with nothing in flight) are
left out of the step-time statistics.  A step's time is the maximum over
ranks of the wall time of one loop iteration (``zero_grad``, forward,
backward, ``step()``); the table shows the median over steps (and the mean,
which includes the occasional hard-bound stall).

Latency.  The settings ask for 5 ms ± 0.2 ms per link (``tc netem delay 5ms
0.2ms``).  When the kernel has netem, the namespaces get exactly that
(``--latency-mode netem``).  When it does not (``CONFIG_NET_SCH_NETEM``
unset, as on the machine these results come from), the latency is injected
by the benchmark in the communication layer (``--latency-mode transport``,
:class:`DelayedTransport`): every point-to-point round of a collective
(``_raw_sendrecv``, ``_raw_recv``) waits one one-way latency drawn from
N(5 ms, 0.2 ms), and an allreduce waits 2·(P−1) of them (the rounds of a
ring).  The bandwidth cap stays the kernel's (tbf).  The injected waits are
measured and reported (``meta.latency``).

Back end.  In both modes both reducers run through the same Transport on
the scheduler's background thread, one layer after the other, first in
first out (dense: ``TransportDenseReduction``; gTop-k: ``ThreadedReduction``),
so the two modes measure the same code; torch's native asynchronous
allreduce (the scheduler's default dense back end) is not what is timed.

Results: ``lab/results/elastic.json`` (every step time, accuracies,
the scheduler's statistics), ``elastic.md`` (the table) and ``elastic.png``.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import math
import os
import platform
import random
import statistics
import sys
import time
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from gtopk_plugin.collectives.transport import Transport

from gtopk_plugin.bench.bench_record import write_json

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
DEFAULT_POLICIES = "barrier,norm:0.3,norm:0.5,norm:0.8,variance"


# ---------------------------------------------------------------------------
# the model
# ---------------------------------------------------------------------------
class BasicBlock(nn.Module):
    """ResNet basic block (two 3x3 convolutions, batch norm, identity
    shortcut).  Downsampling blocks use the parameter-free shortcut of the
    ResNet paper's CIFAR networks (option A: stride-2 subsampling, zero
    padding of the new channels), so every trained layer is a convolution."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout, affine=False)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout, affine=False)
        self.stride, self.pad = stride, cout - cin

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        h = self.bn2(self.conv2(h))
        s = x[:, :, ::self.stride, ::self.stride] if self.stride > 1 else x
        if self.pad:
            s = F.pad(s, (0, 0, 0, 0, 0, self.pad))
        return F.relu(h + s)


class SmallResNet(nn.Module):
    """Stem convolution, ``len(widths)`` basic blocks (the first at the stem's
    width, each later one doubling the channels at half the resolution),
    global average pooling and a linear classifier, for 1 x 16 x 16 inputs.
    Batch norm without affine parameters: every trained layer (the unit the
    elastic scheduler reduces and applies) is one convolution or the
    classifier."""

    def __init__(self, width: int = 16, blocks: int = 3, classes: int = 10):
        super().__init__()
        self.stem = nn.Conv2d(1, width, 3, 1, 1, bias=False)
        self.bn = nn.BatchNorm2d(width, affine=False)
        layers, c = [], width
        for i in range(blocks):
            cout = c if i == 0 else 2 * c
            layers.append(BasicBlock(c, cout, 1 if i == 0 else 2))
            c = cout
        self.blocks = nn.Sequential(*layers)
        self.fc = nn.Linear(c, classes)

    def forward(self, x):
        x = F.relu(self.bn(self.stem(x)))
        x = self.blocks(x)
        return self.fc(x.mean((2, 3)))


def model_info(width: int, blocks: int) -> dict:
    m = SmallResNet(width, blocks)
    layers = [n for n, mod in m.named_modules() if any(True for _ in mod.parameters(recurse=False))]
    return {"name": f"SmallResNet(width={width}, blocks={blocks})",
            "parameters": sum(p.numel() for p in m.parameters()), "layers": len(layers),
            "layer_names": layers,
            "layer_numel": [sum(p.numel() for p in mod.parameters(recurse=False))
                            for n, mod in m.named_modules() if n in layers]}


# ---------------------------------------------------------------------------
# latency in the communication layer (when the kernel has no netem)
# ---------------------------------------------------------------------------
class DelayedTransport(Transport):
    """A Transport that forwards to ``inner`` and adds a one-way link latency
    (normal, ``latency_s`` ± ``jitter_s``, at least 0) to every round: one per
    pairwise send/receive or receive, 2·(P−1) per allreduce (a ring's
    rounds).  Sends return at once, as a socket send does.  The latency is
    slept after the round's bytes have crossed the (shaped) link: an upper
    bound of a real link's latency when the peer is late anyway.

    Not a subclass of TorchDistributedTransport on purpose: the elastic
    scheduler then runs its dense reduction through this Transport (on its
    background thread) instead of torch's native asynchronous allreduce,
    which the latency could not reach."""

    def __init__(self, inner: Transport, latency_s: float, jitter_s: float, seed: int):
        super().__init__()
        self.inner = inner
        # the check's max over ranks takes the inner engine's algorithm, and
        # so its number of latencies
        self.max_by_dissemination = getattr(inner, "max_by_dissemination", False)
        self.latency_s, self.jitter_s = float(latency_s), float(jitter_s)
        self.timeout = getattr(inner, "timeout", 300.0)
        self._rng = random.Random(seed)
        self.slept_s = 0.0
        self.waits = 0
        self.wanted_s = 0.0
        # seconds inside the inner Transport's primitives (the transfers and
        # the wait for peers), apart from the injected latency
        self.inner_s = 0.0

    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def size(self) -> int:
        return self.inner.size

    def _lag(self, rounds: int = 1) -> None:
        if self.latency_s <= 0 and self.jitter_s <= 0:
            return
        want = sum(max(0.0, self._rng.gauss(self.latency_s, self.jitter_s)) for _ in range(rounds))
        t0 = time.perf_counter()
        time.sleep(want)
        self.slept_s += time.perf_counter() - t0
        self.wanted_s += want
        self.waits += rounds

    @contextlib.contextmanager
    def _in_inner(self):
        """Adds the time of the block (an inner primitive) to ``inner_s``."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.inner_s += time.perf_counter() - t0

    def _raw_sendrecv(self, dst, send, src, recv):
        with self._in_inner():
            self.inner._raw_sendrecv(dst, send, src, recv)
        self._lag()

    def _raw_send(self, peer, send):
        with self._in_inner():
            self.inner._raw_send(peer, send)

    def _raw_recv(self, peer, recv):
        with self._in_inner():
            self.inner._raw_recv(peer, recv)
        self._lag()

    def _raw_allreduce_sum_(self, t):
        with self._in_inner():
            self.inner._raw_allreduce_sum_(t)
        self._lag(2 * (self.size - 1))

    def _raw_allreduce_max_(self, t):
        with self._in_inner():
            self.inner._raw_allreduce_max_(t)
        self._lag(2 * (self.size - 1))

    def _raw_allgather_object(self, obj):
        with self._in_inner():
            out = self.inner._raw_allgather_object(obj)
        self._lag(2 * (self.size - 1))
        return out

    def comm_device(self, device):
        return self.inner.comm_device(device)


# ---------------------------------------------------------------------------
# worker side (every rank, one process each; gtopk_plugin.bench.bench_launch)
# ---------------------------------------------------------------------------
def parse_policies(spec: str) -> List[dict]:
    """"barrier,norm:0.5,variance:2" -> [{policy, beta, variance_factor, name}]."""
    out = []
    for part in spec.replace(" ", "").split(","):
        if not part:
            continue
        name, _, val = part.partition(":")
        if name == "barrier":
            out.append({"policy": "barrier", "beta": None, "variance_factor": None, "name": "barrier"})
        elif name == "norm":
            b = float(val or 0.5)
            if not 0 <= b <= 1:
                raise ValueError(f"norm β must be in [0, 1]; got {b}")
            out.append({"policy": "norm", "beta": b, "variance_factor": None, "name": f"norm β={b:g}"})
        elif name == "variance":
            f = float(val or 1.0)
            out.append({"policy": "variance", "beta": None, "variance_factor": f,
                        "name": "variance" if val == "" else f"variance ×{f:g}"})
        else:
            raise ValueError(f"unknown policy {name!r} (barrier, norm[:β], variance[:factor])")
    return out


def _batches(seed: int, step: int, n_train: int, global_batch: int) -> torch.Tensor:
    per_epoch = n_train // global_batch
    epoch, i = divmod(step, per_epoch)
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n_train, generator=g)[i * global_batch:(i + 1) * global_batch]


def _checksum(model: nn.Module) -> float:
    with torch.no_grad():
        return float(sum(p.double().sum().item() + (p.double() ** 2).sum().item() for p in model.parameters()))


def _stats_summary(st: dict) -> dict:
    keep = ("steps", "updates_applied", "barrier_breaks", "late_updates", "staleness", "seconds_waiting",
            "seconds_saved", "mean_applied_fraction_at_break")
    out = {k: st.get(k) for k in keep}
    out["staleness"] = {str(k): v for k, v in (st.get("staleness") or {}).items()}
    br = st.get("breaks") or []
    out["mean_missing_layers_at_break"] = (sum(b["missing"] for b in br) / len(br)) if br else None
    return out


class _Run:
    """One configuration (reducer × policy) of one seed on this rank."""

    def __init__(self, cfg, seed, transport, p):
        import gtopk_plugin as gp
        from gtopk_plugin.elastic import ElasticScheduler

        torch.manual_seed(seed)  # same initial weights in every configuration and on every rank
        self.cfg = cfg
        self.model = SmallResNet(p["width"], p["blocks"])
        self.opt = torch.optim.SGD(self.model.parameters(), lr=p["lr"], momentum=0.9,
                                   weight_decay=p["weight_decay"])
        steps = p["steps"]
        # Cosine decay to 0 over the budget: the final accuracy then depends
        # little on the seed (sd ~0.3 pp for dense S-SGD here, against ~5 pp
        # at a constant rate), so a 0.5 pp difference can be seen.
        self.lr_sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
        kw = dict(policy=cfg["policy"], max_staleness=p["max_staleness"])
        if cfg["beta"] is not None:
            kw["beta"] = cfg["beta"]
        if cfg["variance_factor"] is not None:
            kw["variance_factor"] = cfg["variance_factor"]
        if cfg["reducer"] == "dense":
            self.sched = ElasticScheduler(self.model, self.opt, transport=transport, **kw)
        else:
            red = gp.GradientReducer(cfg["reducer"], p["density"], transport=transport,
                                     kernels=p.get("kernels"))
            self.sched = ElasticScheduler(self.model, self.opt, reducer=red, **kw)
        self.times: List[float] = []
        self.timed: List[bool] = []
        self.losses: List[float] = []
        self.block_seconds = 0.0
        self.drain_waiting = 0.0  # seconds_waiting spent in the untimed finish() at block ends


def _evaluate(model, x, y) -> Dict[str, float]:
    model.eval()
    with torch.no_grad():
        logits = torch.cat([model(x[i:i + 1000]) for i in range(0, len(y), 1000)])
    model.train()
    return {"accuracy": (logits.argmax(1) == y).float().mean().item(), "loss": F.cross_entropy(logits, y).item()}


def worker(ctx, p) -> dict:
    """All configurations of every seed on this rank; returns per-step times,
    losses, final accuracy and the scheduler's statistics per run."""
    import torch.distributed as dist

    from lab.convergence import glyphs
    from gtopk_plugin.collectives.torch_distributed import TorchDistributedTransport

    torch.set_num_threads(1)
    P, rank = ctx.size, ctx.rank
    data = glyphs.load(p["n_train"], p["n_test"], seed=p["data_seed"])
    x, y = data["x_train"], data["y_train"]
    gb = p["batch"] * P
    configs = [dict(c, reducer=r) for r in p["reducers"] for c in p["policies"]]
    # One dedicated process group (and Transport) per configuration, reused
    # over seeds: no configuration ever shares a link schedule with another.
    transports = []
    for i, _ in enumerate(configs):
        group = dist.new_group(list(range(P)))
        inner = TorchDistributedTransport(group, timeout=ctx.timeout)
        transports.append(DelayedTransport(inner, p["latency_s"], p["jitter_s"], seed=1000 * rank + i))
    out_runs = []
    nblocks = math.ceil(p["steps"] / p["block"])
    for seed in p["seeds"]:
        runs = [_Run(cfg, seed, transports[i], p) for i, cfg in enumerate(configs)]
        for b in range(nblocks):
            lo, hi = b * p["block"], min(p["steps"], (b + 1) * p["block"])
            k = b % len(runs)
            for i in list(range(k, len(runs))) + list(range(k)):
                run = runs[i]
                ctx.barrier()
                t_block = time.perf_counter()
                for s in range(lo, hi):
                    t0 = time.perf_counter()
                    idx = torch.tensor_split(_batches(seed, s, len(y), gb), P)[rank]
                    run.sched.zero_grad()
                    loss = F.cross_entropy(run.model(x[idx]), y[idx])
                    loss.backward()
                    run.sched.step()
                    run.lr_sched.step()
                    run.times.append(time.perf_counter() - t0)
                    run.timed.append(s - lo >= p["skip"])
                    run.losses.append(loss.item())
                run.block_seconds += time.perf_counter() - t_block
                w0 = run.sched.stats.seconds_waiting
                run.sched.finish()
                run.drain_waiting += run.sched.stats.seconds_waiting - w0
                ctx.progress(what=f"seed {seed} block {b + 1}/{nblocks} {run.cfg['reducer']} {run.cfg['name']}")
        for run in runs:
            run.sched.finish()
            st = run.sched.stats.as_dict()
            st["seconds_waiting"] -= run.drain_waiting
            run.sched.close()
            ev = _evaluate(run.model, data["x_test"], data["y_test"]) if rank == 0 else None
            out_runs.append({"reducer": run.cfg["reducer"], "policy": run.cfg["policy"], "name": run.cfg["name"],
                             "beta": run.cfg["beta"], "variance_factor": run.cfg["variance_factor"],
                             "seed": seed, "times": run.times, "timed": run.timed, "losses": run.losses,
                             "block_seconds": run.block_seconds, "eval": ev, "checksum": _checksum(run.model),
                             "stats": _stats_summary(st)})
    lat = [{"waits": t.waits, "slept_s": t.slept_s, "wanted_s": t.wanted_s, "reducer": c["reducer"],
            "name": c["name"]} for t, c in zip(transports, configs)]
    return {"runs": out_runs, "latency": lat}


# ---------------------------------------------------------------------------
# parent side
# ---------------------------------------------------------------------------
def _median(xs):
    return statistics.median(xs) if xs else float("nan")


def merge(per_rank: list, P: int, label: str) -> List[dict]:
    """One row per (reducer, policy, seed): step times = max over ranks per
    step; accuracy from rank 0; parameters equal across ranks?"""
    rows = []
    for i, r0 in enumerate(per_rank[0]["runs"]):
        rr = [pr["runs"][i] for pr in per_rank]
        times = [max(t) for t in zip(*(r["times"] for r in rr))]
        timed = [t for t, ok in zip(times, r0["timed"]) if ok]
        rows.append({
            "P": P, "label": label, "reducer": r0["reducer"], "policy": r0["policy"], "name": r0["name"],
            "beta": r0["beta"], "variance_factor": r0["variance_factor"], "seed": r0["seed"],
            "step_times_s": times, "timed": r0["timed"],
            "step_time_median_s": _median(timed),
            "step_time_mean_s": sum(timed) / len(timed) if timed else float("nan"),
            "seconds_per_step_blocks": max(r["block_seconds"] for r in rr) / len(times),
            "accuracy": r0["eval"]["accuracy"], "test_loss": r0["eval"]["loss"],
            "final_train_loss": sum(r0["losses"][-20:]) / len(r0["losses"][-20:]),
            "losses": r0["losses"],
            "params_equal_across_ranks": len({r["checksum"] for r in rr}) == 1,
            "stats_rank0": r0["stats"],
            "seconds_waiting_per_step": [r["stats"]["seconds_waiting"] / max(1, r["stats"]["steps"]) for r in rr],
        })
    return rows


def summarise(rows: List[dict], beta_goal: float = 0.5) -> List[dict]:
    """Per (P, reducer, policy): median step time over every timed step of
    every seed, the ratio to the barrier's, mean accuracy over seeds and its
    paired difference to the barrier (same seed: same initial weights and
    batches)."""
    out = []
    keys = []
    for r in rows:
        k = (r["P"], r["reducer"], r["name"])
        if k not in keys:
            keys.append(k)
    for P, red, name in keys:
        rs = [r for r in rows if (r["P"], r["reducer"], r["name"]) == (P, red, name)]
        base = [r for r in rows if (r["P"], r["reducer"], r["policy"]) == (P, red, "barrier")]
        pooled = [t for r in rs for t, ok in zip(r["step_times_s"], r["timed"]) if ok]
        base_pooled = [t for r in base for t, ok in zip(r["step_times_s"], r["timed"]) if ok]
        med, bmed = _median(pooled), _median(base_pooled)
        mean = sum(pooled) / len(pooled)
        bmean = sum(base_pooled) / len(base_pooled) if base_pooled else float("nan")
        accs = [r["accuracy"] for r in rs]
        bacc = {r["seed"]: r["accuracy"] for r in base}
        deltas = [100 * (r["accuracy"] - bacc[r["seed"]]) for r in rs if r["seed"] in bacc]
        st = [r["stats_rank0"] for r in rs]
        steps = sum(s["steps"] for s in st) or 1
        stale = {}
        for s in st:
            for k_, v in s["staleness"].items():
                stale[k_] = stale.get(k_, 0) + v
        uses = sum(stale.values()) or 1
        fr = [s["mean_applied_fraction_at_break"] for s in st if s["mean_applied_fraction_at_break"] is not None]
        row = {"P": P, "reducer": red, "policy": rs[0]["policy"], "name": name, "beta": rs[0]["beta"],
               "variance_factor": rs[0]["variance_factor"], "label": rs[0]["label"], "seeds": len(rs),
               "timed_steps": len(pooled), "step_time_median_s": med, "step_time_mean_s": mean,
               "ratio_vs_barrier": med / bmed if bmed == bmed and bmed > 0 else None,
               "reduction_vs_barrier": 1 - med / bmed if bmed == bmed and bmed > 0 else None,
               "mean_ratio_vs_barrier": mean / bmean if bmean == bmean and bmean > 0 else None,
               "accuracy_mean": sum(accs) / len(accs),
               "accuracy_std": statistics.stdev(accs) if len(accs) > 1 else None,
               "accuracy_delta_pp_mean": sum(deltas) / len(deltas) if deltas else None,
               "accuracy_delta_pp_std": statistics.stdev(deltas) if len(deltas) > 1 else None,
               "breaks_per_step": sum(s["barrier_breaks"] for s in st) / steps,
               "stale_use_fraction": 1 - stale.get("0", 0) / uses,
               "mean_applied_fraction_at_break": sum(fr) / len(fr) if fr else None,
               "waiting_s_per_step": sum(s["seconds_waiting"] for s in st) / steps,
               "params_equal_across_ranks": all(r["params_equal_across_ranks"] for r in rs)}
        if row["policy"] == "norm" and row["beta"] == beta_goal and row["ratio_vs_barrier"] is not None:
            d = row["accuracy_delta_pp_mean"]
            row["goal"] = {"step_time_reduction_ge_25pct": row["reduction_vs_barrier"] >= 0.25,
                           "accuracy_within_0.5pp": d is not None and abs(d) <= 0.5 if d is not None else None}
        out.append(row)
    return out


def markdown(summary: List[dict], meta: dict) -> str:
    lines = ["| P | reducer | policy | median step (ms) | vs barrier | mean step (ms) | accuracy (%) | "
             "Δ acc vs barrier (pp) | breaks/step | stale uses | ‖applied‖/‖g‖ at break |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in summary:
        ratio = "1.00×" if r["policy"] == "barrier" else (
            f"{r['ratio_vs_barrier']:.2f}× ({-100 * r['reduction_vs_barrier']:+.0f}%)"
            if r["ratio_vs_barrier"] is not None else "–")
        acc = f"{100 * r['accuracy_mean']:.2f}" + (f" ± {100 * r['accuracy_std']:.2f}" if r["accuracy_std"] else "")
        if r["policy"] == "barrier" or r["accuracy_delta_pp_mean"] is None:
            dacc = "–"
        else:
            dacc = f"{r['accuracy_delta_pp_mean']:+.2f}" + (
                f" ± {r['accuracy_delta_pp_std']:.2f}" if r["accuracy_delta_pp_std"] is not None else "")
        frac = "–" if r["mean_applied_fraction_at_break"] is None else f"{r['mean_applied_fraction_at_break']:.2f}"
        lines.append(f"| {r['P']} | {r['reducer']} | {r['name']} | {1e3 * r['step_time_median_s']:.1f} | {ratio} | "
                     f"{1e3 * r['step_time_mean_s']:.1f} | {acc} | {dacc} | {r['breaks_per_step']:.2f} | "
                     f"{100 * r['stale_use_fraction']:.0f}% | {frac} |")
    return "\n".join(lines) + "\n"


def plot(res: dict, path: str) -> Optional[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install -e '.[bench]')")
        return None
    summary, rows = res["summary"], res["rows"]
    groups = []
    for r in summary:
        if (r["P"], r["reducer"]) not in groups:
            groups.append((r["P"], r["reducer"]))
    fig, axes = plt.subplots(len(groups), 3, figsize=(15, 3.6 * len(groups)), squeeze=False)
    for gi, (P, red) in enumerate(groups):
        sm = [r for r in summary if (r["P"], r["reducer"]) == (P, red)]
        names = [r["name"] for r in sm]
        ax = axes[gi][0]
        data = [[1e3 * t for rr in rows if (rr["P"], rr["reducer"], rr["name"]) == (P, red, n)
                 for t, ok in zip(rr["step_times_s"], rr["timed"]) if ok] for n in names]
        ax.boxplot(data, showfliers=False)
        ax.set_xticks(range(1, len(names) + 1), names, rotation=20, fontsize=8)
        for i, r in enumerate(sm):
            if r["policy"] != "barrier" and r["ratio_vs_barrier"] is not None:
                ax.annotate(f"{r['ratio_vs_barrier']:.2f}×", (i + 1, 1e3 * r["step_time_median_s"]),
                            textcoords="offset points", xytext=(14, 0), fontsize=8)
        ax.set_ylabel("step time (ms)")
        ax.set_title(f"P={P}, {red}: step time (median, quartiles)", fontsize=10)
        ax = axes[gi][1]
        means = [100 * r["accuracy_mean"] for r in sm]
        errs = [100 * (r["accuracy_std"] or 0) for r in sm]
        ax.bar(range(len(names)), means, yerr=errs, color=["0.5"] + ["C0"] * (len(names) - 1), capsize=3)
        lo = min(m - e for m, e in zip(means, errs))
        ax.set_ylim(max(0, lo - 5), min(100, max(m + e for m, e in zip(means, errs)) + 2))
        ax.set_xticks(range(len(names)), names, rotation=20, fontsize=8)
        ax.set_ylabel("test accuracy (%)")
        ax.set_title(f"P={P}, {red}: accuracy after {len(rows[0]['losses'])} steps "
                     f"(mean ± sd over seeds)", fontsize=10)
        ax = axes[gi][2]
        for n in names:
            rs = [rr for rr in rows if (rr["P"], rr["reducer"], rr["name"]) == (P, red, n)]
            L = min(len(rr["losses"]) for rr in rs)
            avg = [sum(rr["losses"][i] for rr in rs) / len(rs) for i in range(L)]
            w = max(1, L // 25)
            sm_ = [sum(avg[max(0, i - w + 1):i + 1]) / len(avg[max(0, i - w + 1):i + 1]) for i in range(L)]
            ax.plot(sm_, label=n, lw=1)
        ax.set_xlabel("step")
        ax.set_ylabel("training loss (rank 0, smoothed)")
        ax.legend(fontsize=7)
        ax.set_title(f"P={P}, {red}: training loss", fontsize=10)
    net = res["meta"]["network"]
    lat = res["meta"]["latency"]
    fig.suptitle(f"Elastic scheduler, {res['meta']['model']['name']}, {net.get('label')} "
                 f"rate={net.get('rate')}, latency {lat['mode']} {lat['latency_ms']:g}±{lat['jitter_ms']:g} ms",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _net_opts(args, netem: bool):
    return argparse.Namespace(rate=args.rate, burst=args.burst, tbf_latency=args.tbf_latency,
                              delay=f"{args.latency_ms:g}ms" if netem else "0ms",
                              jitter=f"{args.jitter_ms:g}ms" if netem and args.jitter_ms > 0 else "0ms",
                              no_netns=args.no_netns, sysctl=args.sysctl)


def run(args) -> dict:
    from lab.cluster import harness, netns

    policies = parse_policies(args.policies)
    reducers = [r for r in args.reducers.replace(",", " ").split() if r]
    workers = [w for ws in args.workers for w in ws]
    nblocks = math.ceil(args.steps / args.block)
    per_p = len(args.seeds_list) * nblocks * len(policies) * len(reducers)
    progress = harness.Progress(per_p * len(workers), "elastic", disable=args.quiet)
    mode = args.latency_mode
    ns_ok, ns_why = (False, "--no-netns given") if args.no_netns else netns.available()
    if mode == "auto":
        mode = "netem" if ns_ok and netns.netem_available()[0] else "transport"
    if mode == "netem" and not ns_ok:
        raise SystemExit(f"--latency-mode netem needs network namespaces: {ns_why}")
    if mode == "netem":
        ok, why = netns.netem_available()
        if not ok:
            raise SystemExit(f"--latency-mode netem: {why}; use --latency-mode transport")
    elif args.latency_ms > 0:
        why = netns.netem_available()[1] if ns_ok else ns_why
        progress.note(f"latency {args.latency_ms:g} ± {args.jitter_ms:g} ms injected in the transport "
                      f"(not netem: {why})")
    inject = mode == "transport"
    try:
        from gtopk_plugin import kernels
        kern = kernels.backend("cpu")
    except Exception as e:  # noqa: BLE001
        kern = f"unavailable ({e})"
    payload = dict(width=args.width, blocks=args.blocks, batch=args.batch, lr=args.lr,
                   weight_decay=args.weight_decay, density=args.density, max_staleness=args.max_staleness,
                   steps=args.steps, block=args.block, skip=args.skip, seeds=args.seeds_list,
                   n_train=args.n_train, n_test=args.n_test, data_seed=0,
                   reducers=reducers, policies=policies, kernels=args.kernels,
                   latency_s=args.latency_ms / 1e3 if inject else 0.0,
                   jitter_s=args.jitter_ms / 1e3 if inject else 0.0)
    import torch as _t
    res = {"meta": {"date": datetime.datetime.now().isoformat(timespec="seconds"), "argv": sys.argv,
                    "host": platform.node(), "cpus": os.cpu_count(), "torch": _t.__version__,
                    "python": platform.python_version(), "kernels": kern,
                    "model": model_info(args.width, args.blocks),
                    "settings": {k: v for k, v in payload.items() if k not in ("policies",)},
                    "policies": policies, "loadavg_start": harness.loadavg(), "network": None,
                    "latency": {"mode": mode, "latency_ms": args.latency_ms, "jitter_ms": args.jitter_ms}},
           "rows": [], "summary": [], "elapsed": []}
    t_all = time.time()
    with harness.signals_as_exceptions():
        for P in workers:
            net = harness.network(P, _net_opts(args, mode == "netem"))
            desc = net.describe()
            if not desc["shaped"]:
                progress.note(f"NOT SHAPED: {desc.get('why')}; results labelled 'unshaped'")
            res["meta"]["network"] = desc
            t0 = time.time()
            with net:
                per_rank = harness.run_job(net, P, worker, payload, "torch", progress, timeout=args.timeout,
                                           echo=args.echo)
            label = desc["label"]
            res["rows"] += merge(per_rank, P, label)
            lat = [l_ for pr in per_rank for l_ in pr["latency"]]
            waits = sum(l_["waits"] for l_ in lat)
            res["meta"]["latency"][f"P{P}_injected"] = {
                "rounds": waits,
                "mean_wanted_ms": 1e3 * sum(l_["wanted_s"] for l_ in lat) / waits if waits else 0.0,
                "mean_slept_ms": 1e3 * sum(l_["slept_s"] for l_ in lat) / waits if waits else 0.0}
            res["meta"]["latency"][f"P{P}_rounds_per_step"] = {
                f"{l_['reducer']} {l_['name']}": l_["waits"] / (args.steps * len(args.seeds_list))
                for l_ in per_rank[0]["latency"]}
            res["elapsed"].append({"P": P, "seconds": round(time.time() - t0, 1)})
    progress.close()
    res["meta"]["loadavg_end"] = harness.loadavg()
    res["meta"]["seconds"] = round(time.time() - t_all, 1)
    res["summary"] = summarise(res["rows"])
    return res


def _list(conv):
    def parse(s):
        return [conv(x) for x in s.replace(",", " ").split()]
    return parse


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m lab elastic", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: P=2, tiny model, 6 steps, one seed (overrides the sizes below)")
    g = ap.add_argument_group("what is compared")
    g.add_argument("--workers", "-P", type=_list(int), nargs="+", default=[[2]],
                   help="worker counts (default 2: one core per worker on this 2-core machine)")
    g.add_argument("--policies", default=DEFAULT_POLICIES,
                   help=f"barrier, norm:β, variance[:factor], comma-separated (default {DEFAULT_POLICIES})")
    g.add_argument("--reducers", default="dense,gtopk", help="dense and/or a GradientReducer method (default dense,gtopk)")
    g.add_argument("--density", type=float, default=0.01, help="density of the sparse reducers (default 0.01)")
    g.add_argument("--max-staleness", type=int, default=1)
    g.add_argument("--kernels", default=None, help="GradientReducer kernels (default: the library's choice)")
    g = ap.add_argument_group("training")
    g.add_argument("--steps", type=int, default=120, help="steps per run (the fixed budget; default 120)")
    g.add_argument("--seeds", type=int, default=3, help="seeds (default 3): paired over configurations")
    g.add_argument("--batch", type=int, default=64, help="batch per worker (default 64)")
    g.add_argument("--lr", type=float, default=0.1, help="peak SGD rate (momentum 0.9, cosine decay to 0)")
    g.add_argument("--weight-decay", type=float, default=5e-4)
    g.add_argument("--width", type=int, default=16, help="stem channels (default 16)")
    g.add_argument("--blocks", type=int, default=3, help="basic blocks (default 3)")
    g.add_argument("--n-train", type=int, default=6000)
    g.add_argument("--n-test", type=int, default=4000)
    g.add_argument("--block", type=int, default=20, help="steps per block of the side-by-side rotation")
    g.add_argument("--skip", type=int, default=2, help="untimed first steps of every block")
    g = ap.add_argument_group("network")
    g.add_argument("--rate", default="100mbit", help="per-link rate (tc tbf; default 100mbit; 'none': no cap)")
    g.add_argument("--burst", default="64kb")
    g.add_argument("--tbf-latency", default="50ms")
    g.add_argument("--latency-ms", type=float, default=5.0, help="one-way link latency (default 5)")
    g.add_argument("--jitter-ms", type=float, default=0.2, help="latency jitter, sd (default 0.2)")
    g.add_argument("--latency-mode", choices=["auto", "netem", "transport"], default="auto",
                   help="netem in the namespaces, or injected per round in the transport (auto: netem when "
                   "the kernel has it)")
    g.add_argument("--sysctl", action="append", default=[], metavar="KEY=VALUE")
    g.add_argument("--no-netns", action="store_true", help="plain loopback (results labelled unshaped)")
    g = ap.add_argument_group("output")
    g.add_argument("--json", default=os.path.join(RESULTS, "elastic.json"))
    g.add_argument("--no-plot", action="store_true")
    g.add_argument("--quiet", action="store_true", help="no progress bar")
    g.add_argument("--echo", action="store_true", help="show the workers' output")
    g.add_argument("--timeout", type=float, default=1800.0, help="seconds for the whole worker job")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.workers, args.steps, args.seeds, args.block, args.skip = [[2]], 6, 1, 3, 1
        args.width, args.blocks, args.batch, args.n_train, args.n_test = 4, 2, 16, 256, 128
    args.seeds_list = list(range(args.seeds))
    from gtopk_plugin.bench import bench_launch as launch
    from lab.cluster import netns
    try:
        res = run(args)
    except netns.NetnsError as e:
        print(f"python -m lab elastic: {e}", file=sys.stderr)
        return 2
    except launch.WorkerFailed as e:
        print(f"python -m lab elastic: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("python -m lab elastic: interrupted; namespaces and workers removed", file=sys.stderr)
        return 130
    write_json(args.json, "elastic", document=res, packages=("torch", "gtopk_plugin"))
    md = markdown(res["summary"], res["meta"])
    with open(os.path.splitext(args.json)[0] + ".md", "w") as f:
        f.write(md)
    print(md)
    png = None if args.no_plot else plot(res, os.path.splitext(args.json)[0] + ".png")
    print(f"wrote {args.json}, {os.path.splitext(args.json)[0]}.md" + (f" and {png}" if png else "")
          + f" in {res['meta']['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
