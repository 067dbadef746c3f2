"""Error feedback (residual memory), the decorator around any selector in
BytePS's compressor core.  DESIGN.md §3: ``acc = grad + residual``; after the
exchange ``residual = acc`` with the entries whose value reached the global
result set to zero (or to their wire-rounding error)."""
from __future__ import annotations

from typing import Dict, Optional

import torch

from .. import kernels


class ErrorFeedback:
    """Per-name residual memory.  ``enabled=False`` discards the residual
    (plain sparsification, as in the no-feedback ablations)."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.residuals: Dict[str, torch.Tensor] = {}

    def compensate(self, name: str, flat_grad: torch.Tensor) -> torch.Tensor:
        """``grad + residual`` (a new tensor; the input is not modified)."""
        res = self.residuals.get(name)
        if res is None or not self.enabled:
            return flat_grad.clone()
        if res.shape != flat_grad.shape or res.dtype != flat_grad.dtype:
            raise RuntimeError(
                f"residual of {name!r} has shape {tuple(res.shape)}/{res.dtype} but the gradient "
                f"has {tuple(flat_grad.shape)}/{flat_grad.dtype}; the layout changed, call reset()")
        return flat_grad + res.to(flat_grad.device)

    def update(self, name: str, new_residual: torch.Tensor) -> None:
        if self.enabled:
            self.residuals[name] = new_residual

    @staticmethod
    def remainder(acc: torch.Tensor, sent_idx: torch.Tensor, sent_vals: torch.Tensor,
                  kernels_choice: Optional[str] = None) -> torch.Tensor:
        """``acc`` less what reached the result (kernel-dispatched)."""
        return kernels.residual_update(acc, sent_idx, sent_vals, kernels=kernels_choice)

    def reset(self) -> None:
        self.residuals.clear()

    def state_dict(self):
        return {n: r.detach().cpu().clone() for n, r in self.residuals.items()}

    def load_state_dict(self, sd, device=None):
        self.residuals = {n: (r.to(device) if device is not None else r.clone()) for n, r in sd.items()}
