"""GradientReducer: composes a compressor (a selector or a codec), error
feedback, an aggregation and a transport into one sparse (or dense, or
encoded) gradient reduction per call.

Semantics (docs/design.md §2): ``acc = grad + residual``; the compressor
picks entries of ``acc`` (exactly ``k_s = max(1, ceil(density·n_s))`` per
segment for the exact selectors) or encodes it into a payload; the
aggregation combines the contributions across workers; the residual becomes
``acc`` less what this worker's contribution put into the global result;
the update is the result divided by P (``op="average"``) or the plain sum
(``op="sum"``).  Mass conservation holds for every method:
Σ_ranks Σ_steps grad = Σ_steps result(op=sum) + Σ_ranks residual.

A call is a :class:`~gtopk_plugin.pipeline.reduce_call.Call` passed through
stages chosen once, at construction, from the settings (:meth:`GradientReducer._build`);
the stages live in :mod:`gtopk_plugin.pipeline`.
"""
from __future__ import annotations

from typing import Dict, Mapping, Optional

import torch

from gtopk_plugin import collectives, registry
from gtopk_plugin.collectives import Transport
from gtopk_plugin.collectives.torch_distributed import TorchDistributedTransport
from gtopk_plugin.compress import ErrorFeedback
from gtopk_plugin.compress.dense import DenseSelector
from gtopk_plugin.compress.momentum import MomentumCorrection, MomentumSpec
from gtopk_plugin.compress.optimizer_binding import OptimizerBinding
from gtopk_plugin.compress.topk import GTopKSelector, TopKSelector
from gtopk_plugin.config import ReducerConfig, split_momentum_correction
from gtopk_plugin.pipeline.comm_worker import CommWorker
from gtopk_plugin.pipeline.check_stages import (Agree, Compensate, CompensateEarly, FusedTopK, GradsFinite,
                                                 Validate, compensates_after_check)
from gtopk_plugin.pipeline.dense_direct import DensePath, DirectUpdate, RedoCopy
from gtopk_plugin.pipeline.exchange_stages import (Aggregate, Encode, NearestWire, Record, Residual, Select,
                                                   StochasticWire, Update)
from gtopk_plugin.pipeline.layout import Segments, global_segment_name, k_for, local_grad_norm
from gtopk_plugin.pipeline.reduce_call import Call, Stages
from gtopk_plugin.pipeline.reduce_stats import ReduceStats
from gtopk_plugin.pipeline.reducer_state import ReducerState
from gtopk_plugin.pipeline.small_tensors import SmallTensors
from gtopk_plugin.pipeline.update_buffers import UpdateBuffers

Tensor = torch.Tensor

__all__ = ["GradientReducer", "k_for", "global_segment_name", "local_grad_norm", "UpdateBuffers"]

# Selectors whose select() is exactly kernels.select_topk(acc, offsets, k):
# the compensation may pick their entries in the same pass
# (kernels.compensate_select_topk).  Exact types: a subclass may override select().
_FUSED_TOPK = (TopKSelector, GTopKSelector)


