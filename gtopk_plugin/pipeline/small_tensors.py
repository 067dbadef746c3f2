"""Small tensors go dense: ``GradientReducer(dense_below=N)``.

Tensors with fewer than ``N`` entries (biases, norm scales) are summed
exactly by the dense aggregation in the same ``reduce()`` call, the rest by
the reducer's method as without them (as PyTorch's PowerSGD hook and
BytePS's ``BYTEPS_MIN_COMPRESS_BYTES`` do).  Per call, on every rank:

- small tensors: the allreduced sum (or sum / P), as ``method="dense"``
  gives it; no residual; DGC momentum and clipping apply as to dense;
- the others: exactly the method's result without the small tensors (with
  ``granularity="global"``, k counts the large ones only);
- one consistency check covers both parts (a NaN anywhere raises / skips
  the whole step on every rank); the dense part's own check always passes;
- bytes: the dense ring allreduce plus the method's; ``last_stats.parts``
  = {"dense": ..., "method": ...}.

See docs/recipes.md, "Small tensors dense", and docs/design.md §2.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Mapping, Optional, Tuple

import torch

from gtopk_plugin.pipeline.layout import all_finite, local_grad_norm, validate_grads
from gtopk_plugin.pipeline.reduce_call import Call
from gtopk_plugin.pipeline.update_buffers import check_out

Tensor = torch.Tensor

# ReduceStats fields that add up over the two parts
_SUMMED = ("numel", "selected", "result_nnz", "sent_entries", "bytes_sent", "bytes_received",
           "payload_bytes_sent", "payload_bytes_received", "header_bytes_sent",
           "header_bytes_received", "control_bytes", "messages_sent", "rounds", "dense_bytes")


def split(grads, threshold: int) -> Optional[Tuple[Dict[str, Tensor], Dict[str, Tensor]]]:
    """``(small, rest)`` when ``grads`` has tensors below ``threshold``
    entries, else ``None`` (invalid input, too, is left to the normal path:
    its checks raise on every rank)."""
    if threshold <= 0 or not isinstance(grads, Mapping):
        return None
    if not all(isinstance(n, str) and isinstance(t, Tensor) for n, t in grads.items()):
        return None
    small = {n: t for n, t in grads.items() if t.numel() < threshold}
    if not small:
        return None
    return small, {n: t for n, t in grads.items() if n not in small}


class SmallTensors:
    """The stage of a reducer with ``dense_below``, around the method's
    stages: ``method`` (a stage, ``Call -> Call``) reduces the other
    tensors, ``dense`` (a ``method="dense"`` GradientReducer on the same
    transport and settings, built by the reducer) the small ones, kept at
    the reducer's step and optimizer binding (``state``)."""

    def __init__(self, method, dense, state, threshold: int):
        self.method, self.dense, self.state, self.threshold = method, dense, state, threshold

    def __call__(self, c):
        """One call split in two (see the module docstring)."""
        parts = split(c.grads, self.threshold)
        if parts is None:
            return self.method(c)
        small, rest = parts
        dense, cfg = self.dense, self.state.config
        dense.step, dense.binding = self.state.step, self.state.binding
        # the call's one joint check (GradientReducer.joint_check) is the
        # method's, or the dense reducer's when it is the only check
        dense.joint_check = None if rest else self.state.joint_check
        grad_norm = c.grad_norm
        if cfg.clip_norm is not None and grad_norm is None:
            # the clipping norm is over the whole call, both parts
            try:
                grad_norm = local_grad_norm(list(small.values()) + list(rest.values()))
            except RuntimeError:
                grad_norm = None  # invalid input: the check below raises
        bad, names, tensors = validate_grads(small)
        bad = bad or check_out(c.out, names, tensors)
        kw = dict(advance_step=False, grad_norm=grad_norm, loss_scale=c.loss_scale, out=c.out)
        if not rest:  # nothing to compress: the dense reducer alone (its check)
            c.updates = dense.reduce(small, **kw)
            return self._finish(c, dense.last_stats, None)
        # the method's call carries the small tensors' check
        main = Call(rest, grad_norm, c.loss_scale, c.out, c.out_reuse)
        layout = [("dense_below", self.threshold)] + [
            (n, tuple(t.shape), str(t.dtype)) for n, t in zip(names, tensors)]
        main.extra = (layout, [n for n, t in zip(names, tensors) if not all_finite(t)] if bad is None else [], bad)
        main = self.method(main)
        c.updates = main.updates
        if main.stats.skipped:  # every rank skips the whole step (nonfinite="skip"/"propagate")
            fill = float("inf") if cfg.nonfinite == "propagate" else 0.0
            c.updates.update({n: c.out[n].fill_(fill) if c.out is not None else torch.full_like(t, fill)
                              for n, t in small.items()})
            main.stats.numel += sum(t.numel() for t in small.values())
            return self._finish(c, None, main.stats)
        c.updates.update(dense.reduce(small, **kw))
        return self._finish(c, dense.last_stats, main.stats)

    def _finish(self, c, small_stats, main_stats):
        """The call's stats: the sum of both parts', ``parts`` naming each."""
        if main_stats is None:
            st = dataclasses.replace(small_stats, method=self.state.config.method,
                                     aggregation=self.state.aggregation, k=small_stats.numel)
        elif small_stats is None:
            st = main_stats
        else:
            st = dataclasses.replace(main_stats, **{f: getattr(main_stats, f) + getattr(small_stats, f)
                                                    for f in _SUMMED})
            st.k = main_stats.k + small_stats.numel  # dense: every entry of the small tensors
            st.seconds = {k: main_stats.seconds.get(k, 0.0) + small_stats.seconds.get(k, 0.0)
                          for k in set(main_stats.seconds) | set(small_stats.seconds)}
        st.parts = {"dense": small_stats, "method": main_stats}
        c.stats = st
        return c

    # -- checkpoints: the dense part's velocities (DGC momentum) ----------
    def state_dict(self) -> dict:
        return {"velocities": self.dense.momentum.state_dict(), "loss_scale": self.dense.loss_scale}

    def load_state_dict(self, sd: dict) -> None:
        self.dense.momentum.load_state_dict(sd.get("velocities", {}))
        self.dense.loss_scale = sd.get("loss_scale")

    def reset(self) -> None:
        self.dense.reset()
