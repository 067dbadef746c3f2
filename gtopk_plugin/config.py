"""Configuration: frozen dataclasses, keyword validation, and the ONE place that
reads ``GTOPK_*`` environment variables (docs/design.md §1).

Everything else in the package receives its settings as arguments; nothing
deep inside a reducer or a collective looks at ``os.environ``.
"""
from __future__ import annotations

import math
import numbers
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Union

import torch

from gtopk_plugin import registry

OPS = ("average", "sum")
GRANULARITIES = ("layer", "global")
NONFINITE = ("raise", "skip", "propagate")
# values on the wire: fp16/bf16 casts, or int8 with a per-message
# power-of-two scale (collectives/wire.py: 5 bytes per int32-indexed entry)
WIRE_DTYPES = (torch.float16, torch.bfloat16, torch.int8)
WIRE_ROUNDINGS = ("nearest", "stochastic")  # the int8 wire's rounding
KERNEL_BACKENDS = ("auto", "reference", "cpu", "cuda")

DensitySchedule = Union[None, Sequence[float], Callable[[int], float], "DensityWarmup"]


@dataclass(frozen=True)
class DensityWarmup:
    """Exponential density warm-up used by DGC and the gtopkssgd code base.

    For the first ``steps`` steps the density decays geometrically from
    ``start_density`` to the reducer's target density; afterwards the target
    is used.  ``start_density=1.0`` makes the first step dense-equivalent.
    """

    steps: int
    start_density: float = 0.25

    def __post_init__(self):
        if not isinstance(self.steps, int) or self.steps < 1:
            raise ValueError(f"DensityWarmup.steps must be a positive int, got {self.steps!r}")
        if not (0.0 < self.start_density <= 1.0):
            raise ValueError(
                f"DensityWarmup.start_density must be in (0, 1], got {self.start_density!r}")

    @classmethod
    def dgc(cls, steps_per_epoch: int, epochs: int = 4, start_density: float = 0.25) -> "DensityWarmup":
        """The recommended recipe (Lin et al. 2018, DGC §3.3): density decays
        exponentially from 25% to the target over the first ``epochs``
        (DGC: 25% → 6.25% → 1.56% → 0.4% → 0.1% over 4 epochs), so the
        early, fast-changing gradients are not starved.  One argument:
        ``GradientReducer(..., warmup=DensityWarmup.dgc(len(loader)))``."""
        if not isinstance(steps_per_epoch, int) or steps_per_epoch < 1:
            raise ValueError(f"steps_per_epoch must be a positive int; got {steps_per_epoch!r}")
        if not isinstance(epochs, int) or epochs < 1:
            raise ValueError(f"epochs must be a positive int; got {epochs!r}")
        return cls(steps=steps_per_epoch * epochs, start_density=start_density)

    def density(self, step: int, target: float) -> float:
        if step >= self.steps:
            return target
        frac = step / self.steps
        # geometric interpolation: start * (target/start)^(step/steps)
        return self.start_density * (target / self.start_density) ** frac


def _check_density(name: str, d) -> float:
    # a real number only: float("0.1") and float(True) would pass silently
    if isinstance(d, bool) or not isinstance(d, numbers.Real):
        raise ValueError(f"{name} must be a float in (0, 1], e.g. 0.01; got {d!r} "
                         f"({type(d).__name__})")
    d = float(d)
    if not (0.0 < d <= 1.0) or math.isnan(d):
        raise ValueError(f"{name} must be in (0, 1] (fraction of entries kept, e.g. 0.01); got {d!r}")
    return d


def check_momentum(m, nesterov: bool = False, dampening: float = 0.0) -> None:
    """DGC momentum correction's settings (those of torch.optim.SGD);
    ``ValueError`` saying what to pass.  (Here, at the bottom layer, so that
    both this config and ``compress.momentum.MomentumSpec`` use it.)"""
    if not isinstance(m, (int, float)) or isinstance(m, bool) or not (0.0 <= float(m) < 1.0):
        raise ValueError(f"momentum_correction must be True (the optimizer's momentum), a momentum in "
                         f"[0, 1) such as 0.9, or None; got {m!r}")
    if not (0.0 <= float(dampening) <= 1.0):
        raise ValueError(f"dampening must be in [0, 1]; got {dampening!r}")
    if nesterov and (float(m) == 0.0 or float(dampening) != 0.0):
        raise ValueError("Nesterov momentum requires momentum > 0 and dampening 0 "
                         "(as torch.optim.SGD)")


