"""One reduce step of the TensorFlow layer (the reducer's pipeline,
docs/design.md §2): the check (one MAX-allreduce of ``[non-finite,
fingerprint, -fingerprint, step]``) in TensorFlow, then :func:`exchange`,
the core's torch code in one numpy call (clipping, momentum correction,
error feedback, compressor, aggregation: the PyTorch side's bits by
construction), then the update (the sum, divided by P for ``hvd.Average``).
One traced graph serves every step.
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
from gtopk_plugin.compress.momentum import MomentumCorrection, MomentumSpec
from gtopk_plugin.config import DensityWarmup
from gtopk_plugin.kernels.reference import INT32_LIMIT, index_dtype
from gtopk_plugin.pipeline import input_check
from gtopk_plugin.pipeline.layout import clip_scale, global_segment_name, segment_ks
from gtopk_plugin.pipeline.traffic import STATS_FIELDS, TRANSPORT_FIELDS, StepTraffic
from gtopk_plugin.frameworks.horovod_tf._guard import hvd, tf
from gtopk_plugin.frameworks.horovod_tf.tf_bridge import carrier, numpy_call, to_numpy, to_torch
from gtopk_plugin.frameworks.horovod_tf.tf_transport import transport_for

__all__ = ["reduce", "exchange"]

# exchange()'s counts: the transport's, then rounds and entries sent
COUNTS = TRANSPORT_FIELDS + ("rounds", "sent_entries")
_NT = len(TRANSPORT_FIELDS)


def _key(x) -> str:
    """A momentum or warm-up schedule as the same text on every rank."""
    if callable(x):
        return f"callable {getattr(x, '__module__', '')}.{getattr(x, '__qualname__', type(x).__name__)}"
    if isinstance(x, (int, float)):
        return repr(float(x))
    return repr(x) if x is None or isinstance(x, (tuple, DensityWarmup)) else "variable"


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

    ks = segment_ks(sizes, cfg.density, cfg.granularity, full=codec)  # the target (after any warm-up)
    res_vars = [comp.state_var(comp.residuals, "residual", f"r{pos[j]:04d}", all_sizes[j], dtype) for j in big]
    dts = [s_dtype if j in small else dtype for j in range(len(tensors))]  # each part's flat dtype
    mspec = comp.momentum_spec()
    vel_vars = None if mspec is None else \
        [comp.state_var(comp.velocities, "velocity", f"u{i:04d}", n, dt) for i, n, dt in zip(pos, all_sizes, dts)]

    settings = (cfg.method, cfg.aggregation, cfg.granularity, str(comp.wire_dtype),
                "average" if average else "sum", tuple(ks), _key(cfg.warmup),
                None if mspec is None else (_key(mspec[0]), bool(mspec[1]), float(mspec[2]), cfg.momentum_masking),
                cfg.clip_norm, cfg.dense_below, cfg.wire_rounding, cfg.hyper)  # hyper: the method's own
    layout = input_check.describe_layout(
        [(n, tuple(t.shape.as_list()), t.dtype.name) for n, t in zip(all_names, tensors)], settings)
    v, checks = _check(comp, ps, transport, layout, tensors)
    step = v[3]
    # P + a run-time zero: Grappler would turn a division by a constant into
    # a multiplication by its reciprocal (other bits for P = 3)
    zero = 0 if P == 1 else tf.cast(tf.minimum(v[3], 0), tf.int32)

    def cat(ts, dt):
        return tf.concat(ts, 0) if ts else tf.zeros([0], dt or tf.float32)

    with tf.control_dependencies(checks):
        skip = v[0] > 0
        flat = [tf.reshape(tf.cast(t, dt), [-1]) for t, dt in zip(tensors, dts)]
        g, g_s = cat([flat[j] for j in big], dtype), cat([flat[j] for j in small], s_dtype)
    old_r = cat([r.read_value() for r in res_vars] if cfg.error_feedback else [], g.dtype)
    old_u, old_us = (cat([vel_vars[j].read_value() for j in js] if mspec else [], d.dtype)
                     for js, d in ((big, g), (small, g_s)))
    m = tf.cast(mspec[0] if mspec else 0.0, tf.float64)
    control = tf.constant([32 if (P > 1 and f == "control_bytes") else 0 for f in TRANSPORT_FIELDS], tf.int64)
    zero64 = tf.constant(0, tf.int64)

    def run():
        result, residual, u, small_sum, us, counts = exchange(
            comp, transport, mspec, [g, old_r, old_u, g_s, old_us, tf.cast(step, tf.int64), m],
            sizes=sizes, s_sizes=s_sizes, offsets=offsets, names=seg_names,
            shapes=[tuple(tensors[j].shape.as_list()) for j in big] if cfg.granularity == "layer" else None,
            rank=rank, P=P)
        update = result / tf.cast(P + zero, dtype) if average and big else result
        if small and average:
            small_sum = small_sum / tf.cast(P + zero, s_dtype)
        return update, residual, u, small_sum, us, control + counts[:_NT], counts[-1], counts[-2]

    def skipped():
        return tf.zeros([N], g.dtype), old_r, old_u, tf.zeros([Ns], g_s.dtype), old_us, control, zero64, zero64

    if tf.executing_eagerly():
        res = skipped() if bool(skip) else run()
    elif cfg.nonfinite == "skip":
        res = tf.cond(skip, skipped, run)
    else:
        res = run()
    update, residual, new_u, small_sum, new_us, traffic, sent, rounds = res
    k = sum(ks) if cfg.warmup is None or not big else tf.numpy_function(  # k at this step's density
        lambda st: np.int64(sum(segment_ks(sizes, cfg.density_at(int(st)), cfg.granularity, full=codec))),
        [step], tf.int64, stateful=False)
    stats = {"dense_bytes": sum(StepTraffic.ring_allreduce(P, 0, n * dt.size).dense_bytes
                                for n, dt in ((N, dtype), (Ns, s_dtype)) if dt is not None),
             "numel": N + Ns, "k": k + Ns, "sent_entries": sent, "rounds": rounds}
    comp._traffic.var.assign(tf.concat([traffic, tf.stack([tf.cast(stats[f], tf.int64) for f in STATS_FIELDS]),
                                    tf.reshape(tf.cast(skip, tf.int64), [1])], 0))
    states = [(res_vars, residual, sizes)] if cfg.error_feedback else []
    if mspec is not None:
        states += [([vel_vars[j] for j in big], new_u, sizes), ([vel_vars[j] for j in small], new_us, s_sizes)]
    for variables, value, ns in states:
        for var, part in zip(variables, tf.split(value, ns) if variables else []):
            var.assign(part)
    comp.step.assign(step + 1)
    out = list(grads)
    for js, ups, ns in ((big, update, sizes), (small, small_sum, s_sizes)):
        for j, u in zip(js, tf.split(ups, ns) if js else []):
            u = tf.cast(tf.reshape(u, tensors[j].shape), tensors[j].dtype)
            out[pos[j]] = u * tf.cast(post, u.dtype) if post != 1.0 else u
    return out


def exchange(comp, transport, mspec, inputs, *, sizes: Sequence[int], s_sizes: Sequence[int],
             offsets: Sequence[int], names, shapes, rank: int, P: int):
    """One stateful numpy function running the reducer's steps from
    clipping on in the core's torch code.  ``inputs``: the flat method part,
    its residual and velocity (empty: none), the small part and its
    velocity, the step, the momentum (float64).  Returns the dense sum, the
    new residual and velocities, the small part's exact sum, the counts."""
    cfg, cmp = comp.config, comp.compressor
    codec = getattr(cmp, "kind", "selector") == "codec"
    warm_start = 0 if cfg.aggregation == ROUNDS else int(getattr(cmp, "start_iter", 0) or 0)
    agg = collectives.get(cfg.aggregation)
    N = int(sum(sizes))
    offs_t = torch.tensor(list(offsets), dtype=torch.int64)
    g, g_s = inputs[0], inputs[3]
    bdt, sdt = g.dtype, g_s.dtype
    bf, sbf = bdt == tf.bfloat16, sdt == tf.bfloat16
    int8 = cfg.value_dtype == wire.QUANTIZED
    ring = 0 if P == 1 else 2 * (P - 1)
    b_names, s_names = [f"b{i}" for i in range(len(sizes))], [f"s{i}" for i in range(len(s_sizes))]

    def method(acc, st: int, t, counts):
        """``(dense sum, new residual, indices that reached the result or None)``."""
        k_t = torch.tensor(segment_ks(sizes, cfg.density_at(st), cfg.granularity, full=codec), dtype=torch.int64)
        ctx = SelectionContext(step=st, segment_names=list(names), seed=cfg.seed, rank=rank,
                               kernels=cfg.kernels, shapes=shapes if cfg.aggregation == ROUNDS else None)
        if codec:
            counts["sent_entries"] += N
            if warm_start > 0 and cmp.dense_at(st):  # the dense method's step: residual zero
                total = acc.clone()
                if P > 1:
                    t.allreduce_sum_(total)
                counts["rounds"] += ring
                return total, torch.zeros_like(acc), None
            x = acc.clone() if cfg.aggregation == ROUNDS else acc  # the codec keeps views of its input
            payload, mine = codec_contribution(cmp, x, offs_t, N, x.dtype, ctx)
            sel = Selection(idx=None, vals=mine, numel=N, offsets=offs_t, k=k_t, idx_dtype=index_dtype(N),
                            sum_dtype=x.dtype, static_count=True, kernels=cfg.kernels, payload=payload)
            res = agg(sel, t)
            counts["rounds"] += res.rounds
            # acc less this worker's contribution as it decodes; no masking
            return res.vals.to(acc.dtype), acc - sel.vals.reshape(-1), None
        idx, vals = cmp.select(acc, offs_t, k_t, ctx)
        idx = torch.arange(N) if idx is None else idx  # None: "every entry" (a dense selector)
        # the int8 wire's stochastic rounding, keyed as the reducer keys it
        draws = None if cfg.wire_rounding == "nearest" else wire.Draws(cfg.seed, st, names[0])
        if hasattr(agg, "draws"):  # aggregations that re-round sums (int8 wire)
            agg.draws = draws
        wvals = wire.to_wire(vals, cfg.value_dtype or acc.dtype) if draws is None else \
            wire.quantize(vals, draws(f"rank{rank}", idx))[0]
        res = agg(Selection(idx=idx, vals=wvals, numel=N, offsets=offs_t, k=k_t, idx_dtype=index_dtype(N),
                            sum_dtype=acc.dtype, static_count=bool(getattr(cmp, "exact_count", False)),
                            kernels=cfg.kernels), t)
        counts["rounds"] += res.rounds
        counts["sent_entries"] += idx.numel()
        result = res.vals.to(acc.dtype)
        if res.idx is not None:  # a sparse result: dense here (zeros elsewhere)
            result = torch.zeros(N, dtype=acc.dtype).index_put_((res.idx.long(),), result)
        # acc less what reached the result as it travelled (int8: decoded, exact) ...
        sent = wire.values(wvals, acc.dtype) if int8 else wvals.to(acc.dtype)
        at, sent = (idx.long(), sent) if res.reached is None else (idx[res.reached].long(), sent[res.reached])
        residual = acc.clone()
        residual[at] = acc[at] - sent
        if res.residual_add is not None:  # ... plus the wire roundings this rank owns
            fix_i, fix_v = res.residual_add
            residual.index_put_((fix_i.long(),), fix_v.to(acc.dtype), accumulate=True)
        return result, residual, at

    def run(g, r, u, g_s, u_s, st, m):
        t = transport if transport is not None else SingleProcessTransport()
        if hasattr(t, "begin"):
            t.begin()
        before = t.counters.copy()
        counts = {"rounds": 0, "sent_entries": 0}
        x, xs = to_torch(g, bf), to_torch(g_s, sbf)
        parts, sparts = list(torch.split(x, list(sizes))), list(torch.split(xs, list(s_sizes)))
        scale = clip_scale(cfg.clip_norm, sparts + parts, None, None, P)  # over the whole call
        if scale != 1.0:
            parts, sparts = [p * scale for p in parts], [p * scale for p in sparts]
        if mspec is not None:  # DGC momentum correction: the increments enter the residual
            mc = MomentumCorrection(MomentumSpec(float(m), bool(mspec[1]), float(mspec[2])), cfg.momentum_masking)
            for ns, nn, vel, b in ((b_names, sizes, u, bf), (s_names, s_sizes, u_s, sbf)):
                mc.velocities.update(zip(ns, torch.split(to_torch(vel, b), list(nn))))
            parts = mc.accumulate(b_names, sizes, parts, x.dtype, "cpu") if parts else parts
            sparts = mc.accumulate(s_names, s_sizes, sparts, xs.dtype, "cpu") if sparts else sparts
        result = acc = torch.cat(parts) if parts else x
        if cfg.error_feedback and parts:
            acc = acc + to_torch(r, bf)
        residual = acc
        if parts:
            result, residual, at = method(acc, int(st), t, counts)
            if mspec is not None and at is not None:  # momentum factor masking
                mc.mask_(b_names, at)
        small = torch.cat(sparts) if sparts else xs.clone()
        if sparts:  # the exact sum, after the method's exchange (the PyTorch side's order)
            if P > 1:
                t.allreduce_sum_(small)
            counts["sent_entries"] += small.numel()
            counts["rounds"] += ring
        vel = [torch.cat([mc.velocities[n] for n in ns]) if mspec is not None and ns else v[:0]
               for ns, v in ((b_names, x), (s_names, xs))]
        delta = t.counters.copy().minus(before)
        outs = (result, residual if cfg.error_feedback and parts else x[:0], vel[0], small, vel[1])
        return tuple(to_numpy(o) for o in outs) + (np.asarray(
            [getattr(delta, f) for f in TRANSPORT_FIELDS] + [counts["rounds"], counts["sent_entries"]], np.int64),)

    ins = [carrier(a) for a in inputs[:5]] + list(inputs[5:])
    outs = numpy_call(comp.codec_state(), run, ins, [ins[0].dtype] * 3 + [ins[3].dtype] * 2 + [tf.int64])
    vals = [tf.ensure_shape(o, a.shape) for o, a in zip(outs[:5], inputs)]
    vals = [tf.bitcast(o, tf.bfloat16) if a.dtype == tf.bfloat16 else o for o, a in zip(vals, inputs)]
    return vals + [tf.ensure_shape(outs[5], [len(COUNTS)])]
