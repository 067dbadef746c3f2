"""What the elastic scheduler did (``ElasticScheduler.stats``), for logs and
benchmarks: how often and how early the barrier broke, how stale the
parameters were when used, and the time spent waiting and saved."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Deque, Dict, List, Optional


@dataclass
class BreakRecord:
    """One broken barrier: at step ``step``'s end the forward pass of step
    ``step + 1`` went ahead while ``missing`` layers' updates had not been
    applied.  Squared norms are of the local gradients (see policies)."""

    step: int
    applied_units: List[int]       # in the order their updates were applied
    missing: int
    applied_sq: float
    missing_sq: float
    total_sq: float
    bound: Optional[float]         # β² (norm) or B² (variance)
    seconds_after_step: float      # since ElasticScheduler.step() closed the step

    @property
    def applied_fraction(self) -> float:
        """‖applied‖ / ‖whole‖ when the barrier broke (how early, by norm)."""
        return 1.0 if self.total_sq <= 0 else (self.applied_sq / self.total_sq) ** 0.5


@dataclass
class ElasticStats:
    """Counters since construction (or ``reset()``).

    steps: ``step()`` calls.  updates_applied: layer updates applied.
    barrier_breaks: steps whose barrier broke.  late_updates: updates applied
    after their step's barrier broke.  staleness: histogram, over every use of
    a layer in a training forward pass (grad enabled), of how many of its
    updates were still missing (0 = fresh; never above max_staleness).
    seconds_waiting: time blocked waiting for updates (pre-forward, step,
    finish).  seconds_saved: for each broken barrier, from the break to the
    arrival of that step's last update, as seen at the scheduler's polls —
    an upper estimate of the waiting the barrier policy would have added
    there.  breaks: the last ``keep`` :class:`BreakRecord`.
    """

    steps: int = 0
    updates_applied: int = 0
    barrier_breaks: int = 0
    late_updates: int = 0
    staleness: Dict[int, int] = field(default_factory=dict)
    seconds_waiting: float = 0.0
    seconds_saved: float = 0.0
    keep: int = 1000
    breaks: Deque[BreakRecord] = field(default_factory=deque)

    def record_break(self, rec: BreakRecord) -> None:
        self.barrier_breaks += 1
        self.breaks.append(rec)
        while len(self.breaks) > self.keep:
            self.breaks.popleft()

    def record_use(self, staleness: int) -> None:
        self.staleness[staleness] = self.staleness.get(staleness, 0) + 1

    @property
    def mean_applied_fraction_at_break(self) -> Optional[float]:
        if not self.breaks:
            return None
        return sum(b.applied_fraction for b in self.breaks) / len(self.breaks)

    def reset(self) -> None:
        self.steps = self.updates_applied = self.barrier_breaks = self.late_updates = 0
        self.staleness = {}
        self.seconds_waiting = self.seconds_saved = 0.0
        self.breaks.clear()

    def as_dict(self) -> dict:
        return {"steps": self.steps, "updates_applied": self.updates_applied,
                "barrier_breaks": self.barrier_breaks, "late_updates": self.late_updates,
                "staleness": dict(sorted(self.staleness.items())),
                "seconds_waiting": self.seconds_waiting, "seconds_saved": self.seconds_saved,
                "mean_applied_fraction_at_break": self.mean_applied_fraction_at_break,
                "breaks": [dict(vars(b), applied_fraction=b.applied_fraction) for b in self.breaks]}

    def load(self, d: dict) -> None:
        """Counters back from :meth:`as_dict` (break records are not restored)."""
        self.steps = int(d.get("steps", 0))
        self.updates_applied = int(d.get("updates_applied", 0))
        self.barrier_breaks = int(d.get("barrier_breaks", 0))
        self.late_updates = int(d.get("late_updates", 0))
        self.staleness = {int(k): int(v) for k, v in d.get("staleness", {}).items()}
        self.seconds_waiting = float(d.get("seconds_waiting", 0.0))
        self.seconds_saved = float(d.get("seconds_saved", 0.0))
