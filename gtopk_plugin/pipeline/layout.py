"""Layout of one reducer call: the input checks, the flat dtype, the
segments and their k (docs/design.md §2, selection), the finiteness test and
the clipping norm.  Framework-neutral and stateless apart from a small
cache; the TensorFlow layer uses the same functions.

Segments: with granularity "layer" one per tensor (``k_s = max(1,
ceil(density·n_s))``), with "global" one for the whole call, named by
:func:`global_segment_name`.  A codec encodes every entry: it is given
``k_s = n_s`` (``full=True``).
"""
from __future__ import annotations

import hashlib
import math
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch

Tensor = torch.Tensor
_GLOBAL_SEGMENT = "__global__"


def global_segment_name(names) -> str:
    """Name of the one segment of a granularity="global" call: keyed by the
    tensors it holds, so that buckets of one step (DDP buckets, the elastic
    scheduler's layers) draw independent random positions, while every rank
    (same names) still draws the same ones where the method shares draws."""
    h = hashlib.blake2b("\x00".join(names).encode(), digest_size=8).hexdigest()
    return f"{_GLOBAL_SEGMENT}:{h}"


def k_for(density: float, numel: int) -> int:
    """``max(1, ceil(density·numel))`` (the product rounded to 1e-6 first, so
    0.07·100 gives 7, not 8), capped at ``numel``."""
    return min(numel, max(1, math.ceil(round(density * numel, 6))))


def all_finite(t: Tensor) -> bool:
    """Whether every entry of ``t`` is finite, in one read: a finite sum
    (accumulated in at least float32, so float16 sums cannot overflow) has
    only finite terms; a non-finite sum -- a NaN/Inf or a float32 overflow --
    falls back to the exact elementwise test.  torch.isfinite(t).all()
    materialises a bool tensor and is ~15x slower at 25M elements."""
    acc = torch.float64 if t.dtype == torch.float64 else torch.float32
    if bool(torch.isfinite(t.sum(dtype=acc))):
        return True
    return bool(torch.isfinite(t).all())


def local_grad_norm(tensors) -> float:
    """L2 norm over several tensors, accumulated in float64 (the clipping
    norm of one worker's whole step)."""
    total = 0.0
    for t in tensors:
        total += float(torch.linalg.vector_norm(t.detach().reshape(-1), dtype=torch.float64) ** 2)
    return math.sqrt(total)


def clip_scale(clip_norm: Optional[float], flat, grad_norm: Optional[float],
               loss_scale: Optional[float], P: int) -> float:
    """DGC local clipping (Lin et al. 2018): the factor that brings this
    worker's gradient norm (``grad_norm``, default: the norm of ``flat``)
    down to ``clip_norm · P^-1/2`` (times the loss scale), else 1."""
    if clip_norm is None:
        return 1.0
    if grad_norm is None:
        grad_norm = local_grad_norm(flat)
    thr = clip_norm / math.sqrt(P) * (1.0 if loss_scale is None else float(loss_scale))
    grad_norm = float(grad_norm)
    return 1.0 if grad_norm <= thr else thr / (grad_norm + 1e-6 * thr)


def validate_grads(grads) -> Tuple[Optional[str], List[str], List[Tensor]]:
    """Local input checks of ``reduce(grads)``.  Returns an error message
    instead of raising, so that the consistency check can make every rank
    raise together; else the sorted names and their tensors."""
    if not isinstance(grads, Mapping):
        return f"grads must be a dict name -> tensor; got {type(grads).__name__}", [], []
    if not grads:
        return "grads is empty: pass at least one named gradient tensor", [], []
    names = sorted(grads)
    tensors = []
    for n in names:
        t = grads[n]
        if not isinstance(n, str):
            return f"gradient names must be str; got {n!r}", [], []
        if not isinstance(t, torch.Tensor):
            return f"gradient {n!r} is a {type(t).__name__}, not a torch.Tensor", [], []
        if not t.is_floating_point():
            return (f"gradient {n!r} has dtype {t.dtype}; pass a floating-point tensor "
                    "(float32, float16, bfloat16 or float64)"), [], []
        if t.dim() == 0:
            return (f"gradient {n!r} is 0-d; pass it as a 1-element tensor "
                    "(t.reshape(1)) or leave it out of the reducer"), [], []
        if t.numel() == 0:
            return f"gradient {n!r} is empty (shape {tuple(t.shape)}); leave it out of the reducer", [], []
        if t.device.type == "meta":
            return (f"gradient {n!r} is on the meta device (shape only, no data); reduce real "
                    "gradients: materialise the model first (module.to_empty(device=...) and "
                    "load or initialise its weights)"), [], []
        tensors.append(t)
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        return f"gradients are on several devices {sorted(map(str, devices))}; pass one device per call", [], []
    return None, names, tensors


