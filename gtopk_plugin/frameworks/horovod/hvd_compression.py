"""The ``compression=`` choices of the PyTorch Horovod optimizer.

Horovod's own ``Compression`` has ``none`` and ``fp16`` (dense allreduce);
ours adds the sparse methods of the core (docs/design.md §2) as
:class:`SparseCompression` objects, made by ``Compression.topk/gtopk/rtopk/
randomk/threshold(density, ...)`` and validated at construction.  The
names and factory methods are shared with the TensorFlow layer
(:mod:`gtopk_plugin.frameworks.compression_names`), so a job switches
framework without renaming anything.

Like Horovod's ``horovod/torch/compression.py``, this module only describes
a compression; :mod:`.optimizer` runs it.
"""
from __future__ import annotations

from typing import Optional

import torch
from horovod.torch.compression import Compression as _HvdCompression
from horovod.torch.compression import Compressor as _HvdCompressor

from gtopk_plugin import config, registry
from gtopk_plugin.config import ReducerConfig
from gtopk_plugin.frameworks.compression_names import SPARSE_METHODS, CompressionNames

__all__ = ["SparseCompression", "Compression", "is_dense_compressor", "sparse_choices"]

_NONFINITE = ("raise", "skip", "propagate")
# The core's dense reducer: in this layer dense reduction is Horovod's own
# allreduce (Compression.none / fp16), so the registry's "dense" is refused.
DENSE_METHOD = "dense"


class SparseCompression:
    """A compressor of the core's registry (:mod:`gtopk_plugin.registry`),
    selected as a Horovod ``compression=``.

    Made by ``Compression.<name>(density, ...)`` for any registered method
    (``topk``, ``gtopk``, ``rtopk``, ``randomk``, ``threshold``, codecs such
    as ``onebit``, or one registered from user code); validated at
    construction (``ValueError`` naming the bad keyword).

    Args:
        method, density: as :class:`~gtopk_plugin.GradientReducer`.
        r_factor: rTop-k's r (keep k of the top r·k); accepted by every
            method, used by those that declare it.
        **hyper: the method's own hyper-parameters (``registry.describe``).
        value_dtype: ``None``, ``torch.float16``, ``torch.bfloat16`` or
            ``torch.int8`` values on the wire (int8: 5 bytes per entry plus one
            exponent byte per message, rounding error kept exactly in the
            residual; see GradientReducer and docs/api.md).
        wire_rounding: the int8 wire's rounding, ``"nearest"`` (default) or
            ``"stochastic"`` (unbiased, keyed by (seed, step)).
        warmup: density schedule (``DensityWarmup``, a sequence, or a callable).
        merge, granularity, seed, error_feedback, kernels: as GradientReducer
            (``granularity="global"`` selects per bucket).
        nonfinite: ``"raise"`` (every rank raises, nothing applied),
            ``"skip"`` (every rank applies zero for the step, residuals kept),
            or ``"propagate"`` (as "skip", but the skipped bucket's gradients
            are set to NaN on every rank, so a ``torch.cuda.amp.GradScaler``
            sees the overflow, skips ``optimizer.step`` and lowers its scale,
            as it would with dense Horovod allreduce).
        fusion_threshold: bucket size in bytes (default ``GTOPK_FUSION_THRESHOLD``
            or 64 MiB).  Smaller buckets start their exchange earlier in
            backward; each costs a consistency check and its own rounds.
        momentum_correction: DGC momentum correction with factor masking,
            using the wrapped SGD optimizer's own momentum, nesterov,
            dampening and weight decay (read at every step; the optimizer's
            ``step()`` then runs with momentum and weight decay 0 for those
            groups, restored right after).  Adam/AdamW: ``ValueError`` (use
            plain error feedback).  See docs/recipes.md.
        momentum, nesterov, momentum_masking: explicit correction settings
            (as GradientReducer) for an optimizer built without momentum.
        clip_norm: DGC local clipping (threshold × P^-1/2, global norm over
            all buckets of the step: with it, buckets are reduced after
            backward, in ``synchronize()``).
        dense_below: tensors with fewer entries go dense (exact sum, no
            residual) in the same step, as GradientReducer(dense_below=)
            (default 0: off).
        exchange: ``"gloo"`` (default): the sparse exchange runs on a gloo
            side channel made inside the job, leaving one Horovod op per
            step (join detection); ``"horovod"``: every exchange step is a
            Horovod collective (alltoall per butterfly round).  Same
            results and byte counts; docs/results.md compares their timings.  (With NCCL-built Horovod always "horovod".)
            Like every setting it must be the same on every rank; unlike the
            others a mismatch here is not detected (Horovod stalls).

    Objects of this class only work with ``gtopk_plugin.horovod.DistributedOptimizer``.
    """

    def __init__(self, method: str, density: float, *, r_factor: float = 4.0,
                 value_dtype: Optional[torch.dtype] = None, warmup=None, merge: Optional[str] = None,
                 granularity: str = "layer", seed: int = 0, nonfinite: str = "raise",
                 error_feedback: bool = True, kernels: Optional[str] = None,
                 fusion_threshold: Optional[int] = None, momentum_correction: bool = False,
                 momentum: Optional[float] = None, nesterov: bool = False,
                 momentum_masking: bool = True, clip_norm: Optional[float] = None,
                 exchange: str = "gloo", dense_below: int = 0, wire_rounding: str = "nearest", **hyper):
        if method == DENSE_METHOD:
            raise ValueError("dense reduction is Compression.none (Horovod's own allreduce), not a sparse "
                             "compression")
        if nonfinite not in _NONFINITE:
            raise ValueError(f"unknown nonfinite policy {nonfinite!r}; pass 'raise', 'skip' or 'propagate'")
        if fusion_threshold is None:
            fusion_threshold = config.env_fusion_threshold_bytes()
        if isinstance(fusion_threshold, bool) or not isinstance(fusion_threshold, int) or fusion_threshold < 1:
            raise ValueError(f"fusion_threshold must be a positive number of bytes; got {fusion_threshold!r}")
        if exchange not in ("gloo", "horovod"):
            raise ValueError(f"exchange must be 'gloo' or 'horovod'; got {exchange!r}")
        self.nonfinite = nonfinite
        self.fusion_threshold = fusion_threshold
        self.exchange = exchange
        kw = dict(method=method, density=density, r_factor=r_factor, merge=merge,
                  granularity=granularity, value_dtype=value_dtype, seed=seed, warmup=warmup,
                  nonfinite="skip" if nonfinite == "propagate" else nonfinite,
                  error_feedback=bool(error_feedback), momentum=momentum, nesterov=bool(nesterov),
                  momentum_masking=bool(momentum_masking), clip_norm=clip_norm,
                  dense_below=dense_below, wire_rounding=wire_rounding)
        if momentum_correction and momentum is not None:
            raise ValueError("pass either momentum_correction=True (momentum read from the optimizer) "
                             "or momentum=<float>, not both")
        self.momentum_correction = bool(momentum_correction)
        if kernels is not None:
            kw["kernels"] = kernels
        self.config = ReducerConfig(**kw, hyper=hyper)  # validates method, hyper-parameters (ValueError)
        self._reducer_kwargs = dict(kw, **hyper)

    @property
    def method(self) -> str:
        return self.config.method

    @property
    def density(self) -> float:
        return self.config.density

    def reducer_kwargs(self) -> dict:
        """GradientReducer keywords (all but ``op`` and ``transport``)."""
        return dict(self._reducer_kwargs)

    def __repr__(self):
        extra = "".join(f", {k}={v!r}" for k, v in self._reducer_kwargs.items()
                        if k not in ("method", "density") and v != _DEFAULTS.get(k))
        if self.momentum_correction:
            extra += ", momentum_correction=True"
        if self.exchange != "gloo":
            extra += f", exchange={self.exchange!r}"
        if not registry.get(self.method).uses_density:  # codecs: Compression.onebit(...)
            return f"Compression.{self.method}({extra[2:]})"
        return f"Compression.{self.method}({self.density!r}{extra})"

    # Horovod's own optimizer calls these: say plainly that it cannot run us.
    def compress(self, tensor):
        raise TypeError(f"{self!r} is a sparse gtopk_plugin compression: pass it to "
                        "gtopk_plugin.horovod.DistributedOptimizer, not horovod.torch.DistributedOptimizer")

    decompress = compress


