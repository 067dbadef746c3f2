"""Selector interface: how a method picks the entries a worker sends.

Selectors are pure torch and never communicate (DESIGN.md §2 rule 2).  They
see one flat accumulator (gradient + residual) per call, cut into segments
(one per tensor with granularity "layer", one for the bucket with "global"),
and return global indices (ascending) and the selected values.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch

Tensor = torch.Tensor


@dataclass
class SelectionContext:
    """What a selector may know besides the data: the step and segment names
    (for counter-based randomness), the user's seed, this worker's rank and
    the kernels back end in force."""

    step: int
    segment_names: Sequence[str]
    seed: int
    rank: int = 0
    kernels: Optional[str] = None


def seeded_generator(seed: int, step: int, name: str, rank: Optional[int] = None) -> torch.Generator:
    """A generator keyed by (seed, step, segment name[, rank]).

    Counter-based rather than a running stream: the draws of a tensor do not
    depend on which other tensors share the call (DDP buckets change after
    the first step) nor on history, so the step counter is the whole RNG
    state and resuming from a checkpoint is bit-exact.  ``rank=None`` gives
    the same draws on every rank (random-k's shared indices).
    """
    key = f"{seed}:{step}:{name}" if rank is None else f"{seed}:{step}:{name}:rank{rank}"
    h = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(h, "little") & ((1 << 63) - 1))


class Selector:
    """Base class.  Class attributes describe the selector to the reducer:

    ``exact_count``: returns exactly ``k_s`` entries per segment, so peers know
    every message size in advance and no size header travels.
    ``shared_indices``: every rank selects the same indices (random-k), so only
    values travel, summed by a dense allreduce.
    ``aggregation``: the default way results are combined across workers.
    """

    name: str = "?"
    exact_count: bool = True
    shared_indices: bool = False
    aggregation: str = "allgather"

    def __init__(self, r_factor: float = 4.0):
        self.r_factor = r_factor

    def select(self, acc: Tensor, offsets: Tensor, k: Tensor,
               ctx: SelectionContext) -> Tuple[Tensor, Tensor]:
        raise NotImplementedError
