"""The sparse step of the PyTorch Horovod optimizer: fixed buckets, each
reduced by the core's :class:`~gtopk_plugin.GradientReducer` as soon as all
its gradients are ready (overlapping backward).

* buckets are reduced in a fixed order on every rank, bucket i's Horovod ops
  in scope ``b{i}`` (:func:`~gtopk_plugin.pipeline.param_buckets.bucket_scope`);
* only the last bucket advances the reducer's step counter (warm-up and
  random draws are per step);
* with ``clip_norm`` the buckets are held until ``synchronize()`` (the norm
  covers the whole step);
* a gloo side channel carries the exchange; the step's one Horovod op is
  the join detection (:class:`JoinedRankError` on every rank);
* every Horovod op carries the optimizer's prefix ``gtopk.p{set}.o{n}`` and
  a step's join is waited for before the next step starts, so two
  optimizers or an abandoned step never reuse an in-flight op name;
* the reducer's communication worker reduces them in submission order.

See docs/horovod.md, "What happens in a step".  :class:`_SparsePath`'s
methods are copied into the optimizer class (:mod:`.hvd_optimizer`).
"""
from __future__ import annotations

import warnings
from typing import Dict, List, Optional

import horovod.torch as hvd
import torch
from horovod.common.exceptions import HorovodInternalError
from horovod.torch import mpi_ops as _ops

from gtopk_plugin.pipeline.comm_worker import CommWorker
from gtopk_plugin.pipeline.param_buckets import bucket_scope, make_buckets
from gtopk_plugin.pipeline.input_check import JoinedRankError
from gtopk_plugin.two_level.hierarchical_reducer import HierarchicalReducer
from gtopk_plugin.reducer import GradientReducer, local_grad_norm
from gtopk_plugin.pipeline.traffic import StepTraffic
from gtopk_plugin.frameworks.horovod.hvd_transport import HorovodNodeEngine, HorovodTransport

Tensor = torch.Tensor
_JOINED = ("gtopk_plugin: a rank has called hvd.join() (it has no more data) while others still "
           "reduce: sparse compressions exchange index sets, which a joined rank cannot take part "
           "in.  Give every rank the same number of steps (drop the uneven last batches, e.g. "
           "DistributedSampler(drop_last=True)), or reduce the remaining steps with "
           "Compression.none; then call hvd.join() on every rank.  Nothing was applied and "
           "residuals are unchanged.")


# Sparse optimizers built so far per Horovod process set: the n of each
# one's op-name prefix (module docstring).
_BUILT: Dict[int, int] = {}


def _next_index(process_set) -> int:
    sid = int(process_set.process_set_id or 0)
    n = _BUILT.get(sid, 0)
    _BUILT[sid] = n + 1
    return n


def adopt_index(process_set, index: int) -> None:
    """An optimizer took ``index`` from rank 0 (elastic sync): optimizers
    built after it here are numbered after it, as on rank 0."""
    sid = int(process_set.process_set_id or 0)
    _BUILT[sid] = max(_BUILT.get(sid, 0), index + 1)


def op_prefix(process_set, index: int) -> str:
    """The prefix of every Horovod op name of the ``index``-th sparse
    optimizer on ``process_set``."""
    return f"gtopk.p{int(process_set.process_set_id or 0)}.o{index}"


def op_name(op) -> str:
    """``hvd.Average`` etc. by name, for error messages."""
    for n in ("Average", "Sum", "Adasum", "Min", "Max", "Product"):
        if getattr(hvd, n, object()) == op:
            return f"hvd.{n}"
    return repr(op)


