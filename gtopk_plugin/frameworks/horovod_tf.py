"""Horovod-TensorFlow layer: the sparse methods of the core for
``horovod.tensorflow`` users, as a drop-in ``DistributedGradientTape`` and a
Keras ``DistributedOptimizer`` whose ``compression=`` takes the same names as
the PyTorch side (none, fp16, topk, gtopk, rtopk, randomk, threshold)::

    import horovod.tensorflow as hvd
    from gtopk_plugin.tensorflow import DistributedGradientTape, Compression

    hvd.init()
    compression = Compression.gtopk(0.01)          # once: it holds the residuals
    with tf.GradientTape() as tape:
        loss = loss_fn(model(x), y)
    tape = DistributedGradientTape(tape, compression=compression)
    grads = tape.gradient(loss, model.trainable_variables)

Everything here is TensorFlow ops, so it runs eagerly and inside
``tf.function`` (Keras ``fit`` included): selection with ``tf.math.top_k``
(which orders equal values by lower index first, i.e. DESIGN.md §3's tie
rule), exchange with ``horovod.tensorflow``'s ``allgather`` (sparse
allgather), ``alltoall`` with ``splits`` (the gTop-k butterfly, one op per
round, every rank taking part in every round as the PyTorch
``HorovodTransport`` does) and ``allreduce`` (random-k values, the
consistency check).  The arithmetic is the core's, step for step:
``acc = grad + residual``; selection; the aggregation; ``residual = acc``
less what reached the global result, as it travelled (wire-rounded); the
update is the sum divided by P (average) or the sum.  The only torch code
used at run time draws random-k's and rTop-k's random positions
(``tf.numpy_function``), so that both frameworks draw the same positions
from the same (seed, step, tensor name[, rank]) key.  The tests feed
identical gradients to this layer and to the single-process oracle of the
PyTorch side and compare bits.

With ``momentum_correction=True`` (or ``momentum=``) the compression runs
DGC's momentum correction with momentum factor masking and, with
``clip_norm=``, DGC's local clipping, as compress/momentum.py and the
reducer do (see ``_bind_momentum`` for how a Keras SGD is kept from
applying momentum twice).  With an fp16/bf16 wire, merged sums are added in
float32 and every later rounding is charged to one rank's residual, as
collectives/gtopk.py and collectives/dense.py do (DESIGN.md §3).

Dense compression (``Compression.none``/``fp16`` or any Horovod
``Compressor``) returns Horovod's own tape/optimizer unchanged.

Residuals, velocities and the step counter are non-trainable ``tf.Variable``
objects held by the compression object (a ``tf.Module``): create it once, not per
step.  The Keras optimizer tracks it, so ``tf.train.Checkpoint(model=...,
optimizer=opt)`` and ``model.save_weights`` (TF format) save and restore the
residuals with the model; with the tape, add it to the checkpoint yourself
(``tf.train.Checkpoint(model=model, gtopk=compression)``).

Only the ``horovod_tf*`` modules of the package import TensorFlow (DESIGN.md
§2): this one (front ends and the reduction), ``horovod_tf_collectives``
(Horovod ops, allgather, butterfly), ``horovod_tf_kernels`` (selection and
merge) and ``horovod_tf_elastic``; ``import gtopk_plugin`` never does.
"""
from __future__ import annotations

import math
import re
import warnings
from typing import Optional

import numpy as np

_INSTALL_HINT = ("Install TensorFlow 2.12-2.15 and Horovod built with TensorFlow support into this "
                 "environment with:  GTOPK_HOROVOD_TF=1 bash scripts/install_horovod.sh  "
                 "(installs tensorflow-cpu==2.15.1 and builds horovod==0.28.1 against it; "
                 "`make horovod` does this too)")
try:
    import tensorflow as tf
except ImportError as _e:  # pragma: no cover - exercised only without TensorFlow
    raise ImportError(f"gtopk_plugin.tensorflow needs TensorFlow (import failed: {_e}). {_INSTALL_HINT}") from _e
try:
    import horovod.tensorflow as hvd
    import horovod.tensorflow.keras as hvd_keras
    from horovod.tensorflow.compression import Compression as _HvdCompression
    from horovod.tensorflow.compression import Compressor as _HvdCompressor
except Exception as _e:  # pragma: no cover - a Horovod built without TF fails with various types
    raise ImportError(
        f"gtopk_plugin.tensorflow needs Horovod built with TensorFlow support (import failed: "
        f"{type(_e).__name__}: {_e}). {_INSTALL_HINT}") from _e

import torch  # noqa: E402  (validation and the shared random draws only)

from .. import consistency  # noqa: E402
from ..config import DensityWarmup, ReducerConfig  # noqa: E402
from ..kernels import reference as _ref  # noqa: E402
from ..compress.momentum import MomentumSpec  # noqa: E402
from ..reducer import global_segment_name, k_for  # noqa: E402
from .compression_names import SPARSE_METHODS, CompressionNames  # noqa: E402
from .horovod_tf_collectives import TRAFFIC_KEYS, _allgather_sum, _butterfly, _Ops, _sharded_sum  # noqa: E402
from .horovod_tf_kernels import (  # noqa: E402,F401
    _randomk_positions, _rtopk_picks, accumulation_dtype, clip_factor, magnitude, merge_select, momentum_step,
    select_threshold, select_topk, to_wire)

