"""``SparseCompression``: a registered compressor of the core as a
Horovod-TensorFlow ``compression=``, holding this worker's state (residuals,
momentum-correction velocities, the step counter) as ``tf.Variable`` objects
of a ``tf.Module``, so every checkpoint that holds it saves and restores them.

The settings are the PyTorch side's :class:`~gtopk_plugin.config.ReducerConfig`
(same validation, same messages), the method is looked up in the compressor
registry (a compressor registered from user code works here too), and the
step itself is :func:`.step.reduce`.
"""
from __future__ import annotations

import re
from typing import Optional

import torch

from gtopk_plugin.config import ReducerConfig
from gtopk_plugin.pipeline.traffic import STATS_FIELDS, TRANSPORT_FIELDS, StepTraffic
from gtopk_plugin.frameworks.horovod_tf import selection
from gtopk_plugin.frameworks.horovod_tf._guard import tf
from gtopk_plugin.frameworks.horovod_tf.codec_state import CodecState, decode, has_state

__all__ = ["SparseCompression", "TRAFFIC_FIELDS"]

_TF_WIRE = {None: None, "float16": tf.float16, "bfloat16": tf.bfloat16, "int8": tf.int8}
_TORCH_WIRE = {None: None, "float16": torch.float16, "bfloat16": torch.bfloat16, "int8": torch.int8}
# last_step_traffic's int64 vector: the transport's fields, the statistics', skipped
TRAFFIC_FIELDS = TRANSPORT_FIELDS + STATS_FIELDS + ("skipped",)
_DEFAULTS = dict(r_factor=4.0, merge=None, granularity="layer", seed=0, nonfinite="raise", momentum=None,
                 nesterov=False, dampening=0.0, momentum_masking=True, clip_norm=None, hyper=(),
                 exchange="gloo", dense_below=0, wire_rounding="nearest")


def _wire_name(value_dtype) -> Optional[str]:
    if value_dtype is None:
        return None
    for name, tdt in (("float16", tf.float16), ("bfloat16", tf.bfloat16), ("int8", tf.int8)):
        if value_dtype in (name, tdt, _TORCH_WIRE[name]):
            return name
    raise ValueError(f"value_dtype must be None, tf.float16, tf.bfloat16 or tf.int8; got {value_dtype!r}")


def _check_int8(config, exchange: str, cmp) -> None:
    """The int8 wire runs only where the core's own aggregation runs
    (:mod:`.fused`: the core quantizes every message, re-rounds the merged
    sums and hands back the roundings this rank owns); elsewhere every rank
    raises the same ValueError at construction."""
    from gtopk_plugin.frameworks.horovod_tf.fused import FUSED_AGGREGATIONS

    if exchange != "gloo":
        raise ValueError(f"value_dtype=tf.int8 needs exchange='gloo' (the core's aggregation on the side "
                         f"channel); exchange={exchange!r} cannot carry it -- pass value_dtype=tf.float16 "
                         "or tf.bfloat16 there")
    if not getattr(cmp, "exact_count", False) or config.aggregation not in FUSED_AGGREGATIONS:
        raise ValueError(f"value_dtype=tf.int8 is not available for method {config.method!r} "
                         f"(aggregation {config.aggregation!r}) in the TensorFlow layer: its counts vary, so "
                         "it takes the TF path, which has no int8 wire; use Compression.topk or .gtopk "
                         "(exact counts) with value_dtype=tf.int8, or value_dtype=tf.float16 with "
                         f"{config.method!r}")


class _Untracked:
    """Holds a variable out of checkpoints: a ``tf.Module`` tracks
    (checkpoints) every variable among its attributes, but the last step's
    traffic record is a report, not state -- and leaving it out keeps
    checkpoints written before the record grew (8 entries, now 12)
    restorable."""

    def __init__(self, var):
        self.var = var


