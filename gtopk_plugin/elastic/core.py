"""The scheduling core: which layer may run its forward pass now, and which
reduced gradients to apply (Nadiradze, Markov et al. 2020, arXiv
2001.05918, §6).  Framework- and model-neutral: it sees layers as integers,
a back end (:class:`~.backend.AsyncReduction`), a policy and an
``apply(unit, step, update)`` callback.

For the forward pass of step τ: a layer's updates are applied in step
order, each exactly once, at the first poll after arrival at which the
layer is unused in the current forward (polls: before every layer's
forward, at ``step()``, ``zero_grad()``, ``finish()``); before layer L's
forward every update of a step ≤ τ − 1 − max_staleness is applied (hard
bound), any other missing one is waited for until its step's barrier breaks
or it arrives; ``drain()`` applies everything.  See docs/elastic.md.

A layer never has more than ``max_staleness + 1`` reductions outstanding (a
launch first waits for older ones), so a back end can name its per-layer
ops with ``max_staleness + 2`` slots.
"""
from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence

import torch

from gtopk_plugin.elastic.backend import AsyncReduction, refill
from gtopk_plugin.elastic.policies import Policy
from gtopk_plugin.elastic.scheduler_stats import BreakRecord, ElasticStats

Tensor = torch.Tensor


@dataclass
class _Entry:
    unit: int
    step: int
    handle: Any
    result: Optional[List[Tensor]] = None
    arrived_at: Optional[float] = None
    local: Optional[List[Tensor]] = None


class _StepRecord:
    """Everything the policy needs about one step's updates."""

    def __init__(self, step: int, n: int):
        self.step = step
        self.sq_t: List[Optional[Tensor]] = [None] * n
        self.sq: List[float] = []
        self.total_sq = 0.0
        self.applied = [False] * n
        self.order: List[int] = []
        self.n_applied = 0
        self.arrived: List[Optional[float]] = [None] * n
        self.dev = [0.0] * n
        self.closed = False
        self.closed_at = 0.0
        self.broken = False
        self.break_time = 0.0


def local_sq_norm(tensors: Sequence[Tensor]) -> Tensor:
    """Σ ‖t‖² in float64 (a 0-d tensor: no device sync during backward)."""
    acc = None
    for t in tensors:
        n = torch.linalg.vector_norm(t.detach(), dtype=torch.float64)
        acc = n * n if acc is None else acc + n * n
    return acc