__all__ = ["Compression", "SparseCompression", "DistributedGradientTape", "DistributedOptimizer",
           "magnitude", "select_topk", "select_threshold", "merge_select"]

_TF_WIRE = {None: None, "float16": tf.float16, "bfloat16": tf.bfloat16}
_TORCH_WIRE = {None: None, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _schedule_key(warmup) -> str:
    """The warm-up schedule as the same text on every rank (a function's
    repr carries its address)."""
    if warmup is None or isinstance(warmup, (tuple, DensityWarmup)):
        return repr(warmup)
    return f"callable {getattr(warmup, '__module__', '')}.{getattr(warmup, '__qualname__', type(warmup).__name__)}"


# ---------------------------------------------------------------------------
# Compression (holds the state: residuals and step counter)
# ---------------------------------------------------------------------------
def _wire_name(value_dtype) -> Optional[str]:
    if value_dtype is None:
        return None
    for name, tdt in (("float16", tf.float16), ("bfloat16", tf.bfloat16)):
        if value_dtype in (name, tdt, _TORCH_WIRE[name]):
            return name
    raise ValueError(f"value_dtype must be None, tf.float16 or tf.bfloat16; got {value_dtype!r}")


def _promote(dtypes) -> "tf.DType":
    """The flat buffer's dtype, as torch.promote_types over the gradients."""
    ds = set(dtypes)
    if len(ds) == 1:
        return dtypes[0]
    if tf.float64 in ds:
        return tf.float64
    return tf.float32


class SparseCompression(tf.Module):
    """A sparse method of the core as a Horovod-TF ``compression=``; made by
    ``Compression.topk/gtopk/rtopk/randomk/threshold(density, ...)``.

    It holds this worker's error-feedback residuals (one non-trainable
    ``tf.Variable`` per gradient, flat, created at the first step) and the
    step counter (``tf.Variable``, int64), so create it once and pass the
    same object to every step's ``DistributedGradientTape``.  One object per
    list of variables: residuals are keyed by position in that list.

    Args:
        method, density: as :class:`~gtopk_plugin.GradientReducer`.
        r_factor: rTop-k's r (keep k of the top r·k).
        value_dtype: None, ``tf.float16`` or ``tf.bfloat16`` (values on the wire).
        merge: None, ``"allgather"`` or ``"gtopk"`` (any selector on the butterfly).
        granularity: ``"layer"`` (k per tensor) or ``"global"`` (k over all).
        seed: key of random-k's shared and rTop-k's per-rank draws.
        nonfinite: ``"raise"`` (every rank raises; nothing applied) or
            ``"skip"`` (every rank applies zero for the step; residuals kept).
        warmup: density schedule of the first steps, as the PyTorch side
            (``DensityWarmup``, a sequence of densities, or a callable
            step -> density): k per segment is ``k_for(density at the
            step, n)``, a run-time count inside ``tf.function``.
        error_feedback: keep the residual (default True).
        momentum_correction: DGC momentum correction with momentum factor
            masking, with the Keras SGD's own momentum and Nesterov flag (as
            the PyTorch Horovod layer's keyword): ``DistributedOptimizer``
            takes them from the optimizer it wraps, ``DistributedGradientTape``
            from its ``optimizer=``; that optimizer then applies the update
            without momentum (see ``_bind_momentum``).  The front ends'
            ``momentum_correction=True`` does the same.
        momentum, nesterov, dampening: DGC momentum correction (Lin et al.
            2018; compress/momentum.py): each worker keeps a velocity
            ``u <- m·u + g`` (Nesterov: ``u <- m·(u + g)``, increment
            ``u + g``) and accumulates it, not ``g``, into the residual.
            The optimizer that applies the update must then have no momentum
            of its own: build it without, or let
            ``DistributedOptimizer(..., momentum_correction=True)`` /
            ``DistributedGradientTape(..., momentum_correction=True,
            optimizer=opt)`` take a Keras SGD's momentum over (see there).
            ``None`` (default): off.
        momentum_masking: zero the velocity where the accumulator's entry
            reached the global result (DGC's momentum factor masking;
            default True).
        clip_norm: DGC local gradient clipping: each worker scales its
            gradient so that its L2 norm over all tensors of the call (the
            whole step: one call reduces every gradient of a step) is at
            most ``clip_norm · P^-1/2``, before the velocity and residual.
        name: prefix of the Horovod op names (distinct per object when
            several compressions reduce in the same step).

    State (``tf.Variable`` objects tracked by this ``tf.Module``, so in
    every checkpoint that holds it): ``residuals``, ``velocities`` (with
    momentum correction) and ``step``.
    """

    def __init__(self, method: str, density: float, *, r_factor: float = 4.0, value_dtype=None,
                 merge: Optional[str] = None, granularity: str = "layer", seed: int = 0,
                 nonfinite: str = "raise", error_feedback: bool = True, warmup=None,
                 momentum_correction: bool = False, momentum: Optional[float] = None, nesterov: bool = False,
                 dampening: float = 0.0, momentum_masking: bool = True, clip_norm: Optional[float] = None,
                 name: Optional[str] = None):
        if method == "dense":
            raise ValueError("dense reduction is Compression.none (Horovod's own allreduce), not a sparse "
                             "compression")
        if nonfinite == "propagate":
            raise ValueError("nonfinite='propagate' is for torch's GradScaler; the TensorFlow layer takes "
                             "'raise' or 'skip'")
        if momentum_correction and momentum is not None:
            raise ValueError("pass either momentum_correction=True (momentum read from the optimizer) "
                             "or momentum=<float>, not both")
        wire = _wire_name(value_dtype)
        self.config = ReducerConfig(method=method, density=density, r_factor=r_factor, merge=merge,
                                    granularity=granularity, value_dtype=_TORCH_WIRE[wire], seed=seed,
                                    nonfinite=nonfinite, error_feedback=bool(error_feedback),
                                    warmup=warmup, momentum=momentum, nesterov=bool(nesterov),
                                    dampening=dampening, momentum_masking=bool(momentum_masking),
                                    clip_norm=clip_norm, kernels="reference")  # validates (ValueError)
        prefix = name or f"gtopk_tf_{method}"
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", prefix):
            raise ValueError(f"name must be a Python identifier (it prefixes Horovod op names); got {prefix!r}")
        super().__init__(name=prefix)
        self.prefix = prefix
        self.wire_dtype = _TF_WIRE[wire]
        # take the Keras SGD's momentum over (bound by the front ends)
        self.momentum_correction = bool(momentum_correction)
        with tf.init_scope():
            self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")
        self.residuals = {}  # "r0003" -> flat tf.Variable (tracked: checkpoints)
        self.velocities = {}  # "u0003" -> flat tf.Variable: momentum correction's u
        # A Keras SGD whose momentum/nesterov the correction takes over
        # (momentum_correction=True); None: the config's momentum.
        self._momentum_from = None
        with tf.init_scope():  # bytes of the last step (TRAFFIC_KEYS), then numel, k, dense bytes
            self._traffic = tf.Variable(tf.zeros([len(TRAFFIC_KEYS) + 3], tf.int64), trainable=False,
                                        name="last_step_traffic")

    @property
    def method(self) -> str:
        return self.config.method

    @property
    def density(self) -> float:
        return self.config.density

    def __repr__(self):
        c = self.config
        extra = "".join(f", {k}={v!r}" for k, v in (("r_factor", c.r_factor), ("merge", c.merge),
                                                     ("granularity", c.granularity), ("seed", c.seed),
                                                     ("nonfinite", c.nonfinite), ("momentum", c.momentum),
                                                     ("nesterov", c.nesterov), ("dampening", c.dampening),
                                                     ("momentum_masking", c.momentum_masking),
                                                     ("clip_norm", c.clip_norm))
                        if v != _DEFAULTS[k])
        if self.momentum_correction:
            extra += ", momentum_correction=True"
        if self.wire_dtype is not None:
            extra += f", value_dtype=tf.{self.wire_dtype.name}"
        return f"Compression.{c.method}({c.density!r}{extra})"

    # Horovod's own tape/optimizer call these: say plainly that they cannot run us.
    def compress(self, tensor):
        raise TypeError(f"{self!r} is a sparse gtopk_plugin compression: pass it to "
                        "gtopk_plugin.tensorflow.DistributedGradientTape / DistributedOptimizer, "
                        "not to horovod.tensorflow's")

    decompress = compress

    # -- state ----------------------------------------------------------------
    def _state_var(self, store: dict, what: str, key: str, numel: int, dtype):
        """This worker's flat state variable ``key`` in ``store`` (residuals
        or velocities), created zero at first use."""
        v = store.get(key)
        if v is None:
            with tf.init_scope():  # created once, eagerly, even while tracing
                v = tf.Variable(tf.zeros([numel], dtype), trainable=False, name=f"{what}_{key}")
            store[key] = v
        elif v.shape[0] != numel or v.dtype != dtype:
            raise ValueError(
                f"{self!r}: the {what} {key} has {v.shape[0]} {v.dtype.name} entries but the gradient "
                f"has {numel} {dtype.name}: pass the same variables in the same order every step "
                "(one compression object per variable list)")
        return v

    def _residual(self, key: str, numel: int, dtype):
        return self._state_var(self.residuals, "residual", key, numel, dtype)

    def momentum_spec(self):
        """The momentum correction of the next call: ``(momentum, nesterov,
        dampening)`` or None (off).  Taken from the bound Keras SGD (read at
        every call, so inside ``tf.function`` at trace time, as Keras' own
        ``update_step`` reads it) when its momentum is not 0, else from the
        ``momentum=`` this compression was built with."""
        opt = self._momentum_from
        if opt is not None:
            spec = _keras_sgd_momentum(opt)
            if spec is not None:
                return spec
        c = self.config
        return None if c.momentum is None else (c.momentum, c.nesterov, c.dampening)

    @property
    def last_step_traffic(self) -> dict:
        """This worker's bytes in the last step, with the keys of the PyTorch
        side's ``last_step_traffic``: ``bytes_sent``/``bytes_received``
        (payload + headers), their ``payload_``/``header_`` parts,
        ``control_bytes`` (the consistency check), ``numel``, ``k`` (entries
        selected per rank) and ``dense_bytes`` (what a ring allreduce of the
        same gradients would send).  Counted as the PyTorch transport counts
        (ring model for allgather/allreduce); Horovod's own metadata (the
        alltoall splits, its negotiation) is not included.  Read eagerly."""
        v = [int(x) for x in self._traffic.numpy()]
        out = dict(zip(TRAFFIC_KEYS, v))
        out["bytes_sent"] = out["payload_bytes_sent"] + out["header_bytes_sent"]
        out["bytes_received"] = out["payload_bytes_received"] + out["header_bytes_received"]
        out["numel"], out["k"], out["dense_bytes"] = v[len(TRAFFIC_KEYS):]
        return out

    def residual_values(self) -> dict:
        """This worker's residuals as numpy arrays (flat), by key."""
        return {k: v.numpy() for k, v in self.residuals.items()}

    def velocity_values(self) -> dict:
        """This worker's momentum-correction velocities as numpy arrays
        (flat), by key (``u0003`` goes with the residual ``r0003``)."""
        return {k: v.numpy() for k, v in self.velocities.items()}

    # -- the reduction ------------------------------------------------------------
    def reduce(self, grads, process_set=None, op=None, gradient_predivide_factor: float = 1.0):
        """Reduce the list ``grads`` (tensors, ``IndexedSlices`` or None)
        across the Horovod workers of ``process_set``; returns the list of
        updates (None stays None).  Collective: every rank calls it with the
        same shapes.  Works eagerly and while tracing a ``tf.function``."""
        ps = hvd.global_process_set if process_set is None else process_set
        op = hvd.Average if op is None else op
        if op not in (hvd.Average, hvd.Sum):
            raise ValueError("sparse compression supports op=hvd.Average and hvd.Sum")
        average = op == hvd.Average
        pre = 1.0 / gradient_predivide_factor if average else 1.0
        post = gradient_predivide_factor if average else 1.0
        cfg = self.config
        ops = _Ops(ps, self.prefix)
        P = ops.P

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
            if pre != 1.0:
                g = g * tf.cast(pre, g.dtype)
            pos.append(i)
            tensors.append(g)
        if not tensors:
            return list(grads)
        names = [f"t{i:04d}" for i in pos]     # positional: stable across model instances
        sizes = [int(t.shape.num_elements()) for t in tensors]
        dtype = _promote([t.dtype for t in tensors])
        wire = self.wire_dtype or dtype
        if cfg.granularity == "layer":
            offsets = [0]
            for s in sizes:
                offsets.append(offsets[-1] + s)
            seg_names = names
        else:
            offsets = [0, sum(sizes)]
            seg_names = [global_segment_name(names)]  # the PyTorch side's key of the draws
        seg_sizes = [offsets[s + 1] - offsets[s] for s in range(len(offsets) - 1)]

        def ks_at(step_value: int):  # the PyTorch side's rule: k_for(density at the step, n)
            return [k_for(cfg.density_at(step_value), n) for n in seg_sizes]

        ks = [k_for(cfg.density, n) for n in seg_sizes]  # the target (after any warm-up)
        N = offsets[-1]
        if N > _ref.INT32_LIMIT:
            raise ValueError(f"{N} gradient entries exceed int32 indices; reduce fewer variables per call")
        res_vars = [self._residual(f"r{i:04d}", n, dtype) for i, n in zip(pos, sizes)]
        mspec = self.momentum_spec()
        vel_vars = None if mspec is None else \
            [self._state_var(self.velocities, "velocity", f"u{i:04d}", n, dtype) for i, n in zip(pos, sizes)]

        # Consistency: one MAX-allreduce of [non-finite, layout, -layout, step]
        # tells every rank at once about NaN/Inf anywhere and about ranks that
        # disagree on the layout, and agrees on the step counter (the largest:
        # a worker that restored a checkpoint carries the others along).
        layout = [(n, tuple(t.shape.as_list()), t.dtype.name) for n, t in zip(names, tensors)]
        layout.append(("settings", cfg.method, cfg.aggregation, cfg.granularity, str(self.wire_dtype),
                       "average" if average else "sum", tuple(ks), _schedule_key(cfg.warmup),
                       None if mspec is None else (_momentum_key(mspec[0]), bool(mspec[1]), float(mspec[2]),
                                                   cfg.momentum_masking),
                       cfg.clip_norm))
        fp = consistency.fingerprint(layout)
        finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(t)) for t in tensors])
        v = tf.stack([tf.cast(tf.logical_not(finite), tf.int64), tf.constant(fp, tf.int64),
                      tf.constant(-fp, tf.int64), self.step.read_value()])
        if P > 1:
            v = ops.allreduce(v, hvd.Max, "check")
            ops.zero = tf.cast(tf.minimum(v[3], 0), tf.int32)  # step >= 0; unknown to TF
        step = v[3]
        mismatch_msg = ("gtopk_plugin: ranks reduced different tensors or settings (shapes, dtypes, "
                        "k or method must match)")
        nonfinite_msg = ("gtopk_plugin: non-finite gradient (NaN or Inf) on some rank; nothing was applied "
                         "and residuals are unchanged (pass nonfinite='skip' to skip such steps)")
        if tf.executing_eagerly():
            if int(v[1]) != -int(v[2]):
                raise consistency.LayoutMismatchError(mismatch_msg)
            if cfg.nonfinite == "raise" and int(v[0]):
                raise consistency.NonFiniteGradientError(nonfinite_msg)
            checks = []
        else:
            checks = [tf.debugging.Assert(tf.equal(v[1], -v[2]), [mismatch_msg])]
            if cfg.nonfinite == "raise":
                checks.append(tf.debugging.Assert(tf.equal(v[0], 0), [nonfinite_msg]))
        with tf.control_dependencies(checks):
            skip = v[0] > 0
            flat = [tf.reshape(tf.cast(t, dtype), [-1]) for t in tensors]
            if cfg.clip_norm is not None:  # DGC local clipping, over every tensor of the step
                factor = tf.cast(clip_factor(flat, cfg.clip_norm, P), dtype)
                flat = [g * factor for g in flat]
            old_u = new_u = None
            if mspec is not None:  # DGC momentum correction: the increments enter the residual
                old_u = [u.read_value() for u in vel_vars]
                flat, new_u = momentum_step(flat, old_u, *mspec)
            acc = tf.concat([g + r.read_value() if cfg.error_feedback else g for g, r in zip(flat, res_vars)], 0)

        control = ops.traffic()  # the check only: what a skipped step sends

        # The counts at this step: with a density warm-up they follow the
        # agreed step -- Python ints when eager, a run-time tensor in a traced
        # graph (one graph serves every step).
        ks_fn = None
        if cfg.warmup is not None:
            if tf.executing_eagerly():
                ks = ks_at(int(step))
            else:
                ks_fn = ks_at
                ks = tf.ensure_shape(tf.numpy_function(lambda st: np.asarray(ks_at(int(st)), np.int32),
                                                       [step], tf.int32, stateful=False), [len(seg_sizes)])

        def run():
            return self._sparse(ops, acc, offsets, ks, ks_fn, seg_names, step, dtype, wire, N, average)

        def skipped():
            return tf.zeros([N], dtype), acc, control, tf.zeros([0], tf.int32)

        if tf.executing_eagerly():
            update, residual, traffic, reached = skipped() if bool(skip) else run()
        elif cfg.nonfinite == "skip":
            update, residual, traffic, reached = tf.cond(skip, skipped, run)
        else:
            update, residual, traffic, reached = run()
        dense_bytes = 2 * (P - 1) * N * dtype.size // P
        k_sum = sum(ks) if ks_fn is None else tf.reduce_sum(tf.cast(ks, tf.int64))
        self._traffic.assign(tf.concat([traffic, tf.stack([tf.constant(N, tf.int64), tf.cast(k_sum, tf.int64),
                                                           tf.constant(dense_bytes, tf.int64)])], 0))
        if cfg.error_feedback:
            if cfg.nonfinite == "skip":  # a skipped step keeps the old residual
                residual = tf.where(skip, tf.concat([r.read_value() for r in res_vars], 0), residual)
            for r, part in zip(res_vars, tf.split(residual, sizes)):
                r.assign(part)
        if mspec is not None:
            u = tf.concat(new_u, 0)
            if cfg.momentum_masking:  # DGC momentum factor masking: u restarts where v reached the result
                u = tf.tensor_scatter_nd_update(u, reached[:, None], tf.zeros(tf.shape(reached), dtype))
            if cfg.nonfinite == "skip":  # a skipped step keeps the old velocity
                u = tf.where(skip, tf.concat(old_u, 0), u)
            for var, part in zip(vel_vars, tf.split(u, sizes)):
                var.assign(part)
        self.step.assign(step + 1)
        out = list(grads)
        for i, t, u in zip(pos, tensors, tf.split(update, sizes)):
            u = tf.cast(tf.reshape(u, t.shape), t.dtype)
            out[i] = u * tf.cast(post, u.dtype) if post != 1.0 else u
        return out

    def _sparse(self, ops, acc, offsets, ks, ks_at, seg_names, step, dtype, wire, N, average):
        """One sparse step on the flat accumulator: (dense update, residual,
        traffic, indices of this rank's entries that reached the result).
        ``ks``: per-segment counts, Python ints or (with ``ks_at``, step ->
        counts, for the torch draws) a run-time tensor."""
        cfg = self.config
        P = ops.P
        method, agg = cfg.method, cfg.aggregation
        offsets_t = tf.constant(offsets, tf.int32)
        k_t = tf.constant(ks, tf.int32) if ks_at is None else ks
        sizes = [offsets[s + 1] - offsets[s] for s in range(len(offsets) - 1)]

        def r_of(n, k):  # rTop-k's r per segment: min(n, ceil(r_factor * k))
            return min(n, math.ceil(cfg.r_factor * k))

        if method in ("topk", "gtopk") or (method == "rtopk" and cfg.r_factor == 1.0):
            idx, vals = select_topk(acc, offsets, ks)
        elif method == "threshold":
            idx, vals = select_threshold(acc, offsets, ks)
        elif method == "rtopk":
            def rs_ks_at(step_value):  # (rs, ks) at a step, for the torch draws
                k_list = ks_at(step_value)
                return [r_of(n, k) for n, k in zip(sizes, k_list)], k_list

            if ks_at is None:
                rs, layout_at = [r_of(n, k) for n, k in zip(sizes, ks)], None
            else:
                rs, layout_at = tf.minimum(tf.constant(sizes, tf.int32), tf.cast(
                    tf.math.ceil(cfg.r_factor * tf.cast(ks, tf.float64)), tf.int32)), rs_ks_at
            top_idx, _ = select_topk(acc, offsets, rs)
            idx = tf.gather(top_idx, _rtopk_picks(step, rs, ks, seg_names, cfg.seed, ops.rank, layout_at))
            vals = tf.gather(acc, idx)
        elif method == "randomk":
            idx = _randomk_positions(step, offsets, ks, seg_names, cfg.seed, ks_at)
            vals = tf.gather(acc, idx)
        else:  # pragma: no cover - ReducerConfig validated the method
            raise ValueError(method)
        wire_vals = to_wire(vals, wire)  # clamped to the wire's finite range, never ±inf
        # A wire narrower than the gradients: sums in the accumulation dtype,
        # each later rounding charged to one rank's residual (DESIGN.md §3).
        acc_dt = accumulation_dtype(wire, dtype)
        # P + a run-time zero: in a traced graph Grappler turns a division by a
        # constant into a multiplication by its reciprocal (other bits for P=3)
        divisor = tf.cast(P + ops.zero if average else 1, dtype)
        alive = charges = None
        value_charges = None
        if agg == "allgather":  # summed in the gradients' dtype, in rank order: nothing re-rounded
            summed = _allgather_sum(ops, idx, wire_vals, N, dtype, static_count=method != "threshold")
            update = summed / divisor if average else summed
        elif agg == "gtopk":
            res_i, res_v, alive, charges = _butterfly(ops, idx, wire_vals, offsets_t, k_t, acc_dt)
            v = tf.cast(res_v, dtype)
            update = tf.scatter_nd(res_i[:, None], v / divisor if average else v, [N])
        elif agg == "allreduce_values":
            if P == 1:
                summed = wire_vals
            elif acc_dt is None:
                summed = ops.allreduce(wire_vals, hvd.Sum, "values")
            else:
                summed, (pos, err) = _sharded_sum(ops, wire_vals, acc_dt)
                value_charges = (tf.gather(idx, pos), err)
            v = tf.cast(summed, dtype)
            update = tf.scatter_nd(idx[:, None], v / divisor if average else v, [N])
        else:  # pragma: no cover
            raise ValueError(agg)
        sent = tf.cast(wire_vals, dtype)
        if alive is not None:
            idx, sent = tf.boolean_mask(idx, alive), tf.boolean_mask(sent, alive)
        residual = tf.tensor_scatter_nd_update(acc, idx[:, None], tf.gather(acc, idx) - sent)
        if charges is not None:  # merged sums' wire roundings this rank owns
            residual = charges.apply(residual)
        if value_charges is not None:
            residual = tf.tensor_scatter_nd_add(residual, value_charges[0][:, None],
                                                tf.cast(value_charges[1], dtype))
        # idx: this rank's entries that reached the result (momentum masking)
        return ops.keep(update, residual) + (ops.traffic(), idx)


