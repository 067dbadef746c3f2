"""The drop-in ``DistributedOptimizer`` of the PyTorch Horovod layer::

    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               named_parameters=model.named_parameters(),
                               compression=Compression.gtopk(0.01))

A sparse compression gives ours, whose step is :class:`~.hvd_sparse._SparsePath`
(the core's ``GradientReducer`` per bucket, overlapping backward); a dense
one gives Horovod's own optimizer (plus ``last_step_traffic`` and a
non-spinning ``synchronize()``, :mod:`.waiting`), or ours with
:class:`~.hvd_dense._DensePath` where Horovod would fail or hang (bfloat16
parameters, ``groups``); ``op=hvd.Adasum`` gives Horovod's Adasum optimizer.
As in Horovod, the class derives from the user's optimizer class, with
methods copied from :class:`_OptimizerBody` plus one path class.

A parameter is reduced by one optimizer of ours: hooks hold the optimizer
weakly (a dropped one is collected and its hooks removed), and building one
over parameters of a live earlier one retires that one (hooks removed,
``step()`` raises).  See docs/horovod.md.
"""
from __future__ import annotations

import contextlib
import warnings
import weakref
from typing import List, Optional

import horovod.torch as hvd
import torch
from horovod.torch import mpi_ops as _ops

from gtopk_plugin.pipeline.param_buckets import bucket_names, name_parameters, resolve_groups
from gtopk_plugin.reducer import GradientReducer
from gtopk_plugin.pipeline.reduce_stats import ReduceStats
from gtopk_plugin.two_level.topology import node_keywords
from gtopk_plugin.frameworks.compression_names import signature
from gtopk_plugin.frameworks.horovod.hvd_compression import Compression, SparseCompression, is_dense_compressor, sparse_choices
from gtopk_plugin.frameworks.horovod.hvd_dense import _DensePath, attach_ring_traffic, needs_own_dense_path
from gtopk_plugin.frameworks.horovod import waiting
from gtopk_plugin.frameworks.horovod.hvd_sparse import _SparsePath, adopt_index, op_prefix

__all__ = ["DistributedOptimizer"]

_STATE_KEY = "gtopk_plugin"  # our entry in optimizer.state_dict()
# Horovod's broadcast_optimizer_state initialises an empty optimizer state
# with a plain local step() when the optimizer's module is Horovod's
# optimizer module, and with a collective step() otherwise.  Our optimizer
# must get the local one, as Horovod's own does.
_HVD_OPTIMIZER_MODULE = hvd.DistributedOptimizer.__module__


class _GtopkHorovodOptimizer:
    """Marker base of every optimizer class made here (the elastic state
    handler in :mod:`.hvd_resize_state` finds them by it)."""


# id(parameter) -> the optimizer of ours whose hooks are on it.  An entry
# dies with its optimizer, which holds the parameter: an id is not reused
# while its entry lives.
_OWNER: "weakref.WeakValueDictionary[int, _OptimizerBody]" = weakref.WeakValueDictionary()

_RETIRED = ("gtopk_plugin: this DistributedOptimizer was retired when another one was built over "
            "its parameters (a parameter's gradients are reduced by one optimizer; its gradient "
            "hooks were removed).  Step the newer optimizer, or build the new one only once the "
            "old one is no longer used.")


def _remove_hooks(handles) -> None:
    for h in handles:
        h.remove()
    handles.clear()


