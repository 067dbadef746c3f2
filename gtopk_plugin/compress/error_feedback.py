"""Error feedback (residual memory), the decorator around any selector in
BytePS's compressor core.  DESIGN.md §3: ``acc = grad + residual``; after the
exchange ``residual = acc`` with the entries whose value reached the global
result set to zero (or to their wire-rounding error)."""
from __future__ import annotations

from typing import Dict, Optional

import torch



class ErrorFeedback:
    """Per-name residual memory.  ``enabled=False`` discards the residual
    (plain sparsification, as in the no-feedback ablations)."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.residuals: Dict[str, torch.Tensor] = {}

    def compensate_into(self, name: str, flat_grad: torch.Tensor, out: torch.Tensor) -> None:
        """``out = grad + residual`` (or a copy of ``grad``) written into a
        slice of the caller's flat buffer: one pass, no temporary."""
        res = self.residuals.get(name)
        if res is None or not self.enabled:
            out.copy_(flat_grad)
            return
        if res.shape != flat_grad.shape or res.dtype != flat_grad.dtype:
            raise RuntimeError(
                f"residual of {name!r} has shape {tuple(res.shape)}/{res.dtype} but the gradient "
                f"has {tuple(flat_grad.shape)}/{flat_grad.dtype}; the layout changed, call reset()")
        torch.add(flat_grad, res.to(flat_grad.device), out=out)

    def update(self, name: str, new_residual: torch.Tensor) -> None:
        if self.enabled:
            self.residuals[name] = new_residual

    @staticmethod
    def remainder_(acc: torch.Tensor, sent_idx: torch.Tensor, sent_vals: torch.Tensor) -> torch.Tensor:
        """In place: ``acc[i] -= sent`` at the entries that reached the result
        (the same arithmetic as :meth:`remainder`, touching k entries, not N).
        Returns ``acc``, which is now the residual."""
        if sent_idx.numel():
            i = sent_idx.long()
            acc[i] = acc[i] - sent_vals.to(acc.dtype)
        return acc

    def rescale_(self, factor: float) -> None:
        """Multiply every residual by ``factor`` (the AMP loss scale changed)."""
        for r in self.residuals.values():
            r.mul_(factor)

    def reset(self) -> None:
        self.residuals.clear()

    def state_dict(self):
        return {n: r.detach().cpu().clone() for n, r in self.residuals.items()}

    def load_state_dict(self, sd, device=None):
        self.residuals = {n: (r.to(device) if device is not None else r.clone()) for n, r in sd.items()}