_DEFAULTS = dict(r_factor=4.0, merge=None, granularity="layer", seed=0, nonfinite="raise", momentum=None,
                 nesterov=False, dampening=0.0, momentum_masking=True, clip_norm=None)


class Compression(CompressionNames):
    """Gradient compression for :func:`DistributedGradientTape` and
    :func:`DistributedOptimizer`: the names of the PyTorch side.

    ``none`` and ``fp16`` are Horovod's own compressors (dense allreduce:
    Horovod's own tape/optimizer is returned).  The others take the density
    (fraction of entries sent per tensor) and the keywords of
    :class:`SparseCompression`.
    """

    none = _HvdCompression.none
    fp16 = _HvdCompression.fp16
    _sparse = SparseCompression
    _public_name = "gtopk_plugin.tensorflow.Compression"


def _check_compression(compression):
    if isinstance(compression, SparseCompression):
        return True
    is_dense = (isinstance(compression, type) and issubclass(compression, _HvdCompressor)) or \
        isinstance(compression, _HvdCompressor)
    if not is_dense:
        hint = (f" (did you mean Compression.{compression}(density)?)"
                if isinstance(compression, str) and compression in SPARSE_METHODS else "")
        raise ValueError(
            f"unknown compression {compression!r}{hint}: pass Compression.none, Compression.fp16, "
            "Compression.topk/gtopk/rtopk/randomk/threshold(density), or a Horovod Compressor")
    return False


