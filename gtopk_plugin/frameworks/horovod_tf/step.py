"""One reduce step of the Horovod-TensorFlow layer: the reducer's pipeline
(DESIGN.md §3) on TensorFlow tensors, with every decision that is not a
tensor op taken by the framework-neutral core.

``acc = grad + residual`` (after DGC clipping and momentum correction);
the registry's compressor selects (or encodes) through :mod:`.selection`;
the aggregation the compressor declares combines the contributions
(:mod:`.collectives`); ``residual = acc`` less what reached the global
result, as it travelled (wire-rounded); the update is the sum divided by P
(average) or the sum.

From the core, not re-derived: segments and k (``layout.segment_ks``,
``global_segment_name``; the density warm-up through
``ReducerConfig.density_at``), the consistency fingerprint
(``consistency.describe_layout`` / ``fingerprint``), the butterfly schedule
(``collectives/schedule.py``), the traffic record (``traffic.StepTraffic``)
and the selection itself (the compressor objects).  A codec's dense
warm-up (``start_iter``: the dense method's step before it) is
:mod:`.warmup`.

Exchanges (issue #15): on the gloo side channel of :mod:`.side` by default
(``exchange="gloo"``: no Horovod op in the step), or as Horovod ops
(``exchange="horovod"``; elastic jobs, whose recovery needs Horovod's
errors).  The same bytes in the same order either way.

Consistency: one MAX-allreduce of ``[non-finite, fingerprint, -fingerprint,
step]`` tells every rank at once about NaN/Inf anywhere and about ranks that
disagree on the layout, and agrees on the step counter (the largest: a
worker that restored a checkpoint carries the others along).
"""
from __future__ import annotations

import numpy as np

from gtopk_plugin.pipeline import input_check as consistency
from gtopk_plugin.config import DensityWarmup
from gtopk_plugin.kernels.reference import INT32_LIMIT
from gtopk_plugin.pipeline.layout import global_segment_name, segment_ks
from gtopk_plugin.pipeline.traffic import STATS_FIELDS
from gtopk_plugin.frameworks.horovod_tf import selection
from gtopk_plugin.frameworks.horovod_tf import small as small_part
from gtopk_plugin.frameworks.horovod_tf import warmup
from gtopk_plugin.frameworks.horovod_tf._guard import hvd, tf
from gtopk_plugin.frameworks.horovod_tf.collectives import Contribution, aggregate
from gtopk_plugin.frameworks.horovod_tf.fused import fused_ok, select_aggregate
from gtopk_plugin.frameworks.horovod_tf.tf_kernels import accumulation_dtype, clip_factor, momentum_step, to_wire
from gtopk_plugin.frameworks.horovod_tf.tf_momentum import momentum_key
from gtopk_plugin.frameworks.horovod_tf.ops import Ops
from gtopk_plugin.frameworks.horovod_tf.tf_rounds import run_rounds
from gtopk_plugin.frameworks.horovod_tf.side import channel_for

__all__ = ["reduce"]


def schedule_key(warmup) -> str:
    """The warm-up schedule as the same text on every rank (a function's
    repr carries its address)."""
    if warmup is None or isinstance(warmup, (tuple, DensityWarmup)):
        return repr(warmup)
    return f"callable {getattr(warmup, '__module__', '')}.{getattr(warmup, '__qualname__', type(warmup).__name__)}"


def _promote(dtypes) -> "tf.DType":
    """The flat buffer's dtype, as torch.promote_types over the gradients."""
    ds = set(dtypes)
    if len(ds) == 1:
        return dtypes[0]
    return tf.float64 if tf.float64 in ds else tf.float32


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


