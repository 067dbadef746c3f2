"""Worker-side measurements, run on every rank by :mod:`gtopk_plugin.bench.bench_launch`.

* :func:`linktest`: raw TCP throughput, every worker sending to its right
  neighbour while receiving from its left (the ring pattern), on the
  worker's own interface: what the shaped link carries without any engine.
* :func:`comm_grid`: measurement 1, communication only.  Each rank selects
  its top-k once per (N, density) with the library's kernels, then times the
  library's aggregation (dense ring allreduce, sparse allgather, gTop-k
  butterfly) on the engine's transport, after a barrier, step by step.
  Horovod runs as two engines: ``horovod`` (the exchange on the transport's
  gloo side channel, the optimizer's default) and ``horovod-ops`` (every
  exchange step a Horovod collective); ``ops_per_step`` is what the
  transport issued per step.
  Selection is left out of the timed region on purpose (on 2 cores shared by
  8 workers it would measure CPU contention, not the network); the bytes are
  the real messages of a real top-k selection.
* :func:`replay`: measurement 2, one training iteration per step: emulated
  compute (sleep, the paper's seconds), selection (``paper``: sleep the
  paper's seconds; ``measured``: the full GradientReducer call with our
  kernels; ``none``: nothing), then the real exchange.

Every function returns JSON-able rows with per-step times of this rank; the
parent takes the maximum over ranks per step (a synchronous step lasts as
long as its slowest worker) and then the median over steps.
"""
from __future__ import annotations

import math
import resource
import socket
import threading
import time

import torch

from gtopk_plugin import collectives, kernels
from gtopk_plugin.collectives import Selection
from gtopk_plugin import registry
from gtopk_plugin.reducer import GradientReducer, k_for

from lab.cluster import codecs as codec_rows
from lab.cluster import shapes as model_shapes
from lab.cluster.cpu_account import busy_split, cpu_jiffies

DTYPES = {"fp32": torch.float32, "fp16": torch.float16}


def _layout(sizes):
    offsets = [0]
    for s in sizes:
        offsets.append(offsets[-1] + s)
    return torch.tensor(offsets, dtype=torch.int64)


def _k(sizes, density):
    return torch.tensor([k_for(density, s) for s in sizes], dtype=torch.int64)


def _aggregation(method: str) -> str:
    return registry.get(method).aggregation


def _selection(method, acc, offsets, k, dtype, cache):
    """This rank's Selection for ``method`` (top-k computed once per density
    and cached: the same sets every step, so every step moves the same bytes)."""
    wire = DTYPES[dtype]
    if _aggregation(method) == "dense":
        return Selection(idx=None, vals=acc.to(wire), numel=acc.numel(), offsets=offsets, k=k,
                         idx_dtype=kernels.index_dtype(acc.numel()), sum_dtype=acc.dtype,
                         static_count=True)
    key = tuple(k.tolist())
    if key not in cache:
        cache.clear()  # one density at a time: keep memory flat
        cache[key] = kernels.select_topk(acc, offsets, k)
    idx, vals = cache[key]
    return Selection(idx=idx, vals=vals.to(wire), numel=acc.numel(), offsets=offsets, k=k,
                     idx_dtype=kernels.index_dtype(acc.numel()), sum_dtype=acc.dtype, static_count=True)


_WIRE_METHODS = ("exchange", "send", "recv", "phase", "allgather_blobs", "allreduce_sum_", "_ring_step")


class WireClock:
    """Time spent inside the transport's counted operations (on the wire,
    waiting for peers included), as opposed to the aggregation's own
    compute around them (the butterfly's merges, Top-k's dense sum).  Wraps
    the transport instance's methods; nested calls count once."""

    def __init__(self, transport):
        self.seconds = 0.0
        self._depth = 0
        for name in _WIRE_METHODS:
            if hasattr(transport, name):
                setattr(transport, name, self._wrap(getattr(transport, name)))

    def _wrap(self, fn):
        def timed(*a, **kw):
            self._depth += 1
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self._depth -= 1
                if self._depth == 0:
                    self.seconds += time.perf_counter() - t0
        return timed


def _clock(ctx):
    if getattr(ctx, "_wire_clock", None) is None:
        ctx._wire_clock = WireClock(ctx.transport)
    return ctx._wire_clock