def split_momentum_correction(value, optimizer=None, named_parameters=None, *, wrapped: bool = False):
    """The public ``momentum_correction=`` as (momentum or None, bind): True
    reads the torch ``optimizer``'s own momentum (bind it; the reducers also
    need ``named_parameters``; ``wrapped``: the front end binds the optimizer
    it wraps), a number is the momentum itself, None/False is off
    (docs/recipes.md).  ``ValueError`` for a missing or stray optimizer."""
    bind, needs_names = value is True, not wrapped
    if bind and not wrapped and (optimizer is None or named_parameters is None):
        raise ValueError("momentum_correction=True reads the SGD optimizer's momentum: pass "
                         "optimizer=<the torch.optim optimizer>"
                         + (" and named_parameters=model.named_parameters()" if needs_names else "")
                         + " (or the momentum itself, momentum_correction=0.9, with an optimizer "
                         "built without momentum)")
    if optimizer is not None and not bind:
        raise ValueError("optimizer= is only used with momentum_correction=True")
    return (None if bind or value is None or value is False else value), bind


@dataclass(frozen=True)
class ReducerConfig:
    """Validated settings of a :class:`gtopk_plugin.GradientReducer`.

    Hyper-parameters the user tunes; the reducer's internal state (residuals,
    step, RNG) lives in the reducer, not here.
    """

    method: str = "gtopk"
    density: float = 0.01
    r_factor: float = 4.0
    merge: Optional[str] = None
    granularity: str = "layer"
    value_dtype: Optional[torch.dtype] = None
    op: str = "average"
    seed: int = 0
    warmup: DensitySchedule = None
    nonfinite: str = "raise"
    error_feedback: bool = True
    kernels: str = field(default_factory=lambda: env_kernels())
    # DGC momentum correction (compress/momentum.py): the momentum, None = off
    momentum_correction: Optional[float] = None
    nesterov: bool = False
    dampening: float = 0.0
    momentum_masking: bool = True
    # DGC local gradient clipping: each worker clips its own gradient to
    # clip_norm * P^-1/2 (global L2 norm over the step's tensors) before it
    # enters the velocity / accumulator; None = off
    clip_norm: Optional[float] = None
    # the method's own hyper-parameters (declared by its compressor class in
    # the registry), as sorted (name, value) pairs; a dict is accepted
    hyper: Any = ()
    # tensors with fewer entries go dense (exact allreduce) in the same step;
    # 0 = off (gtopk_plugin/small_tensors.py)
    dense_below: int = 0
    # the int8 wire's rounding: "nearest" or "stochastic" (unbiased, keyed
    # by (seed, step, ...) like every random draw)
    wire_rounding: str = "nearest"

    def __post_init__(self):
        # Method, hyper-parameters and merge are validated against the
        # registry (gtopk_plugin.registry, a leaf module below this one): no
        # method names here, so a user-registered compressor is as valid as
        # a built-in one.
        cls = registry.get(self.method)  # ValueError naming the known methods
        object.__setattr__(self, "density", _check_density("density", self.density))
        # r_factor predates per-method hyper-parameters: always accepted and
        # validated (by the declaration of the method that owns it), routed
        # into the method only where it declares it
        spec = registry.find_hyperparam("r_factor")
        if spec is not None:
            object.__setattr__(self, "r_factor", spec.validate(self.r_factor))
        hyper = self.hyper
        if isinstance(hyper, Mapping):
            hyper = tuple(sorted(hyper.items()))
        try:
            hyper = tuple((str(k), v) for k, v in hyper)
        except (TypeError, ValueError):
            raise ValueError(f"hyper must be a dict of the method's hyper-parameters; got {self.hyper!r}") \
                from None
        resolved = registry.resolve(self.method, dict(hyper), {"r_factor": self.r_factor})
        object.__setattr__(self, "hyper", tuple(sorted((k, resolved[k]) for k, _ in hyper)))
        if self.merge is not None and self.merge not in cls.merges:
            if not cls.merges:
                raise ValueError(
                    f"merge={self.merge!r} does not apply to method {self.method!r} (it is aggregated "
                    f"by {cls.aggregation!r}); pass merge=None")
            raise ValueError(f"unknown merge {self.merge!r} for method {self.method!r}; pass None, "
                             + " or ".join(repr(m) for m in cls.merges))
        if self.value_dtype is not None and cls.kind == "codec":
            raise ValueError(f"value_dtype does not apply to method {self.method!r} (a codec: it sets "
                             "its own wire format); pass value_dtype=None")
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"unknown granularity {self.granularity!r}; pass 'layer' or 'global'")
        if self.method == "powersgd" and self.granularity != "layer":
            # caught here, not inside the first reduce(): PowerSGD needs each
            # tensor's own matrix shape
            raise ValueError("powersgd compresses each tensor as a matrix: use granularity='layer' "
                             "(one segment per tensor, shapes known)")
        if self.value_dtype is not None and self.value_dtype not in WIRE_DTYPES:
            raise ValueError(f"value_dtype must be None, torch.float16, torch.bfloat16 or torch.int8; "
                             f"got {self.value_dtype!r}")
        if self.wire_rounding not in WIRE_ROUNDINGS:
            raise ValueError(f"unknown wire_rounding {self.wire_rounding!r}; pass 'nearest' or 'stochastic'")
        if self.wire_rounding != "nearest" and self.value_dtype != torch.int8:
            raise ValueError("wire_rounding='stochastic' applies to the int8 wire; pass "
                             "value_dtype=torch.int8 (fp16/bf16 casts round to nearest)")
        if self.op not in OPS:
            raise ValueError(f"unknown op {self.op!r}; pass 'average' or 'sum'")
        if not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int; got {self.seed!r}")
        if self.nonfinite not in NONFINITE:
            raise ValueError(f"unknown nonfinite policy {self.nonfinite!r}; pass 'raise', 'skip' or "
                             "'propagate'")
        m = self.momentum_correction
        if m is True:
            raise ValueError("momentum_correction=True reads the optimizer's momentum: pass it to "
                             "GradientReducer/SparseState with optimizer=, or give the momentum "
                             "itself (momentum_correction=0.9)")
        if m is not None and m is not False:
            check_momentum(m, bool(self.nesterov), float(self.dampening))
            object.__setattr__(self, "momentum_correction", float(m))
        else:
            object.__setattr__(self, "momentum_correction", None)
            if self.nesterov:
                raise ValueError("nesterov=True needs momentum_correction=<momentum> "
                                 "(e.g. momentum_correction=0.9, nesterov=True)")
        if self.clip_norm is not None:
            try:
                c = float(self.clip_norm)
            except (TypeError, ValueError):
                raise ValueError(f"clip_norm must be a positive number or None; got {self.clip_norm!r}") \
                    from None
            if not (c > 0.0) or math.isinf(c):
                raise ValueError(f"clip_norm must be a positive finite number or None; got {self.clip_norm!r}")
            object.__setattr__(self, "clip_norm", c)
        db = self.dense_below
        if isinstance(db, bool) or not hasattr(db, "__index__") or db.__index__() < 0:
            raise ValueError(f"dense_below must be an int >= 0 (entries; 0 = off); got {db!r}")
        object.__setattr__(self, "dense_below", int(db.__index__()))
        if self.kernels not in KERNEL_BACKENDS:
            raise ValueError(f"unknown kernels back end {self.kernels!r}; pass one of {', '.join(KERNEL_BACKENDS)}")
        w = self.warmup
        if w is not None and not isinstance(w, DensityWarmup) and not callable(w):
            try:
                seq = tuple(w)
            except TypeError:
                raise ValueError(
                    "warmup must be None, a DensityWarmup, a sequence of densities for the "
                    f"first steps, or a callable step -> density; got {w!r}") from None
            for i, d in enumerate(seq):
                _check_density(f"warmup[{i}]", d)
            object.__setattr__(self, "warmup", seq)

    @property
    def aggregation(self) -> str:
        """How results combine: the compressor's default, or ``merge`` when set
        (``merge="butterfly"`` puts any sparse selector on the gTop-k butterfly)."""
        return self.merge or registry.get(self.method).aggregation

    @property
    def method_hyper(self) -> Dict[str, Any]:
        """Every hyper-parameter the method declares, validated: the given
        value, else ``r_factor`` where the method declares it, else the
        default -- the keywords its compressor class is built with."""
        return registry.resolve(self.method, dict(self.hyper), {"r_factor": self.r_factor})

    def density_at(self, step: int) -> float:
        """Density in force at ``step`` (0-based), after the warm-up schedule."""
        w = self.warmup
        if w is None:
            return self.density
        if isinstance(w, DensityWarmup):
            return w.density(step, self.density)
        if callable(w):
            return _check_density(f"warmup({step})", w(step))
        return w[step] if step < len(w) else self.density


