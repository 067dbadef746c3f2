"""A compressor's own state in TensorFlow checkpoints (issue #17): PowerSGD's
warm-start ``Q`` matrices (Vogels et al. 2019, §3: "reuse the previous
step's Q"), or any registered compressor's ``state_dict()``.

Why a ``tf.string`` variable: the state lives in the torch compressor object
(the registry's code runs through ``tf.numpy_function``, :mod:`.selection`,
:mod:`.rounds`), its entries and shapes are the compressor's business (a
user codec declares none up front), and a TensorFlow variable must exist,
with a fixed shape, before a traced step reads it.  One scalar string
variable holding ``torch.save(compressor.state_dict())`` fits every
compressor: ``SparseCompression`` tracks it (``compressor_state``), so
``tf.train.Checkpoint``, Keras ``save_weights`` (TF format, through the
optimizer's ``gtopk_compression``) and ``SparseKerasState`` hold it beside
the residuals, velocities and step counter.

The variable is the source of truth: every step reads it into the
compressor's numpy function, which loads it into the torch object when it
differs from what the object holds (a restored checkpoint; compared as
bytes, cheap for PowerSGD's m×r factors), runs the compressor, and returns
the new state, which the step assigns back -- inside the branch that runs
the exchange, so a skipped step keeps the old state.  Resume is bit-exact:
the restored factors are the saved bits (random draws are keyed by
(seed, step, name); the step counter is in the checkpoint too).  Random
keys of qsgd/rtopk/randomk need no state of their own.
"""
from __future__ import annotations

import io

import numpy as np
import tensorflow as tf
import torch

from gtopk_plugin.compress.compressor import Compressor

__all__ = ["has_state", "CodecState", "numpy_call", "decode"]


def has_state(comp) -> bool:
    """Whether ``comp`` keeps state across steps (overrides ``state_dict``)."""
    return type(comp).state_dict is not Compressor.state_dict


def _encode(sd: dict) -> bytes:
    if not sd:  # nothing held (yet): the empty string, no serialisation per step
        return b""
    buf = io.BytesIO()
    torch.save(sd, buf)
    return buf.getvalue()


def decode(blob: bytes) -> dict:
    return torch.load(io.BytesIO(blob), weights_only=True) if blob else {}


class CodecState:
    """The bridge between ``comp``'s ``state_dict`` and the bytes of the
    ``tf.string`` variable; used inside the numpy functions only."""

    def __init__(self, comp):
        self.comp = comp
        self._held = b""  # the bytes the torch object's state corresponds to

    def load(self, blob) -> None:
        """Before the compressor runs: take the variable's ``blob``."""
        if isinstance(blob, np.ndarray):  # eagerly a 0-d object array, in a graph bytes
            blob = blob.item()
        blob = bytes(blob)
        if blob != self._held:
            self.comp.load_state_dict(decode(blob))
            self._held = blob

    def dump(self) -> bytes:
        """After it ran: the state to assign to the variable."""
        self._held = _encode(self.comp.state_dict())
        return self._held


def numpy_call(state, fn, inputs, Tout, stateful: bool):
    """``tf.numpy_function(fn, inputs, Tout)`` with the compressor state
    threaded through: ``state`` is None (a stateless compressor: the plain
    call) or ``(CodecState, tf.string variable)``, whose value goes in as a
    last input and comes back as a last output, assigned to the variable."""
    if state is None:
        return tf.numpy_function(fn, inputs, Tout, stateful=stateful)
    codec, var = state
    single = not isinstance(Tout, (list, tuple))

    def run(*args):
        codec.load(args[-1])
        out = fn(*args[:-1])
        # an object array: numpy's bytes dtype would strip trailing NUL bytes
        return (out if isinstance(out, tuple) else (out,)) + (np.array(codec.dump(), dtype=object),)

    outs = tf.numpy_function(run, list(inputs) + [var.read_value()], ([Tout] if single else list(Tout)) + [tf.string],
                             stateful=True)
    var.assign(tf.ensure_shape(outs[-1], []))
    return outs[0] if single else outs[:-1]