class GradientReducer:
    """Reduce a dict of named gradients across workers.

    Example::

        red = GradientReducer(method="gtopk", density=0.01)
        updates = red.reduce({n: p.grad for n, p in model.named_parameters()})

    ``method`` is any registered compressor (``gtopk_plugin.compress.available()``),
    with its own hyper-parameters as keywords; every argument is validated
    (``ValueError``).  The arguments, ``nonfinite`` policies, checkpoints and
    statistics are described in docs/api.md.
    """

    def __init__(self, method: str = "gtopk", density: float = 0.01, r_factor: float = 4.0,
                 merge: Optional[str] = None, granularity: str = "layer",
                 value_dtype: Optional[torch.dtype] = None, op: str = "average",
                 transport: Optional[Transport] = None, seed: int = 0, warmup=None,
                 nonfinite: str = "raise", error_feedback: bool = True,
                 kernels: Optional[str] = None, momentum_correction=None,
                 nesterov: bool = False, dampening: float = 0.0, momentum_masking: bool = True,
                 clip_norm: Optional[float] = None, dense_below: int = 0, wire_rounding: str = "nearest",
                 optimizer=None, named_parameters=None, **hyper):
        kw = {} if kernels is None else {"kernels": kernels}
        momentum, bind = split_momentum_correction(momentum_correction, optimizer, named_parameters)
        self.config = cfg = ReducerConfig(
            method=method, density=density, r_factor=r_factor, merge=merge, granularity=granularity,
            value_dtype=value_dtype, op=op, seed=seed, warmup=warmup, nonfinite=nonfinite,
            error_feedback=bool(error_feedback), momentum_correction=momentum, nesterov=bool(nesterov),
            dampening=dampening, momentum_masking=bool(momentum_masking), clip_norm=clip_norm,
            hyper=hyper, dense_below=dense_below, wire_rounding=wire_rounding, **kw)
        if transport is None:
            transport = TorchDistributedTransport()
        if not isinstance(transport, Transport):
            raise ValueError(f"transport must be a gtopk_plugin Transport; got {type(transport).__name__}")
        self.transport = transport
        # the compressor, built with its declared hyper-parameters (validated)
        self.compressor = registry.get(method)(**cfg.method_hyper)
        self.codec = self.compressor.kind == "codec"
        self.aggregation = cfg.aggregation
        self.memory = ErrorFeedback(cfg.error_feedback)
        self.momentum = MomentumCorrection(
            None if cfg.momentum_correction is None else MomentumSpec(cfg.momentum_correction, cfg.nesterov, cfg.dampening),
            masking=cfg.momentum_masking)
        self.state = ReducerState(cfg, self.aggregation, transport, self.compressor, self.memory, self.momentum)
        self.last_stats: Optional[ReduceStats] = None
        # persistent dense update buffers per layout (see reduce(): lifetime)
        self._updates = UpdateBuffers()
        self._small: Optional[SmallTensors] = None
        self._stages = self._build()
        # the communication worker of reduce_async (made at its first call),
        # and whether the next call starts a step (its failure scope)
        self._worker: Optional[CommWorker] = None
        self._starts_step = True
        if bind:
            self.bind_optimizer(optimizer, named_parameters)

    def _build(self):
        """The stages of a call (docs/design.md §2), chosen from the settings:
        check -> compensate -> select or encode -> aggregate -> residual ->
        update, wrapped by the small tensors' dense side with ``dense_below``."""
        cfg, st, tr, agg = self.config, self.state, self.transport, collectives.get(self.aggregation)
        segments = Segments(cfg.granularity, full=self.codec)
        if compensates_after_check(cfg):
            early = GradsFinite()  # they change state: compensate after the check
        elif type(self.compressor) is DenseSelector and self.aggregation == "dense":
            early = DensePath(cfg, st, self._updates, tr)  # the gradients straight into the update
        elif type(self.compressor) in _FUSED_TOPK:
            early = FusedTopK(st, cfg.kernels, segments)
        else:
            early = CompensateEarly(st, cfg.kernels)
        direct = isinstance(early, DensePath)
        check = [Validate(cfg, self.aggregation, self.compressor, st, tr), early,
                 Agree(cfg, self.aggregation, tr, self._updates, st)] + ([RedoCopy(early)] if direct else [])
        to_wire = NearestWire(cfg) if cfg.wire_rounding == "nearest" else StochasticWire(cfg, tr, agg)
        select = (Encode if self.codec else Select)(cfg, self.compressor, segments, to_wire, self.aggregation,
                                                    agg, tr)
        update = (DirectUpdate if direct else Update)(cfg, self.memory, self._updates, tr)
        stages = Stages(check + [Compensate(cfg, st, tr), select, Aggregate(cfg, self.compressor, tr),
                                 Residual(cfg, self.memory, self.momentum), update, Record(cfg, tr)])
        if not cfg.dense_below:
            return stages
        dense = GradientReducer(
            method="dense", op=cfg.op, transport=tr, seed=cfg.seed, nonfinite=cfg.nonfinite,
            error_feedback=cfg.error_feedback, kernels=cfg.kernels,
            momentum_correction=cfg.momentum_correction,
            nesterov=cfg.nesterov, dampening=cfg.dampening, momentum_masking=cfg.momentum_masking,
            clip_norm=cfg.clip_norm)
        self._small = st.small = SmallTensors(stages, dense, st, cfg.dense_below)
        return self._small

    # ------------------------------------------------------------------ API
    def reduce(self, grads: Mapping[str, Tensor], *, advance_step: bool = True,
               grad_norm: Optional[float] = None, loss_scale: Optional[float] = None,
               out: Optional[Mapping[str, Tensor]] = None, out_reuse: bool = False) -> Dict[str, Tensor]:
        """Reduce ``grads`` (name -> dense gradient) across all ranks and return
        name -> dense update (same shapes and dtypes).  Collective: every rank
        calls it with the same names, shapes and dtypes.

        ``advance_step=False`` keeps the step counter (warm-up density,
        random draws) for a further call in the same training step.
        ``grad_norm``: with ``clip_norm``, this worker's norm over the whole
        step.  ``loss_scale``: the AMP loss scale the gradients carry.
        ``out``: name -> contiguous tensor like the gradient (it may be the
        gradient) to receive each update; ``out_reuse=True`` promises it
        holds what this reducer wrote there last.  Without ``out`` the
        updates are views into persistent buffers, reused once the caller
        has dropped every tensor of an earlier call (:class:`UpdateBuffers`):
        do not write into them.  docs/api.md has the details.
        """
        if self._worker is not None:
            self._settle()  # the calls submitted before run first (FIFO)
        self._starts_step = advance_step
        return self._reduce_now(grads, advance_step, grad_norm, loss_scale, out, out_reuse)

    def reduce_async(self, grads: Mapping[str, Tensor], *, advance_step: bool = True,
                     grad_norm: Optional[float] = None, loss_scale: Optional[float] = None,
                     out: Optional[Mapping[str, Tensor]] = None,
                     out_reuse: bool = False) -> "torch.futures.Future[Dict[str, Tensor]]":
        """:meth:`reduce` on this reducer's communication worker: returns at
        once a ``torch.futures.Future`` of what :meth:`reduce` returns (or
        raises).  Calls run one at a time in submission order, the same on
        every rank; after a failed call the rest of its step (the calls up
        to the next with ``advance_step=True``) fail with
        :class:`~gtopk_plugin.pipeline.comm_worker.EarlierFailure` without
        running.  Until its future completes, do not change ``grads`` or
        ``out``, and run no other collective on the group; the reducer's
        state (``step``, ``state_dict()``, ...) and :meth:`reduce` wait for
        the calls submitted before them.  On CUDA the calls run on a side
        stream after the work queued so far; waiting on the future
        synchronises the waiter's stream."""
        worker = self.worker(next(iter(grads.values())).device if grads else None)
        fresh, self._starts_step = self._starts_step, advance_step
        return worker.submit(self._reduce_now, dict(grads), advance_step, grad_norm, loss_scale,
                             None if out is None else dict(out), out_reuse, fresh=fresh)

    def _reduce_now(self, grads, advance_step, grad_norm, loss_scale, out, out_reuse):
        # not thread-safe (state and the group's collective order): a second
        # thread inside meanwhile gets ConcurrentUseError, never a crash
        with self.transport.exclusive("GradientReducer.reduce()"):
            call = self._stages(Call(grads, grad_norm, loss_scale, out, out_reuse))
            self.last_stats = call.stats
            if advance_step:
                self.state.step += 1
            return call.updates

    def worker(self, device=None) -> CommWorker:
        """This reducer's communication worker (made on first use, for the
        device of the gradients: a side stream on CUDA).  Framework layers
        submit their per-bucket jobs to it, so that one thread runs every
        collective of the reducer in order."""
        w = self._worker
        if w is None or w.closed:
            w = self._worker = CommWorker(f"gtopk-comm-{self.config.method}", device=device)
        return w

    def _settle(self) -> None:
        """Wait for the calls submitted to the worker (not from the worker itself)."""
        w = self._worker
        if w is not None and not w.idle:
            w.drain()

    def close(self, timeout: Optional[float] = None) -> bool:
        """End the worker thread after the calls submitted; True when it
        has ended within ``timeout`` seconds.  A later ``reduce_async``
        starts a new one; :meth:`reduce` needs none."""
        w = self._worker
        return True if w is None else w.close(timeout=timeout)

    # -------------------------------------------- the state between calls
    @property
    def step(self) -> int:
        """Steps completed: the warm-up density and the random draws follow
        it (a framework layer may set it, e.g. to agree on it across ranks)."""
        self._settle()
        return self.state.step

    @step.setter
    def step(self, value: int) -> None:
        self._settle()
        self.state.step = value

    @property
    def loss_scale(self) -> Optional[float]:
        """The AMP loss scale residuals and velocities are expressed in."""
        self._settle()
        return self.state.loss_scale

    @loss_scale.setter
    def loss_scale(self, value: Optional[float]) -> None:
        self._settle()
        self.state.loss_scale = value

    @property
    def binding(self):
        """The optimizer binding of ``momentum_correction=True``, or None."""
        return self.state.binding

    @binding.setter
    def binding(self, value) -> None:
        self.state.binding = value

    @property
    def joint_check(self):
        """``None``, or ``fn(bad, nonfinite) -> (bad, nonfinite)`` for ranks
        outside the transport whose calls must take the same path (an FSDP
        replica's other shards, whose own reducers exchange elsewhere): run
        on every such rank before each of a call's :attr:`joint_agreements`
        (the check; with momentum correction, clipping or an optimizer
        binding also the accumulator's overflow check), it joins their
        verdicts -- the first invalid input's message and the non-finite
        names -- to this rank's (docs/design.md §6)."""
        return self.state.joint_check

    @property
    def joint_agreements(self) -> int:
        """How many times a call runs :attr:`joint_check` (the same for every
        call and rank): a rank with nothing to reduce mirrors them."""
        return 2 if compensates_after_check(self.config, self.state.binding) else 1

    @joint_check.setter
    def joint_check(self, fn) -> None:
        self.state.joint_check = fn

    def state_dict(self) -> dict:
        """This rank's state: residuals, velocities, step, loss scale and
        compressor state -- everything a bit-exact resume needs (random
        draws are keyed by (seed, step, name)); with ``dense_below``, the
        dense part's velocities under "small".  It records the rank and
        world size it belongs to, the method, settings and layout: load it
        on the same rank of a job of the same size (``gtopk_plugin.checkpoint``
        saves and loads whole jobs, and moves them to another size)."""
        self._settle()
        return self.state.state_dict()

    def load_state_dict(self, sd: dict, *, named_parameters=None) -> None:
        """Load a state saved by :meth:`state_dict` on this rank of a job of
        this world size.  Everything is validated before anything changes
        (a refused state leaves the reducer as it was); ``named_parameters``
        (``model.named_parameters()`` or a dict name -> tensor or shape):
        residuals and velocities must be for these names and sizes.  Raises
        :class:`~gtopk_plugin.CheckpointError` (a ``ValueError``);
        :func:`gtopk_plugin.checkpoint.load_job` moves a job to another size."""
        self._settle()
        self.state.load(sd, named_parameters)

    def _load_own_state(self, sd: dict) -> None:
        """Load a state this process saved itself (elastic restore: the
        transport's rank is not asked)."""
        self._settle()
        self.state.load_own(sd)

    def bind_optimizer(self, optimizer, named_parameters) -> "GradientReducer":
        """What ``momentum_correction=True, optimizer=, named_parameters=``
        does at construction, for a reducer built or loaded without its
        optimizer: ``optimizer``'s SGD momentum (nesterov, dampening) and
        weight decay move in front of the compressor, read from its param
        groups at every call, and ``optimizer.step()`` runs with momentum and
        weight decay 0 for those groups (restored right after).  Returns
        ``self``.  ``ValueError`` for optimizers without SGD momentum (Adam,
        AdamW: use plain error feedback)."""
        self._settle()
        if self.binding is not None:
            self.binding.remove()
        self.binding = OptimizerBinding(optimizer, named_parameters)
        return self

    def reset(self) -> None:
        """Forget residuals and velocities (e.g. after the set of parameters changed)."""
        self._settle()
        self.state.reset()
        self._updates.clear()

