"""``SparseCompression``: a registered compressor of the core as a
Horovod-TensorFlow ``compression=``; its settings are a
:class:`~gtopk_plugin.config.ReducerConfig` (the PyTorch side's validation
and messages), its state ``tf.Variable`` objects of a ``tf.Module`` (saved
by every checkpoint that holds it); the step is :func:`.tf_step.reduce`.
"""
from __future__ import annotations

import re
from dataclasses import fields
from typing import Optional

import torch

from gtopk_plugin.config import ReducerConfig, split_momentum_correction
from gtopk_plugin.pipeline.traffic import STATS_FIELDS, TRANSPORT_FIELDS, StepTraffic
from gtopk_plugin.frameworks.horovod_tf import tf_step
from gtopk_plugin.frameworks.horovod_tf._guard import tf
from gtopk_plugin.frameworks.horovod_tf.tf_bridge import CodecState, compressor, decode_state, has_state
from gtopk_plugin.frameworks.horovod_tf.tf_momentum import keras_sgd_momentum

__all__ = ["SparseCompression", "TRAFFIC_FIELDS"]

# last_step_traffic's int64 vector: the transport's fields, the statistics', skipped
TRAFFIC_FIELDS = TRANSPORT_FIELDS + STATS_FIELDS + ("skipped",)
# the core's aggregations this layer runs; the int8 wire: those of exact counts
AGGREGATIONS = ("allgather", "butterfly", "allreduce_values", "allgather_payloads", "allreduce_rounds")
_INT8_AGGREGATIONS = ("allgather", "butterfly", "allreduce_values")
# the settings repr shows where they differ from ReducerConfig's defaults
_SHOWN = ("r_factor", "merge", "granularity", "seed", "nonfinite", "momentum_correction", "nesterov", "dampening",
          "momentum_masking", "clip_norm", "dense_below", "wire_rounding")


def _wire_name(value_dtype) -> Optional[str]:
    names = [n for n in ("float16", "bfloat16", "int8") if value_dtype in (n, tf.as_dtype(n), getattr(torch, n))]
    if value_dtype is not None and not names:
        raise ValueError(f"value_dtype must be None, tf.float16, tf.bfloat16 or tf.int8; got {value_dtype!r}")
    return names[0] if names else None


def _check_int8(config, exchange: str, cmp) -> None:
    """Where the int8 wire cannot run: a ValueError at construction."""
    if exchange != "gloo":
        raise ValueError(f"value_dtype=tf.int8 needs exchange='gloo' (the core's aggregation on the side "
                         f"channel); exchange={exchange!r} cannot carry it -- pass value_dtype=tf.float16 "
                         "or tf.bfloat16 there")
    if not getattr(cmp, "exact_count", False) or config.aggregation not in _INT8_AGGREGATIONS:
        raise ValueError(f"value_dtype=tf.int8 is not available for method {config.method!r} "
                         f"(aggregation {config.aggregation!r}) in the TensorFlow layer: its counts vary, and "
                         "the layer carries int8 with exact counts only; use Compression.topk or .gtopk "
                         "(exact counts) with value_dtype=tf.int8, or value_dtype=tf.float16 with "
                         f"{config.method!r}")


class _Untracked:
    """Holds a variable out of checkpoints (the last step's traffic record
    is a report, not state)."""

    def __init__(self, var):
        self.var = var