def _sparse_reduce_fn(compression: SparseCompression, process_set, op, gradient_predivide_factor):
    """Replacement for the ``_allreduce_grads(grads, vars[, use_generic_names])``
    function that Horovod's tape and Keras optimizer call."""
    if gradient_predivide_factor != 1.0 and op != hvd.Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")

    def allreduce_grads(grads, vars=None, use_generic_names=False):  # noqa: A002 - Horovod's signature
        return compression.reduce(list(grads), process_set=process_set, op=op,
                                  gradient_predivide_factor=gradient_predivide_factor)

    return allreduce_grads


# ---------------------------------------------------------------------------
# Momentum correction with a Keras optimizer
# ---------------------------------------------------------------------------
def _momentum_key(m) -> str:
    """The momentum as the same text on every rank (fingerprint): its value,
    or "variable" when it is a tensor read at run time."""
    return repr(float(m)) if isinstance(m, (int, float)) else "variable"


def _is_keras_sgd(optimizer) -> bool:
    return isinstance(optimizer, tf.keras.optimizers.SGD)


def _keras_sgd_momentum(optimizer):
    """``(momentum, nesterov, 0.0)`` of a Keras SGD, or None when its
    momentum is the Python number 0 (nothing to correct).  A tensor or
    variable momentum is used as it is, at run time."""
    m = optimizer.momentum
    if isinstance(m, (int, float)):
        if float(m) == 0.0:
            return None
        MomentumSpec(float(m), bool(optimizer.nesterov))  # [0, 1): ValueError (Keras allows 1)
        m = float(m)
    return m, bool(optimizer.nesterov), 0.0


