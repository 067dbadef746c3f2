"""Selector interface: how a method picks the entries a worker sends.

Selectors are pure torch and never communicate (DESIGN.md §2 rule 2).  They
see one flat accumulator (gradient + residual) per call, cut into segments
(one per tensor with granularity "layer", one for the bucket with "global"),
and return global indices (ascending) and the selected values.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch

Tensor = torch.Tensor


@dataclass
class SelectionContext:
    """What a selector may know besides the data: the step (for step-seeded
    randomness), segment names, the worker's own generator and the kernels
    back end in force."""

    step: int
    segment_names: Sequence[str]
    seed: int
    generator: Optional[torch.Generator] = None
    kernels: Optional[str] = None


class Selector:
    """Base class.  Class attributes describe the selector to the reducer:

    ``exact_count``: returns exactly ``k_s`` entries per segment, so peers know
    every message size in advance and no size header travels.
    ``shared_indices``: every rank selects the same indices (random-k), so only
    values travel, summed by a dense allreduce.
    ``uses_generator``: draws from the worker's checkpointed generator.
    ``aggregation``: the default way results are combined across workers.
    """

    name: str = "?"
    exact_count: bool = True
    shared_indices: bool = False
    uses_generator: bool = False
    aggregation: str = "allgather"

    def __init__(self, r_factor: float = 4.0):
        self.r_factor = r_factor

    def select(self, acc: Tensor, offsets: Tensor, k: Tensor,
               ctx: SelectionContext) -> Tuple[Tensor, Tensor]:
        raise NotImplementedError