def _timed_exchange(ctx, agg, sel):
    """(seconds, traffic delta, rounds, seconds on the wire) of one aggregation."""
    tr = ctx.transport
    clock = _clock(ctx)
    before, w0 = tr.counters.copy(), clock.seconds
    t0 = time.perf_counter()
    out = agg(sel, tr)
    dt = time.perf_counter() - t0
    return dt, tr.counters.copy().minus(before), out.rounds, clock.seconds - w0


def _scope(ctx, name: str) -> None:
    """Horovod transports: restart the op names at each step, as the
    optimizer does per bucket, so a step's ops carry the same names every
    step (Horovod's response cache recognises them)."""
    if hasattr(ctx.transport, "set_scope"):
        ctx.transport.set_scope(name)


def _ops(ctx):
    """Ops the transport issued so far (Horovod transports count them, on
    either engine), or None."""
    return getattr(ctx.transport, "collectives", None)


def comm_grid(ctx, p):
    """Measurement 1.  ``p``: numels, densities, dtypes, methods, steps
    (dict N -> steps), warmup, and optionally ``linktest`` (the parameters
    of :func:`linktest`, run first).  Tensors are laid out as
    gtopk_plugin/bench/bytes_per_step.py's model-like layers."""
    from gtopk_plugin.bench.bytes_per_step import layer_shapes

    link = linktest(ctx, p["linktest"]) if p.get("linktest") else None
    engine = p.get("engine", ctx.engine)
    rows = []
    codec_dt = [d for d in p["dtypes"] if d in codec_rows.CODEC_DTYPES]
    todo = [(N, dt, m, d) for N in p["numels"] for m in p["methods"]
            for dt in (codec_dt if codec_rows.is_codec(m) else p["dtypes"])
            for d in (p["densities"] if codec_rows.uses_density(m) else [None])]
    done = 0
    for N in p["numels"]:
        layers = layer_shapes(N)
        names = list(layers)
        sizes = [math.prod(s) for s in layers.values()]
        shapes = [codec_rows.matrix_shape(n) for n in sizes]  # what a low-rank codec sees
        offsets = _layout(sizes)
        g = torch.Generator().manual_seed(1000 + ctx.rank)
        acc = torch.randn(N, generator=g)
        cache = {}
        steps = int(p["steps"][str(N)])
        for d in sorted({d for (n, _, _, d) in todo if n == N}, key=lambda x: (x is not None, x or 0)):
            for dtype in p["dtypes"]:
                for method in p["methods"]:
                    if (N, dtype, method, d) not in todo:
                        continue
                    k = _k(sizes, d if d is not None else 1.0)
                    codec = None
                    if codec_rows.is_codec(method):
                        codec = codec_rows.CodecRow(method, p.get("hyper") or {}, acc, offsets,
                                                    shapes, names, ctx.rank)
                    else:
                        sel = _selection(method, acc, offsets, k, dtype, cache)
                    agg = collectives.get(_aggregation(method))
                    times, wire, ops = [], [], []
                    for s in range(p["warmup"] + steps):
                        if codec is not None:
                            sel = codec.selection(s)  # encoded outside the timed region
                        _scope(ctx, f"{N}.{dtype}.{method}.{d}")
                        ctx.barrier()
                        if s == p["warmup"]:
                            cpu0, j0 = time.process_time(), cpu_jiffies()
                        n0 = _ops(ctx)
                        dt, delta, rounds, w = _timed_exchange(ctx, agg, sel)
                        if s >= p["warmup"]:
                            times.append(dt)
                            wire.append(w)
                            ops.append(None if n0 is None else _ops(ctx) - n0)
                    busy, softirq = busy_split(j0, cpu_jiffies())
                    proc_cpu = (time.process_time() - cpu0) / steps
                    rows.append(dict(engine=engine, P=ctx.size, numel=N, dtype=dtype, method=method,
                                     density=d, k=int(k.sum()) if d is not None else None,
                                     hyper=(p.get("hyper") or {}).get(method) if codec else None,
                                     times=times, wire_times=wire, ops_per_step=ops[-1] if ops else None,
                                     bytes_sent=delta.payload_bytes_sent + delta.header_bytes_sent,
                                     bytes_received=delta.payload_bytes_received + delta.header_bytes_received,
                                     messages=delta.messages_sent, rounds=rounds,
                                     proc_cpu_s=proc_cpu, machine_busy=busy, machine_softirq=softirq))
                    del sel, codec
                    done += 1
                    ctx.progress(done=done, total=len(todo), what=f"P={ctx.size} {engine} N={N:,} "
                                 f"{dtype} {method}" + (f" d={d:g}" if d else ""))
        del acc, cache
    return {"link": link, "rows": rows}


