"""Small tensors go dense (issue #17): ``GradientReducer(dense_below=N)``.

Tensors with fewer than ``N`` entries (biases, norm scales: little traffic,
much per-tensor overhead, and a large relative error when compressed) are
summed exactly by the dense aggregation in the same ``reduce()`` call, the
rest by the reducer's method as without them -- the practice of PyTorch
DDP's PowerSGD hook (``min_compression_rate`` / tensors of rank <= 1 go
uncompressed) and BytePS (``BYTEPS_MIN_COMPRESS_BYTES``).

Semantics, per call (every rank the same, since shapes are checked):

- small tensors: the update is the allreduced sum (``op="sum"``) or that sum
  divided by P (``op="average"``), exactly as ``method="dense"`` gives it;
  no residual (everything is sent), so they hold no error-feedback state;
  DGC momentum and clipping apply to them as to a dense method;
- the other tensors: exactly what the reducer's method gives on a call
  without the small tensors (with ``granularity="global"`` the small
  tensors leave the global segment: k counts the large ones only);
- one consistency check: the method's check covers the small tensors too
  (their shapes in the fingerprint, their non-finite values in the flag),
  so a NaN anywhere raises / skips the whole step on every rank before
  anything is applied.  The dense part then runs its own check as well (a
  redundant 32-byte control allreduce that always passes).
- bytes: the dense part's ring allreduce plus the method's, exactly;
  ``last_stats`` is the sum of both, with ``last_stats.parts`` = {"dense":
  stats of the small tensors, "method": stats of the rest}.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Mapping, Optional, Tuple

import torch

from gtopk_plugin.pipeline.layout import all_finite, local_grad_norm, validate_grads
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
    """The dense side of a reducer with ``dense_below``: a ``method="dense"``
    reducer on the same transport and settings, kept in step with it."""

    def __init__(self, red):
        from gtopk_plugin.reducer import GradientReducer  # the reducer imports this module

        cfg = red.config
        self.threshold = cfg.dense_below
        self.dense = GradientReducer(
            method="dense", op=cfg.op, transport=red.transport, seed=cfg.seed,
            nonfinite=cfg.nonfinite, error_feedback=cfg.error_feedback, kernels=cfg.kernels,
            momentum=cfg.momentum, nesterov=cfg.nesterov, dampening=cfg.dampening,
            momentum_masking=cfg.momentum_masking, clip_norm=cfg.clip_norm)

    def reduce(self, red, small, rest, *, advance_step, grad_norm, loss_scale, out=None,
               out_reuse=False) -> Dict[str, Tensor]:
        """One ``red.reduce()`` call split in two (see the module docstring)."""
        dense = self.dense
        dense.step, dense.binding = red.step, red.binding
        if red.config.clip_norm is not None and grad_norm is None:
            # the clipping norm is over the whole call, both parts
            try:
                grad_norm = local_grad_norm(list(small.values()) + list(rest.values()))
            except RuntimeError:
                grad_norm = None  # invalid input: the check below raises
        bad, names, tensors = validate_grads(small)
        bad = bad or check_out(out, names, tensors)
        if not rest:  # nothing to compress: the dense reducer alone (its check)
            res = dense.reduce(small, advance_step=False, grad_norm=grad_norm, loss_scale=loss_scale, out=out)
            return self._finish(red, res, dense.last_stats, None, advance_step)
        # the method's call carries the small tensors' check
        layout = [("dense_below", self.threshold)] + [
            (n, tuple(t.shape), str(t.dtype)) for n, t in zip(names, tensors)]
        nonfinite = [n for n, t in zip(names, tensors) if not all_finite(t)] if bad is None else []
        red._also = (layout, nonfinite, bad)
        try:
            res = red._reduce(rest, advance_step=False, grad_norm=grad_norm, loss_scale=loss_scale, out=out,
                              out_reuse=out_reuse)
        finally:
            red._also = None
        main = red.last_stats
        if main.skipped:  # every rank skips the whole step (nonfinite="skip"/"propagate")
            fill = float("inf") if red.config.nonfinite == "propagate" else 0.0
            res.update({n: out[n].fill_(fill) if out is not None else torch.full_like(t, fill)
                        for n, t in small.items()})
            main.numel += sum(t.numel() for t in small.values())
            return self._finish(red, res, None, main, advance_step)
        res.update(dense.reduce(small, advance_step=False, grad_norm=grad_norm, loss_scale=loss_scale,
                                out=out))
        return self._finish(red, res, dense.last_stats, main, advance_step)

    @staticmethod
    def _finish(red, out, small_stats, main_stats, advance_step):
        if main_stats is None:
            st = dataclasses.replace(small_stats, method=red.config.method, aggregation=red.aggregation,
                                     k=small_stats.numel)
        elif small_stats is None:
            st = main_stats
        else:
            st = dataclasses.replace(main_stats, **{f: getattr(main_stats, f) + getattr(small_stats, f)
                                                    for f in _SUMMED})
            st.k = main_stats.k + small_stats.numel  # dense: every entry of the small tensors
            st.seconds = {k: main_stats.seconds.get(k, 0.0) + small_stats.seconds.get(k, 0.0)
                          for k in set(main_stats.seconds) | set(small_stats.seconds)}
        st.parts = {"dense": small_stats, "method": main_stats}
        red.last_stats = st
        if advance_step:
            red.step += 1
        return out

    # -- checkpoints: the dense part's velocities (DGC momentum) ----------
    def state_dict(self) -> dict:
        return {"velocities": self.dense.momentum.state_dict(), "loss_scale": self.dense.loss_scale}

    def load_state_dict(self, sd: dict) -> None:
        self.dense.momentum.load_state_dict(sd.get("velocities", {}))
        self.dense.loss_scale = sd.get("loss_scale")

    def reset(self) -> None:
        self.dense.reset()