_DEFAULTS = dict(r_factor=4.0, merge=None, granularity="layer", value_dtype=None, seed=0, warmup=None,
                 nonfinite="raise", error_feedback=True, momentum=None, nesterov=False,
                 momentum_masking=True, clip_norm=None, dense_below=0, wire_rounding="nearest")


class Compression(CompressionNames):
    """Gradient compression for :func:`DistributedOptimizer`.

    ``none`` and ``fp16`` are Horovod's own compressors (dense allreduce:
    :func:`DistributedOptimizer` returns Horovod's own optimizer).  Every
    other attribute is a compressor of the registry, generated on access
    (:mod:`gtopk_plugin.frameworks.compression_names`): a method that
    selects entries takes the density (fraction of entries sent per
    tensor), e.g. ``topk(density)`` (Top-k S-SGD), ``gtopk(density)`` (the
    gTop-k butterfly), ``rtopk(density, r_factor=4)``, ``randomk(density)``,
    ``threshold(density)``; a codec takes keywords only (``onebit()``).
    All take the method's own hyper-parameters and the keywords of
    :class:`SparseCompression` (``value_dtype``, ``warmup``, ``nonfinite``,
    ``fusion_threshold``, ...).  ``Compression.names()`` lists them.
    """

    none = _HvdCompression.none
    fp16 = _HvdCompression.fp16
    _sparse = SparseCompression
    _public_name = "gtopk_plugin.horovod.Compression"


def is_dense_compressor(c) -> bool:
    """Whether ``c`` is a dense Horovod compressor (``Compression.none``/
    ``fp16`` or any object with ``compress``/``decompress``) rather than
    one of our sparse compressions."""
    if isinstance(c, type):
        return issubclass(c, _HvdCompressor)
    return isinstance(c, _HvdCompressor) or (callable(getattr(c, "compress", None)) and
                                             callable(getattr(c, "decompress", None)) and
                                             not isinstance(c, SparseCompression))



def sparse_choices():
    """The registry's methods this layer runs itself (all but the dense one)."""
    return tuple(n for n in SPARSE_METHODS if n != DENSE_METHOD)