def _keras_momentum_of(optimizer):
    """What momentum ``optimizer`` applies itself: None (none, or taken over
    by gtopk_plugin), else a description for error messages."""
    if getattr(optimizer, "_gtopk_momentum_taken", False):
        return None
    if _is_keras_sgd(optimizer):
        m = optimizer.momentum
        return None if isinstance(m, (int, float)) and float(m) == 0.0 else f"momentum={m!r}"
    hyper = getattr(optimizer, "_hyper", None)  # legacy Keras optimizers
    if isinstance(hyper, dict) and "momentum" in hyper and getattr(optimizer, "_momentum", True):
        m = hyper["momentum"]
        return None if isinstance(m, (int, float)) and float(m) == 0.0 else f"momentum={m!r}"
    return None


def _bind_momentum(compression: "SparseCompression", optimizer) -> None:
    """``momentum_correction=True``: ``compression`` takes the Keras SGD's
    momentum and Nesterov flag over (read at every call) and the optimizer's
    ``update_step`` runs with momentum 0 from now on.

    Why this way: Keras 2.15's ``SGD.update_step`` reads ``self.momentum``
    and ``self.nesterov`` as Python values each time it runs (eagerly) or is
    traced (``tf.function``, XLA); with momentum 0 it computes
    ``m = -lr·g + 0·m; w += m``, which is ``w -= lr·g`` bit for bit.  So the
    optimizer's ``update_step`` is wrapped to see momentum 0 and no Nesterov
    while it runs and the user's values otherwise: ``optimizer.momentum``,
    ``get_config()`` and saved configs keep the user's values, and a
    momentum changed between steps (eagerly) reaches the correction.  Keras'
    ``weight_decay`` is decoupled (``apply_gradients`` subtracts
    ``lr·wd·w`` from the variable before ``update_step``; it never enters
    the momentum), so it stays with the optimizer, unchanged.  An L2
    regularizer's gradient is part of the loss's gradient and so enters the
    correction before the velocity, as DGC adds weight decay.
    """
    if not _is_keras_sgd(optimizer):
        raise ValueError(
            f"momentum_correction=True needs a Keras SGD optimizer (tf.keras.optimizers.SGD with "
            f"momentum); got {type(optimizer).__name__}. Adam-style optimizers keep their own moments: use "
            "error feedback alone (momentum_correction=False). For a legacy or other optimizer, build it "
            "without momentum and pass momentum= (and nesterov=) to the compression instead")
    if compression.config.momentum is not None:
        raise ValueError("pass either momentum_correction=True (momentum read from the optimizer) or "
                         "momentum= to the compression, not both")
    _keras_sgd_momentum(optimizer)  # validates
    compression._momentum_from = optimizer
    if getattr(optimizer, "_gtopk_momentum_taken", False):
        return
    inner = optimizer.update_step  # bound method (SGD's, or a subclass')

    def update_step(gradient, variable):
        saved = optimizer.momentum, optimizer.nesterov
        optimizer.momentum, optimizer.nesterov = 0.0, False  # the correction applied it
        try:
            return inner(gradient, variable)
        finally:
            optimizer.momentum, optimizer.nesterov = saved

    optimizer.update_step = update_step
    optimizer._gtopk_momentum_taken = True


