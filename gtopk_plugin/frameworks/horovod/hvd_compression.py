"""The ``compression=`` choices of the PyTorch Horovod optimizer.

Horovod's own ``Compression`` has ``none`` and ``fp16`` (dense allreduce);
ours adds the sparse methods of the core (docs/design.md §2) as
:class:`SparseCompression` objects, made by ``Compression.topk/gtopk/rtopk/
randomk/threshold(density, ...)`` and validated at construction.  The
names and factory methods are shared with the TensorFlow layer
(:mod:`gtopk_plugin.frameworks.compression_names`), so a job switches
framework without renaming anything.

Like Horovod's ``horovod/torch/compression.py``, this module only describes
a compression; :mod:`.hvd_optimizer` runs it.
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
    """A compressor of the core's registry (:mod:`gtopk_plugin.registry`) as a
    Horovod ``compression=``, for ``gtopk_plugin.horovod.DistributedOptimizer``
    only; made by ``Compression.<name>(density, ...)`` and validated at
    construction (``ValueError`` naming the bad keyword).

    Args:
        method, density, ``**hyper``, r_factor, value_dtype, wire_rounding,
        warmup, merge, granularity, seed, error_feedback, kernels, nesterov,
        momentum_masking, dense_below: as ``GradientReducer``.
        nonfinite: ``"raise"``, ``"skip"`` or ``"propagate"`` (as skip, with
            the gradients set to NaN so a ``GradScaler`` sees the overflow).
        fusion_threshold: bucket bytes (``GTOPK_FUSION_THRESHOLD`` or 64 MiB).
        momentum_correction: DGC momentum correction: True uses the wrapped
            SGD's own momentum settings (Adam/AdamW: ``ValueError``), a number
            is the momentum (optimizer built without it); docs/recipes.md.
        clip_norm: DGC local clipping over the step (buckets then reduced in
            ``synchronize()``).
        exchange: ``"gloo"`` (side channel, default) or ``"horovod"`` (always
            with NCCL Horovod); same results.  A mismatch across ranks is not
            detected (Horovod stalls).
    """

    def __init__(self, method: str, density: float, *, r_factor: float = 4.0,
                 value_dtype: Optional[torch.dtype] = None, warmup=None, merge: Optional[str] = None,
                 granularity: str = "layer", seed: int = 0, nonfinite: str = "raise",
                 error_feedback: bool = True, kernels: Optional[str] = None,
                 fusion_threshold: Optional[int] = None, momentum_correction=None, nesterov: bool = False,
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
        momentum, self.momentum_correction = config.split_momentum_correction(momentum_correction, wrapped=True)
        kw = dict(method=method, density=density, r_factor=r_factor, merge=merge,
                  granularity=granularity, value_dtype=value_dtype, seed=seed, warmup=warmup,
                  nonfinite="skip" if nonfinite == "propagate" else nonfinite,
                  error_feedback=bool(error_feedback), momentum_correction=momentum,
                  nesterov=bool(nesterov), momentum_masking=bool(momentum_masking), clip_norm=clip_norm,
                  dense_below=dense_below, wire_rounding=wire_rounding)
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
                 nonfinite="raise", error_feedback=True, momentum_correction=None, nesterov=False,
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
