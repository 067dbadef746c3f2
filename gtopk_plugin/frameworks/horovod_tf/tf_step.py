"""One reduce step of the TensorFlow layer: the reducer's pipeline
(docs/design.md §2), tensor ops in TensorFlow, the exchange on the core.

check (one MAX-allreduce of ``[non-finite, fingerprint, -fingerprint,
step]``: NaN/Inf anywhere, a layout or settings mismatch, the agreed step)
-> DGC clipping and momentum correction -> ``acc = grad + residual`` ->
:func:`exchange` (the core's compressor and aggregation: the PyTorch side's
bits by construction) -> ``residual = acc`` less what reached the result as
it travelled, plus the wire roundings this rank owns -> update: the sum
(divided by P for ``hvd.Average``).  Tensors below ``dense_below`` entries
are summed exactly in the same step.  One traced graph serves every step.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from gtopk_plugin import collectives
from gtopk_plugin.collectives import Selection, wire
from gtopk_plugin.collectives.rounds import ROUNDS, codec_contribution
from gtopk_plugin.collectives.transport import SingleProcessTransport
from gtopk_plugin.compress.compressor import SelectionContext
from gtopk_plugin.config import DensityWarmup
from gtopk_plugin.kernels.reference import INT32_LIMIT, index_dtype
from gtopk_plugin.pipeline import input_check
from gtopk_plugin.pipeline.layout import global_segment_name, segment_ks
from gtopk_plugin.pipeline.traffic import STATS_FIELDS, TRANSPORT_FIELDS, StepTraffic
from gtopk_plugin.frameworks.horovod_tf._guard import hvd, tf
from gtopk_plugin.frameworks.horovod_tf.tf_bridge import carrier, numpy_call, to_numpy, to_torch
from gtopk_plugin.frameworks.horovod_tf.tf_kernels import clip_factor, momentum_step
from gtopk_plugin.frameworks.horovod_tf.tf_transport import transport_for

__all__ = ["reduce", "exchange"]

# exchange()'s counts: the transport's, then rounds and entries sent
COUNTS = TRANSPORT_FIELDS + ("rounds", "sent_entries")
_NT = len(TRANSPORT_FIELDS)
_TORCH = {tf.float16: torch.float16, tf.bfloat16: torch.bfloat16, tf.float32: torch.float32,
          tf.float64: torch.float64, tf.int8: torch.int8}


def _key(x) -> str:
    """A momentum or warm-up schedule as the same text on every rank."""
    if isinstance(x, (int, float)):
        return repr(float(x))
    if x is None or isinstance(x, (tuple, DensityWarmup)):
        return repr(x)
    if callable(x):
        return f"callable {getattr(x, '__module__', '')}.{getattr(x, '__qualname__', type(x).__name__)}"
    return "variable"


def _promote(dtypes):
    """The flat buffer's dtype, as torch.promote_types over the gradients."""
    ds = set(dtypes)
    return dtypes[0] if len(ds) == 1 else (tf.float64 if tf.float64 in ds else tf.float32)


def _inputs(grads, pre):
    """Positions and flat-ready tensors of the non-None gradients (checked)."""
    pos, tensors = [], []
    for i, g in enumerate(grads):
        if g is None:
            continue
        if isinstance(g, tf.IndexedSlices):
            g = tf.convert_to_tensor(g)
        if not g.dtype.is_floating:
            raise ValueError(f"gradient {i} has dtype {g.dtype.name}; sparse compression needs floats")
        if not g.shape.is_fully_defined():
            raise ValueError(f"gradient {i} has shape {g.shape}, not fully known; sparse compression "
                             "needs static shapes")
        if g.shape.num_elements() == 0:
            raise ValueError(f"gradient {i} is empty (shape {g.shape})")
        pos.append(i)
        tensors.append(g * tf.cast(pre, g.dtype) if pre != 1.0 else g)
    return pos, tensors