def _setup_correction(compression, sparse: bool, momentum_correction: bool, optimizer,
                      warn_uncorrected: bool = False) -> None:
    """Front ends: bind (momentum_correction) or refuse a double momentum."""
    if not sparse:
        # Dense reduction: every worker's gradient reaches the average, so
        # the optimizer's own momentum already is what the correction computes
        # (nothing stays behind); momentum_correction=True changes nothing.
        return
    momentum_correction = momentum_correction or compression.momentum_correction
    if momentum_correction:
        if optimizer is None:
            raise ValueError("momentum_correction=True needs the Keras optimizer: "
                             "DistributedGradientTape(..., momentum_correction=True, optimizer=opt), or "
                             "pass momentum= (and nesterov=) to the compression and build the optimizer "
                             "without momentum")
        _bind_momentum(compression, optimizer)
    elif optimizer is not None and compression.config.momentum is not None:
        own = _keras_momentum_of(optimizer)
        if own is not None:
            raise ValueError(
                f"{compression!r} corrects momentum itself (momentum={compression.config.momentum}), and "
                f"the optimizer has {own}: it would apply momentum a second time. Build the optimizer "
                "without momentum, or pass momentum_correction=True instead of the compression's momentum=")
    elif warn_uncorrected and optimizer is not None and _keras_momentum_of(optimizer) is not None:
        warnings.warn(
            f"{compression!r} with an optimizer that has {_keras_momentum_of(optimizer)}: the optimizer applies "
            "its momentum to the sparse update, which usually trains worse than dense; pass "
            "momentum_correction=True (DGC momentum correction)", UserWarning, stacklevel=3)


