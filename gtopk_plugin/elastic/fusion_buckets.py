"""Tensor fusion for the elastic scheduler: consecutive layers' reductions
launched as one (``ElasticScheduler(..., bucket_cap_mb=...)``).

One reduction per layer pays layers × rounds × latency per step; like
Horovod's fusion buffer and DDP's buckets, this wraps any
:class:`~.backend.AsyncReduction`: layers are collected in launch order
until their gradients reach the cap (or the step's last layer launched),
then reduced in one launch; every layer still gets its own handle, ready
when its bucket is, so the policies decide layer by layer.

Buckets are cut by sizes and launch order alone, the same on every rank.
Semantics are the wrapped back end's on the concatenated layers: a dense
allreduce sums the same values (equal up to rounding at P >= 3, the ring
order may differ; bit for bit at P = 2); a
:class:`~gtopk_plugin.GradientReducer` selects per tensor as before, with
one check and one exchange per bucket.  See docs/elastic.md.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from gtopk_plugin.elastic.backend import AsyncReduction, UnitSpec, refill

Tensor = torch.Tensor


class _Bucket:
    """One launch of the wrapped back end; its result, once waited for."""

    __slots__ = ("handle", "result")

    def __init__(self, handle):
        self.handle = handle
        self.result: Optional[List[Tensor]] = None


class _Part:
    """A layer's handle: its bucket (None while the bucket is still being
    filled) and its tensors' positions in the bucket's result."""

    __slots__ = ("bucket", "lo", "hi")

    def __init__(self):
        self.bucket: Optional[_Bucket] = None
        self.lo = self.hi = 0


class BucketedReduction(AsyncReduction):
    """Fuses consecutive launches of ``inner`` into buckets of at least
    ``cap_bytes`` of gradients (the last of a step closes its bucket)."""

    def __init__(self, inner: AsyncReduction, cap_bytes: int):
        if not isinstance(inner, AsyncReduction):
            raise ValueError(f"inner must be an AsyncReduction; got {type(inner).__name__}")
        if cap_bytes <= 0:
            raise ValueError(f"cap_bytes must be > 0; got {cap_bytes!r}")
        self.inner = inner
        self.cap_bytes = int(cap_bytes)
        self.kind = f"{inner.kind}+buckets({self.cap_bytes})"
        self.timeout = inner.timeout
        # the bucket being filled: (unit, names, copies, part) per layer
        self._open: List[Tuple[int, List[str], List[Tensor], _Part]] = []
        self._open_bytes = 0
        self._open_step: Optional[int] = None
        self._slots = 2
        # (unit, slot) -> persistent copies of a layer's gradients while its
        # bucket is open (the caller may overwrite p.grad after launch)
        self._copies: Dict[Tuple[int, int], List[Tensor]] = {}

    @property
    def reducer(self):
        """The inner back end's GradientReducer, if it has one: what the
        variance policy binds to (policies.bind_to_backend).  Without it a
        bucketed gTop-k back end passed for a native dense one, and the
        policy took its compression error for the gradient variance."""
        return getattr(self.inner, "reducer", None)

    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def size(self) -> int:
        return self.inner.size

    def setup(self, units: Sequence[UnitSpec], max_in_flight: int) -> None:
        self._slots = max(1, int(max_in_flight))
        self.inner.setup(units, max_in_flight)

    def launch(self, unit, step, names, tensors, last_of_step):
        if self._open and self._open_step != step:
            self._flush(False)  # a step's layers never share a bucket with the next step's
        part = _Part()
        self._open.append((unit, list(names), self._copy(unit, step, tensors), part))
        self._open_step = step
        self._open_bytes += sum(t.numel() * t.element_size() for t in tensors)
        if last_of_step or self._open_bytes >= self.cap_bytes:
            self._flush(last_of_step)
        return part

    def _copy(self, unit, step, tensors) -> List[Tensor]:
        """The gradients, copied into this (layer, slot)'s persistent buffers:
        at most ``max_in_flight`` reductions of a layer are outstanding, and
        a slot's copy has been read by the wrapped back end's own launch
        (which copies) before the slot comes round again."""
        key = (unit, step % self._slots)
        self._copies[key] = refill(self._copies.get(key), tensors)
        return self._copies[key]

    def _flush(self, last_of_step: bool) -> None:
        if not self._open:
            return
        layers, self._open, self._open_bytes = self._open, [], 0
        names = [n for _, ns, _, _ in layers for n in ns]
        tensors = [t for _, _, ts, _ in layers for t in ts]
        # the bucket takes its first layer's index: op names and in-flight
        # slots per bucket, the same on every rank (buckets are cut alike)
        bucket = _Bucket(self.inner.launch(layers[0][0], self._open_step, names, tensors, last_of_step))
        pos = 0
        for _, _, ts, part in layers:
            part.bucket, part.lo, part.hi = bucket, pos, pos + len(ts)
            pos += len(ts)

    def ready(self, handle: _Part) -> bool:
        b = handle.bucket
        return b is not None and (b.result is not None or self.inner.ready(b.handle))

    def wait(self, handle: _Part) -> List[Tensor]:
        if handle.bucket is None:
            # The scheduler waits for a step's layers only after the step's
            # last layer launched (which closes every bucket of the step).
            # Launching an open bucket here would happen on this rank alone
            # and cut the buckets differently from the other ranks: refuse.
            raise RuntimeError("gtopk_plugin elastic: waited for a layer whose bucket is still open (its "
                               "step's last layer has not launched); buckets launch only when the cap is "
                               "reached or the step's last layer arrives")
        b = handle.bucket
        if b.result is None:
            b.result = self.inner.wait(b.handle)
        return b.result[handle.lo:handle.hi]

    def idle(self, rounds: int) -> None:
        self.inner.idle(rounds)

    def agree(self, layout, bad_input) -> None:
        self.inner.agree(list(layout) + [("buckets", self.cap_bytes)], bad_input)

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, sd) -> None:
        self.inner.load_state_dict(sd)

    def close(self) -> None:
        self._open.clear()
        self._copies.clear()
        self.inner.close()