def env_kernels() -> str:
    """``GTOPK_KERNELS=reference|cpu|cuda|auto`` forces a kernel back end."""
    return os.environ.get("GTOPK_KERNELS", "auto").strip().lower() or "auto"


def env_compiler() -> str:
    """The C++ compiler the CPU kernels are compiled with on first use
    (``CXX``, as torch.utils.cpp_extension uses it; default ``c++``)."""
    return os.environ.get("CXX", "c++")


def env_cache_home() -> str:
    """The per-user cache directory (``$XDG_CACHE_HOME`` or ``~/.cache``)."""
    return os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")


def env_local_world_size() -> Union[int, str, None]:
    """``LOCAL_WORLD_SIZE`` (set by torchrun): workers per node, the default
    node size of :class:`~gtopk_plugin.two_level.hierarchical_reducer.HierarchicalReducer`.
    ``None`` when unset or empty; a value that is not an integer comes back
    as the string, so that the topology agreement rejects it on every rank
    (raising here, on one rank only, would leave the others waiting)."""
    v = os.environ.get("LOCAL_WORLD_SIZE", "").strip()
    if not v:
        return None
    try:
        return int(v)
    except ValueError:
        return v


def env_fusion_threshold_bytes(default: int = 64 * 1024 * 1024) -> int:
    """``GTOPK_FUSION_THRESHOLD`` (bytes): default gradient-bucket size of the
    framework optimizers (the role of Horovod's ``HOROVOD_FUSION_THRESHOLD``)."""
    v = os.environ.get("GTOPK_FUSION_THRESHOLD")
    return int(v) if v else default


