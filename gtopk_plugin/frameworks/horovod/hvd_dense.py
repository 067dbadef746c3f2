"""The dense step of the PyTorch Horovod optimizer, for the two cases where
Horovod's own ``horovod.torch.DistributedOptimizer`` would fail or hang:

* ``torch.bfloat16`` gradients (no bfloat16 kernels in Horovod 0.28.1):
  they travel as fp32 and come back as bfloat16;
* ``groups`` with a group incomplete at ``step()`` on some rank (Horovod
  would reduce its members one by one there and hang): here it is reduced
  as a whole, under the same name on every rank.

Everything else dense is Horovod's own optimizer.  Either way
``last_step_traffic`` counts the step with the ring model
(:class:`gtopk_plugin.pipeline.traffic.StepTraffic`).  Methods of
:class:`_DensePath` are copied into the optimizer class that
:func:`~.hvd_optimizer.DistributedOptimizer` builds.
"""
from __future__ import annotations

from typing import Dict

import horovod.torch as hvd
import torch
from horovod.torch import mpi_ops as _ops

from gtopk_plugin.pipeline.traffic import StepTraffic
from gtopk_plugin.frameworks.horovod import waiting

Tensor = torch.Tensor


def needs_own_dense_path(param_groups, groups) -> bool:
    """Whether a dense job needs our dense step rather than Horovod's own
    optimizer: a bfloat16 parameter, or explicit ``groups`` (see above)."""
    if groups is not None and groups != 0:
        return True
    return any(p.dtype == torch.bfloat16 for g in param_groups for p in g["params"] if p.requires_grad)


def attach_ring_traffic(opt, compression) -> None:
    """Give Horovod's own optimizer ``opt`` our ``last_step_traffic`` (ring
    model of its dense allreduce, after ``compression``'s cast), set after
    every ``step()`` through torch's optimizer step hooks."""
    wire_size: Dict[torch.dtype, int] = {}

    def element_bytes(dtype) -> int:
        # what the compressor puts on the wire for this dtype (fp16 halves floats)
        if dtype not in wire_size:
            wire_size[dtype] = compression.compress(torch.zeros(1, dtype=dtype))[0].element_size()
        return wire_size[dtype]

    def after_step(optimizer, args, kwargs):
        # (torch runs this hook after the wrapper's step and after the
        # wrapped class's step; the record is the same both times)
        wire = grad = 0
        ps = optimizer.process_set
        params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
        for p in params if ps.included() else ():
            if p.grad is not None and p.grad.is_sparse and not optimizer.sparse_as_dense:
                continue  # allgathered by Horovod, not part of the dense allreduce
            wire += p.numel() * element_bytes(p.dtype)
            grad += p.numel() * p.element_size()
        optimizer.last_step_traffic = StepTraffic.ring_allreduce(ps.size(), wire, grad).as_dict()

    opt.last_step_traffic = None
    opt.register_step_post_hook(after_step)