def _check(comp, ps, transport, layout, tensors):
    """``(agreed check vector, graph assertions)``; eagerly it raises."""
    fp = input_check.fingerprint(layout)
    finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(t)) for t in tensors])
    v = tf.stack([tf.cast(tf.logical_not(finite), tf.int64), tf.constant(fp, tf.int64),
                  tf.constant(-fp, tf.int64), comp.step.read_value()])
    if transport is not None:
        v = transport.tf_allreduce_max(v) if hasattr(transport, "tf_allreduce_max") else hvd.allreduce(
            v, op=hvd.Max, name=f"{comp.prefix}.check", ignore_name_scope=True, process_set=ps)
    mismatch = ("gtopk_plugin: ranks reduced different tensors or settings (shapes, dtypes, "
                "k or method must match)")
    nonfinite = ("gtopk_plugin: non-finite gradient (NaN or Inf) on some rank; nothing was applied "
                 "and residuals are unchanged (pass nonfinite='skip' to skip such steps)")
    raise_nonfinite = comp.config.nonfinite == "raise"
    if tf.executing_eagerly():
        if int(v[1]) != -int(v[2]):
            raise input_check.LayoutMismatchError(mismatch)
        if raise_nonfinite and int(v[0]):
            raise input_check.NonFiniteGradientError(nonfinite)
        return v, []
    checks = [tf.debugging.Assert(tf.equal(v[1], -v[2]), [mismatch])]
    if raise_nonfinite:
        checks.append(tf.debugging.Assert(tf.equal(v[0], 0), [nonfinite]))
    return v, checks