def env_shm_dir() -> Optional[str]:
    """``GTOPK_SHM_DIR``: where a node's shared-memory fabric puts its file
    (default ``/dev/shm``; :mod:`gtopk_plugin.two_level.shared_memory`)."""
    return _env("GTOPK_SHM_DIR")


def env_huge_pages() -> bool:
    """``GTOPK_HUGE_PAGES=0`` stops the reducer's persistent CPU buffers from
    asking the kernel for transparent huge pages (default: on; see
    :mod:`gtopk_plugin.pipeline.huge_pages`)."""
    v = _env("GTOPK_HUGE_PAGES")
    return v is None or v.lower() not in ("0", "false", "no", "off")


def env_timeout_seconds(default: float = 300.0) -> float:
    """``GTOPK_TIMEOUT`` (seconds): default timeout of a transport's collective calls."""
    v = os.environ.get("GTOPK_TIMEOUT")
    return float(v) if v else default


# ---------------------------------------------------------------------------
# Elastic scheduler, configured the BytePS way (gtopk_plugin.byteps).
# Only the readers live here; the scheduler itself takes keyword arguments.
# ---------------------------------------------------------------------------
ELASTIC_POLICIES = ("barrier", "norm", "variance")


def _env(name: str) -> Optional[str]:
    v = os.environ.get(name)
    if v is None or not v.strip():
        return None
    return v.strip()


def env_byteps_elastic_policy() -> Optional[str]:
    """``BYTEPS_ELASTIC_POLICY=barrier|norm|variance`` (None when unset)."""
    v = _env("BYTEPS_ELASTIC_POLICY")
    if v is None:
        return None
    if v.lower() not in ELASTIC_POLICIES:
        raise ValueError(f"BYTEPS_ELASTIC_POLICY={v!r} is not a policy; set it to one of "
                         f"{', '.join(ELASTIC_POLICIES)}")
    return v.lower()


def env_byteps_elastic_beta() -> Optional[float]:
    """``BYTEPS_ELASTIC_BETA`` in [0, 1]: the norm policy's β (None when unset)."""
    v = _env("BYTEPS_ELASTIC_BETA")
    if v is None:
        return None
    try:
        b = float(v)
    except ValueError:
        raise ValueError(f"BYTEPS_ELASTIC_BETA={v!r} is not a number; set it to a value in [0, 1], "
                         "e.g. 0.5") from None
    if not (0.0 <= b <= 1.0):
        raise ValueError(f"BYTEPS_ELASTIC_BETA={v!r} is outside [0, 1]; set it to a value in [0, 1], "
                         "e.g. 0.5")
    return b


def env_byteps_elastic_max_staleness() -> Optional[int]:
    """``BYTEPS_ELASTIC_MAX_STALENESS``: a non-negative int (None when unset)."""
    v = _env("BYTEPS_ELASTIC_MAX_STALENESS")
    if v is None:
        return None
    try:
        s = int(v)
    except ValueError:
        raise ValueError(f"BYTEPS_ELASTIC_MAX_STALENESS={v!r} is not an integer; set it to 0, 1, 2, ...") \
            from None
    if s < 0:
        raise ValueError(f"BYTEPS_ELASTIC_MAX_STALENESS={v!r} is negative; set it to 0, 1, 2, ...")
    return s


def env_byteps_elastic() -> dict:
    """The ``BYTEPS_ELASTIC_*`` variables that are set, validated, as keyword
    arguments of the elastic scheduler (``policy``, ``beta``, ``max_staleness``)."""
    out = {"policy": env_byteps_elastic_policy(), "beta": env_byteps_elastic_beta(),
           "max_staleness": env_byteps_elastic_max_staleness()}
    return {k: v for k, v in out.items() if v is not None}