class _OptimizerBody(torch.optim.Optimizer):
    """Methods shared by both paths.  A path class provides ``_init_path``,
    ``_param_ready``, ``_synchronize_path``, ``_step_started`` and
    ``_abandon_path``.  ``super(self.__class__, self)`` is the user's
    optimizer class (the built class derives from it directly)."""

    def __init__(self, params, named_parameters, compression, backward_passes_per_step, op,
                 gradient_predivide_factor, groups, sparse_as_dense, process_set, grad_scaler=None,
                 hierarchy=None):
        super(self.__class__, self).__init__(params)
        self._hierarchy = hierarchy  # node layout of a hierarchical reduction (sparse), or None
        self.__module__ = _HVD_OPTIMIZER_MODULE
        self._compression = compression
        self.backward_passes_per_step = backward_passes_per_step
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set

        all_params = [p for g in self.param_groups for p in g["params"]]
        self._parameter_names = name_parameters(named_parameters, self.param_groups)
        self._requires_update = [p for p in all_params if p.requires_grad]
        self._delay = {p: backward_passes_per_step for p in self._requires_update}
        self._synchronized = False
        self._should_synchronize = True
        self._hooks = []
        self.last_step_traffic: Optional[dict] = None
        self._groups = resolve_groups(groups, self._requires_update)
        self._reducer: Optional[GradientReducer] = None
        self._retired = False
        self._init_path(grad_scaler)
        if self.process_set.included():
            older = {}
            for p in self._requires_update:
                o = _OWNER.get(id(p))
                if o is not None and o is not self and p in o._delay:
                    older[id(o)] = o
            for o in older.values():
                o._retire()
            ref = weakref.ref(self)
            for p in self._requires_update:
                self._hooks.append(p.register_post_accumulate_grad_hook(_make_hook(ref, p)))
                _OWNER[id(p)] = self
            weakref.finalize(self, _remove_hooks, self._hooks)

    # -- public API (Horovod's) -------------------------------------------
    def synchronize(self):
        """Wait for every gradient's reduction and write the results into
        ``p.grad``.  Parameters that got no gradient this step take part
        with zeros (another rank may have one)."""
        if self._retired:
            raise RuntimeError(_RETIRED)
        if self.process_set.included():
            self._synchronize_path()
        self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self):
        """``step()`` inside this context does not synchronize (call
        ``synchronize()`` yourself first, e.g. to clip or unscale)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        if self._retired:
            raise RuntimeError(_RETIRED)
        try:
            if self._should_synchronize:
                if self._synchronized:
                    warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context "
                                  "after optimizer.synchronize(). This can cause training slowdown. You may "
                                  "want to consider using optimizer.skip_synchronize() context if you use "
                                  "optimizer.synchronize() in your code.")
                self.synchronize()
            self._synchronized = False
            return super(self.__class__, self).step(closure)
        except BaseException:
            # the step hooks' post half never runs after an exception: give
            # momentum and weight decay back to the optimizer's groups
            binding = None if self._reducer is None else self._reducer.binding
            if binding is not None:
                binding.abort_step()
            raise

    def zero_grad(self, set_to_none: bool = True):
        if self._step_started():
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but before "
                                 "optimizer.step() or optimizer.synchronize(). This is prohibited as it "
                                 "can cause a race condition.")
        return super(self.__class__, self).zero_grad(set_to_none=set_to_none)

    def set_backward_passes_per_step(self, passes: int):
        self.backward_passes_per_step = passes
        for p in self._delay:
            self._delay[p] = passes

    def state_dict(self, *args, **kwargs):
        """The wrapped optimizer's state, plus (sparse compression) this
        rank's error-feedback residuals and the step counter under
        ``"gtopk_plugin"``, so checkpoints and ``hvd.elastic.TorchState``
        commits keep them."""
        sd = super(self.__class__, self).state_dict(*args, **kwargs)
        if self._reducer is not None:
            sd[_STATE_KEY] = self._reducer.state_dict()
        return sd

    def load_state_dict(self, state_dict):
        sd = dict(state_dict)  # never modify the caller's (e.g. TorchState's saved) copy
        ours = sd.pop(_STATE_KEY, None)
        self._abandon_step()
        super(self.__class__, self).load_state_dict(sd)
        if ours is not None and self._reducer is not None:
            self._reducer.load_state_dict(ours)

    @property
    def reducer(self) -> Optional[GradientReducer]:
        """The core reducer (sparse compression), else None."""
        return self._reducer

    @property
    def last_stats(self) -> Optional[ReduceStats]:
        """Statistics of the last bucket reduced (sparse compression)."""
        return None if self._reducer is None else self._reducer.last_stats

    @property
    def buckets(self) -> List[List[str]]:
        """Parameter names per bucket, in reduction order (sparse), or per
        Horovod group (dense)."""
        return bucket_names(self._buckets, self._parameter_names)

    # -- hooks ---------------------------------------------------------------
    def _retire(self):
        """Another optimizer of ours took this one's parameters: remove its
        hooks (a step already started finishes on its worker)."""
        self._retired = True
        _remove_hooks(self._hooks)

    def _grad_ready(self, p):
        if self._delay[p] <= 0:
            raise AssertionError("Gradients were computed more than backward_passes_per_step times "
                                 "before call to step(). Increase backward_passes_per_step to "
                                 "accumulate gradients locally.")
        self._delay[p] -= 1
        if self._delay[p] == 0:
            self._param_ready(p)

    # -- elastic -------------------------------------------------------------
    def _abandon_step(self):
        """Forget a half-done step (load_state_dict, elastic restore): wait
        for reductions already running, drop their results."""
        self._abandon_path()
        self._synchronized = False
        self._should_synchronize = True

    def _elastic_sync(self):
        """Called by the elastic state handler on every rank after Horovod
        broadcast the optimizer state: every rank takes rank 0's step counter
        (residuals stay per rank: they are this worker's unsent mass)."""
        if self._reducer is None:
            return
        if self._hierarchy is not None:
            # the node groups live on the old side channel's store and the
            # residuals on the old leaders: not rebuilt after a re-formation
            raise RuntimeError("hierarchical=True does not support hvd.elastic (the node groups and the "
                               "leaders' residuals are not rebuilt when the job re-forms); use a flat "
                               "compression with elastic training")
        self._transport.drop_side_channel()  # the job was re-formed: a new channel
        # rank 0's step counter, and its names for this optimizer's Horovod
        # ops and side channels: a worker that joined the job built its
        # optimizers afresh and counted them and its channels from zero
        t = self._transport
        v = torch.tensor([self._reducer.step, self._op_index, t._channels], dtype=torch.int64)
        if self.process_set.size() > 1:
            v = _ops.broadcast_(v, root_rank=0, name="gtopk.elastic.step", process_set=self.process_set)
        self._reducer.step = int(v[0])
        self._op_index, t._channels = int(v[1]), int(v[2])
        t.prefix = op_prefix(self.process_set, self._op_index)
        adopt_index(self.process_set, self._op_index)
        self._agree_step = False


def _make_hook(ref, p):
    # the optimizer weakly: a hook must not keep a dropped optimizer alive
    def hook(_param):
        opt = ref()
        if opt is not None:
            opt._grad_ready(p)
    return hook


def _class_body(path) -> dict:
    """The methods of ``path`` and :class:`_OptimizerBody` as one class
    dict (the body wins), as Horovod copies ``_DistributedOptimizer``."""
    skip = ("__dict__", "__weakref__", "__doc__")
    body = {k: v for k, v in vars(path).items() if k not in skip}
    body.update((k, v) for k, v in vars(_OptimizerBody).items() if k not in skip)
    return body


_SPARSE_BODY = _class_body(_SparsePath)
_DENSE_BODY = _class_body(_DensePath)


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none,
                         backward_passes_per_step=1, op=hvd.Average, gradient_predivide_factor=1.0,
                         num_groups=0, groups=None, sparse_as_dense=False,
                         process_set=hvd.global_process_set, grad_scaler=None, hierarchical=False,
                         local_size=None, node_of_rank=None, intra_fabric=None):
    """Wrap ``optimizer`` so that ``step()`` applies gradients reduced across
    the Horovod workers — ``horovod.torch.DistributedOptimizer`` with the
    same signature and behaviour, plus sparse ``compression=`` choices.

    Args:
        named_parameters: ``model.named_parameters()``; every parameter of the
            optimizer must be named (``ValueError`` naming the missing one).
        compression: ``Compression.none`` / ``fp16`` (Horovod's dense
            allreduce) or a sparse ``Compression.<method>(density, ...)``.
        optimizer, backward_passes_per_step, op, gradient_predivide_factor,
        num_groups, groups, sparse_as_dense, process_set: as in Horovod.
        grad_scaler: (sparse) the AMP ``GradScaler`` (docs/recipes.md).
        hierarchical, local_size, node_of_rank, intra_fabric: (sparse) two-level
            reduction over the gloo side channel (docs/hierarchical.md).

    Dense compression returns Horovod's own optimizer (Adasum's for
    ``op=hvd.Adasum``) plus ``last_step_traffic``, or ours for bfloat16
    parameters and ``groups``.  Sparse adds ``reducer``, ``last_stats``,
    ``last_step_traffic``, ``buckets`` and residuals in ``state_dict()``.
    """
    if gradient_predivide_factor != 1.0 and op != hvd.Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed in "
                      "v0.23.0.", DeprecationWarning)
        if groups is None:
            groups = num_groups
    if backward_passes_per_step <= 0:
        raise ValueError("backward_passes_per_step must be > 0")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizer must be a torch.optim.Optimizer; got {type(optimizer).__name__}")
    sparse = isinstance(compression, SparseCompression)
    hierarchy = _hierarchy(hierarchical, local_size, node_of_rank, sparse, process_set, intra_fabric)
    if sparse:
        if op == hvd.Adasum:
            raise ValueError("op=hvd.Adasum works with dense compression only; sparse compression "
                             "supports hvd.Average and hvd.Sum")
    elif not is_dense_compressor(compression):
        # the choices come from the registry (a user-registered compressor included)
        hint = (f" (did you mean Compression.{signature(compression)}?)"
                if isinstance(compression, str) and compression in sparse_choices() else "")
        raise ValueError(
            f"unknown compression {compression!r}{hint}: pass Compression.none, Compression.fp16, "
            f"Compression.<method>(...) for a method of {', '.join(sparse_choices())}, or a Horovod "
            "Compressor")
    else:
        if grad_scaler is not None:
            raise ValueError("grad_scaler= is for sparse compressions (error-feedback state follows the "
                             "loss scale); Horovod's dense allreduce needs none")
        if op == hvd.Adasum and hvd.size() > 1:
            # Adasum's delta-model optimizer is Horovod's own; nothing sparse to add.
            return hvd.DistributedOptimizer(optimizer, named_parameters, compression,
                                            backward_passes_per_step, op, gradient_predivide_factor,
                                            0, groups, sparse_as_dense, process_set)
        if named_parameters is not None:
            named_parameters = list(named_parameters)
        name_parameters(named_parameters, optimizer.param_groups)  # clear errors before Horovod's
        if not needs_own_dense_path(optimizer.param_groups, groups):
            opt = hvd.DistributedOptimizer(optimizer, named_parameters, compression,
                                           backward_passes_per_step, op, gradient_predivide_factor,
                                           0, groups, sparse_as_dense, process_set)
            attach_ring_traffic(opt, compression)
            waiting.quiet_synchronize(opt)  # Horovod's own wait spins on the training thread's core
            return opt
    body = _SPARSE_BODY if sparse else _DENSE_BODY
    cls = type(optimizer.__class__.__name__, (optimizer.__class__, _GtopkHorovodOptimizer), body)
    return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step, op,
               gradient_predivide_factor, groups, sparse_as_dense, process_set, grad_scaler, hierarchy)


def _hierarchy(hierarchical, local_size, node_of_rank, sparse, process_set,
               intra_fabric=None) -> Optional[dict]:
    """The HierarchicalReducer's topology keywords, or None (flat); with no
    node layout given, each rank's node is Horovod's ``cross_rank()``."""
    kw = node_keywords(hierarchical, local_size, node_of_rank, intra_fabric)
    if kw is None:
        return None
    if not sparse:
        raise ValueError("hierarchical=True is for the sparse compressions; for dense allreduce use "
                         "Horovod's own HOROVOD_HIERARCHICAL_ALLREDUCE=1")
    if local_size is None and node_of_rank is None:
        if process_set is not hvd.global_process_set:
            raise ValueError("hierarchical=True on a process set: pass local_size= or node_of_rank= "
                             "(Horovod's cross_rank numbers the nodes of the whole job)")
        del kw["local_size"], kw["node_of_rank"]
        kw["own_node"] = hvd.cross_rank()
    return kw
