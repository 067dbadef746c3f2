"""gTopKAllReduce: the butterfly merge of Shi et al. 2019 (arXiv 1901.04359,
Algorithm 1), generalised to any P (docs/design.md §2).

With P' = 2^⌊log2 P⌋: ranks r ≥ P' fold their set into r − P'; for j = 0
.. log2 P' − 1 rank r swaps its set with r XOR 2^j and both compute the
same merge (sum on equal indices, per-segment top-k); ranks r < P − P'
send the result to r + P'.  Every rank ends with the same ≤ k pairs, bit
for bit.  An own entry reached the result iff its index stayed in the
rank's set after every round (a folded rank learns this from a ⌈k/8⌉-byte
bitmask on the final message).

Narrower wires (fp16/bf16, int8 via :func:`wire.quantize`): merges add in
float32 the exact wire values both partners exchanged; a merged set is
rounded to the wire before each send and once at the end, and each
rounding is charged to the group's lowest rank via
``Aggregated.residual_add`` (docs/design.md §3).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch

from gtopk_plugin import kernels
from gtopk_plugin.collectives import wire
from gtopk_plugin.collectives.aggregation import Aggregated, Aggregation, Selection, register
from gtopk_plugin.collectives.schedule import butterfly_schedule, message_rounds
from gtopk_plugin.collectives.transport import Transport

Tensor = torch.Tensor


@dataclass
class ButterflyResult:
    idx: Tensor        # global indices of the result (ascending)
    vals: Tensor       # summed values (wire dtype; int8 wire: decoded, float32)
    sent_mask: Tensor  # bool over the caller's own entries: reached the result
    rounds: int
    # (int64 global idx, values in the accumulation dtype): wire roundings
    # of merged sums that this rank owns and that reached the result
    residual_add: Optional[Tuple[Tensor, Tensor]] = None


class _Charges:
    """Wire roundings this rank owns, kept only while they can still reach
    the result (docs/design.md §3, precision).

    With a wire narrower than the sum dtype, a group's merged set is held in
    the accumulation dtype and rounded to the wire before each send and once
    at the end.  Every member of the group rounds identically; the group's
    lowest rank records ``(idx, exact − rounded)``.  The error belongs in a
    residual only if the rounded entry reaches the global result, i.e. if
    its index stays in the group's set through every later merge -- exactly
    the survival rule of the rank's own entries: a dropped index returns
    each contributor's whole value to its own residual, so its rounding must
    not be charged (and a later reappearance carries other values)."""

    def __init__(self, device, dtype):
        self.idx = torch.empty(0, dtype=torch.int64, device=device)
        self.val = torch.empty(0, dtype=dtype, device=device)

    def record(self, idx: Tensor, err: Tensor) -> None:
        nz = err != 0  # most entries are exact already (e.g. own wire values)
        if bool(nz.any()):
            self.idx = torch.cat([self.idx, idx.long()[nz]])
            self.val = torch.cat([self.val, err[nz]])

    def survive(self, cur_long: Tensor) -> None:
        if self.idx.numel():
            keep = kernels.member_sorted(self.idx, cur_long)
            self.idx, self.val = self.idx[keep], self.val[keep]

    def result(self) -> Optional[Tuple[Tensor, Tensor]]:
        return (self.idx, self.val) if self.idx.numel() else None


def gtopk_allreduce(idx: Tensor, vals: Tensor, offsets: Tensor, k: Tensor, transport: Transport,
                    idx_dtype: torch.dtype, static_count: bool,
                    kernels_choice=None, sum_dtype: Optional[torch.dtype] = None,
                    draws: Optional[Callable[[str, Tensor], Tensor]] = None) -> ButterflyResult:
    """Run the butterfly on this rank's sparse set ``(idx, vals)``.

    ``static_count``: every set in flight has exactly ``sum(k)`` entries
    (exact top-k selection), so no size header travels.
    ``sum_dtype`` (default ``vals.dtype``): when the wire dtype differs,
    merges add in :func:`wire.accumulation_dtype` the exact wire values, sets
    are rounded (clamped) to the wire before each send and at the end, and the
    rounding errors that reach the result come back in ``residual_add`` of the
    group's lowest rank (:class:`_Charges`).
    int8 wire (``vals`` from :func:`wire.quantize`): ``draws(stream, idx)``
    makes the roundings stochastic, ``None`` rounds to nearest; messages are
    ``n·(b_idx + 1) + 1`` bytes and the result comes back decoded.
    """
    P, r = transport.size, transport.rank
    dev = vals.device
    wdt = vals.dtype
    alive = torch.ones(idx.numel(), dtype=torch.bool, device=dev)
    adt = wire.accumulation_dtype(wdt, wdt if sum_dtype is None else sum_dtype)
    if P == 1:
        return ButterflyResult(idx, vals if adt is None else wire.values(vals, adt), alive, 0)
    own_idx = None  # idx as int64, made where a later round needs it (an O(k) copy)

    sched = butterfly_schedule(P, r)  # who talks to whom (collectives/schedule.py)
    K = int(k.sum())
    msg_bytes = wire.message_bytes(K, idx_dtype, wdt) if static_count else None
    charges = None if adt is None else _Charges(dev, adt)

    def merge(a_idx, a_val, b_idx, b_val):
        if adt is not None:
            b_val = wire.values(b_val, adt).to(adt)  # exact: the partner's wire values
        return kernels.merge_select(a_idx, a_val, b_idx, b_val, offsets, k, kernels=kernels_choice)

    def unpack(blob, extra=0):
        i, v, tail = wire.unpack(blob.to(dev), idx_dtype, wdt, extra)
        return i, v, tail

    def to_wire(cur_idx, cur_val, owner: bool, stream: str):
        """(values to send, the set's values from now on): the wire
        rounding, recorded when this rank owns it.  ``stream``: the key of
        stochastic draws, the same on every member of the group."""
        if adt is None:
            return cur_val, cur_val
        u = None if draws is None else draws(stream, cur_idx)
        w, err = wire.round_to_wire(cur_val, wdt, u)
        if owner:
            charges.record(cur_idx, err)
        return w, wire.values(w, adt).to(adt)

    cur_idx = idx.to(idx_dtype)
    cur_val = vals if adt is None else wire.values(vals, adt).to(adt)
    headers = not static_count
    own_mask_bytes = wire.bitmask_bytes(idx.numel())

    # Phase 1 (non-power-of-two P): ranks r >= P' fold their set into r - P'
    # (their own wire values: nothing to round).  Every rank takes part in
    # every phase (see Transport.phase).
    folded_idx = folded_alive = None
    merged = False  # whether cur is still this rank's own set
    if sched.fold_in is not None:
        send_to, recv_from = sched.fold_in.send_to, sched.fold_in.recv_from
        blob = transport.phase(send_to, wire.pack(cur_idx, vals, idx_dtype) if send_to is not None else None,
                               recv_from, msg_bytes, dev, headers)
        if recv_from is not None:
            o_idx, o_val, _ = unpack(blob)
            cur_idx, cur_val, keep_a, keep_b = merge(cur_idx, cur_val, o_idx, o_val)
            merged = True
            alive &= keep_a
            folded_idx, folded_alive = o_idx.long(), keep_b

    # Phase 2: log2(P') butterfly rounds among ranks < P'; both partners of a
    # round compute the same merge.  The lowest rank of the group that holds
    # the set owns its rounding (schedule.Round.owns_rounding).
    for rnd in sched.rounds:
        peer = rnd.peer
        send = None
        if peer is not None:
            low = r & ~((1 << rnd.j) - 1)  # the group's lowest rank (the same on every member)
            send, cur_val = to_wire(cur_idx, cur_val, rnd.owns_rounding, f"round{rnd.j}:group{low}")
        blob = transport.phase(peer, wire.pack(cur_idx, send, idx_dtype) if peer is not None else None,
                               peer, msg_bytes, dev, headers)
        if peer is None:
            continue
        o_idx, o_val, _ = unpack(blob)
        first = not merged  # this rank's own set is operand a: its keep flags are the survival
        cur_idx, cur_val, keep_a, _ = merge(cur_idx, cur_val, o_idx, o_val)
        merged = True
        # An own entry survives only if its index is in every round's set.
        cur_long = None if first and folded_idx is None and charges is None else cur_idx.long()
        if first:
            alive &= keep_a
        else:
            own_idx = idx.long() if own_idx is None else own_idx
            alive &= kernels.member_sorted(own_idx, cur_long, kernels=kernels_choice)
        if folded_idx is not None:
            folded_alive &= kernels.member_sorted(folded_idx, cur_long, kernels=kernels_choice)
        if charges is not None:
            charges.survive(cur_long)

    # The result travels and is returned in the wire dtype on every rank
    # (folded ranks included): one last rounding, owned by rank 0 (the
    # lowest rank of the final group); every entry of it is in the result.
    final_w = None
    if sched.in_core:
        final_w, dec = to_wire(cur_idx, cur_val, sched.owns_final_rounding, "final")
        # the result's values: the wire dtype's, or the int8 wire decoded
        cur_val = final_w if final_w.dtype != wire.QUANTIZED else dec
    residual_add = None if charges is None else charges.result()

    # Phase 3: the folded ranks get the result plus a bitmask of which of
    # their own entries reached it (they cannot tell from the result alone:
    # an index may have been dropped and reappeared with others' values).
    if sched.fold_out is not None:
        send_to, recv_from = sched.fold_out.send_to, sched.fold_out.recv_from
        out = None
        if send_to is not None:
            out = torch.cat([wire.pack(cur_idx, final_w, idx_dtype), wire.pack_bits(folded_alive)])
        blob = transport.phase(send_to, out, recv_from,
                               None if msg_bytes is None else msg_bytes + own_mask_bytes, dev, headers)
        if recv_from is not None:
            res_idx, res_val, bits = unpack(blob, own_mask_bytes)
            if adt is not None:
                res_val = wire.values(res_val, adt)
            return ButterflyResult(res_idx, res_val, wire.unpack_bits(bits.to(dev), idx.numel()),
                                   message_rounds(P))
    return ButterflyResult(cur_idx, cur_val, alive, message_rounds(P), residual_add)


@register("butterfly")
class GTopKAllReduce(Aggregation):
    """The butterfly as an aggregation: the result is the ≤ k global set.
    ``draws``: the int8 wire's stochastic-rounding key of the current call
    (:class:`wire.Draws`, set by the reducer; ``None``: round to nearest)."""

    draws: Optional[wire.Draws] = None

    def __call__(self, sel: Selection, transport: Transport) -> Aggregated:
        br = gtopk_allreduce(sel.idx, sel.vals, sel.offsets, sel.k, transport, sel.idx_dtype,
                             static_count=sel.static_count, kernels_choice=sel.kernels,
                             sum_dtype=sel.sum_dtype, draws=self.draws)
        return Aggregated(br.idx, br.vals, br.sent_mask, br.rounds, br.residual_add)