def reduce(comp, grads, process_set=None, op=None, gradient_predivide_factor: float = 1.0):
    """``SparseCompression.reduce`` (see there)."""
    ps = hvd.global_process_set if process_set is None else process_set
    op = hvd.Average if op is None else op
    if op not in (hvd.Average, hvd.Sum):
        raise ValueError("sparse compression supports op=hvd.Average and hvd.Sum")
    average = op == hvd.Average
    pre = 1.0 / gradient_predivide_factor if average else 1.0
    post = gradient_predivide_factor if average else 1.0
    cfg, cmp = comp.config, comp.compressor
    P, rank = ps.size(), ps.rank()
    if cfg.aggregation == ROUNDS and P > 1 and comp.exchange != "gloo":
        raise ValueError(f"{cfg.method}: a rounds codec (aggregation 'allreduce_rounds', e.g. powersgd) runs "
                         "on the TensorFlow layer's gloo side channel; build the compression with "
                         "exchange='gloo' (the default; elastic states set 'horovod', which rounds codecs "
                         "do not support)")
    transport = transport_for(comp, ps)  # the side channel is made at the first step (collective)

    pos, tensors = _inputs(grads, pre)
    if not tensors:
        return list(grads)
    all_names = [f"t{i:04d}" for i in pos]  # positional: stable across model instances
    all_sizes = [int(t.shape.num_elements()) for t in tensors]
    if sum(all_sizes) > INT32_LIMIT:
        raise ValueError(f"{sum(all_sizes)} gradient entries exceed int32 indices; reduce fewer variables per call")
    # dense_below: the small tensors go dense, the rest to the method
    small = [j for j, n in enumerate(all_sizes) if 0 < cfg.dense_below and n < cfg.dense_below]
    big = [j for j in range(len(tensors)) if j not in small]
    names, sizes = [all_names[j] for j in big], [all_sizes[j] for j in big]
    s_sizes = [all_sizes[j] for j in small]
    dtype = _promote([tensors[j].dtype for j in big]) if big else None
    s_dtype = _promote([tensors[j].dtype for j in small]) if small else None
    N, Ns = sum(sizes), sum(s_sizes)
    if cfg.granularity == "layer" or not big:
        offsets, seg_names = list(np.cumsum([0] + sizes).tolist()), names
    else:
        offsets, seg_names = [0, N], [global_segment_name(names)]  # the PyTorch side's key of the draws
    codec = getattr(cmp, "kind", "selector") == "codec"  # a codec encodes all: k = n (as the reducer)

    def k_sum(st) -> int:
        return sum(segment_ks(sizes, cfg.density_at(int(st)), cfg.granularity, full=codec))

    ks = segment_ks(sizes, cfg.density, cfg.granularity, full=codec)  # the target (after any warm-up)
    res_vars = [comp.state_var(comp.residuals, "residual", f"r{pos[j]:04d}", all_sizes[j], dtype) for j in big]
    dts = [s_dtype if j in small else dtype for j in range(len(tensors))]  # each part's flat dtype
    mspec = comp.momentum_spec()
    vel_vars = None if mspec is None else \
        [comp.state_var(comp.velocities, "velocity", f"u{i:04d}", n, dt) for i, n, dt in zip(pos, all_sizes, dts)]

    settings = (cfg.method, cfg.aggregation, cfg.granularity, str(comp.wire_dtype),
                "average" if average else "sum", tuple(ks), _key(cfg.warmup),
                None if mspec is None else (_key(mspec[0]), bool(mspec[1]), float(mspec[2]), cfg.momentum_masking),
                cfg.clip_norm)
    if cfg.dense_below:
        settings += (("dense_below", cfg.dense_below),)
    if cfg.wire_rounding != "nearest":
        settings += (("wire_rounding", cfg.wire_rounding),)
    layout = input_check.describe_layout(
        [(n, tuple(t.shape.as_list()), t.dtype.name) for n, t in zip(all_names, tensors)], settings)
    if getattr(cmp, "hyper", None):  # the method's own hyper-parameters, as the reducer adds them
        layout.append(("hyper",) + tuple(sorted(cmp.hyper.items())))
    v, checks = _check(comp, ps, transport, layout, tensors)
    step = v[3]
    # P + a run-time zero: Grappler would turn a division by a constant into
    # a multiplication by its reciprocal (other bits for P = 3)
    zero = 0 if P == 1 else tf.cast(tf.minimum(v[3], 0), tf.int32)
    with tf.control_dependencies(checks):
        skip = v[0] > 0
        flat = [tf.reshape(tf.cast(t, dt), [-1]) for t, dt in zip(tensors, dts)]
        if cfg.clip_norm is not None:  # DGC local clipping over every tensor (small part first, as torch)
            factor = clip_factor([flat[j] for j in small + big], cfg.clip_norm, P)
            flat = [g * tf.cast(factor, g.dtype) for g in flat]
        old_u = new_u = None
        if mspec is not None:  # DGC momentum correction: the increments enter the residual
            old_u = [u.read_value() for u in vel_vars]
            flat, new_u = momentum_step(flat, old_u, *mspec)
        acc = tf.concat([flat[j] + r.read_value() if cfg.error_feedback else flat[j]
                         for j, r in zip(big, res_vars)], 0) if big else None
        acc_s = tf.concat([flat[j] for j in small], 0) if small else None
    control = tf.constant([32 if (P > 1 and f == "control_bytes") else 0 for f in TRANSPORT_FIELDS], tf.int64)
    zero64, no_idx = tf.constant(0, tf.int64), tf.zeros([0], tf.int32)

    def run():
        out = exchange(comp, transport, acc, acc_s, sizes=sizes, offsets=offsets, names=seg_names,
                       shapes=[tuple(tensors[j].shape.as_list()) for j in big] if cfg.granularity == "layer" else None,
                       step=step, rank=rank, P=P)
        counts = dict(zip(COUNTS, tf.unstack(out["counts"])))
        traffic = control + out["counts"][:_NT]
        if big:
            result = out["result"]
            update = result / tf.cast(P + zero, dtype) if average else result
            if codec:  # acc less this worker's contribution as it decodes; no masking
                residual, reached = acc - out["sent"], no_idx
            else:
                reached, sent = tf.boolean_mask(out["idx"], out["reached"]), tf.boolean_mask(out["sent"], out["reached"])
                residual = tf.tensor_scatter_nd_update(acc, reached[:, None], tf.gather(acc, reached) - sent)
                residual = tf.tensor_scatter_nd_add(residual, out["fix_i"][:, None], out["fix_v"])
        else:
            update = residual = tf.zeros([0], s_dtype)
            reached = no_idx
        res = (update, residual, traffic, reached, counts["sent_entries"], counts["rounds"])
        if small:
            s = out["small"]
            res += (s / tf.cast(P + zero, s_dtype) if average else s,)
        return res

    def skipped():
        out = (tf.zeros([N], dtype or s_dtype), acc if big else tf.zeros([0], s_dtype), control, no_idx,
               zero64, zero64)
        return out + ((tf.zeros([Ns], s_dtype),) if small else ())

    if tf.executing_eagerly():
        res = skipped() if bool(skip) else run()
    elif cfg.nonfinite == "skip":
        res = tf.cond(skip, skipped, run)
    else:
        res = run()
    update, residual, traffic, reached, sent, rounds = res[:6]
    if cfg.warmup is None or not big:
        k = sum(ks)
    elif tf.executing_eagerly():
        k = k_sum(step)
    else:
        k = tf.numpy_function(lambda st: np.int64(k_sum(st)), [step], tf.int64, stateful=False)
    stats = {"dense_bytes": sum(StepTraffic.ring_allreduce(P, 0, n * dt.size).dense_bytes
                                for n, dt in ((N, dtype), (Ns, s_dtype)) if dt is not None),
             "numel": N + Ns, "k": k + Ns, "sent_entries": sent, "rounds": rounds}
    comp._traffic.assign(tf.concat([traffic, tf.stack([tf.cast(stats[f], tf.int64) for f in STATS_FIELDS]),
                                    tf.reshape(tf.cast(skip, tf.int64), [1])], 0))
    if cfg.error_feedback and big:
        if cfg.nonfinite == "skip":  # a skipped step keeps the old residual
            residual = tf.where(skip, tf.concat([r.read_value() for r in res_vars], 0), residual)
        for r, part in zip(res_vars, tf.split(residual, sizes)):
            r.assign(part)
    if mspec is not None:
        _commit_velocities(cfg, vel_vars, old_u, new_u, big, small, sizes, reached, skip)
    comp.step.assign(step + 1)
    out = list(grads)
    parts = [(big, tf.split(update, sizes) if big else [])] + ([(small, tf.split(res[6], s_sizes))] if small else [])
    for js, ups in parts:
        for j, u in zip(js, ups):
            u = tf.cast(tf.reshape(u, tensors[j].shape), tensors[j].dtype)
            out[pos[j]] = u * tf.cast(post, u.dtype) if post != 1.0 else u
    return out


