"""The gTop-k butterfly's communication schedule for any P, as plain Python
(no torch, no framework): who sends to whom in which phase, and which rank
owns each wire rounding.  :mod:`.gtopk` runs it for every front end.

With P' = 2^⌊log2 P⌋ (Shi et al. 2019, extended in docs/design.md §2):
fold-in (P > P' only: r ≥ P' sends to r − P'), rounds j = 0 .. log2 P' − 1
(r < P' swaps with r XOR 2^j), fold-out (r < P − P' sends the result and a
survivor bitmask to r + P').  Before round j the rounding of a group's set
is owned by its lowest rank (r with its low j bits clear); the final
rounding by rank 0 (docs/design.md §3).

Every rank takes part in every phase (Horovod's collectives need all
ranks); a phase says ``None`` where this rank neither sends nor receives.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

__all__ = ["Exchange", "Round", "ButterflySchedule", "butterfly_schedule", "message_rounds"]


@dataclass(frozen=True)
class Exchange:
    """One fold phase for one rank: whom it sends to and receives from
    (``None``: nobody)."""

    send_to: Optional[int]
    recv_from: Optional[int]


@dataclass(frozen=True)
class Round:
    """Butterfly round ``j`` for one rank: ``peer`` (``None`` for a folded
    rank ≥ P', idle in every round) and whether this rank owns the wire
    rounding of its group's set before the send."""

    j: int
    peer: Optional[int]
    owns_rounding: bool


@dataclass(frozen=True)
class ButterflySchedule:
    """The whole schedule of rank ``rank`` among ``world_size`` ranks."""

    world_size: int
    rank: int
    core: int                        # P' = 2^⌊log2 P⌋
    fold_in: Optional[Exchange]      # None when P is a power of two
    rounds: Tuple[Round, ...]        # log2 P' entries on every rank
    fold_out: Optional[Exchange]     # None when P is a power of two
    owns_final_rounding: bool        # rank 0: the result's last wire rounding

    @property
    def in_core(self) -> bool:
        """Whether this rank takes part in the rounds (r < P')."""
        return self.rank < self.core

    @property
    def folded(self) -> bool:
        """Whether P is not a power of two (fold-in and fold-out phases run)."""
        return self.fold_in is not None


def message_rounds(world_size: int) -> int:
    """Message rounds of the butterfly: log2 P' plus the two fold phases when
    P is not a power of two (0 for P = 1).  The ``rounds`` that the
    statistics and the traffic model report."""
    P = int(world_size)
    return (P.bit_length() - 1) + (0 if P & (P - 1) == 0 else 2)


def butterfly_schedule(world_size: int, rank: int) -> ButterflySchedule:
    """The schedule of ``rank`` (0 ≤ rank < world_size); see the module doc."""
    P, r = int(world_size), int(rank)
    if P < 1 or not 0 <= r < P:
        raise ValueError(f"butterfly_schedule: need 0 <= rank < world_size, got rank {rank} of {world_size}")
    Pp = 1 << (P.bit_length() - 1)
    n_extra = P - Pp
    fold_in = fold_out = None
    if n_extra:
        fold_in = Exchange(send_to=r - Pp if r >= Pp else None, recv_from=r + Pp if r < n_extra else None)
        fold_out = Exchange(send_to=r + Pp if r < n_extra else None, recv_from=r - Pp if r >= Pp else None)
    rounds = tuple(Round(j, (r ^ (1 << j)) if r < Pp else None, r < Pp and r % (1 << j) == 0)
                   for j in range(Pp.bit_length() - 1))
    return ButterflySchedule(P, r, Pp, fold_in, rounds, fold_out, r == 0)
