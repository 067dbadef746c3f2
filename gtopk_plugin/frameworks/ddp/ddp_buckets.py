"""How the DDP hook (:mod:`.torch_ddp`) turns a step's DDP buckets into
``GradientReducer.reduce`` calls and their results into the buckets'
futures.  A :class:`BucketItem` is one bucket as the hook received it; its
gradients are views into its buffer.  :func:`reduce_group` is one
reduction over consecutive buckets, run on the backward thread or, with
``overlap``, on the reducer's communication worker (:func:`submit_group`)."""
import functools
from typing import Dict, List, NamedTuple, Optional, Sequence

import torch

from gtopk_plugin.reducer import GradientReducer
from gtopk_plugin.frameworks.ddp.ddp_usage import agree


class BucketItem(NamedTuple):
    names: List[str]          # the parameters' names (the reducer's keys)
    grads: List[torch.Tensor]  # views into ``buffer``
    buffer: torch.Tensor
    index: int
    fut: torch.futures.Future
    local_used: List[bool]    # received a gradient on this rank this step (ddp_usage)


def agree_used(state, items: Sequence[BucketItem]) -> Dict[str, bool]:
    """name -> used on some rank this step, for every parameter of
    ``items`` (collective: :func:`.ddp_usage.agree`).  DDP applies the
    hook's result only to those (see :mod:`.ddp_usage`)."""
    names = [n for it in items for n in it.names]
    local = [u for it in items for u in it.local_used]
    tr = state._usage_transport
    before = tr.counters.control_bytes
    flags = agree(tr, local, items[0].buffer.device)
    state._traffic_acc.control_bytes += tr.counters.control_bytes - before  # the step's control traffic
    return dict(zip(names, flags))


def reduce_buckets(state, items: Sequence[BucketItem], last: bool, grad_norm,
                   used: Optional[Dict[str, bool]] = None) -> dict:
    """One ``reduce`` over the gradients of ``items`` (DDP buckets) whose
    parameters are in use (``used``, from :func:`agree_used`; ``None``:
    all): the averaged updates by parameter name, written straight into the
    buckets' result buffers where the reducer can (``out=``: a sparse
    update is then a zero fill and O(k) writes there, not a copy of a
    bucket-sized update).  Parameters no rank used are not passed at all:
    their residuals, velocities and step state stay as they are, and their
    part of the result buffer is zero.  Advances the step when ``last``
    even if nothing is left to reduce."""
    for it in items:
        _check_bucket(it)
    keep = [[used is None or used[n] for n in it.names] for it in items]
    names = [n for it, k in zip(items, keep) for n, u in zip(it.names, k) if u]
    grads = [g for it, k in zip(items, keep) for g, u in zip(it.grads, k) if u]
    out = reuse = None
    if isinstance(state.reducer, GradientReducer):
        out, reuse = _result_views(state, items, keep)
    if not names:  # every parameter of these buckets unused on every rank
        if last:
            state.reducer.step += 1
            state._step_scale = None
        state._record_traffic(last, reduced=False)
        return {}
    # The loss scale changes only in scaler.update(), after the step: read it
    # once per step (get_scale() synchronises with the device), not per bucket.
    if state.grad_scaler is not None and state._step_scale is None:
        state._step_scale = float(state.grad_scaler.get_scale())
    try:  # only the step's last bucket advances the step (warm-up, random-k draws)
        kw = {} if out is None else {"out": out, "out_reuse": reuse}
        updates = state.reducer.reduce(dict(zip(names, grads)), advance_step=last,
                                       grad_norm=grad_norm, loss_scale=state._step_scale, **kw)
    except BaseException:
        state._step_scale = None  # a failed step: read the scale afresh next time
        for it in items:  # the result buffers' content is unknown now
            state._written.pop(tuple(it.names), None)
        raise
    state._step_scale = None if last else state._step_scale
    state._record_traffic(last)
    return updates


