"""How the DDP hook (:mod:`.torch_ddp`) turns a step's DDP buckets into
``GradientReducer.reduce`` calls and their results into the buckets'
futures.  An item is ``(names, gradients, bucket buffer, bucket index,
future)``; the gradients are views into the buffer."""
import torch

from ..reducer import GradientReducer


def reduce_buckets(state, items, last: bool, grad_norm) -> dict:
    """One ``reduce`` over the gradients of ``items`` (DDP buckets): the
    averaged updates by parameter name, written straight into the buckets'
    buffers where the reducer can (``out=``: a sparse update is then a zero
    fill and O(k) writes there, not a copy of a bucket-sized update)."""
    names = [n for it in items for n in it[0]]
    grads = [g for it in items for g in it[1]]
    for it in items:
        _check_bucket(it)
    out = _result_views(state, items) if isinstance(state.reducer, GradientReducer) else None
    # The loss scale changes only in scaler.update(), after the step: read it
    # once per step (get_scale() synchronises with the device), not per bucket.
    if state.grad_scaler is not None and state._step_scale is None:
        state._step_scale = float(state.grad_scaler.get_scale())
    try:  # only the step's last bucket advances the step (warm-up, random-k draws)
        kw = {} if out is None else {"out": out, "out_reuse": True}
        updates = state.reducer.reduce(dict(zip(names, grads)), advance_step=last,
                                       grad_norm=grad_norm, loss_scale=state._step_scale, **kw)
    except BaseException:
        state._step_scale = None  # a failed step: read the scale afresh next time
        raise
    state._step_scale = None if last else state._step_scale
    state._record_traffic(last)
    return updates


def _check_bucket(item) -> None:
    names, grads, buffer, index, fut = item
    total = sum(g.numel() for g in grads)
    if total != buffer.numel():
        raise RuntimeError(f"DDP bucket {index} buffer has {buffer.numel()} elements but "
                           f"its gradients have {total}; unsupported bucket layout")


def _result_views(state, items) -> dict:
    """name -> view of the bucket's persistent result buffer, laid out as
    the bucket buffer (each gradient at its own offset).

    The future's value need not be the bucket buffer: DDP views whatever
    tensor the future holds at the bucket's offsets and copies from there
    into ``.grad`` (as it does from its own allreduce's buffer), and it
    never writes into it.  So each bucket gets a buffer of its own, kept
    across steps: the reducer writes the sparse update there with
    ``out_reuse`` -- clearing only the previous step's entries, O(k) --
    instead of zero-filling the bucket buffer (N) or copying an update
    into it (N).  Buffers of an old bucket layout (DDP rebuilds its
    buckets after the first iteration) are dropped."""
    out = {}
    for names, grads, buffer, index, fut in items:
        key = tuple(names)
        buf = state._results.get(key)
        if buf is None or buf.numel() != buffer.numel() or buf.dtype != buffer.dtype:
            for old in [k for k in state._results if set(k) & set(key)]:
                del state._results[old]
            buf = state._results[key] = torch.zeros_like(buffer)
        base = buffer.storage_offset()
        for n, g in zip(names, grads):
            out[n] = buf.narrow(0, g.storage_offset() - base, g.numel()).view(g.shape)
    return out


def finish_bucket(state, item, updates: dict) -> None:
    names, grads, buffer, index, fut = item
    # Already divided by P (op="average"); DDP copies the future's value into
    # the gradients as is.  A flat reducer wrote the updates into this
    # bucket's result buffer (out=, see _result_views); the hierarchical one
    # hands out its update buffer, copied into the bucket's gradients (which
    # are consumed): no bucket-sized allocation either way (issue #15).
    if isinstance(state.reducer, GradientReducer):
        fut.set_result(state._results[tuple(names)])
        return
    for n, g in zip(names, grads):
        g.copy_(updates[n])
    fut.set_result(buffer)
