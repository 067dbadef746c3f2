"""The compressor interface: selectors and codecs.

A compressor turns a worker's ``acc = grad + residual`` (flat, in segments)
into its contribution; pure torch, it never communicates (docs/design.md §1).

* **selector**: ``select(acc, offsets, k, ctx) -> (idx, vals)`` (ascending).
* **codec**: ``encode(acc, offsets, ctx) -> [payload tensors]`` (shapes and
  dtypes depend only on the layout) and ``decode(payload, offsets, numel,
  dtype) -> dense``; or, with ``aggregation = "allreduce_rounds"``, a
  generator ``rounds(acc, offsets, ctx, world_size)`` that yields messages
  to be summed (``s = yield msg``) and returns ``(result, contribution)``.
  With ``merge="reduce_scatter_payloads"`` it supplies ``shard_plan``,
  ``shard_payload``, ``decode_shard``, ``encode_shard`` and the server
  residual accessors (``collectives/payloads.py``).

Error feedback wraps either kind (``compress/error_feedback.py``); the
metadata (``kind``, ``aggregation``, ``merges``, ``hyperparams``,
``uses_density``, ``exact_count``, ``shared_indices``) is read by the
registry.  Semantics, adding one: docs/compressors.md, docs/design.md §2.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Generator, List, Optional, Sequence, Tuple

import torch

from gtopk_plugin.registry import HyperParam

Tensor = torch.Tensor

__all__ = ["Compressor", "Selector", "Codec", "HyperParam", "SelectionContext", "seeded_generator"]


@dataclass
class SelectionContext:
    """What a compressor may know besides the data: the step and segment
    names (for counter-based randomness), the user's seed, this worker's rank
    and the kernels back end in force."""

    step: int
    segment_names: Sequence[str]
    seed: int
    rank: int = 0
    kernels: Optional[str] = None
    # the call's tensor shapes in segment order (granularity "layer"; a
    # low-rank codec views each segment as a matrix)
    shapes: Optional[Sequence[Tuple[int, ...]]] = None


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


class Compressor:
    """Base of selectors and codecs (see the module docstring).

    Class attributes (the metadata every layer reads through the registry):

    ``kind``: "selector" or "codec".
    ``aggregation``: how contributions combine by default: "dense" (allreduce
    of the whole accumulator), "allreduce_values" (values at indices every
    rank shares), "allgather" (sparse allgather), "butterfly" (the gTop-k merge),
    "allgather_payloads" (codecs: allgather of payloads, decode and sum),
    "allreduce_rounds" (codecs whose messages sum: PowerSGD),
    "reduce_scatter_payloads" (the two-phase compressed allreduce).
    ``merges``: the aggregations a user may choose with ``merge=``.
    ``hyperparams``: :class:`HyperParam` declarations; the constructor
    validates the values (``ValueError`` naming the valid range) and sets
    them as attributes (``Compressor.hyper`` returns them as a dict).
    ``uses_density``: whether ``density`` (k per segment) means anything.
    """

    name: str = "?"
    kind: str = "selector"
    aggregation: str = "allgather"
    merges: Tuple[str, ...] = ()
    hyperparams: Tuple[HyperParam, ...] = ()
    uses_density: bool = True

    def __init__(self, **hyper):
        declared = {p.name: p for p in self.hyperparams}
        for key in hyper:
            if key not in declared:
                have = ", ".join(declared) or "none"
                raise ValueError(f"method {self.name!r} has no hyper-parameter {key!r} "
                                 f"(its hyper-parameters: {have})")
        for p in self.hyperparams:
            setattr(self, p.name, p.validate(hyper.get(p.name, p.default)))

    @property
    def hyper(self) -> dict:
        """This instance's hyper-parameter values."""
        return {p.name: getattr(self, p.name) for p in self.hyperparams}

    # State a compressor carries across steps (PowerSGD's warm-start
    # factors); random draws are keyed by (seed, step, name), so most have none.
    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, sd: dict) -> None:
        if sd:
            raise ValueError(f"method {self.name!r} keeps no state; got {sorted(sd)}")


class Selector(Compressor):
    """A compressor that picks entries.

    ``exact_count``: returns exactly ``k_s`` entries per segment, so peers
    know every message size in advance and no size header travels.
    ``shared_indices``: every rank selects the same indices (random-k), so
    only values travel, summed by a dense allreduce.
    """

    kind = "selector"
    exact_count: bool = True
    shared_indices: bool = False

    def select(self, acc: Tensor, offsets: Tensor, k: Tensor,
               ctx: SelectionContext) -> Tuple[Optional[Tensor], Tensor]:
        """``(idx, vals)``: global indices (ascending within each segment,
        segments in order; ``None``: every entry) and ``acc`` at them."""
        raise NotImplementedError


# A dense warm-up for codecs: the first ``start_iter`` steps
# are a plain dense allreduce of the accumulator (no compression, so the
# residual becomes zero), as torch's ``powerSGD_hook`` does before
# ``start_powerSGD_iter`` and 1-bit Adam (Tang et al. 2021, arXiv
# 2102.02888, §4) before it freezes the variance: an error-feedback
# quantizer started on a random network's gradients lags dense for the
# rest of a short run (lab/reports/convergence.md, codecs group).  Declared by
# every codec; ``Codec.dense_at`` is the one rule the layers read.
START_ITER = HyperParam("start_iter", 0, "dense allreduce before this step (warm-up; "
                        "torch: start_powerSGD_iter)", int, low=0)


class Codec(Compressor):
    """A compressor that encodes the whole accumulator into payload tensors
    that decode to a dense approximation (quantizers, sketches, low rank).

    ``start_iter`` (:data:`START_ITER`, declared by every built-in codec):
    steps ``0 .. start_iter − 1`` are a dense allreduce of the accumulator
    instead (:meth:`dense_at`); the layers route them to the dense
    aggregation, so they cost what a dense step costs and leave no
    residual.

    ``encode`` must be deterministic given (acc, ctx) and the payload's
    shapes/dtypes must depend only on (offsets, acc.dtype); ``decode`` must
    be deterministic (every rank decodes every payload and must get the same
    bits).  The default aggregation allgathers the payloads and sums the
    decodes in rank order.
    """

    kind = "codec"
    aggregation = "allgather_payloads"
    uses_density = False
    exact_count = True
    shared_indices = False

    def dense_at(self, step: int) -> bool:
        """Whether training step ``step`` is a dense warm-up step (before
        ``start_iter``; a codec that does not declare it has none)."""
        return int(step) < getattr(self, "start_iter", 0)

    def encode(self, acc: Tensor, offsets: Tensor, ctx: SelectionContext) -> List[Tensor]:
        raise NotImplementedError

    def decode(self, payload: Sequence[Tensor], offsets: Tensor, numel: int,
               dtype: torch.dtype) -> Tensor:
        raise NotImplementedError

    def rounds(self, acc: Tensor, offsets: Tensor, ctx: SelectionContext,
               world_size: int) -> Generator[Tensor, Tensor, Tuple[Tensor, Tensor]]:
        """Codecs with ``aggregation = "allreduce_rounds"`` (see the module
        docstring): yield messages to sum over workers, return ``(result,
        contribution)``."""
        raise NotImplementedError