def _check_bucket(item: BucketItem) -> None:
    total = sum(g.numel() for g in item.grads)
    if total != item.buffer.numel():
        raise RuntimeError(f"DDP bucket {item.index} buffer has {item.buffer.numel()} elements but "
                           f"its gradients have {total}; unsupported bucket layout")


def _result_views(state, items: Sequence[BucketItem], keep):
    """``(out, out_reuse)``: name -> view of the bucket's persistent result
    buffer for the parameters in use (each gradient at its bucket offset), and
    whether the reducer may clear only what it wrote there last.

    DDP copies from whatever tensor the future holds at the bucket's offsets
    and never writes into it, so each bucket keeps a buffer of its own across
    steps and the reducer writes the sparse update there with ``out_reuse``
    (clearing the previous entries, O(k), instead of an N-sized fill or copy).
    Buffers of an old bucket layout are dropped.  ``out_reuse`` holds only if
    every buffer was last written by a call over the same parameters; a
    parameter left out (unused) has its part zeroed once, when it drops out.
    """
    out, reuse = {}, True
    for it, k in zip(items, keep):
        key = tuple(it.names)
        buf = state._results.get(key)
        if buf is None or buf.numel() != it.buffer.numel() or buf.dtype != it.buffer.dtype:
            for old in [o for o in state._results if set(o) & set(key)]:
                del state._results[old]
                state._written.pop(old, None)
            buf = state._results[key] = torch.zeros_like(it.buffer)
            state._written[key] = ()
        base = it.buffer.storage_offset()
        views = [buf.narrow(0, g.storage_offset() - base, g.numel()).view(g.shape) for g in it.grads]
        now = tuple(n for n, u in zip(it.names, k) if u)
        before = state._written.get(key)
        if before != now:
            reuse = False
            for n, v, u in zip(it.names, views, k):
                if not u and (before is None or n in before):
                    v.zero_()
        state._written[key] = now
        out.update((n, v) for n, v, u in zip(it.names, views, k) if u)
    return out, reuse


def finish_bucket(state, item: BucketItem, updates: dict) -> None:
    # Already divided by P (op="average"); DDP copies the future's value into
    # the gradients as is.  A flat reducer wrote the updates into this
    # bucket's result buffer (out=, see _result_views); the hierarchical one
    # hands out its update buffer, copied into the bucket's gradients (which
    # are consumed): no bucket-sized allocation either way.
    if isinstance(state.reducer, GradientReducer):
        item.fut.set_result(state._results[tuple(item.names)])
        return
    for n, g in zip(item.names, item.grads):
        u = updates.get(n)
        g.copy_(u) if u is not None else g.zero_()  # unused on every rank: DDP ignores it
    item.fut.set_result(item.buffer)


def reduce_group(state, items: Sequence[BucketItem], last: bool) -> None:
    """One reduction over ``items`` (consecutive buckets of a step): the
    usage agreement, the reduction, every bucket's future completed."""
    used = agree_used(state, items)
    updates = reduce_buckets(state, items, last, None, used)
    for it in items:
        finish_bucket(state, it, updates)


def fail_group(items: Sequence[BucketItem], exc: BaseException) -> None:
    """No future of ``items`` stays pending after ``exc``."""
    for it in items:
        if not it.fut.done():
            it.fut.set_exception(exc)


def submit_group(state, worker, items: Sequence[BucketItem], last: bool, fresh: bool) -> None:
    """:func:`reduce_group` as a job of ``worker`` (first in first out, so
    every rank reduces the same groups in the same order); its error, or
    that of an earlier job of the step, reaches the buckets' futures."""
    job = worker.submit(reduce_group, state, items, last, fresh=fresh)
    job.add_done_callback(functools.partial(_pass_error, list(items)))


def _pass_error(items, job) -> None:
    try:
        job.value()
    except BaseException as e:  # noqa: BLE001 - handed to DDP through the buckets' futures
        fail_group(items, e)