def _commit_velocities(cfg, vel_vars, old_u, new_u, big, small, sizes, reached, skip):
    """DGC velocities after the step: the method's part restarts where its
    accumulator reached the result (momentum factor masking); the small
    tensors' are plain momentum buffers; a skipped step keeps the old ones."""
    keep_old = cfg.nonfinite == "skip"
    if big:
        u = tf.concat([new_u[j] for j in big], 0)
        if cfg.momentum_masking:
            u = tf.tensor_scatter_nd_update(u, reached[:, None], tf.zeros(tf.shape(reached), u.dtype))
        if keep_old:
            u = tf.where(skip, tf.concat([old_u[j] for j in big], 0), u)
        for j, part in zip(big, tf.split(u, sizes)):
            vel_vars[j].assign(part)
    for j in small:
        vel_vars[j].assign(tf.where(skip, old_u[j], new_u[j]) if keep_old else new_u[j])


def exchange(comp, transport, acc, acc_s, *, sizes: Sequence[int], offsets: Sequence[int], names, shapes,
             step, rank: int, P: int):
    """One stateful numpy function: select (or encode) from the flat ``acc``
    (None: all tensors small) and aggregate over ``transport`` -- at a
    codec's dense warm-up step, sum ``acc`` -- then sum ``acc_s`` exactly.
    Returns tensors ``idx``/``sent`` (this rank's selection, as sent; a codec:
    its dense contribution), ``reached``, ``result`` (dense sum), ``fix_i``/
    ``fix_v`` (wire roundings this rank owns), ``small``, ``counts``."""
    cfg, cmp = comp.config, comp.compressor
    codec = getattr(cmp, "kind", "selector") == "codec"
    warm_start = 0 if cfg.aggregation == ROUNDS else int(getattr(cmp, "start_iter", 0) or 0)
    agg = collectives.get(cfg.aggregation)
    N = int(offsets[-1]) if acc is not None else 0
    offs_t = torch.tensor(list(offsets), dtype=torch.int64)
    bdt = acc.dtype if acc is not None else tf.float32
    sdt = acc_s.dtype if acc_s is not None else tf.float32
    wdt = _TORCH[comp.wire_dtype or bdt]
    int8 = wdt == wire.QUANTIZED
    ring = 0 if P == 1 else 2 * (P - 1)

    def method(x, st: int, t, counts):
        ks = segment_ks(sizes, cfg.density_at(st), cfg.granularity, full=codec)
        k_t = torch.tensor(ks, dtype=torch.int64)
        ctx = SelectionContext(step=st, segment_names=list(names), seed=cfg.seed, rank=rank,
                               kernels=cfg.kernels, shapes=shapes if cfg.aggregation == ROUNDS else None)
        none_i, none_v = torch.zeros(0, dtype=torch.int32), x[:0]
        if codec:
            counts["sent_entries"] += N
            if warm_start > 0 and cmp.dense_at(st):  # the dense method's step: residual zero
                total = x.clone()
                if P > 1:
                    t.allreduce_sum_(total)
                counts["rounds"] += ring
                return none_i, x, none_i.bool(), total, none_i, none_v
            if cfg.aggregation == ROUNDS:
                x = x.clone()  # the codec keeps views of acc; TF's buffer is read-only
            payload, mine = codec_contribution(cmp, x, offs_t, N, x.dtype, ctx)
            sel = Selection(idx=None, vals=mine, numel=N, offsets=offs_t, k=k_t, idx_dtype=index_dtype(N),
                            sum_dtype=x.dtype, static_count=True, kernels=cfg.kernels, payload=payload)
            res = agg(sel, t)
            counts["rounds"] += res.rounds
            return none_i, sel.vals.reshape(-1), none_i.bool(), res.vals.to(x.dtype), none_i, none_v
        idx, vals = cmp.select(x, offs_t, k_t, ctx)
        if idx is None:  # "every entry" (a dense selector)
            idx = torch.arange(N)
        # the int8 wire's stochastic rounding, keyed as the reducer keys it
        draws = None if cfg.wire_rounding == "nearest" else wire.Draws(cfg.seed, st, names[0])
        if hasattr(agg, "draws"):  # aggregations that re-round sums (int8 wire)
            agg.draws = draws
        wvals = wire.to_wire(vals, wdt) if draws is None else wire.quantize(vals, draws(f"rank{rank}", idx))[0]
        res = agg(Selection(idx=idx, vals=wvals, numel=N, offsets=offs_t, k=k_t, idx_dtype=index_dtype(N),
                            sum_dtype=x.dtype, static_count=bool(getattr(cmp, "exact_count", False)),
                            kernels=cfg.kernels), t)
        counts["rounds"] += res.rounds
        counts["sent_entries"] += idx.numel()
        result = res.vals.to(x.dtype)
        if res.idx is not None:  # a sparse result: dense here (zeros elsewhere)
            result = torch.zeros(N, dtype=x.dtype).index_put_((res.idx.long(),), result)
        reached = torch.ones(idx.numel(), dtype=torch.bool) if res.reached is None else res.reached
        fix_i, fix_v = res.residual_add if res.residual_add is not None else (none_i, none_v)
        sent = wire.values(wvals, x.dtype) if int8 else wvals.to(x.dtype)  # int8: decoded (exact)
        return idx.to(torch.int32), sent, reached, result, fix_i.to(torch.int32), fix_v.to(x.dtype)

    def run(a, a_s, st):
        t = transport if transport is not None else SingleProcessTransport()
        if hasattr(t, "begin"):
            t.begin()
        before = t.counters.copy()
        counts = {"rounds": 0, "sent_entries": 0}
        x = to_torch(a, bdt == tf.bfloat16)
        outs = method(x, int(st), t, counts) if acc is not None else \
            (torch.zeros(0, dtype=torch.int32), x, torch.zeros(0, dtype=torch.bool), x, torch.zeros(0, dtype=torch.int32), x)
        small = to_torch(a_s, sdt == tf.bfloat16).clone()
        if acc_s is not None:  # the exact sum, after the method's exchange (the PyTorch side's order)
            if P > 1:
                t.allreduce_sum_(small)
            counts["sent_entries"] += small.numel()
            counts["rounds"] += ring
        delta = t.counters.copy().minus(before)
        return tuple(to_numpy(o) for o in outs) + (to_numpy(small), np.asarray(
            [getattr(delta, f) for f in TRANSPORT_FIELDS] + [counts["rounds"], counts["sent_entries"]],
            np.int64))

    empty = tf.zeros([0])
    a = carrier(acc) if acc is not None else empty
    a_s = carrier(acc_s) if acc_s is not None else empty
    outs = numpy_call(comp.codec_state(), run, [a, a_s, tf.cast(step, tf.int64)],
                      [tf.int32, a.dtype, tf.bool, a.dtype, tf.int32, a.dtype, a_s.dtype, tf.int64])
    keys = ("idx", "sent", "reached", "result", "fix_i", "fix_v", "small", "counts")
    out = {k: tf.ensure_shape(v, [None]) for k, v in zip(keys, outs)}
    for k, dt in (("sent", bdt), ("result", bdt), ("fix_v", bdt), ("small", sdt)):
        if dt == tf.bfloat16:
            out[k] = tf.bitcast(out[k], tf.bfloat16)
    out["counts"] = tf.ensure_shape(out["counts"], [len(COUNTS)])
    if acc is not None:
        out["result"] = tf.ensure_shape(out["result"], [N])
    return out
