"""Cross-rank consistency check run at the start of every ``reduce()`` call.

One tiny MAX-allreduce of four int64 values tells every rank at once whether
any rank (a) passed invalid input, (b) has a non-finite gradient, or (c) sees
a different layout (tensor names, shapes, dtypes, per-segment k, step,
method).  Only when something is wrong do ranks exchange details (an
allgather of small Python objects) so that every rank raises the same clear
error instead of hanging in a mismatched exchange.
"""
from __future__ import annotations

import hashlib
from typing import List, Optional, Sequence, Tuple

import torch

from gtopk_plugin.collectives.transport import Transport


class LayoutMismatchError(RuntimeError):
    """Ranks disagree on tensor names, shapes, dtypes or settings."""


class NonFiniteGradientError(RuntimeError):
    """A gradient holds NaN or Inf and ``nonfinite="raise"``."""


class JoinedRankError(RuntimeError):
    """A rank has called ``hvd.join()`` while others still reduce sparsely."""


class PeerInputError(RuntimeError):
    """Another rank passed invalid input to the same collective call."""


class NonFiniteStateError(RuntimeError):
    """The error-feedback accumulator (residual plus the step's gradient,
    through the velocity) overflowed although the gradients were finite:
    the state can no longer be trusted; ``reset()`` or restore a checkpoint."""


def check_state_finite(transport: Transport, overflow_names: Sequence[str], device=None) -> None:
    """One int64 MAX agreement that no rank's accumulator overflowed (the
    general path builds it after the main check, from finite gradients);
    raises :class:`NonFiniteStateError` on every rank otherwise.  ``device``:
    the gradients' (an NCCL group takes the vector there)."""
    v = torch.tensor([1 if overflow_names else 0], dtype=torch.int64, device=device)
    if transport.size > 1:
        v = transport.control_allreduce_max(v)
    if int(v[0]) == 0:
        return
    names = list(overflow_names)
    per_rank = transport.allgather_object(names) if transport.size > 1 else [names]
    detail = "; ".join(f"rank {r}: {', '.join(n)}" for r, n in enumerate(per_rank) if n)
    raise NonFiniteStateError(
        f"gtopk_plugin: the error-feedback accumulator (residual + gradient through the velocity) is "
        f"not finite although every gradient was, in {detail}: the residual or velocity overflowed.  "
        "Nothing was sent; call reset() or restore a checkpoint, and lower the learning rate or "
        "turn on clipping (clip_norm=)")


def describe_layout(tensors: Sequence[Tuple], settings: Tuple) -> List[Tuple]:
    """The layout description every rank fingerprints, for every framework
    layer: one ``(name, shape, dtype)`` entry per tensor, then
    ``("settings", *settings)`` -- whatever must agree across ranks for the
    exchange to pair up (method, aggregation, granularity, wire dtype, op,
    k per segment, ...).  Plain Python values only (``repr`` must be the
    same on every rank); :func:`first_mismatch` names the first entry that
    differs."""
    return [tuple(t) for t in tensors] + [("settings",) + tuple(settings)]


def fingerprint(layout: Sequence[Tuple]) -> int:
    """63-bit hash of a layout description, identical on every rank (and in
    every framework: plain Python, no tensors)."""
    h = hashlib.blake2b(repr(tuple(layout)).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 62) - 1)


def first_mismatch(layouts: List[Sequence[Tuple]]) -> str:
    """Human-readable description of the first difference between rank 0's
    layout and another rank's."""
    ref = list(layouts[0])
    for r, lay in enumerate(layouts[1:], start=1):
        lay = list(lay)
        for i in range(max(len(ref), len(lay))):
            a = ref[i] if i < len(ref) else None
            b = lay[i] if i < len(lay) else None
            if a != b:
                return f"entry {i}: rank 0 has {a!r}, rank {r} has {b!r}"
    return "layouts differ"


def check(transport: Transport, layout: Sequence[Tuple], bad_input: Optional[str],
          nonfinite_names: Sequence[str]) -> Tuple[bool, List[Tuple[int, List[str]]]]:
    """Agree across ranks.  Raises on every rank for invalid input or a layout
    mismatch; returns ``(any_nonfinite, [(rank, names), ...])``."""
    return check_flagged(transport, layout, bad_input, nonfinite_names)[:2]


def check_flagged(transport: Transport, layout: Sequence[Tuple], bad_input: Optional[str],
                  nonfinite_names: Sequence[str], flag: bool = False, device=None
                  ) -> Tuple[bool, List[Tuple[int, List[str]]], bool]:
    """:func:`check`, also agreeing on a per-rank ``flag`` at no extra cost
    (the dense step's "my prescaled copy is not exact": every rank then
    redoes it unscaled); returns ``(any_nonfinite, where, any_flag)``,
    ``any_flag`` meaningful only when no rank is non-finite.  ``device``:
    the gradients' (an NCCL group takes the vector there)."""
    fp = fingerprint(layout) if bad_input is None else 0
    # status: -1 fine, +1 invalid input.  A rank that has called hvd.join()
    # takes part in Horovod allreduces with zeros, so a 0 after the MAX means
    # a joined rank: detected here, before any collective it cannot join.
    status = 1 if bad_input is not None else -1
    # 2: non-finite, 1: flagged, 0: neither -- the MAX keeps what matters
    # (a non-finite step is skipped or raises whatever the flag says)
    state = 2 if nonfinite_names else int(bool(flag))
    v = torch.tensor([status, state, fp, -fp], dtype=torch.int64, device=device)
    if transport.size > 1:
        v = transport.control_allreduce_max(v)
    status, state, hi, neg_lo = v.tolist()
    bad = status > 0
    if status == 0:
        raise JoinedRankError(
            "gtopk_plugin: a rank has called hvd.join() (it has no more data) while others still "
            "reduce: sparse compressions exchange index sets, which a joined rank cannot take part "
            "in.  Give every rank the same number of steps (drop the uneven last batches, e.g. "
            "DistributedSampler(drop_last=True)), or reduce the remaining steps with "
            "Compression.none; then call hvd.join() on every rank.  Nothing was applied and "
            "residuals are unchanged.")
    if bad:
        msgs = transport.allgather_object(bad_input) if transport.size > 1 else [bad_input]
        if bad_input is not None:
            raise ValueError(bad_input)
        culprits = "; ".join(f"rank {r}: {m}" for r, m in enumerate(msgs) if m is not None)
        raise PeerInputError(f"another rank passed invalid input to reduce(): {culprits}")
    if hi != -neg_lo:
        layouts = transport.allgather_object(list(layout))
        raise LayoutMismatchError(
            "gtopk_plugin: ranks called reduce() with different tensors or settings "
            f"(names, shapes, dtypes, k, step or method must match): {first_mismatch(layouts)}")
    if state < 2:
        return False, [], state == 1
    names = list(nonfinite_names)
    per_rank = transport.allgather_object(names) if transport.size > 1 else [names]
    return True, [(r, n) for r, n in enumerate(per_rank) if n], False
