"""How the DDP hook (:mod:`.torch_ddp`) turns a step's DDP buckets into
``GradientReducer.reduce`` calls and their results into the buckets'
futures.  An item is ``(names, gradients, bucket buffer, bucket index,
future)``; the gradients are views into the buffer."""
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
    # the gradients themselves receive the updates: DDP's bucket.gradients()
    # are contiguous views into the bucket buffer, and the reducer writes
    # them only after it has read them
    out = dict(zip(names, grads)) if isinstance(state.reducer, GradientReducer) else None
    # The loss scale changes only in scaler.update(), after the step: read it
    # once per step (get_scale() synchronises with the device), not per bucket.
    if state.grad_scaler is not None and state._step_scale is None:
        state._step_scale = float(state.grad_scaler.get_scale())
    try:  # only the step's last bucket advances the step (warm-up, random-k draws)
        kw = {} if out is None else {"out": out}
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


def finish_bucket(item, updates: dict) -> None:
    names, grads, buffer, index, fut = item
    # Already divided by P (op="average"); DDP copies the future's value into
    # the gradients as is.  Each update goes into its gradient's slice of the
    # bucket buffer (the gradients are consumed): no bucket-sized allocation
    # (issue #15).  A flat reducer wrote them there itself (out=); the
    # hierarchical one hands out its update buffer, copied here.
    for n, g in zip(names, grads):
        if updates[n].data_ptr() != g.data_ptr():
            g.copy_(updates[n])
    fut.set_result(buffer)
