"""Error feedback (residual memory), the decorator around any compressor --
selector or codec -- as in BytePS's compressor core.  docs/design.md §2: ``acc = grad + residual``; after the
exchange ``residual = acc`` with the entries whose value reached the global
result set to zero (or to their wire-rounding error).

Memory layout (no N-sized allocation per step).  The residuals of
the tensors of one reducer call (a *layout*: the sorted names, dtype and
device) live in one persistent flat buffer, and ``residuals[name]`` are views
into it.  A second persistent buffer of the same size is the step's scratch
accumulator: ``acc = grad + residual`` is written there (together with the
finiteness check), so a non-finite step -- detected only after the
accumulator was written -- leaves the residual untouched.  When the step
commits, the residual becomes ``acc`` less what was sent (O(k) writes into
the accumulator) and the two buffers swap roles.  After a dense step with
values sent exactly the residual is all zeros: the old residual buffer is
zeroed instead (or kept, when it already was), and the next step's
compensation is a copy.  ``residuals[name]`` therefore alternates between two
fixed storages; read it afresh after every step rather than holding on to it.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from gtopk_plugin.pipeline import huge_pages
from gtopk_plugin import kernels as _kernels

Tensor = torch.Tensor


class FlatResidual:
    """The two persistent buffers of one layout (see the module docstring)."""

    __slots__ = ("names", "sizes", "bufs", "views", "cur", "zero")

    def __init__(self, names: Sequence[str], sizes: Sequence[int], dtype, device):
        self.names = tuple(names)
        self.sizes = tuple(int(s) for s in sizes)
        n = sum(self.sizes)
        # bufs[cur] holds the residual, bufs[1 - cur] is the scratch accumulator
        # huge pages: every step scatters k writes into them (huge_pages.py)
        self.bufs: List[Optional[Tensor]] = [huge_pages.zeros(n, dtype, device), None]
        self.views: List[Optional[List[Tensor]]] = [list(torch.split(self.bufs[0], list(self.sizes))), None]
        self.cur = 0
        self.zero = True  # bufs[cur] is known to be all zeros

    def _ensure(self, j: int) -> None:
        if self.bufs[j] is None:
            ref = self.bufs[1 - j]
            self.bufs[j] = huge_pages.empty_like(ref)
            self.views[j] = list(torch.split(self.bufs[j], list(self.sizes)))

    @property
    def residual(self) -> Tensor:
        return self.bufs[self.cur]

    def accumulator(self) -> Tuple[Tensor, List[Tensor]]:
        """The scratch buffer (and its per-name views) the step writes acc into."""
        j = 1 - self.cur
        self._ensure(j)
        return self.bufs[j], self.views[j]


class ErrorFeedback:
    """Per-name residual memory.  ``enabled=False`` discards the residual
    (plain sparsification, as in the no-feedback ablations)."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.residuals: Dict[str, torch.Tensor] = {}
        self._flat: Dict[tuple, FlatResidual] = {}
        # names whose residual a committed step (or a loaded state) produced:
        # a layout's buffers exist from its first call on, but a call that was
        # skipped (non-finite) or raised has made no residual to checkpoint
        self._live: set = set()

    # -------------------------------------------------- persistent buffers
    def has_layout(self, names: Sequence[str], sizes: Sequence[int], dtype, device) -> bool:
        """Whether this layout's buffers exist already (no allocation to come)."""
        f = self._flat.get((tuple(names), dtype, torch.device(device)))
        return f is not None and f.sizes == tuple(int(s) for s in sizes)

    def layout(self, names: Sequence[str], sizes: Sequence[int], dtype, device) -> FlatResidual:
        """The persistent buffers of this layout, created on first use.  The
        residuals of its names are imported whenever ``residuals`` no longer
        holds this layout's views (first use, ``load_state_dict``, ``reset``,
        a name that moved in from another layout -- DDP rebuilds its buckets
        after the first step); a layout that shares a name with the new one
        is dropped."""
        key = (tuple(names), dtype, torch.device(device))
        f = self._flat.get(key)
        if f is None or f.sizes != tuple(int(s) for s in sizes):
            f = FlatResidual(names, sizes, dtype, device)
            moved = set(names)
            for other in [k for k in self._flat if k != key and moved.intersection(k[0])]:
                del self._flat[other]
            self._flat[key] = f
            self._import(f, fresh=True)
        elif self.enabled and any(self.residuals.get(n) is not v
                                  for n, v in zip(f.names, f.views[f.cur])):
            self._import(f, fresh=False)
        return f

    def _import(self, f: FlatResidual, fresh: bool) -> None:
        """Copy the residuals held in ``residuals`` into ``f``'s residual
        buffer (zeros for names without one) and make ``residuals`` point at
        its views."""
        if not self.enabled:
            return
        zero = True
        for n, part in zip(f.names, f.views[f.cur]):
            # a name no step has committed (or loaded) holds zeros: nothing to
            # carry over, whatever layout its views belonged to (a call that
            # failed the cross-rank check may have made one)
            old = self.residuals.get(n) if n in self._live else None
            if old is None:
                if not fresh:
                    part.zero_()
                continue
            # a narrower residual (one saved from fp16 gradients before the
            # state was float32) widens exactly; a wider one would round
            if old.numel() != part.numel() or torch.promote_types(old.dtype, part.dtype) != part.dtype:
                raise RuntimeError(
                    f"residual of {n!r} has shape {tuple(old.shape)}/{old.dtype} but the gradient's "
                    f"state is {(part.numel(),)}/{part.dtype}; the layout changed, call reset()")
            part.copy_(old.reshape(-1))
            zero = False
        f.zero = zero
        self._point(f)

    def _point(self, f: FlatResidual) -> None:
        if self.enabled:
            for n, v in zip(f.names, f.views[f.cur]):
                self.residuals[n] = v

    def commit_step(self, f: FlatResidual, acc: Tensor, idx: Optional[Tensor], sent: Tensor,
                    exact: bool, residual_add=None, kernels: Optional[str] = None,
                    reached: Optional[Tensor] = None) -> None:
        """The wrapper's one rule, for selectors and codecs alike (docs/design.md
        §2): residual = ``acc`` less what this worker's contribution was as
        it travelled and reached the result.  ``idx``/``sent``: the sent
        entries and their wire values, of which those where ``reached``
        (bool, like ``idx``; ``None``: all) reached it (``idx is None``: ``sent`` is a dense
        vector -- the accumulator as sent, or a codec's payload decoded);
        ``exact``: a dense ``sent`` equal to ``acc`` bit for bit (the
        residual is then zero); ``residual_add``: (int64 indices, values) of
        later wire roundings this rank owns.  Writes into ``acc`` (O(k) for a
        selection) and commits it as the residual."""
        if not self.enabled:
            return
        extra = residual_add is not None and residual_add[0].numel() > 0
        if idx is None and exact and not extra:
            self.commit_zero(f)  # dense, sent exactly: acc - acc is zero everywhere
            return
        if idx is None:
            acc.sub_(sent)  # the wire value (or decode) widened to acc's dtype, one rounding
        else:
            # O(k): the accumulator becomes the residual in place
            _kernels.subtract_at_(acc, idx, sent, mask=reached, kernels=kernels)
        if extra:
            acc.index_add_(0, residual_add[0].long(), residual_add[1].to(acc.dtype))
        self.commit_accumulator(f)

    def commit_accumulator(self, f: FlatResidual) -> None:
        """The step's new residual was made in place in the accumulator: the
        buffers swap roles."""
        f.cur = 1 - f.cur
        f.zero = False
        self._point(f)
        self._live.update(f.names)

    def commit_zero(self, f: FlatResidual) -> None:
        """The step's new residual is all zeros (a dense step, values sent
        exactly): zero the residual buffer unless it already is."""
        if not f.zero:
            f.residual.zero_()
            f.zero = True
        self._point(f)
        self._live.update(f.names)

    def add_at(self, f: FlatResidual, pos: Tensor, vals: Tensor) -> None:
        """``residual[pos] += vals`` (unique int64 ``pos``) after the step's
        commit: a rounding of the applied update this rank owns."""
        if not self.enabled or pos.numel() == 0:
            return
        f.residual.index_add_(0, pos, vals.to(f.residual.dtype))
        f.zero = False
        self._point(f)

    def rescale_(self, factor: float) -> None:
        """Multiply every residual by ``factor`` (the AMP loss scale changed)."""
        for r in self.residuals.values():
            r.mul_(factor)

    def reset(self) -> None:
        self.residuals.clear()
        self._flat.clear()
        self._live.clear()

    def state_dict(self):
        return {n: r.detach().cpu().clone() for n, r in self.residuals.items() if n in self._live}

    def load_state_dict(self, sd, device=None):
        # the persistent buffers re-import these on the next call (identity check)
        self.residuals = {n: (r.to(device) if device is not None else r.clone()) for n, r in sd.items()}
        self._live = set(self.residuals)