class _DensePath:
    """Dense compression: one named Horovod allreduce per gradient (or per
    group) as soon as it is ready; Horovod's tensor fusion batches them."""

    def _init_path(self, grad_scaler):
        self._spec = None
        self._buckets = [list(g) for g in self._groups]
        self._group_of = {p: g for g in self._groups for p in g}
        self._group_left = {g: len(g) for g in self._groups}
        self._handles: Dict[object, tuple] = {}
        self._dense_nbytes = self._grad_nbytes = 0

    def _step_started(self) -> bool:
        return bool(self._handles)

    def _param_ready(self, p):
        if p in self._group_of:
            g = self._group_of[p]
            self._group_left[g] -= 1
            if self._group_left[g] == 0:
                self._handles[g] = self._grouped_allreduce_async(g)
        else:
            self._handles[p] = self._allreduce_async(p)

    def _abandon_path(self):
        # Wait for the reductions still in flight (every rank started them:
        # they complete) so their names are free for the next step; a step
        # started under a name still in flight on this rank would fail here
        # alone, with Horovod's duplicate-name error.
        for kind, h, _ in self._handles.values():
            try:
                h() if kind == "sparse" else waiting.synchronize(h)
            except Exception:  # noqa: BLE001 - the step is being discarded
                pass
        self._handles.clear()
        self._dense_nbytes = self._grad_nbytes = 0
        for p in self._delay:
            self._delay[p] = self.backward_passes_per_step
        for g in self._groups:
            self._group_left[g] = len(g)

    def _prepare_dense(self, p):
        if p.grad is None:
            # Unused this step here, perhaps used on another rank: take part with zeros.
            p.grad = torch.zeros_like(p)
        t = p.grad
        if t.is_sparse and self.sparse_as_dense:
            t = t.to_dense()
        return t

    def _scales(self):
        # Horovod splits the average into a pre-scale 1/f and a post-scale f
        # (the engine adds the 1/size for op=Average).
        if self.op == hvd.Average:
            return 1.0 / self.gradient_predivide_factor, self.gradient_predivide_factor
        return 1.0, 1.0

    def _allreduce_async(self, p):
        name = self._parameter_names[p]
        t = self._prepare_dense(p)
        if t.is_sparse:
            return ("sparse", _ops.sparse_allreduce_async(t, name=name, op=self.op,
                                                          process_set=self.process_set), None)
        # Horovod 0.28.1 has no bfloat16 kernels: such gradients travel as fp32.
        orig = t.dtype
        if orig == torch.bfloat16:
            t = t.float()
        c, ctx = self._compression.compress(t)
        self._count_dense(p, c)
        pre, post = self._scales()
        h = _ops.allreduce_async_(c, name=name, op=self.op, prescale_factor=pre, postscale_factor=post,
                                  process_set=self.process_set)
        return ("dense", h, (ctx, orig))

    def _grouped_allreduce_async(self, g):
        ts, ctxs = [], []
        for p in g:
            t = self._prepare_dense(p)
            if t.is_sparse:
                raise ValueError(f"parameter {self._parameter_names[p]!r} has a sparse gradient; grouped "
                                 "allreduce needs dense ones (pass sparse_as_dense=True)")
            orig = t.dtype
            if orig == torch.bfloat16:
                t = t.float()
            c, ctx = self._compression.compress(t)
            self._count_dense(p, c)
            ts.append(c)
            ctxs.append((ctx, orig))
        pre, post = self._scales()
        h = _ops.grouped_allreduce_async_(ts, name=self._parameter_names[g[0]], op=self.op,
                                          prescale_factor=pre, postscale_factor=post,
                                          process_set=self.process_set)
        return ("grouped", h, ctxs)

    def _count_dense(self, p, sent: Tensor):
        # bytes on the wire (after compression) and of the gradient itself
        self._dense_nbytes += sent.numel() * sent.element_size()
        self._grad_nbytes += p.numel() * p.element_size()

    def _set_grad(self, p, out):
        if p.grad.is_sparse:
            if not out.is_sparse:
                out = out.to_sparse()
            p.grad.zero_().add_(out)
        elif out is not p.grad:
            p.grad.set_(out.to(p.grad.dtype) if out.dtype != p.grad.dtype else out)

    def _synchronize_path(self):
        done = set()
        for key in self._handles:
            done.update(key) if isinstance(key, tuple) else done.add(key)
        # Incomplete groups go as a whole (same op name on every rank).
        for g in self._groups:
            if g not in self._handles and any(p not in done for p in g):
                self._handles[g] = self._grouped_allreduce_async(g)
                done.update(g)
        for p in self._requires_update:
            if p not in done:
                self._handles[p] = self._allreduce_async(p)
        try:
            for key, (kind, h, ctx) in list(self._handles.items()):
                del self._handles[key]  # waited for below: nothing left to settle if this raises
                if kind == "grouped":
                    for p, out, (c, orig) in zip(key, waiting.synchronize(h), ctx):
                        self._set_grad(p, self._compression.decompress(out, c).to(orig))
                elif kind == "sparse":
                    self._set_grad(key, h())
                else:
                    c, orig = ctx
                    self._set_grad(key, self._compression.decompress(waiting.synchronize(h), c).to(orig))
            # Horovod's engine is not observable: the ring model of the base
            # Transport, so figures compare with the sparse paths' counts.
            self.last_step_traffic = StepTraffic.ring_allreduce(
                self.process_set.size(), self._dense_nbytes, self._grad_nbytes).as_dict()
        finally:
            self._abandon_path()
