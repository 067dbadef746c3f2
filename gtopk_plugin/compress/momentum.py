"""Momentum correction and momentum factor masking (DGC: Lin et al. 2018,
"Deep Gradient Compression", arXiv 1712.01887, §3.2), the velocity half of
error feedback.

Per worker, in front of the compressor::

    u ← m·u + (1 − dampening)·g   (Nesterov: u ← m·(u + g), increment u + g)
    v ← v + u                     (v is the error-feedback residual)
    where an entry of v reached the result, zero it in v and in u

and the optimizer applies the reduced update without momentum of its own.
Invariant and ordering with clipping: docs/design.md §5.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from gtopk_plugin.pipeline import huge_pages
from gtopk_plugin.config import check_momentum

Tensor = torch.Tensor


@dataclass(frozen=True)
class MomentumSpec:
    """Hyper-parameters of one tensor's correction (those of torch.optim.SGD)."""

    momentum: float
    nesterov: bool = False
    dampening: float = 0.0

    def __post_init__(self):
        check_momentum(self.momentum, self.nesterov, self.dampening)


class MomentumCorrection:
    """Per-worker velocities ``u`` of DGC's momentum correction.

    ``spec`` is the default :class:`MomentumSpec` (``None``: correction off);
    ``per_name`` overrides it per tensor (an optimizer binding refreshes it
    from the optimizer's param groups before every step, so momentum
    schedules such as OneCycleLR's are followed).  ``masking`` zeroes the
    velocity where the accumulator's entry reached the result (DGC's momentum
    factor masking; on by default, as in DGC).
    """

    def __init__(self, spec: Optional[MomentumSpec] = None, masking: bool = True):
        self.spec = spec
        self.masking = bool(masking)
        self.per_name: Dict[str, MomentumSpec] = {}
        self.velocities: Dict[str, Tensor] = {}
        self._flat: Dict[Tuple[str, ...], Tensor] = {}

    @property
    def enabled(self) -> bool:
        return self.spec is not None or bool(self.per_name)

    def spec_for(self, name: str) -> Optional[MomentumSpec]:
        return self.per_name.get(name, self.spec)

    def _flat_velocity(self, names: Sequence[str], sizes: Sequence[int], dtype, device) -> Tensor:
        """One flat buffer for this layout, its per-name views stored as the
        velocities (so masking with the layout's global indices is O(k)).  A
        name moving to another layout (DDP rebuilds buckets after step 0)
        carries its velocity along."""
        key = tuple(names)
        buf = self._flat.get(key)
        if buf is not None and buf.dtype == dtype and buf.device == device:
            return buf
        buf = huge_pages.zeros(sum(sizes), dtype, device)  # masked at k positions a step
        for n, part in zip(names, torch.split(buf, list(sizes))):
            old = self.velocities.get(n)
            if old is not None:
                if old.numel() != part.numel():
                    raise RuntimeError(f"velocity of {n!r} has {old.numel()} entries but the gradient "
                                       f"has {part.numel()}; the layout changed, call reset()")
                part.copy_(old.reshape(-1))
            self.velocities[n] = part
        moved = set(names)
        for other in [k for k in self._flat if k != key and moved.intersection(k)]:
            del self._flat[other]
        self._flat[key] = buf
        return buf

    def accumulate(self, names: Sequence[str], sizes: Sequence[int], flat_grads: Sequence[Tensor],
                   dtype, device, scratch: Optional[Sequence[Tensor]] = None) -> List[Tensor]:
        """Advance every velocity by its gradient and return the increments
        that enter the residual (``u`` itself, or ``u + g`` with Nesterov;
        the gradient as it is for a name without correction).  ``scratch``:
        per-name buffers the Nesterov increments are written into (the
        reducer's persistent accumulator) instead of fresh tensors."""
        self._flat_velocity(names, sizes, dtype, device)
        out = []
        for i, (n, g) in enumerate(zip(names, flat_grads)):
            spec = self.spec_for(n)
            if spec is None:
                out.append(g)
                continue
            u = self.velocities[n]
            m, d = float(spec.momentum), float(spec.dampening)
            if spec.nesterov:
                u.add_(g).mul_(m)          # u <- m (u + g)
                if scratch is None:
                    out.append(u + g)      # increment u + g (torch's g + m·buf)
                else:
                    out.append(torch.add(u, g, out=scratch[i]))
            else:
                u.mul_(m).add_(g, alpha=1.0 - d)
                out.append(u)
        return out

    def mask_(self, names: Sequence[str], reached_idx: Tensor) -> None:
        """Momentum factor masking: zero the velocity at the layout's global
        indices whose accumulated value reached the global result."""
        if not self.masking or reached_idx is None or reached_idx.numel() == 0:
            return
        buf = self._flat.get(tuple(names))
        if buf is None:
            return
        buf[reached_idx.long()] = 0

    def rescale_(self, factor: float) -> None:
        """Multiply every velocity by ``factor`` (the loss scale changed)."""
        for buf in self._flat.values():
            buf.mul_(factor)
        flat_names = {n for k in self._flat for n in k}
        for n, u in self.velocities.items():
            if n not in flat_names:
                u.mul_(factor)

    def reset(self) -> None:
        self.velocities.clear()
        self._flat.clear()

    def state_dict(self) -> Dict[str, Tensor]:
        return {n: u.detach().cpu().clone() for n, u in self.velocities.items()}

    def load_state_dict(self, sd: Mapping[str, Tensor]) -> None:
        self._flat.clear()
        self.velocities = {n: u.clone() for n, u in sd.items()}
