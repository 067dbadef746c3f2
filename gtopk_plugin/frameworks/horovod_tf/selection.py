"""Selection and encoding for the Horovod-TensorFlow layer: the registry's
torch compressors, called through ``tf.numpy_function``.

Why torch inside a TensorFlow graph: the selection is where the layer
spends its local time (issue #15), and the project's C++ kernels
(``csrc/cpu``, dispatched by :mod:`gtopk_plugin.kernels`) select the top 1%
of 1.1M entries in about 1 ms where per-tensor ``tf.math.top_k`` takes about
30 ms.  Calling the compressor object itself also means there is one
implementation of every method: a compressor registered from user code
(``gtopk_plugin.registry.register``) runs in this layer unchanged, and
random-k's / rTop-k's draws come from the same (seed, step, segment
name[, rank]) keys as on the PyTorch side.  The cost is a copy-free hand-over:
``tf.numpy_function`` gives the accumulator as a numpy array on the CPU,
``torch.from_numpy`` wraps it without a copy, and only the k selected
entries come back.  bfloat16 (which numpy lacks) crosses as its int16 bit
pattern.

``tf.numpy_function`` runs eagerly and inside ``tf.function`` (Keras
``fit`` included); a graph that uses it cannot be serialised into a
SavedModel, which a training step never is.  The step and, with a density
warm-up inside ``tf.function``, the counts are run-time inputs, so one
traced graph serves every step.

Codecs (``kind = "codec"``) go the same way: :func:`encode` runs
``encode`` and this worker's own ``decode`` in one call and returns the
payload packed into bytes (``collectives/wire.pack_tensors``, the PyTorch
side's format) for Horovod's allgather; :func:`decode_sum` decodes every
rank's payload in rank order and sums, as
``collectives/payloads.PayloadAllGather`` does.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np
import tensorflow as tf
import torch

from gtopk_plugin.collectives import wire
from gtopk_plugin.compress.compressor import SelectionContext
from gtopk_plugin.frameworks.horovod_tf.codec_state import numpy_call

__all__ = ["select", "select_topk", "select_threshold", "encode", "decode_sum", "compressor"]


def compressor(method: str, **hyper):
    """A registered compressor instance (``method`` as in ``Compression.<method>``)."""
    from gtopk_plugin import registry

    return registry.get(method)(**hyper)


def _static(ks) -> bool:
    """Counts known while tracing (Python ints) rather than a run-time int32
    tensor (a density warm-up inside ``tf.function``)."""
    return not isinstance(ks, (tf.Tensor, tf.Variable))


def _carrier(x):
    """``x`` as a dtype numpy and torch share (bfloat16 as its int16 bits)."""
    return tf.bitcast(x, tf.int16) if x.dtype == tf.bfloat16 else x


def _torch(a: np.ndarray, bf16: bool) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(a))  # zero-copy for a contiguous array
    return t.view(torch.bfloat16) if bf16 else t


def _numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().contiguous()
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()


def select(x, offsets: Sequence[int], ks, comp, *, step=0, names: Optional[Sequence[str]] = None,
           seed: int = 0, rank: int = 0, kernels: Optional[str] = None, state=None):
    """``comp.select`` on the flat tensor ``x`` (segments ``offsets``, counts
    ``ks``: Python ints or a run-time int32 tensor): ``(int32 indices, values
    in x's dtype)``.  ``step``: a Python int or an int64 scalar tensor (the
    agreed step); ``names``: the segment names keying random draws;
    ``state``: a stateful compressor's state (:mod:`.codec_state`)."""
    n_seg = len(offsets) - 1
    names = list(names) if names is not None else [f"s{i}" for i in range(n_seg)]
    bf16 = x.dtype == tf.bfloat16
    offs_t = torch.tensor(list(offsets), dtype=torch.int64)
    numel = int(offsets[-1])
    k_in = tf.constant(list(ks), tf.int64) if _static(ks) else tf.cast(ks, tf.int64)

    def run(a, k, st):
        ctx = SelectionContext(step=int(st), segment_names=names, seed=seed, rank=rank, kernels=kernels)
        idx, vals = comp.select(_torch(a, bf16), offs_t, torch.from_numpy(np.asarray(k, np.int64)), ctx)
        if idx is None:  # "every entry" (a dense selector)
            idx = torch.arange(numel)
        return idx.to(torch.int32).numpy(), _numpy(vals)

    carrier = _carrier(x)
    idx, vals = numpy_call(state, run, [carrier, k_in, tf.cast(step, tf.int64)], [tf.int32, carrier.dtype],
                           stateful=False)
    if bf16:
        vals = tf.bitcast(vals, tf.bfloat16)
    count = None
    if _static(ks) and getattr(comp, "exact_count", False):
        count = sum(min(int(k), int(offsets[s + 1]) - int(offsets[s])) for s, k in enumerate(ks))
    return tf.ensure_shape(idx, [count]), tf.ensure_shape(vals, [count])