class ElasticCore:
    def __init__(self, backend: AsyncReduction, policy: Policy, max_staleness: int, n_units: int,
                 apply: Callable[[int, int, List[Tensor]], None], stats: ElasticStats,
                 on_complete: Callable[[int], None] = lambda step: None,
                 unit_names: Optional[Sequence[str]] = None, clock=time.perf_counter):
        self.backend = backend
        self.policy = policy
        self.max_staleness = max_staleness
        self.n = n_units
        self._apply = apply
        self._on_complete = on_complete
        self.stats = stats
        self.clock = clock
        self.names = list(unit_names) if unit_names is not None else [str(i) for i in range(n_units)]
        self.pending: List[Deque[_Entry]] = [deque() for _ in range(n_units)]
        self.inflight: Dict[int, None] = {}
        self.records: Dict[int, _StepRecord] = {}
        self._broken_open = 0
        # per unit, copies of its local gradients that no entry holds any
        # more (the variance policy's deviation): reused, not reallocated
        self._spare: List[List[List[Tensor]]] = [[] for _ in range(n_units)]

    # ------------------------------------------------------------ launching
    def launch(self, u: int, step: int, names, tensors, last_of_step: bool) -> None:
        q = self.pending[u]
        t0 = None
        for e in q:
            if e.step <= step - self.max_staleness - 1 and e.result is None:
                t0 = t0 or self.clock()
                self._collect(e)
        if t0 is not None:
            self.stats.seconds_waiting += self.clock() - t0
        rec = self.records.get(step)
        if rec is None:
            rec = self.records[step] = _StepRecord(step, self.n)
        rec.sq_t[u] = local_sq_norm(tensors)
        local = self._copy_local(u, tensors) if self.policy.needs_deviation else None
        handle = self.backend.launch(u, step, names, tensors, last_of_step)
        q.append(_Entry(u, step, handle, local=local))
        self.inflight[u] = None

    def _copy_local(self, u: int, tensors) -> List[Tensor]:
        """The unit's local gradients at launch, copied (the next backward
        may overwrite them) into a spare copy of this unit's where one fits
        (no layer-sized allocation per step in steady state).  A
        unit holds at most ``max_staleness + 1`` copies at once (the hard
        bound applies older updates before its next forward, and applying
        one frees its copy), so its first launch makes that many."""
        spare = self._spare[u]
        if not spare and not self.pending[u]:  # none made yet (or its layout changed)
            spare.extend([torch.empty_like(t) for t in tensors] for _ in range(self.max_staleness + 1))
        return refill(spare.pop() if spare else None, tensors)

    def close_step(self, step: int) -> None:
        """Every layer of ``step`` has launched: fix its norms."""
        rec = self.records[step]
        missing = [self.names[i] for i, s in enumerate(rec.sq_t) if s is None]
        if missing:
            raise RuntimeError(f"gtopk_plugin elastic: step {step} closed before layers {missing} launched")
        rec.sq = [float(s) for s in rec.sq_t]
        rec.sq_t = []
        rec.total_sq = math.fsum(rec.sq)
        rec.closed = True
        rec.closed_at = self.clock()
        if rec.n_applied == self.n:
            self._complete(rec)

    # -------------------------------------------------------------- polling
    def has_pending(self) -> bool:
        return bool(self.inflight)

    def missing(self, u: int) -> int:
        return len(self.pending[u])

    def _ready(self, e: _Entry) -> bool:
        if e.result is not None:
            return True
        if self.backend.ready(e.handle):
            if e.arrived_at is None:
                e.arrived_at = self.clock()
            return True
        return False

    def _collect(self, e: _Entry) -> None:
        e.result = self.backend.wait(e.handle)
        if e.arrived_at is None:
            e.arrived_at = self.clock()

    def poll(self, eligible: Callable[[int], bool]) -> bool:
        """Apply every arrived update whose layer is ``eligible`` (not in use);
        True when something was applied."""
        applied = False
        for u in list(self.inflight):
            q = self.pending[u]
            if eligible(u):
                while q and self._ready(q[0]):
                    self._apply_front(u)
                    applied = True
            elif self._broken_open:
                # only to time the arrival (seconds_saved); applied later
                for e in q:
                    if not self._ready(e):
                        break
        return applied

    def _apply_front(self, u: int) -> None:
        q = self.pending[u]
        e = q[0]
        if e.result is None:
            self._collect(e)
        self._apply(u, e.step, e.result)
        q.popleft()
        if not q:
            self.inflight.pop(u, None)
        rec = self.records[e.step]
        rec.applied[u] = True
        rec.order.append(u)
        rec.n_applied += 1
        rec.arrived[u] = e.arrived_at
        if e.local is not None:
            rec.dev[u] = self.policy.deviation(e.local, e.result)
            self._spare[u].append(e.local)
            e.local = None
        self.stats.updates_applied += 1
        if rec.broken:
            self.stats.late_updates += 1
        if rec.closed and rec.n_applied == self.n:
            self._complete(rec)

    def _complete(self, rec: _StepRecord) -> None:
        if rec.broken:
            self._broken_open -= 1
            last = max(a for a in rec.arrived if a is not None)
            self.stats.seconds_saved += max(0.0, last - rec.break_time)
        if self.policy.needs_deviation:
            self.policy.observe(math.fsum(rec.dev))
        del self.records[rec.step]
        self._on_complete(rec.step)

    # --------------------------------------------------------------- policy
    def _broken(self, step: int) -> bool:
        rec = self.records.get(step)
        if rec is None or rec.broken:
            return True  # complete (and forgotten), or already broken
        if not rec.closed:
            return False
        if self.policy.requires_all:
            return False
        applied_sq = math.fsum(s for s, a in zip(rec.sq, rec.applied) if a)
        missing_sq = math.fsum(s for s, a in zip(rec.sq, rec.applied) if not a)
        if not self.policy.broken(applied_sq, missing_sq, rec.total_sq):
            return False
        rec.broken = True
        rec.break_time = self.clock()
        self._broken_open += 1
        self.stats.record_break(BreakRecord(
            step=step, applied_units=list(rec.order), missing=self.n - rec.n_applied,
            applied_sq=applied_sq, missing_sq=missing_sq, total_sq=rec.total_sq,
            bound=self.policy.bound(), seconds_after_step=rec.break_time - rec.closed_at))
        return True

    def ensure(self, u: int, tau: int, eligible: Callable[[int], bool]) -> None:
        """Before layer ``u`` is used in the forward pass of step ``tau``:
        wait as the hard bound and the policy require (``u`` must be eligible)."""
        start = None
        rounds = 0
        try:
            while True:
                q = self.pending[u]
                if not q:
                    return
                if q[0].step <= tau - 1 - self.max_staleness:
                    start = start or self.clock()
                    self._apply_front(u)  # hard bound: blocks in the back end's wait
                    continue
                if all(self._broken(e.step) for e in q):
                    return
                start = start or self.clock()
                if self.policy.requires_all:
                    self._apply_front(u)
                    continue
                if self.poll(eligible):
                    rounds = 0
                    continue
                if self.clock() - start > self.backend.timeout:
                    raise RuntimeError(
                        f"gtopk_plugin elastic: layer {self.names[u]!r} waited {self.backend.timeout:g} s "
                        f"for the updates of step {q[0].step} on rank {self.backend.rank} (a peer died or "
                        "stopped training)")
                self.backend.idle(rounds)
                rounds += 1
        finally:
            if start is not None:
                self.stats.seconds_waiting += self.clock() - start

    def drain(self) -> None:
        """Wait for and apply every outstanding update."""
        if not self.inflight:
            return
        start = self.clock()
        try:
            for u in sorted(self.inflight):
                while self.pending[u]:
                    self._apply_front(u)
        finally:
            self.stats.seconds_waiting += self.clock() - start