# ---------------------------------------------------------------------------
# Front ends
# ---------------------------------------------------------------------------
def DistributedGradientTape(gradtape, device_dense='', device_sparse='', compression=Compression.none,
                            sparse_as_dense=False, op=hvd.Average, gradient_predivide_factor=1.0,
                            num_groups=0, groups=None, process_set=hvd.global_process_set,
                            scale_local_gradients=True, momentum_correction=False, optimizer=None):
    """``horovod.tensorflow.DistributedGradientTape`` with the same signature,
    plus the sparse ``compression=`` choices.  With ``Compression.none`` /
    ``fp16`` (or any Horovod ``Compressor``) it is Horovod's own tape.  With
    a sparse compression, ``gradient()`` reduces all gradients of the call in
    one sparse exchange (``groups`` and ``sparse_as_dense`` do not apply:
    gradients are always reduced as dense tensors, together); local sources
    (``register_local_source``) and ``scale_local_gradients`` work as in
    Horovod.  Pass the same compression object every step: it holds the
    residuals (and velocities).

    ``momentum_correction=True, optimizer=opt`` (a Keras SGD with momentum):
    DGC momentum correction with factor masking in the compression, with
    ``opt``'s momentum and Nesterov flag; ``opt`` then applies the update
    without momentum (its ``update_step`` runs with momentum 0; weight decay
    stays with it; see ``_bind_momentum``).  Or build ``opt`` without
    momentum and give the compression ``momentum=``.  ``optimizer=`` alone
    only checks that no momentum is applied twice.  With a dense compression
    ``momentum_correction`` changes nothing (the optimizer's momentum on the
    exact average is already the corrected one)."""
    sparse = _check_compression(compression)
    _setup_correction(compression, sparse, momentum_correction, optimizer)
    tape = hvd.DistributedGradientTape(
        gradtape, device_dense=device_dense, device_sparse=device_sparse,
        compression=_HvdCompression.none if sparse else compression, sparse_as_dense=sparse_as_dense,
        op=op, gradient_predivide_factor=gradient_predivide_factor, num_groups=num_groups, groups=groups,
        process_set=process_set, scale_local_gradients=scale_local_gradients)
    if sparse:
        tape._allreduce_grads = _sparse_reduce_fn(compression, process_set, op, gradient_predivide_factor)
        tape.gtopk_compression = compression
    return tape