def select_topk(x, offsets: Sequence[int], ks):
    """Exact per-segment top-k (the registry's ``topk``): DESIGN.md §3's
    selection and tie rule, bit for bit the reference kernel's."""
    return select(x, offsets, ks, compressor("topk"))


def select_threshold(x, offsets: Sequence[int], ks):
    """Sampled-threshold selection per segment (the registry's
    ``threshold``; count within ±10% of k_s)."""
    return select(x, offsets, ks, compressor("threshold"))


class _Payloads:
    """The payload tensors' shapes and dtypes of the last :func:`encode`
    (they depend only on the layout, so every rank's payload unpacks like
    this rank's own)."""

    def __init__(self):
        self.like: Optional[List[torch.Tensor]] = None


def encode(acc, offsets: Sequence[int], comp, *, step=0, names=None, seed: int = 0, rank: int = 0,
           kernels: Optional[str] = None, state=None):
    """A codec's contribution: ``(blob, mine, spec)`` -- this worker's payload
    packed into uint8 bytes, its own decode (in ``acc``'s dtype; what error
    feedback subtracts) and the handle :func:`decode_sum` needs."""
    names = list(names) if names is not None else [f"s{i}" for i in range(len(offsets) - 1)]
    bf16 = acc.dtype == tf.bfloat16
    offs_t = torch.tensor(list(offsets), dtype=torch.int64)
    numel = int(offsets[-1])
    spec = _Payloads()

    def run(a, st):
        x = _torch(a, bf16)
        ctx = SelectionContext(step=int(st), segment_names=names, seed=seed, rank=rank, kernels=kernels)
        payload = [t.contiguous() for t in comp.encode(x, offs_t, ctx)]
        spec.like = [torch.empty_like(t) for t in payload]
        mine = comp.decode(payload, offs_t, numel, x.dtype).to(x.dtype).reshape(-1)
        return wire.pack_tensors(payload).numpy(), _numpy(mine)

    carrier = _carrier(acc)
    blob, mine = numpy_call(state, run, [carrier, tf.cast(step, tf.int64)], [tf.uint8, carrier.dtype],
                            stateful=False)
    if bf16:
        mine = tf.bitcast(mine, tf.bfloat16)
    return tf.ensure_shape(blob, [None]), tf.ensure_shape(mine, [numel]), (spec, offs_t, numel)


def decode_sum(blobs, mine, rank: int, comp, spec, sum_dtype):
    """Σ over ranks, in rank order, of every payload decoded (this rank's
    own: ``mine``, not decoded twice), in ``sum_dtype``: every rank decodes
    the same bytes with the same code, so every rank gets the same bits."""
    payloads, offs_t, numel = spec
    bf16 = sum_dtype == tf.bfloat16
    out_dtype = tf.int16 if bf16 else sum_dtype

    def run(*args):
        own = _torch(args[-1], mine.dtype == tf.bfloat16)
        tdt = {tf.float16: torch.float16, tf.bfloat16: torch.bfloat16, tf.float32: torch.float32,
               tf.float64: torch.float64}[sum_dtype]
        out = torch.zeros(numel, dtype=tdt)
        for q, b in enumerate(args[:-1]):  # rank order: identical bits on every rank
            d = own if q == rank else comp.decode(wire.unpack_tensors(torch.from_numpy(b), payloads.like),
                                                  offs_t, numel, own.dtype)
            out += d.reshape(-1).to(tdt)
        return _numpy(out)

    out = tf.numpy_function(run, list(blobs) + [_carrier(mine)], out_dtype, stateful=False)
    if bf16:
        out = tf.bitcast(out, tf.bfloat16)
    return tf.ensure_shape(out, [numel])
