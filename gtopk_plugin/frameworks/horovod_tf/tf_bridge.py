"""The bridge from TensorFlow tensors to the torch core inside
``tf.numpy_function``: numpy <-> torch without copies (bfloat16 as its
int16 bits), the registry's compressors, and a compressor's own state
(PowerSGD's warm start) as ``torch.save`` bytes in one ``tf.string``
variable, checkpointed with the residuals and assigned inside the branch
that ran (a skipped step keeps the old state; a restore resumes bit for bit).
"""
from __future__ import annotations

import io
from typing import Sequence

import numpy as np
import tensorflow as tf
import torch

from gtopk_plugin.compress.compressor import Compressor, SelectionContext

__all__ = ["compressor", "carrier", "to_torch", "to_numpy", "CodecState", "has_state", "decode_state",
           "numpy_call", "select"]


def compressor(method: str, **hyper):
    """A registered compressor instance (``method`` as in ``Compression.<method>``)."""
    from gtopk_plugin import registry

    return registry.get(method)(**hyper)


def carrier(x):
    """``x`` as a dtype numpy and torch share (bfloat16 as its int16 bits)."""
    return tf.bitcast(x, tf.int16) if x.dtype == tf.bfloat16 else x


def to_torch(a: np.ndarray, bf16: bool) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(a))  # zero-copy for a contiguous array
    return t.view(torch.bfloat16) if bf16 else t


def to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().contiguous()
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()


def has_state(comp) -> bool:
    """Whether ``comp`` keeps state across steps (overrides ``state_dict``)."""
    return type(comp).state_dict is not Compressor.state_dict


def decode_state(blob: bytes) -> dict:
    return torch.load(io.BytesIO(blob), weights_only=True) if blob else {}


class CodecState:
    """``comp``'s ``state_dict`` <-> the variable's bytes (loaded when they
    differ from what the object holds)."""

    def __init__(self, comp):
        self.comp = comp
        self._held = b""  # the bytes the torch object's state corresponds to

    def load(self, blob) -> None:
        blob = bytes(blob.item() if isinstance(blob, np.ndarray) else blob)
        if blob != self._held:
            self.comp.load_state_dict(decode_state(blob))
            self._held = blob

    def dump(self) -> bytes:
        sd = self.comp.state_dict()
        buf = io.BytesIO()
        if sd:
            torch.save(sd, buf)
        self._held = buf.getvalue()
        return self._held


def numpy_call(state, fn, inputs, Tout, stateful: bool = True):
    """``tf.numpy_function(fn, inputs, Tout)``; ``state``: None or
    ``(CodecState, tf.string variable)``, threaded through as a last input
    and output and assigned back to the variable."""
    if state is None:
        return tf.numpy_function(fn, inputs, Tout, stateful=stateful)
    codec, var = state

    def run(*args):
        codec.load(args[-1])
        # an object array: numpy's bytes dtype would strip trailing NUL bytes
        return tuple(fn(*args[:-1])) + (np.array(codec.dump(), dtype=object),)

    outs = tf.numpy_function(run, list(inputs) + [var.read_value()], list(Tout) + [tf.string], stateful=True)
    var.assign(tf.ensure_shape(outs[-1], []))
    return outs[:-1]


def select(x, offsets: Sequence[int], ks, comp):
    """``comp.select`` (e.g. ``compressor("topk")``) on the flat tensor ``x``
    (counts ``ks``: Python ints or an int tensor), at step 0: ``(int32
    indices, values)``; the tests hold it to the reference kernels' bits."""
    bf16, static = x.dtype == tf.bfloat16, not isinstance(ks, (tf.Tensor, tf.Variable))
    offs_t = torch.tensor(list(offsets), dtype=torch.int64)
    ctx = SelectionContext(step=0, segment_names=[f"s{i}" for i in range(len(offsets) - 1)], seed=0)

    def run(a, k):
        idx, vals = comp.select(to_torch(a, bf16), offs_t, torch.from_numpy(np.asarray(k, np.int64)), ctx)
        return idx.to(torch.int32).numpy(), to_numpy(vals)

    k_in = tf.constant(list(ks), tf.int64) if static else tf.cast(ks, tf.int64)
    idx, vals = tf.numpy_function(run, [carrier(x), k_in], [tf.int32, carrier(x).dtype], stateful=False)
    count = None
    if static and getattr(comp, "exact_count", False):
        count = sum(min(int(k), int(offsets[s + 1]) - int(offsets[s])) for s, k in enumerate(ks))
    vals = tf.bitcast(vals, tf.bfloat16) if bf16 else vals
    return tf.ensure_shape(idx, [count]), tf.ensure_shape(vals, [count])