class SparseCompression(tf.Module):
    """A registered compressor as a Horovod-TF ``compression=``, made by
    ``Compression.<method>(density, ...)``.  Create it once and pass it every
    step: it holds this worker's state (``residuals``, ``velocities``,
    ``step``, ``compressor_state``: tracked ``tf.Variable`` objects, keyed by
    position in the variable list), so checkpoints resume bit for bit.

    Keywords as :class:`~gtopk_plugin.GradientReducer`'s, except:
    ``value_dtype`` None, ``tf.float16``, ``tf.bfloat16`` or ``tf.int8``
    (int8: exact-count selectors with ``exchange="gloo"``); ``nonfinite``
    ``"raise"`` or ``"skip"``; ``momentum_correction=True``: DGC momentum
    correction with the wrapped Keras SGD's momentum (:mod:`.tf_momentum`),
    a number: that momentum (the optimizer built without it);
    ``exchange``: ``"gloo"`` (a side channel made inside the job, the
    default) or ``"horovod"`` (Horovod ops; what elastic states set);
    ``name``: the prefix of Horovod op names.
    """

    def __init__(self, method: str, density: float = 0.01, *, r_factor: float = 4.0, hyper=None,
                 value_dtype=None, merge: Optional[str] = None, granularity: str = "layer", seed: int = 0,
                 nonfinite: str = "raise", error_feedback: bool = True, warmup=None,
                 momentum_correction=None, nesterov: bool = False,
                 dampening: float = 0.0, momentum_masking: bool = True, clip_norm: Optional[float] = None,
                 name: Optional[str] = None, exchange: str = "gloo", dense_below: int = 0,
                 wire_rounding: str = "nearest", **method_hyper):
        hyper = {**dict(hyper or {}), **method_hyper}
        if nonfinite == "propagate":
            raise ValueError("nonfinite='propagate' is for torch's GradScaler; the TensorFlow layer takes "
                             "'raise' or 'skip'")
        momentum, bind = split_momentum_correction(momentum_correction, wrapped=True)
        wire = _wire_name(value_dtype)
        if wire_rounding in ("stochastic",) and wire != "int8":  # the PyTorch side's check, in TF's words
            raise ValueError("wire_rounding='stochastic' applies to the int8 wire; pass value_dtype=tf.int8 "
                             "(fp16/bf16 casts round to nearest)")
        self.config = ReducerConfig(  # validates (ValueError)
            method=method, density=density, r_factor=r_factor, merge=merge, granularity=granularity, seed=seed,
            value_dtype=wire and getattr(torch, wire), nonfinite=nonfinite, error_feedback=bool(error_feedback),
            warmup=warmup, momentum_correction=momentum, nesterov=bool(nesterov), dampening=dampening,
            momentum_masking=bool(momentum_masking), clip_norm=clip_norm, hyper=hyper, dense_below=dense_below,
            wire_rounding=wire_rounding)
        if self.config.aggregation == "dense":
            raise ValueError(f"{method!r} is a dense reduction: that is Compression.none (Horovod's own "
                             "allreduce), not a sparse compression")
        if self.config.aggregation not in AGGREGATIONS:
            raise ValueError(f"merge={self.config.aggregation!r} is not available in the TensorFlow layer "
                             f"(it has {', '.join(AGGREGATIONS)}); use the method's "
                             "default merge here, or the PyTorch layer (gtopk_plugin.horovod) for this one")
        prefix = name or f"gtopk_tf_{method}"
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", prefix):
            raise ValueError(f"name must be a Python identifier (it prefixes Horovod op names); got {prefix!r}")
        super().__init__(name=prefix)
        self.prefix = prefix
        if exchange not in ("gloo", "horovod"):
            raise ValueError(f"exchange must be 'gloo' or 'horovod'; got {exchange!r}")
        self.exchange = exchange
        self.wire_dtype = wire and tf.as_dtype(wire)
        self.compressor = compressor(method, **self.config.method_hyper)
        if wire == "int8":
            _check_int8(self.config, exchange, self.compressor)
        self.momentum_correction = bind
        with tf.init_scope():
            self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")
            # a compressor's own state (PowerSGD's warm-start Q): torch.save bytes
            self._codec = CodecState(self.compressor) if has_state(self.compressor) else None
            if self._codec is not None:
                self.compressor_state = tf.Variable(b"", dtype=tf.string, trainable=False,
                                                    name="compressor_state")
            # the last step's StepTraffic fields (TRAFFIC_FIELDS)
            self._traffic = _Untracked(tf.Variable(tf.zeros([len(TRAFFIC_FIELDS)], tf.int64),
                                                   trainable=False, name="last_step_traffic"))
        self.residuals, self.velocities = {}, {}  # "r0003"/"u0003" -> flat tf.Variable
        self._momentum_from = None  # the Keras SGD whose momentum the correction takes over

    @property
    def method(self) -> str:
        return self.config.method

    @property
    def density(self) -> float:
        return self.config.density

    def __repr__(self):
        c = self.config
        extra = [f"{f.name}={getattr(c, f.name)!r}" for f in fields(c)
                 if f.name in _SHOWN and getattr(c, f.name) != f.default]
        extra += [f"exchange={self.exchange!r}"] if self.exchange != "gloo" else []
        extra += [f"{k}={v!r}" for k, v in c.hyper]  # the method's own, as Compression.<method>(..., k=v)
        extra += ["momentum_correction=True"] if self.momentum_correction else []
        extra += [f"value_dtype=tf.{self.wire_dtype.name}"] if self.wire_dtype is not None else []
        if getattr(self.compressor, "kind", "selector") != "codec":  # a codec: no density
            extra.insert(0, repr(c.density))
        return f"Compression.{c.method}({', '.join(extra)})"

    def compress(self, tensor):
        raise TypeError(f"{self!r} is a sparse gtopk_plugin compression: pass it to "
                        "gtopk_plugin.tensorflow.DistributedGradientTape / DistributedOptimizer, "
                        "not to horovod.tensorflow's")

    decompress = compress

    # -- state ----------------------------------------------------------------
    def state_var(self, store: dict, what: str, key: str, numel: int, dtype):
        """The flat state variable ``key`` of ``store``, zero at first use."""
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
        """``(momentum, nesterov, dampening)`` of the next call, or None: the
        bound Keras SGD's (read at every call, at trace time inside
        ``tf.function``) when not 0, else this compression's own momentum."""
        opt = self._momentum_from
        if opt is not None:
            spec = keras_sgd_momentum(opt)
            if spec is not None:
                return spec
        c = self.config
        return None if c.momentum_correction is None else (c.momentum_correction, c.nesterov, c.dampening)

    @property
    def last_step_traffic(self) -> dict:
        """This worker's traffic in the last step (read eagerly), in the
        PyTorch layers' format (``StepTraffic.as_dict()``) plus ``skipped``."""
        v = dict(zip(TRAFFIC_FIELDS, (int(x) for x in self._traffic.var.numpy())))
        skipped = bool(v.pop("skipped"))
        return StepTraffic(**v, buckets=1, skipped=skipped).as_dict()

    def residual_values(self) -> dict:
        """This worker's residuals (flat numpy arrays) by key, ``r0003``..."""
        return {k: v.numpy() for k, v in self.residuals.items()}

    def codec_state(self):
        """``(CodecState, tf.string variable)``, or None (a stateless compressor)."""
        return None if self._codec is None else (self._codec, self.compressor_state)

    def compressor_state_dict(self) -> dict:
        """The compressor's ``state_dict()`` as checkpointed (``{}``: none)."""
        return {} if self._codec is None else decode_state(self.compressor_state.numpy())

    def velocity_values(self) -> dict:
        """This worker's velocities (``u0003`` goes with ``r0003``)."""
        return {k: v.numpy() for k, v in self.velocities.items()}

    @tf.autograph.experimental.do_not_convert  # graph-safe as written; see tf_optimizer's allreduce_grads
    def reduce(self, grads, process_set=None, op=None, gradient_predivide_factor: float = 1.0):
        """The updates of the list ``grads`` (None stays None) over
        ``process_set``; collective, eager or inside ``tf.function``."""
        return tf_step.reduce(self, grads, process_set, op, gradient_predivide_factor)