class SparseCompression(tf.Module):
    """A compressor of the registry as a Horovod-TF ``compression=``; made by
    ``Compression.topk/gtopk/rtopk/randomk/threshold(density, ...)`` (or any
    registered method: ``SparseCompression("mine", density, hyper={...})``).

    It holds this worker's error-feedback residuals (one non-trainable
    ``tf.Variable`` per gradient, flat, created at the first step) and the
    step counter (``tf.Variable``, int64), so create it once and pass the
    same object to every step's ``DistributedGradientTape``.  One object per
    list of variables: residuals are keyed by position in that list.

    Args:
        method, density: as :class:`~gtopk_plugin.GradientReducer`.
        r_factor: rTop-k's r (keep k of the top r·k).
        hyper, **method_hyper: the method's own hyper-parameters (as the
            registry declares them; validated, ``ValueError`` naming the
            valid range and, for an unknown keyword, the method's
            hyper-parameters).
        value_dtype: None, ``tf.float16``, ``tf.bfloat16`` or ``tf.int8`` (values
            on the wire; int8: 1-byte codes with one power-of-two exponent
            byte per message, the rounding error kept exactly in the
            residual, as the PyTorch side's ``torch.int8`` -- topk, gtopk,
            rtopk, randomk with ``exchange="gloo"``; docs/api.md).
        wire_rounding: the int8 wire's rounding, ``"nearest"`` (default) or
            ``"stochastic"`` (unbiased, keyed by (seed, step); only with
            ``value_dtype=tf.int8``).
        merge: None or an aggregation the method allows (``"allgather"``,
            ``"gtopk"``: any selector on the butterfly).
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
            masking, with the Keras SGD's own momentum and Nesterov flag:
            ``DistributedOptimizer`` takes them from the optimizer it wraps,
            ``DistributedGradientTape`` from its ``optimizer=``; that
            optimizer then applies the update without momentum (see
            :func:`.momentum.bind_momentum`).
        momentum, nesterov, dampening: DGC momentum correction (Lin et al.
            2018; compress/momentum.py): each worker keeps a velocity
            ``u <- m·u + g`` (Nesterov: ``u <- m·(u + g)``, increment
            ``u + g``) and accumulates it, not ``g``, into the residual.
            The optimizer that applies the update must then have no momentum
            of its own.  ``None`` (default): off.
        momentum_masking: zero the velocity where the accumulator's entry
            reached the global result (DGC's momentum factor masking).
        clip_norm: DGC local gradient clipping: each worker scales its
            gradient so that its L2 norm over all tensors of the call is at
            most ``clip_norm · P^-1/2``, before the velocity and residual.
        exchange: ``"gloo"`` (default): the step's exchanges on a gloo
            side channel made inside the job at the first step (one
            Horovod broadcast; issue #15: a Horovod op costs a cycle of its
            background loop), ``"horovod"``: as Horovod ops (what
            ``SparseElasticState`` sets: elastic recovery needs Horovod's
            errors).  Same bytes, same results either way.
        dense_below: tensors with fewer entries go dense (exact sum, no
            residual, in their own dtype) in the same step, as the PyTorch
            side's ``dense_below`` (default 0: off; :mod:`.small`).
        name: prefix of the Horovod op names (distinct per object when
            several compressions reduce in the same step).

    State (``tf.Variable`` objects tracked by this ``tf.Module``, so in
    every checkpoint that holds it): ``residuals``, ``velocities`` (with
    momentum correction), ``step`` and, for a compressor with state of its
    own (PowerSGD's warm-start factors), ``compressor_state``
    (:mod:`.codec_state`): a restored job resumes bit for bit.
    """

    def __init__(self, method: str, density: float = 0.01, *, r_factor: float = 4.0, hyper=None,
                 value_dtype=None, merge: Optional[str] = None, granularity: str = "layer", seed: int = 0,
                 nonfinite: str = "raise", error_feedback: bool = True, warmup=None,
                 momentum_correction: bool = False, momentum: Optional[float] = None, nesterov: bool = False,
                 dampening: float = 0.0, momentum_masking: bool = True, clip_norm: Optional[float] = None,
                 name: Optional[str] = None, exchange: str = "gloo", dense_below: int = 0,
                 wire_rounding: str = "nearest", **method_hyper):
        # the method's own hyper-parameters may come as keywords (as
        # Compression.<name>(density, **kwargs) passes them) or as hyper=
        hyper = {**dict(hyper or {}), **method_hyper}
        if nonfinite == "propagate":
            raise ValueError("nonfinite='propagate' is for torch's GradScaler; the TensorFlow layer takes "
                             "'raise' or 'skip'")
        if momentum_correction and momentum is not None:
            raise ValueError("pass either momentum_correction=True (momentum read from the optimizer) "
                             "or momentum=<float>, not both")
        wire = _wire_name(value_dtype)
        if wire_rounding in ("stochastic",) and wire != "int8":  # the PyTorch side's check, in TF's words
            raise ValueError("wire_rounding='stochastic' applies to the int8 wire; pass value_dtype=tf.int8 "
                             "(fp16/bf16 casts round to nearest)")
        self.config = ReducerConfig(method=method, density=density, r_factor=r_factor, merge=merge,
                                    granularity=granularity, value_dtype=_TORCH_WIRE[wire], seed=seed,
                                    nonfinite=nonfinite, error_feedback=bool(error_feedback),
                                    warmup=warmup, momentum=momentum, nesterov=bool(nesterov),
                                    dampening=dampening, momentum_masking=bool(momentum_masking),
                                    clip_norm=clip_norm, hyper=hyper,
                                    dense_below=dense_below,
                                    wire_rounding=wire_rounding)  # validates (ValueError)
        if self.config.aggregation == "dense":
            raise ValueError(f"{method!r} is a dense reduction: that is Compression.none (Horovod's own "
                             "allreduce), not a sparse compression")
        from gtopk_plugin.frameworks.horovod_tf.collectives import AGGREGATIONS  # at construction, on every rank, not at the first step
        if self.config.aggregation not in AGGREGATIONS and self.config.aggregation != "allreduce_rounds":
            raise ValueError(f"merge={self.config.aggregation!r} is not available in the TensorFlow layer "
                             f"(it has {', '.join(AGGREGATIONS)}, allreduce_rounds); use the method's "
                             "default merge here, or the PyTorch layer (gtopk_plugin.horovod) for this one")
        prefix = name or f"gtopk_tf_{method}"
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", prefix):
            raise ValueError(f"name must be a Python identifier (it prefixes Horovod op names); got {prefix!r}")
        super().__init__(name=prefix)
        self.prefix = prefix
        if exchange not in ("gloo", "horovod"):
            raise ValueError(f"exchange must be 'gloo' or 'horovod'; got {exchange!r}")
        self.exchange = exchange
        self.wire_dtype = _TF_WIRE[wire]
        # the registry's compressor: selection / encoding (see .selection)
        self.compressor = selection.compressor(method, **self.config.method_hyper)
        if wire == "int8":
            _check_int8(self.config, exchange, self.compressor)
        self.momentum_correction = bool(momentum_correction)  # take the Keras SGD's momentum over
        with tf.init_scope():
            self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")
            # the compressor's own state (PowerSGD's warm-start Q), when it has
            # any: torch.save bytes, checkpointed with the rest (.codec_state)
            self._codec = CodecState(self.compressor) if has_state(self.compressor) else None
            if self._codec is not None:
                self.compressor_state = tf.Variable(b"", dtype=tf.string, trainable=False,
                                                    name="compressor_state")
        self.residuals = {}  # "r0003" -> flat tf.Variable (tracked: checkpoints)
        self.velocities = {}  # "u0003" -> flat tf.Variable: momentum correction's u
        # A Keras SGD whose momentum/nesterov the correction takes over
        # (momentum_correction=True); None: the config's momentum.
        self._momentum_from = None
        with tf.init_scope():  # the last step's StepTraffic fields (TRAFFIC_FIELDS)
            self._traffic_box = _Untracked(tf.Variable(tf.zeros([len(TRAFFIC_FIELDS)], tf.int64),
                                                       trainable=False, name="last_step_traffic"))

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
                                                     ("clip_norm", c.clip_norm),
                                                     ("exchange", self.exchange),
                                                     ("dense_below", c.dense_below),
                                                     ("wire_rounding", c.wire_rounding))
                        if v != _DEFAULTS[k])
        if c.hyper:  # the method's own hyper-parameters, as keywords (Compression.<method>(..., k=v))
            extra += "".join(f", {k}={v!r}" for k, v in dict(c.hyper).items())
        if self.momentum_correction:
            extra += ", momentum_correction=True"
        if self.wire_dtype is not None:
            extra += f", value_dtype=tf.{self.wire_dtype.name}"
        if getattr(self.compressor, "kind", "selector") == "codec":  # no density: Compression.onebit(...)
            return f"Compression.{c.method}({extra[2:]})"
        return f"Compression.{c.method}({c.density!r}{extra})"

    # Horovod's own tape/optimizer call these: say plainly that they cannot run us.
    def compress(self, tensor):
        raise TypeError(f"{self!r} is a sparse gtopk_plugin compression: pass it to "
                        "gtopk_plugin.tensorflow.DistributedGradientTape / DistributedOptimizer, "
                        "not to horovod.tensorflow's")

    decompress = compress

    # -- state ----------------------------------------------------------------
    def state_var(self, store: dict, what: str, key: str, numel: int, dtype):
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

    def momentum_spec(self):
        """The momentum correction of the next call: ``(momentum, nesterov,
        dampening)`` or None (off).  Taken from the bound Keras SGD (read at
        every call, so inside ``tf.function`` at trace time, as Keras' own
        ``update_step`` reads it) when its momentum is not 0, else from the
        ``momentum=`` this compression was built with."""
        from gtopk_plugin.frameworks.horovod_tf.tf_momentum import keras_sgd_momentum

        opt = self._momentum_from
        if opt is not None:
            spec = keras_sgd_momentum(opt)
            if spec is not None:
                return spec
        c = self.config
        return None if c.momentum is None else (c.momentum, c.nesterov, c.dampening)

    @property
    def _traffic(self):
        return self._traffic_box.var

    @property
    def last_step_traffic(self) -> dict:
        """This worker's traffic in the last step, as the PyTorch layers
        report it (:class:`gtopk_plugin.pipeline.traffic.StepTraffic` ``.as_dict()``):
        ``bytes_sent``/``bytes_received`` (payload + headers), their
        ``payload_``/``header_`` parts, ``control_bytes`` (the consistency
        check), ``messages_sent``, ``numel``, ``k`` (entries selected per
        rank), ``sent_entries``, ``rounds``, ``dense_bytes`` (what a ring
        allreduce of the same gradients would send) and ``skipped``.
        Counted as the PyTorch transport counts (see :mod:`.ops`).  Read
        eagerly."""
        v = dict(zip(TRAFFIC_FIELDS, (int(x) for x in self._traffic.numpy())))
        skipped = bool(v.pop("skipped"))
        return StepTraffic(**v, buckets=1, skipped=skipped).as_dict()

    def residual_values(self) -> dict:
        """This worker's residuals as numpy arrays (flat), by key."""
        return {k: v.numpy() for k, v in self.residuals.items()}

    def codec_state(self):
        """``(CodecState, tf.string variable)`` for the numpy-function
        bridges, or None when the compressor keeps no state."""
        return None if self._codec is None else (self._codec, self.compressor_state)

    def compressor_state_dict(self) -> dict:
        """The compressor's state as its ``state_dict()`` gives it (PowerSGD:
        ``{"q": {name: ΣQ/W}}``), read from the checkpointed variable
        (eagerly); ``{}`` for a stateless compressor or before the first step."""
        return {} if self._codec is None else decode(self.compressor_state.numpy())

    def velocity_values(self) -> dict:
        """This worker's momentum-correction velocities as numpy arrays
        (flat), by key (``u0003`` goes with the residual ``r0003``)."""
        return {k: v.numpy() for k, v in self.velocities.items()}

    def reduce(self, grads, process_set=None, op=None, gradient_predivide_factor: float = 1.0):
        """Reduce the list ``grads`` (tensors, ``IndexedSlices`` or None)
        across the Horovod workers of ``process_set``; returns the list of
        updates (None stays None).  Collective: every rank calls it with the
        same shapes.  Works eagerly and while tracing a ``tf.function``."""
        from gtopk_plugin.frameworks.horovod_tf.step import reduce

        return reduce(self, grads, process_set, op, gradient_predivide_factor)
