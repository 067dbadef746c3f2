"""Which parameters DDP discards in a step: the DDP hook's side of
``find_unused_parameters=True`` and ``static_graph=True``.

DDP leaves the ``.grad`` of a parameter that no rank used in a step
untouched, discarding what a hook returned for it: it marks a parameter
used when its gradient accumulator runs (any backward since the last
synchronised step, as of torch 2.13; older releases: the synchronising pass
only, a known PyTorch limitation) and takes the OR over the ranks (with
``static_graph=True`` the first iteration's map holds for the run).

The hook observes the same event with a post-accumulate-grad hook per
parameter (:class:`UsageTracker`), agrees on the OR itself (:func:`agree`,
one MAX collective of one byte per parameter) and leaves the unused
parameters out of the step's reduction: their residuals and velocities stay
as they are and nothing counts as sent that DDP does not apply.  No private
DDP state is read (DDP's own map is reduced too late).  See docs/ddp.md.
"""
from __future__ import annotations

import weakref
from typing import Dict, List, Sequence, Set, Tuple

import torch

__all__ = ["UsageTracker", "agree"]


class UsageTracker:
    """Which parameters received a gradient since the last step's end.

    ``watch(p)`` adds a post-accumulate-grad hook to ``p`` (once): it fires
    right after autograd accumulates into ``p.grad``, before DDP's own hook
    on the same accumulator marks the parameter ready, so the parameters of
    a bucket are all recorded by the time DDP hands the bucket over.
    ``end_step()`` forgets them, as DDP clears its map after each
    synchronised step.

    A parameter first watched while a backward pass is already running (the
    hook sees its bucket before knowing it) missed that pass's accumulation:
    for that step it counts as used when its ``.grad`` is set (DDP zero-fills
    an unset gradient's bucket entries and treats the parameter as unused).
    Passing ``named_parameters`` to the state watches every parameter from
    the start.
    """

    def __init__(self):
        # id -> (param, handle): the parameter is kept so that its id cannot
        # be taken by another tensor while it is mapped here
        self._watched: Dict[int, Tuple[torch.Tensor, object]] = {}
        self._used: Set[int] = set()
        self._fresh: Set[int] = set()  # watched during the current step

    def watch(self, params, fresh: bool) -> None:
        """Observe ``params`` from now on; ``fresh``: a backward pass may
        already have accumulated into them unobserved (see the class)."""
        ref = weakref.ref(self)
        for p in params:
            if id(p) in self._watched or not p.requires_grad:
                continue
            h = p.register_post_accumulate_grad_hook(_Record(ref))
            self._watched[id(p)] = (p, h)
            if fresh:
                self._fresh.add(id(p))

    def used(self, params: Sequence[torch.Tensor]) -> List[bool]:
        """For each of ``params``: did it receive a gradient this step?"""
        return [id(p) in self._used or (id(p) in self._fresh and p.grad is not None) for p in params]

    def end_step(self) -> None:
        self._used.clear()
        self._fresh.clear()

    def remove(self) -> None:
        """Take every hook off (the state is rebound to other parameters)."""
        for _, h in self._watched.values():
            h.remove()
        self._watched.clear()
        self.end_step()


class _Record:
    """The post-accumulate-grad hook: records the parameter as used (weakly
    bound, so that a dropped state leaves only no-op hooks behind)."""

    __slots__ = ("tracker",)

    def __init__(self, tracker: "weakref.ref[UsageTracker]"):
        self.tracker = tracker

    def __call__(self, p: torch.Tensor) -> None:
        t = self.tracker()
        if t is not None:
            t._used.add(id(p))


def agree(transport, local: Sequence[bool], device) -> List[bool]:
    """The OR over ranks of each rank's ``local`` flags (collective: every
    rank passes as many flags, for the same parameters in the same order --
    DDP's bucket layout is the same on every rank).  One byte per flag,
    counted as control traffic on ``transport``; nothing sent at P = 1."""
    if transport.size == 1:
        return [bool(u) for u in local]
    mask = torch.tensor([1 if u else 0 for u in local], dtype=torch.uint8, device=device)
    return [bool(v) for v in transport.control_allreduce_max(mask).tolist()]