def flat_dtype(tensors) -> torch.dtype:
    """The promotion of the call's gradient dtypes (the default wire dtype)."""
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


#: gradient dtypes whose error-feedback state is kept in float32
HALF_DTYPES = (torch.float16, torch.bfloat16)


def state_dtype(grad_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the error-feedback state (residual, velocity, scratch
    accumulator) and of the sums, for gradients of ``grad_dtype``: float32
    for fp16/bf16 (docs/design.md §3, half precision), else the gradient's
    own.  A float16 residual overflows (the unsent mass outgrows 65504) and
    a bfloat16 one stops feeding back (a small gradient added to a large
    residual vanishes in 8 bits of mantissa): neither is offered."""
    return torch.float32 if grad_dtype in HALF_DTYPES else grad_dtype


#: bytes of persistent state per gradient element, at most: residual,
#: scratch accumulator and update buffer in the state dtype, plus a
#: flattened copy of an input that is not contiguous
_BUFFERS = 3


def memory_check(tensors, dtype: torch.dtype) -> Optional[str]:
    """A message when the buffers a first call on this layout allocates
    (residual, accumulator, update: ``_BUFFERS`` × numel in ``dtype``, and
    a contiguous copy of every non-contiguous -- e.g. expanded -- gradient)
    cannot fit in the device's free memory; ``None`` otherwise or when the
    free memory is unknown.  Checked before any allocation, so every rank
    raises a clear error instead of one being killed by the OOM killer."""
    numel = sum(t.numel() for t in tensors)
    need = _BUFFERS * numel * torch.empty(0, dtype=dtype).element_size()
    need += sum(t.numel() * t.element_size() for t in tensors if not t.is_contiguous())
    dev = tensors[0].device
    free = _free_bytes(dev)
    if free is None or need <= free:
        return None
    return (f"the gradients hold {numel:,} elements: their error-feedback buffers need "
            f"{need / 2**30:.1f} GiB, but only {free / 2**30:.1f} GiB of {dev.type} memory is free; "
            "pass fewer or smaller gradients per call (or materialise expanded tensors "
            "deliberately)")


def _free_bytes(device) -> Optional[int]:
    if device.type == "cuda":
        try:
            return int(torch.cuda.mem_get_info(device)[0])
        except Exception:  # pragma: no cover - no CUDA runtime
            return None
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:  # not Linux
        return None
    return None


def segment_ks(sizes: Sequence[int], density: float, granularity: str, full: bool = False
               ) -> List[int]:
    """k per segment (see the module docstring)."""
    if granularity == "layer":
        return [int(n) if full else k_for(density, n) for n in sizes]
    n = sum(sizes)
    return [int(n) if full else k_for(density, n)] if sizes else []


class Segments:
    """Segments of a layout -- ``(offsets, k, names)``: two small int64 host
    tensors and the segment names -- cached per (names, sizes, density), as
    every call needs them."""

    def __init__(self, granularity: str, full: bool = False):
        self.granularity = granularity
        self.full = full
        self._cache: Dict[tuple, tuple] = {}

    def __call__(self, names, sizes, density):
        key = (tuple(names), tuple(sizes), density)
        hit = self._cache.get(key)
        if hit is None:
            if len(self._cache) > 64:
                self._cache.clear()
            hit = self._cache[key] = self._make(names, sizes, density)
        return hit

    def _make(self, names, sizes, density):
        if self.granularity == "layer":
            offs = [0]
            for s in sizes:
                offs.append(offs[-1] + s)
            seg_names = list(names)
        else:
            offs = [0, sum(sizes)]
            seg_names = [global_segment_name(names)]
        ks = segment_ks(sizes, density, self.granularity, self.full)
        return (torch.tensor(offs, dtype=torch.int64), torch.tensor(ks, dtype=torch.int64), seg_names)