def _check(comp, ops, layout, tensors):
    """The consistency check: ``(v, checks)``, the agreed vector and the
    graph assertions (eagerly it raises on every rank at once instead)."""
    cfg = comp.config
    fp = consistency.fingerprint(layout)
    finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(t)) for t in tensors])
    v = tf.stack([tf.cast(tf.logical_not(finite), tf.int64), tf.constant(fp, tf.int64),
                  tf.constant(-fp, tf.int64), comp.step.read_value()])
    if ops.P > 1:
        v = ops.allreduce(v, hvd.Max, "check")
        ops.zero = tf.cast(tf.minimum(v[3], 0), tf.int32)  # step >= 0; unknown to TF
    mismatch = ("gtopk_plugin: ranks reduced different tensors or settings (shapes, dtypes, "
                "k or method must match)")
    nonfinite = ("gtopk_plugin: non-finite gradient (NaN or Inf) on some rank; nothing was applied "
                 "and residuals are unchanged (pass nonfinite='skip' to skip such steps)")
    if tf.executing_eagerly():
        if int(v[1]) != -int(v[2]):
            raise consistency.LayoutMismatchError(mismatch)
        if cfg.nonfinite == "raise" and int(v[0]):
            raise consistency.NonFiniteGradientError(nonfinite)
        return v, []
    checks = [tf.debugging.Assert(tf.equal(v[1], -v[2]), [mismatch])]
    if cfg.nonfinite == "raise":
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
    # the exchanges on the gloo side channel (made at the first step), or Horovod's ops
    ops = Ops(ps, comp.prefix, channel_for(comp, ps, comp.prefix) if comp.exchange == "gloo" else None)
    P = ops.P

    pos, tensors = _inputs(grads, pre)
    if not tensors:
        return list(grads)
    all_names = [f"t{i:04d}" for i in pos]     # positional: stable across model instances
    all_sizes = [int(t.shape.num_elements()) for t in tensors]
    if sum(all_sizes) > INT32_LIMIT:
        raise ValueError(f"{sum(all_sizes)} gradient entries exceed int32 indices; reduce fewer variables per call")
    # dense_below: the small tensors' positions go dense (.small), the rest to the method
    big, small = small_part.split(all_sizes, cfg.dense_below)
    names, sizes = [all_names[j] for j in big], [all_sizes[j] for j in big]
    s_sizes = [all_sizes[j] for j in small]
    dtype = _promote([tensors[j].dtype for j in big]) if big else None
    s_dtype = _promote([tensors[j].dtype for j in small]) if small else None
    wire = comp.wire_dtype or dtype
    N, Ns = sum(sizes), sum(s_sizes)
    if cfg.granularity == "layer" or not big:
        offsets, seg_names = list(np.cumsum([0] + sizes).tolist()), names
    else:
        offsets, seg_names = [0, N], [global_segment_name(names)]  # the PyTorch side's key of the draws
    seg_sizes = [offsets[s + 1] - offsets[s] for s in range(len(offsets) - 1)]
    full = getattr(cmp, "kind", "selector") == "codec"  # a codec encodes all: k = n (as the reducer)

    def ks_at(step_value: int):  # the PyTorch side's rule: k_for(density at the step, n)
        return segment_ks(sizes, cfg.density_at(step_value), cfg.granularity, full=full)

    ks = segment_ks(sizes, cfg.density, cfg.granularity, full=full)  # the target (after any warm-up)
    res_vars = [comp.state_var(comp.residuals, "residual", f"r{pos[j]:04d}", all_sizes[j], dtype) for j in big]
    small_set = set(small)
    dts = [s_dtype if j in small_set else dtype for j in range(len(tensors))]  # each part's flat dtype
    mspec = comp.momentum_spec()
    vel_vars = None if mspec is None else \
        [comp.state_var(comp.velocities, "velocity", f"u{i:04d}", n, dt) for i, n, dt in zip(pos, all_sizes, dts)]

    settings = (cfg.method, cfg.aggregation, cfg.granularity, str(comp.wire_dtype),
                "average" if average else "sum", tuple(ks), schedule_key(cfg.warmup),
                None if mspec is None else (momentum_key(mspec[0]), bool(mspec[1]), float(mspec[2]),
                                            cfg.momentum_masking),
                cfg.clip_norm)
    if cfg.dense_below:
        settings += (("dense_below", cfg.dense_below),)
    if cfg.wire_rounding != "nearest":
        settings += (("wire_rounding", cfg.wire_rounding),)
    layout = consistency.describe_layout(
        [(n, tuple(t.shape.as_list()), t.dtype.name) for n, t in zip(all_names, tensors)], settings)
    hyper = getattr(cmp, "hyper", None)
    if hyper:  # the method's own hyper-parameters, as the reducer adds them
        layout.append(("hyper",) + tuple(sorted(hyper.items())))
    v, checks = _check(comp, ops, layout, tensors)
    step = v[3]
    with tf.control_dependencies(checks):
        skip = v[0] > 0
        flat = [tf.reshape(tf.cast(t, dt), [-1]) for t, dt in zip(tensors, dts)]
        if cfg.clip_norm is not None:  # DGC local clipping, over every tensor of the step
            # (small part first: the PyTorch side's order of the norms)
            factor = clip_factor([flat[j] for j in small + big], cfg.clip_norm, P)
            flat = [g * tf.cast(factor, g.dtype) for g in flat]
        old_u = new_u = None
        if mspec is not None:  # DGC momentum correction: the increments enter the residual
            old_u = [u.read_value() for u in vel_vars]
            flat, new_u = momentum_step(flat, old_u, *mspec)
        acc = tf.concat([flat[j] + r.read_value() if cfg.error_feedback else flat[j]
                         for j, r in zip(big, res_vars)], 0) if big else None
        acc_s = tf.concat([flat[j] for j in small], 0) if small else None

    control = ops.traffic()  # the check only: what a skipped step sends

    # The counts at this step: with a density warm-up they follow the
    # agreed step -- Python ints when eager, a run-time tensor in a traced
    # graph (one graph serves every step).
    if cfg.warmup is not None and big:
        if tf.executing_eagerly():
            ks = ks_at(int(step))
        else:
            ks = tf.ensure_shape(tf.numpy_function(lambda st: np.asarray(ks_at(int(st)), np.int32),
                                                   [step], tf.int32, stateful=False), [len(seg_sizes)])
    zero = tf.constant(0, tf.int64)

    def run():
        if big:
            out = list(_sparse(comp, ops, acc, offsets, ks, seg_names, step, dtype, wire, N, average,
                               [tensors[j].shape.as_list() for j in big]))
        else:
            out = [tf.zeros([0], s_dtype), tf.zeros([0], s_dtype), control, tf.zeros([0], tf.int32), zero, zero]
        if small:  # the exact sum, after the method's exchange (the PyTorch side's order)
            out += list(ops.keep(small_part.dense_sum(ops, acc_s, average)))
            out[2] = ops.traffic()
            out[4] = out[4] + Ns
            out[5] = out[5] + (0 if P == 1 else 2 * (P - 1))
        return tuple(out)

    def skipped():
        out = (tf.zeros([N], dtype or s_dtype), acc if big else tf.zeros([0], s_dtype), control,
               tf.zeros([0], tf.int32), zero, zero)
        return out + ((tf.zeros([Ns], s_dtype),) if small else ())

    if tf.executing_eagerly():
        res = skipped() if bool(skip) else run()
    elif cfg.nonfinite == "skip":
        res = tf.cond(skip, skipped, run)
    else:
        res = run()
    update, residual, traffic, reached, sent, rounds = res[:6]
    k_sum = sum(ks) if isinstance(ks, list) else tf.reduce_sum(tf.cast(ks, tf.int64))
    stats = {"dense_bytes": small_part.dense_bytes(P, [(N, dtype.size if big else 0),
                                                       (Ns, s_dtype.size if small else 0)]),
             "numel": N + Ns, "k": k_sum + Ns, "sent_entries": sent, "rounds": rounds}
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
    parts = [(big, tf.split(update, sizes) if big else [])]
    if small:
        parts.append((small, tf.split(res[6], s_sizes)))
    for js, ups in parts:
        for j, u in zip(js, ups):
            t = tensors[j]
            u = tf.cast(tf.reshape(u, t.shape), t.dtype)
            out[pos[j]] = u * tf.cast(post, u.dtype) if post != 1.0 else u
    return out


