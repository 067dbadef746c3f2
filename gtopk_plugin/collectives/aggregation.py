"""Aggregation interface: how the workers' selected entries are combined.

An aggregation takes this rank's selection and returns the global result
plus which of this rank's entries reached it (what exact error feedback
needs).  Aggregations talk only to a :class:`Transport`.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Type

import torch

from gtopk_plugin.collectives.transport import Transport

Tensor = torch.Tensor


@dataclass
class Selection:
    """This rank's contribution.  ``idx is None`` means the dense vector."""

    idx: Optional[Tensor]
    vals: Tensor          # wire dtype
    numel: int
    offsets: Tensor
    k: Tensor
    idx_dtype: torch.dtype
    sum_dtype: torch.dtype
    static_count: bool    # every set in flight has exactly sum(k) entries
    kernels: Optional[str] = None
    # a codec's contribution (``vals`` is then its own payload decoded)
    payload: Optional["Encoded"] = None
    # where a dense sum in the sum dtype may be written instead of a fresh
    # N-sized tensor (the reducer's update ring: a fresh 100 MB
    # tensor costs ten reads in page faults); ``None``: allocate
    out: Optional[Tensor] = None


@dataclass
class Encoded:
    """A codec's payload: the tensors that travel and how any rank's payload
    (same shapes and dtypes) decodes to a dense vector of ``numel``."""

    tensors: Sequence[Tensor]
    decode: Callable[[List[Tensor]], Tensor]


@dataclass
class Aggregated:
    """Global result: values at ``idx`` (``idx is None``: a dense vector of
    ``numel``); ``reached`` flags this rank's entries that made it into the
    result (``None``: all of them)."""

    idx: Optional[Tensor]
    vals: Tensor
    reached: Optional[Tensor]
    rounds: int
    # Rounding (or clamping) error that a lower-precision wire introduced
    # after this rank's own rounding -- a merged sum re-rounded for the next
    # round -- and that this rank owns (docs/design.md §3, precision): global
    # int64 indices and values in the sum dtype, added to this rank's
    # residual so mass conservation holds to the sum dtype's rounding.
    residual_add: Optional[Tuple[Tensor, Tensor]] = None


class Aggregation(abc.ABC):
    name = "?"

    @abc.abstractmethod
    def __call__(self, sel: Selection, transport: Transport) -> Aggregated: ...


_REGISTRY: Dict[str, Type[Aggregation]] = {}


def register(name: str):
    def deco(cls):
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def get(name: str) -> Aggregation:
    try:
        return _REGISTRY[name]()
    except KeyError:
        raise ValueError(f"unknown aggregation {name!r}; known: {', '.join(_REGISTRY)}") from None