def DistributedOptimizer(optimizer, name=None, device_dense='', device_sparse='',
                         compression=Compression.none, sparse_as_dense=False, gradient_predivide_factor=1.0,
                         op=hvd.Average, backward_passes_per_step=1, average_aggregated_gradients=False,
                         num_groups=0, groups=None, process_set=hvd.global_process_set,
                         scale_local_gradients=True, momentum_correction=False):
    """``horovod.tensorflow.keras.DistributedOptimizer`` with the same
    signature, plus the sparse ``compression=`` choices.  With a sparse
    compression the optimizer tracks it (attribute ``gtopk_compression``),
    so its residuals, velocities and step counter checkpoint with the
    optimizer: ``tf.train.Checkpoint(model=model, optimizer=opt)`` or
    ``model.save_weights`` in TF format.

    ``momentum_correction=True`` (``optimizer`` a Keras SGD): DGC momentum
    correction with momentum factor masking, with the optimizer's momentum
    and Nesterov flag; the returned optimizer then applies the reduced
    update without momentum (its ``update_step`` runs with momentum 0, its
    config keeps the user's values) and keeps its (decoupled) weight decay.
    A compression built with ``momentum=`` next to an SGD with momentum is a
    ``ValueError`` (momentum applied twice)."""
    sparse = _check_compression(compression)
    opt = hvd_keras.DistributedOptimizer(
        optimizer, name=name, device_dense=device_dense, device_sparse=device_sparse,
        compression=_HvdCompression.none if sparse else compression, sparse_as_dense=sparse_as_dense,
        gradient_predivide_factor=gradient_predivide_factor, op=op,
        backward_passes_per_step=backward_passes_per_step,
        average_aggregated_gradients=average_aggregated_gradients, num_groups=num_groups, groups=groups,
        process_set=process_set, scale_local_gradients=scale_local_gradients)
    if sparse:
        reduce_fn = _sparse_reduce_fn(compression, process_set, op, gradient_predivide_factor)
        opt._allreduce_grads = reduce_fn
        # backward_passes_per_step > 1: Horovod's local-aggregation helper
        # (eager or graph flavour) took its own reference to the reduction
        # function when it was built; it sums the passes locally and calls the
        # function once per exchange, so the sparse reduction sees the
        # aggregated gradient and its step counter counts exchanges.
        helper = getattr(opt, "_agg_helper", None)
        if helper is not None:
            for attr in ("allreduce_grads", "_allreduce_grads"):
                if hasattr(helper, attr):
                    setattr(helper, attr, reduce_fn)
        opt.gtopk_compression = compression
    _setup_correction(compression, sparse, momentum_correction, opt, warn_uncorrected=True)
    return opt