def _commit_velocities(cfg, vel_vars, old_u, new_u, big, small, sizes, reached, skip):
    """DGC velocities after the step: the method's part restarts where its
    accumulator reached the result (momentum factor masking); the small
    tensors' are plain momentum buffers (a dense method: no masking); a
    skipped step keeps the old ones."""
    if big:
        u = tf.concat([new_u[j] for j in big], 0)
        if cfg.momentum_masking:  # DGC momentum factor masking: u restarts where v reached the result
            u = tf.tensor_scatter_nd_update(u, reached[:, None], tf.zeros(tf.shape(reached), u.dtype))
        if cfg.nonfinite == "skip":  # a skipped step keeps the old velocity
            u = tf.where(skip, tf.concat([old_u[j] for j in big], 0), u)
        for j, part in zip(big, tf.split(u, sizes)):
            vel_vars[j].assign(part)
    for j in small:
        vel_vars[j].assign(tf.where(skip, old_u[j], new_u[j]) if cfg.nonfinite == "skip" else new_u[j])


def _sparse(comp, ops, acc, offsets, ks, seg_names, step, dtype, wire, N, average, shapes):
    """One step on the flat accumulator: ``(dense update, residual, traffic,
    indices of this rank's entries that reached the result, entries sent,
    rounds)``.  ``ks``: per-segment counts, Python ints or a run-time tensor."""
    cfg, cmp = comp.config, comp.compressor
    P = ops.P
    common = dict(step=step, names=seg_names, seed=cfg.seed, rank=ops.rank, kernels=cfg.kernels,
                  state=comp.codec_state())
    # A wire narrower than the gradients: sums in the accumulation dtype,
    # each later rounding charged to one rank's residual (DESIGN.md §3).
    acc_dt = accumulation_dtype(wire, dtype)
    int8 = wire == tf.int8  # the int8 wire: only on the core's aggregation (.fused)
    # P + a run-time zero: in a traced graph Grappler turns a division by a
    # constant into a multiplication by its reciprocal (other bits for P=3)
    divisor = tf.cast(P + ops.zero if average else 1, dtype)
    if cfg.aggregation == "allreduce_rounds":  # PowerSGD: its rounds on the side channel (.rounds)
        total, mine, n_msgs = run_rounds(ops, acc, offsets, cmp, shapes if cfg.granularity == "layer" else None,
                                         step=step, names=seg_names, seed=cfg.seed, kernels=cfg.kernels,
                                         state=comp.codec_state())
        update = total / divisor if average else total
        return ops.keep(update, acc - mine) + (ops.traffic(), tf.zeros([0], tf.int32), tf.constant(N, tf.int64),
                                               n_msgs * (0 if P == 1 else 2 * (P - 1)))
    if getattr(cmp, "kind", "selector") == "codec":
        def codec():
            blob, mine, spec = selection.encode(acc, offsets, cmp, **common)
            res = aggregate(cfg.aggregation, ops, Contribution(N, dtype, None, comp=cmp, blob=blob, mine=mine,
                                                               spec=spec))
            update = res.vals / divisor if average else res.vals
            # error feedback: acc less this worker's contribution as it decodes;
            # no momentum masking (as the reducer: only selected entries restart)
            return ops.keep(update, acc - mine) + (ops.traffic(), tf.zeros([0], tf.int32),
                                                   tf.constant(N, tf.int64), tf.constant(res.rounds, tf.int64))
        # steps before the codec's start_iter: the dense method's step (.warmup)
        return warmup.unless_warm(ops, cmp, step, lambda: warmup.dense_step(ops, acc, average), codec)
    if fused_ok(cmp, cfg.aggregation, ops, int8):  # select + the core's aggregation in one call (.fused)
        # (int8: wire_vals are the values as they decode, in acc's dtype)
        idx, wire_vals, alive, r_idx, r_vals, fix_i, fix_v, rounds = select_aggregate(
            ops, acc, offsets, ks, cmp, cfg.aggregation, wire, rounding=cfg.wire_rounding, **common)
        total = r_vals / divisor if average else r_vals
        update = total if cfg.aggregation == "allgather" else tf.scatter_nd(r_idx[:, None], total, [N])
        idx, sent = tf.boolean_mask(idx, alive), tf.boolean_mask(tf.cast(wire_vals, dtype), alive)
        residual = tf.tensor_scatter_nd_update(acc, idx[:, None], tf.gather(acc, idx) - sent)
        if acc_dt is not None:  # wire roundings this rank owns, in order
            residual = tf.tensor_scatter_nd_add(residual, fix_i[:, None], fix_v)
        return ops.keep(update, residual) + (ops.traffic(), idx, tf.size(wire_vals, out_type=tf.int64), rounds)
    idx, vals = selection.select(acc, offsets, ks, cmp, **common)
    wire_vals = to_wire(vals, wire)  # clamped to the wire's finite range, never ±inf
    k_t = tf.constant(ks, tf.int32) if isinstance(ks, list) else ks
    res = aggregate(cfg.aggregation, ops, Contribution(
        N, dtype, acc_dt, idx=idx, vals=wire_vals, offsets_t=tf.constant(offsets, tf.int32), k_t=k_t,
        static_count=bool(getattr(cmp, "exact_count", False)), comp=cmp))
    if res.idx is None:
        update = res.vals / divisor if average else res.vals
    else:
        update = tf.scatter_nd(res.idx[:, None], res.vals / divisor if average else res.vals, [N])
    sent = tf.cast(wire_vals, dtype)
    if res.alive is not None:
        idx, sent = tf.boolean_mask(idx, res.alive), tf.boolean_mask(sent, res.alive)
    residual = tf.tensor_scatter_nd_update(acc, idx[:, None], tf.gather(acc, idx) - sent)
    if res.residual_fix is not None:  # wire roundings this rank owns
        residual = res.residual_fix(residual)
    # idx: this rank's entries that reached the result (momentum masking)
    return ops.keep(update, residual) + (ops.traffic(), idx, tf.size(wire_vals, out_type=tf.int64),
                                         tf.constant(res.rounds, tf.int64))