class _SparsePath:
    """Sparse compression: the core's GradientReducer per bucket."""

    def _init_path(self, grad_scaler):
        self._spec = self._compression
        op = self.op
        if op not in (hvd.Average, hvd.Sum):
            raise ValueError("sparse compression supports op=hvd.Average or hvd.Sum; got "
                             f"{op_name(op)}")
        self._op_index = _next_index(self.process_set)
        self._transport = HorovodTransport(self.process_set, prefix=op_prefix(self.process_set, self._op_index),
                                           side_channel=self._spec.exchange == "gloo")
        red_op = "average" if op == hvd.Average else "sum"
        if self._hierarchy is None:
            self._reducer = GradientReducer(transport=self._transport, op=red_op,
                                            **self._spec.reducer_kwargs())
        else:  # dense inside a node, the method between node leaders
            self._reducer = HierarchicalReducer(engine=HorovodNodeEngine(self._transport), op=red_op,
                                                **self._hierarchy, **self._spec.reducer_kwargs())
        if grad_scaler is not None and not callable(getattr(grad_scaler, "get_scale", None)):
            raise ValueError("grad_scaler must be a torch.amp.GradScaler (an object with get_scale())")
        self._grad_scaler = grad_scaler
        self._step_loss_scale: Optional[float] = None
        # local clipping needs the whole step's norm: buckets wait for synchronize()
        self._hold_buckets = self._spec.config.clip_norm is not None
        self._step_grad_norm: Optional[float] = None
        if self._spec.momentum_correction:
            self._reducer.bind_optimizer(
                self, [(n, p) for p, n in self._parameter_names.items()])
        elif self._spec.config.momentum_correction is None and any(
                float(g.get("momentum", 0.0) or 0.0) > 0.0 for g in self.param_groups):
            warnings.warn(
                f"{self._spec!r} with an optimizer that has momentum: the optimizer applies its "
                "momentum to the sparse update, which usually trains worse than dense; pass "
                "momentum_correction=True to the compression (DGC momentum correction, "
                "docs/recipes.md)", UserWarning, stacklevel=4)
        self._buckets = make_buckets(self._requires_update, self._groups, self._spec.fusion_threshold)
        self._bucket_of = {p: i for i, b in enumerate(self._buckets) for p in b}
        self._worker: Optional[CommWorker] = None  # a hierarchical reducer's (a flat one has its own)
        self._join_handle = None
        # The step counter (density warm-up, random draws, layout check)
        # must agree on all ranks; a fresh optimizer takes the largest one
        # at its first step (e.g. rank 0 loaded a checkpoint).  Elastic
        # sync clears this flag after broadcasting rank 0's counter.
        self._agree_step = True
        self._reset_sparse_step()

    def _step_started(self) -> bool:
        return bool(self._ready)

    def _abandon_path(self):
        # every rank abandons the same step: its reductions already running
        # finish (their ops are in the peers' streams too), results dropped
        for fut in self._futures:
            if fut is not None:
                try:
                    fut.wait()
                except BaseException:  # noqa: BLE001 - the step is being discarded
                    pass
        self._settle_join()
        self._reset_sparse_step()

    def _settle_join(self):
        """Wait for a join this optimizer started and no bucket consumed
        (an abandoned step), so its name is free again on this rank."""
        h, self._join_handle = self._join_handle, None
        if h is not None:
            try:
                self._transport._wait(h)  # sleeps, as every wait of this path
            except BaseException:  # noqa: BLE001 - the step is being discarded
                pass

    def _reset_sparse_step(self):
        # (a join no bucket consumed stays in _join_handle: the next step
        # settles it before it starts its own under the same name)
        self._step_grad_norm = None
        self._step_loss_scale = None
        self._ready = set()
        self._bucket_left = [len(b) for b in self._buckets]
        self._futures: List[Optional[torch.futures.Future]] = [None] * len(self._buckets)
        self._next_bucket = 0
        self._joined = False
        for p in self._delay:
            self._delay[p] = self.backward_passes_per_step

    def _param_ready(self, p):
        if p in self._ready:
            return
        if not self._ready and self._transport.side_channel and self._transport.size > 1:
            # join detection: the step's one Horovod op, overlapping backward
            self._settle_join()
            self._join_handle = _ops.allreduce_async(
                torch.ones(1, dtype=torch.int32), op=hvd.Sum, name=f"{self._transport.prefix}.join",
                process_set=self.process_set)
        self._ready.add(p)
        self._bucket_left[self._bucket_of[p]] -= 1
        self._launch_ready_buckets()

    def _launch_ready_buckets(self):
        # Fixed order on every rank: bucket i+1 never starts before bucket i,
        # so the single worker thread walks the same op sequence everywhere.
        if self._hold_buckets and self._step_grad_norm is None:
            return
        if self._next_bucket == 0 and self._step_loss_scale is None:
            pre = 1.0 / self.gradient_predivide_factor if self.op == hvd.Average else 1.0
            scale = 1.0 if self._grad_scaler is None else float(self._grad_scaler.get_scale())
            self._step_loss_scale = scale * pre
        while self._next_bucket < len(self._buckets) and self._bucket_left[self._next_bucket] == 0:
            i = self._next_bucket
            grads = {self._parameter_names[p]: p.grad for p in self._buckets[i]}
            join = None
            if i == 0:  # bucket 0 waits for the step's join (consumed: nothing to settle)
                join, self._join_handle = self._join_handle, None
            # fresh: each bucket runs and raises on its own, whatever the others did
            self._futures[i] = self._comm_worker().submit(self._reduce_bucket, i, grads, join, fresh=True)
            self._next_bucket += 1

    def _comm_worker(self) -> CommWorker:
        """The thread the buckets are reduced on: the reducer's own."""
        if isinstance(self._reducer, GradientReducer):
            return self._reducer.worker()
        if self._worker is None or self._worker.closed:
            self._worker = CommWorker(f"gtopk-comm-horovod-{self._transport.prefix}")
        return self._worker

    def _reduce_bucket(self, i: int, grads: Dict[str, Tensor], join=None):
        """Runs on the worker thread: one GradientReducer call per bucket
        (bucket 0 first waits for the step's join allreduce, ``join``)."""
        t = self._transport
        t.set_scope(bucket_scope(i))
        try:
            return self._reduce_bucket_on(t, i, grads, join)
        except HorovodInternalError:
            t.drop_side_channel()  # a lost peer: the next step makes a new channel
            raise

    def _reduce_bucket_on(self, t: HorovodTransport, i: int, grads: Dict[str, Tensor], join):
        if join is not None:
            t.collectives += 1
            self._joined = int(t._wait(join)[0]) < t.size
        if self._joined:  # every bucket of the step, on every rank that did not join
            raise JoinedRankError(_JOINED)
        if i == 0:
            self._step_start = t.counters.copy()
            if self._agree_step:
                v = torch.tensor([self._reducer.step], dtype=torch.int64)
                if t.size > 1:
                    v = t.control_allreduce_max(v)
                self._reducer.step = int(v[0])
                self._agree_step = False
        pre = 1.0 / self.gradient_predivide_factor if self.op == hvd.Average else 1.0
        prepared = {}
        for n, g in grads.items():
            g = g.detach()
            if g.is_sparse:
                g = g.to_dense()
            prepared[n] = g * pre if pre != 1.0 else g
        scaled = self._grad_scaler is not None or pre != 1.0
        # the updates go straight into the (dense, contiguous) p.grad tensors,
        # which the reducer reads before it writes them: no copy of an
        # update buffer in synchronize()
        kw = {}
        if self._hierarchy is None and all(not g.is_sparse and g.is_contiguous() for g in grads.values()):
            kw["out"] = grads
        out = self._reducer.reduce(prepared, advance_step=(i == len(self._buckets) - 1),
                                   grad_norm=self._step_grad_norm,
                                   loss_scale=self._step_loss_scale if scaled else None, **kw)
        return out, self._reducer.last_stats

    def _synchronize_path(self):
        for p in self._requires_update:
            if p not in self._ready:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                self._param_ready(p)
        if self._hold_buckets:
            # this worker's gradient norm over the whole step (DGC local clipping)
            pre = 1.0 / self.gradient_predivide_factor if self.op == hvd.Average else 1.0
            self._step_grad_norm = pre * local_grad_norm(
                p.grad.to_dense() if p.grad.is_sparse else p.grad for p in self._requires_update)
            self._launch_ready_buckets()
        first_error, stats = None, []
        post = self.gradient_predivide_factor if self.op == hvd.Average else 1.0
        try:
            for i, fut in enumerate(self._futures):
                try:
                    out, st = fut.wait()
                except BaseException as e:  # noqa: BLE001 - wait for every bucket, then raise
                    first_error = first_error or e
                    continue
                stats.append(st)
                poison = st.skipped and self._spec.nonfinite == "propagate"
                for p in self._buckets[i]:
                    u = out[self._parameter_names[p]]
                    if post != 1.0:
                        u = u * post
                    if poison:
                        u = torch.full_like(u, float("nan"))
                    if p.grad.is_sparse:
                        p.grad = u.to_sparse()
                    elif u.data_ptr() != p.grad.data_ptr():  # not written in place (out=)
                        p.grad.copy_(u)
        finally:
            self._reset_sparse_step()
        if first_error is not None:
            raise first_error
        d = self._transport.counters.copy().minus(self._step_start)
        if self._hierarchy is not None:  # the levels' own transports: bytes from the stats
            self.last_step_traffic = _level_traffic(stats, d)
            return
        # transport fields from the counters over the whole step (they also
        # see the step-counter agreement), selection fields from the stats
        self.last_step_traffic = StepTraffic.from_stats(stats, counters=d).as_dict()


def _level_traffic(stats, world) -> dict:
    """A hierarchical step's traffic: the inter-node exchange's bytes (the
    buckets' stats; zero on non-leaders) as the usual fields, the node
    level's apart, the world transport's control bytes (checks, the step
    agreement) added."""
    out = StepTraffic.from_stats(stats).as_dict()
    out["control_bytes"] += world.control_bytes
    for f in ("intra_bytes_sent", "intra_bytes_received", "inter_bytes_sent", "inter_bytes_received"):
        out[f] = sum(getattr(st, f) for st in stats)
    return out