def replay(ctx, p):
    """Measurement 2.  ``p``: models, methods, density, selection
    (paper|measured|none), compute (model -> s), select_s (model -> s),
    steps (model -> n), warmup."""
    rows = []
    todo = len(p["models"]) * len(p["methods"])
    done = 0
    for model in p["models"]:
        sizes = model_shapes.sizes(model)
        names = [n for n, _ in model_shapes.shapes(model)]
        N = sum(sizes)
        offsets = _layout(sizes)
        g = torch.Generator().manual_seed(2000 + ctx.rank)
        acc = torch.randn(N, generator=g)
        cache = {}
        compute = float(p["compute"][model])
        steps = int(p["steps"][model])
        for method in p["methods"]:
            dense = _aggregation(method) == "dense"
            k = _k(sizes, 1.0 if dense else p["density"])
            select_s = 0.0 if dense or p["selection"] != "paper" else float(p["select_s"][model])
            red = grads = sel = None
            if p["selection"] == "measured":
                red = GradientReducer(method=method, density=p["density"], transport=ctx.transport)
                grads = dict(zip(names, torch.split(acc, sizes)))
            else:
                sel = _selection(method, acc, offsets, k, "fp32", cache)
                agg = collectives.get(_aggregation(method))
            its, comms, sels, wires = [], [], [], []
            for s in range(p["warmup"] + steps):
                _scope(ctx, f"{model}.{method}")
                ctx.barrier()
                t0 = time.perf_counter()
                time.sleep(compute)
                if red is not None:
                    w0 = _clock(ctx).seconds
                    red.reduce(grads)
                    sec = red.last_stats.seconds
                    comm, sel_t = sec.get("communicate", 0.0), sec.get("select", 0.0)
                    wire = _clock(ctx).seconds - w0
                else:
                    if select_s:
                        time.sleep(select_s)
                    comm, _, _, wire = _timed_exchange(ctx, agg, sel)
                    sel_t = select_s
                it = time.perf_counter() - t0
                if s >= p["warmup"]:
                    its.append(it)
                    comms.append(comm)
                    sels.append(sel_t)
                    wires.append(wire)
            rows.append(dict(engine=p.get("engine", ctx.engine), P=ctx.size, model=model, numel=N, method=method,
                             density=None if dense else p["density"], k=None if dense else int(k.sum()),
                             selection=p["selection"], compute_s=compute, iter_times=its, comm_times=comms,
                             select_times=sels, wire_times=wires,
                             maxrss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024))
            del red, grads, sel
            done += 1
            ctx.progress(done=done, total=todo, what=f"P={ctx.size} {model} {method}")
        del acc, cache
    return rows


def linktest(ctx, p):
    """Raw TCP over the worker's interface: every rank sends ``nbytes`` to
    its right neighbour while receiving as much from its left, ``reps``
    times.  Returns this rank's receive times and socket buffer sizes."""
    P, r = ctx.size, ctx.rank
    addrs, port = p["addrs"], int(p["port"]) + (r if p.get("port_per_rank") else 0)
    right = (r + 1) % P
    rport = int(p["port"]) + (right if p.get("port_per_rank") else 0)
    nbytes, reps = int(p["nbytes"]), int(p["reps"])
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((addrs[r], port))
    srv.listen(1)
    ctx.barrier()
    out = socket.create_connection((addrs[right], rport))
    inc, _ = srv.accept()
    buf = bytearray(1 << 20)
    view = memoryview(buf)
    times = []
    for _ in range(reps):
        ctx.barrier()

        def send():
            left = nbytes
            while left:
                n = out.send(view[:min(left, len(buf))])
                left -= n

        t = threading.Thread(target=send)
        t0 = time.perf_counter()
        t.start()
        got = 0
        while got < nbytes:
            n = inc.recv_into(view, min(len(buf), nbytes - got))
            if not n:
                raise RuntimeError("link test: peer closed the connection")
            got += n
        times.append(time.perf_counter() - t0)
        t.join()
    info = dict(rank=r, times=times, nbytes=nbytes,
                sndbuf=out.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF),
                rcvbuf=inc.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF))
    ctx.barrier()
    out.close()
    inc.close()
    srv.close()
    return info
