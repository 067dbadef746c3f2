"""Two-level (hierarchical) reduction for clusters of multi-GPU nodes:
dense inside a node, the sparse exchange between nodes only.

1. the workers' gradients (after each worker's clipping and weight decay)
   are summed densely inside each node
   (:mod:`gtopk_plugin.two_level.node_fabric`: shared memory for CPU
   tensors, else an allreduce on the node group);
2. the node's sum runs through a :class:`~gtopk_plugin.GradientReducer`
   (any method) on the cross-node group of node leaders (local rank 0),
   with ``op="sum"``; residual and DGC velocity live on the leader only;
3. the leader's result is broadcast inside the node (a shared region, or a
   binomial tree of (index, value) pairs or the dense vector, whichever is
   smaller) and ``op="average"`` divides by the whole world size P.

One consistency check over the whole group runs first, so every rank
raises, skips or propagates alike.  Mass is conserved with leader
residuals: Σ_ranks Σ_steps g' = Σ_steps result + Σ_leaders residual.
``last_stats`` adds ``intra_*``/``inter_*`` bytes and seconds.  Semantics
table, bytes, why a leader and not shards: docs/hierarchical.md.
"""
from __future__ import annotations

import copy
import dataclasses
import math
import pickle
import time
from typing import Dict, Mapping, Optional

import torch

from gtopk_plugin import config

from gtopk_plugin.pipeline import input_check as consistency
from gtopk_plugin.collectives.transport import Transport
from gtopk_plugin.compress.optimizer_binding import OptimizerBinding
from gtopk_plugin.pipeline.input_check import JoinedRankError, LayoutMismatchError, NonFiniteGradientError, PeerInputError
from gtopk_plugin.pipeline.layout import all_finite, clip_scale, flat_dtype, segment_ks, validate_grads
from gtopk_plugin.two_level.node_fabric import ERROR, PROPAGATE, SKIP, NodeFabric, check_fabric, flat_result, status_blob
from gtopk_plugin.reducer import GradientReducer
from gtopk_plugin.pipeline.reduce_stats import ReduceStats
from gtopk_plugin.two_level.topology import Topology, TorchEngine, agree

Tensor = torch.Tensor
__all__ = ["HierarchicalReducer"]

_ERRORS = {c.__name__: c for c in (NonFiniteGradientError, LayoutMismatchError, PeerInputError,
                                    JoinedRankError, ValueError)}
_STATE_VERSION = 1


class _SpecsOnly:
    """The optimizer binding as the leader's inner reducer sees it: momentum
    specs per name, but no weight decay (every worker added its own)."""

    def __init__(self, binding):
        self.binding = binding

    def specs(self, names):
        return self.binding.specs(names)

    def fingerprint(self, names):
        return self.binding.fingerprint(names)

    @staticmethod
    def add_weight_decay(name, flat_grad, loss_scale=1.0):
        return flat_grad

    def remove(self):
        self.binding.remove()


class HierarchicalReducer:
    """Two-level reduction (see the module docstring and docs/hierarchical.md).

    Example::

        red = HierarchicalReducer(method="gtopk", density=0.001, local_size=8)
        updates = red.reduce({n: p.grad for n, p in model.named_parameters()})

    Args:
        method, density and every other :class:`GradientReducer` keyword
            but ``transport``: as there (``op`` "average" divides by P).
        local_size: ranks per node, rank r on node r // local_size.
        node_of_rank: instead, one node id per rank (uneven nodes allowed;
            rules in :mod:`gtopk_plugin.two_level.topology`).  Neither:
            ``LOCAL_WORLD_SIZE`` when the configuration reads it, else
            ``ValueError``.
        group: the ``torch.distributed`` group to split (default: WORLD).
        timeout: seconds one exchange may take (default ``GTOPK_TIMEOUT``).
        engine: a maker of the two levels' transports (``world()`` and
            ``split(topology)``, as :class:`~gtopk_plugin.two_level.topology.TorchEngine`);
            replaces ``group``.
        own_node: this rank's node id, when the engine knows it.
        intra_fabric: ``"auto"``, ``"shared_memory"`` or ``"engine"``
            (:mod:`gtopk_plugin.two_level.node_fabric`).

    The topology is agreed at the first :meth:`reduce` (or :meth:`setup`), a
    collective; invalid or disagreeing topologies raise the same
    ``ValueError`` on every rank.
    """

    def __init__(self, method: str = "gtopk", density: float = 0.01, *, local_size=None,
                 node_of_rank=None, group=None, timeout: Optional[float] = None, engine=None,
                 own_node: Optional[int] = None, intra_fabric: str = "auto", momentum_correction=None,
                 optimizer=None, named_parameters=None, **kwargs):
        if "transport" in kwargs:
            raise ValueError("HierarchicalReducer builds its transports from the topology; pass "
                             "group= (torch.distributed) instead of transport=")
        if engine is not None and group is not None:
            raise ValueError("pass group= or engine=, not both")
        self._fabric_mode = check_fabric(intra_fabric)
        self._topology_args = dict(local_size=local_size, node_of_rank=node_of_rank, own_node=own_node)
        self._engine = engine if engine is not None else TorchEngine(group=group, timeout=timeout)
        user_op, clip = kwargs.pop("op", "average"), kwargs.pop("clip_norm", None)
        momentum, bind = config.split_momentum_correction(momentum_correction, optimizer, named_parameters)
        self._inner_kwargs = dict(kwargs, method=method, density=density, op="sum",
                                  momentum_correction=momentum)
        # validates every keyword now (ValueError naming it); the leader's
        # real inner reducer is built at setup(), on its transport
        probe = GradientReducer(transport=_Unbound(), **self._inner_kwargs)
        # the user's settings (ReducerConfig validates op and clip_norm again)
        self.config = dataclasses.replace(probe.config, op=user_op, clip_norm=clip)
        self.aggregation = probe.aggregation
        self._codec = probe.codec
        self.topology: Optional[Topology] = None
        self.inner: Optional[GradientReducer] = None   # the leader's cross-node reducer
        self.intra: Optional[Transport] = None
        self.fabric: Optional[NodeFabric] = None
        self.binding = None
        self._step = 0
        self.last_stats: Optional[ReduceStats] = None
        self._pending_state: Optional[dict] = None
        if bind:
            self.bind_optimizer(optimizer, named_parameters)

    # ---------------------------------------------------------------- setup
    def setup(self) -> Topology:
        """Agree on the topology and make the two levels' transports
        (collective; done by the first :meth:`reduce` otherwise)."""
        if self.topology is not None:
            return self.topology
        env_local = config.env_local_world_size()
        topo = agree(self._engine.world(), env_local_size=env_local, **self._topology_args)
        intra, inter = self._engine.split(topo)
        if topo.is_leader:
            self.inner = GradientReducer(transport=inter, **self._inner_kwargs)
            self.inner.step = self.step
            if self.binding is not None:
                self.inner.binding = _SpecsOnly(self.binding)
        self.topology, self.intra = topo, intra
        self.fabric = NodeFabric(intra, self._engine.world(), self._fabric_mode)
        if self._pending_state is not None:
            sd, self._pending_state = self._pending_state, None
            self.load_state_dict(sd)
        return topo

    @property
    def step(self) -> int:
        """Steps completed (the leader's inner reducer follows it: a
        framework layer may set it, e.g. to agree on it across ranks)."""
        return self._step

    @step.setter
    def step(self, value: int) -> None:
        self._step = int(value)
        if self.inner is not None:
            self.inner.step = self._step

    @property
    def world(self) -> Transport:
        return self._engine.world()

    # ------------------------------------------------------------------ API
    def reduce(self, grads: Mapping[str, Tensor], *, advance_step: bool = True,
               grad_norm: Optional[float] = None, loss_scale: Optional[float] = None) -> Dict[str, Tensor]:
        """``GradientReducer.reduce``'s signature and semantics: name ->
        update (the sum over all P ranks divided by P for ``op="average"``),
        identical on every rank.  ``grad_norm``: this worker's norm over the
        whole step for ``clip_norm`` (default: this call's tensors)."""
        topo = self.setup()
        t0 = time.perf_counter()
        cfg, P = self.config, topo.size
        bad, names, tensors = validate_grads(grads)
        density = cfg.density_at(self.step)
        sizes = [t.numel() for t in tensors]
        ks = segment_ks(sizes, density, cfg.granularity, full=self._codec)
        nonfinite = [n for n, t in zip(names, tensors) if not all_finite(t)] if bad is None else []
        world = self.world
        w0 = world.counters.copy()
        any_nf, where = consistency.check(world, self._layout(names, tensors, ks), bad, nonfinite)
        control = world.counters.control_bytes - w0.control_bytes
        seconds = {"check": time.perf_counter() - t0}
        if any_nf:
            detail = "; ".join(f"rank {r}: {', '.join(n)}" for r, n in where)
            if cfg.nonfinite == "raise":
                raise NonFiniteGradientError(
                    f"gtopk_plugin: non-finite gradient (NaN or Inf) in {detail}; nothing was "
                    "applied and residuals are unchanged (pass nonfinite='skip' to skip such steps)")
            status = PROPAGATE if cfg.nonfinite == "propagate" else SKIP
            return self._finish(names, tensors, sizes, ks, density, status, None, None, control,
                                seconds, t0, advance_step, inner_ran=False)

        # the node sum in the gradients' dtype (the bytes of the node's
        # links); an fp16 sum that overflows is caught by the leader's inner
        # reducer, whose error-feedback state is float32 (docs/design.md §3)
        dtype = flat_dtype(tensors)
        fabric = self.fabric
        flat = fabric.buffer(names, sizes, dtype, tensors[0].device)
        torch.cat([t.detach().reshape(-1).to(dtype) for t in tensors], out=flat)
        self._compensate(names, flat, sizes, grad_norm, loss_scale, P)
        i0 = self.intra.counters.copy()
        t1 = time.perf_counter()
        flat = fabric.node_sum(flat)  # the node's dense sum (on the leader)
        seconds["intra"] = time.perf_counter() - t1
        status, update, blob, inner_s = SKIP, None, None, 0.0
        divisor = P if cfg.op == "average" else 1
        if topo.is_leader:
            t2 = time.perf_counter()
            try:
                node = {n: p.view(t.shape) for n, p, t in zip(names, torch.split(flat, sizes), tensors)}
                out = self.inner.reduce(node, advance_step=advance_step, loss_scale=loss_scale)
                inner_s = time.perf_counter() - t2
                if self.inner.last_stats.skipped:
                    status = PROPAGATE if cfg.nonfinite == "propagate" else SKIP
                    blob = status_blob(status)
                else:
                    status, update, blob = fabric.publish(flat_result(out, names, sizes), divisor)
            except Exception as e:
                # tell the node before raising, or it waits in vain
                fabric.broadcast(status_blob(ERROR, pickle.dumps((type(e).__name__, str(e)))), flat.device)
                raise
        t3 = time.perf_counter()
        blob = fabric.broadcast(blob, flat.device)
        if not topo.is_leader:  # the leader's update, divided like its own
            status, update = fabric.receive(blob, (tuple(names), dtype, flat.device), sum(sizes), divisor)
        seconds["intra"] += time.perf_counter() - t3
        seconds["inter"] = inner_s
        intra = self.intra.counters.copy().minus(i0)
        return self._finish(names, tensors, sizes, ks, density, status, update, intra, control,
                            seconds, t0, advance_step, inner_ran=True)

    def _compensate(self, names, flat, sizes, grad_norm, loss_scale, P) -> None:
        """Per worker, before the node sum: DGC local clipping to
        ``clip_norm · P^-1/2`` (P the whole world) and the optimizer's
        weight decay, in the flat reducer's order."""
        parts = list(torch.split(flat, sizes))
        scale = clip_scale(self.config.clip_norm, parts, grad_norm, loss_scale, P)
        if scale != 1.0:
            flat.mul_(scale)
        if self.binding is not None:
            ls = 1.0 if loss_scale is None else float(loss_scale)
            for n, part in zip(names, parts):
                g = self.binding.add_weight_decay(n, part, ls)
                if g is not part:
                    part.copy_(g)

    def _finish(self, names, tensors, sizes, ks, density, status, update, intra, control,
                seconds, t0, advance_step, inner_ran):
        cfg, topo = self.config, self.topology
        numel = sum(sizes)
        if status == ERROR:
            kind, msg = pickle.loads(update)
            raise _ERRORS.get(kind, RuntimeError)(
                msg if kind in _ERRORS else f"gtopk_plugin: the node leader failed: {kind}: {msg}")
        if status in (SKIP, PROPAGATE):
            fill = math.inf if status == PROPAGATE else 0.0
            out = {n: torch.full_like(t, fill) for n, t in zip(names, tensors)}
        else:  # divided already (NodeFabric.publish / receive)
            out = {n: u.view_as(t) if u.dtype == t.dtype else u.view_as(t).to(t.dtype)
                   for n, u, t in zip(names, torch.split(update, sizes), tensors)}
        if topo.is_leader and inner_ran:
            st = copy.copy(self.inner.last_stats)  # keeps its extra attributes (parts)
        else:
            st = ReduceStats(method=cfg.method, aggregation=self.aggregation, step=self.step,
                             world_size=topo.nodes, numel=numel, k=int(sum(ks)), density=density,
                             skipped=status in (SKIP, PROPAGATE))
        st.control_bytes += control
        st.intra_bytes_sent = 0 if intra is None else intra.payload_bytes_sent + intra.header_bytes_sent
        st.intra_bytes_received = 0 if intra is None else \
            intra.payload_bytes_received + intra.header_bytes_received
        st.inter_bytes_sent, st.inter_bytes_received = st.bytes_sent, st.bytes_received
        st.nodes, st.local_size, st.node = topo.nodes, topo.local_size, topo.node
        st.intra_fabric = self.fabric.current if inner_ran else None  # None: no node sum this step
        st.seconds = dict(st.seconds, **seconds)
        st.seconds.setdefault("intra", 0.0)
        st.seconds.setdefault("inter", 0.0)
        st.seconds["total"] = time.perf_counter() - t0
        self.last_stats = st
        if advance_step:
            self.step += 1
        return out

    def _layout(self, names, tensors, ks):
        cfg = self.config
        lay = [(n, tuple(t.shape), str(t.dtype)) for n, t in zip(names, tensors)]
        lay.append(("settings", cfg.method, self.aggregation, cfg.granularity, str(cfg.value_dtype),
                    cfg.op, self.step, tuple(ks), cfg.clip_norm, cfg.dense_below))
        # whatever else changes the result (the leaders' inner check sees
        # only the leaders; a worker's nonfinite policy acts on every rank)
        lay.append(("policy", cfg.seed, cfg.nonfinite, cfg.error_feedback,
                    cfg.momentum_correction, cfg.nesterov,
                    cfg.dampening, cfg.momentum_masking, cfg.wire_rounding))
        if self.binding is not None:
            lay.append(("optimizer",) + tuple(self.binding.fingerprint(names)))
        if cfg.hyper:
            lay.append(("hyper",) + tuple(cfg.hyper))
        lay.append(("hierarchical", tensors[0].device.type if tensors else "") + self.topology.node_of_rank)
        return lay

    # --------------------------------------------------- optimizer, state
    def bind_optimizer(self, optimizer, named_parameters) -> "HierarchicalReducer":
        """DGC momentum correction with ``optimizer``'s settings, as
        :meth:`GradientReducer.bind_optimizer` (call it on every rank:
        every rank's optimizer then steps without momentum and weight decay;
        weight decay is added per worker, the velocity is the leader's)."""
        if self.binding is not None:
            self.binding.remove()
        self.binding = OptimizerBinding(optimizer, named_parameters)
        if self.inner is not None:
            self.inner.binding = _SpecsOnly(self.binding)
        return self

    def state_dict(self) -> dict:
        """This rank's state: the step, and on a leader the inner reducer's
        residuals, velocities and loss scale (bit-exact resume; load it on
        the same rank of the same topology)."""
        if self.topology is None and self._pending_state is not None:
            return self._pending_state
        return {"version": _STATE_VERSION, "hierarchical": True, "step": self.step,
                "node_of_rank": None if self.topology is None else list(self.topology.node_of_rank),
                "inner": None if self.inner is None else self.inner.state_dict()}

    def load_state_dict(self, sd: dict) -> None:
        if not isinstance(sd, dict) or sd.get("version") != _STATE_VERSION or not sd.get("hierarchical"):
            raise ValueError("not a HierarchicalReducer state (version 1); a flat GradientReducer's "
                             "residuals cannot be split into node leaders' residuals")
        if self.topology is None:  # applied at setup, once this rank knows its role
            self._pending_state = sd
            self.step = int(sd["step"])
            return
        saved = sd.get("node_of_rank")
        if saved is not None and tuple(saved) != self.topology.node_of_rank:
            raise ValueError(f"the state was saved on topology {saved}, this job runs "
                             f"{list(self.topology.node_of_rank)}: residuals live on the node leaders")
        if (sd.get("inner") is not None) != self.topology.is_leader and saved is not None:
            raise ValueError("the state was saved by a rank of another role (leader / non-leader); "
                             "load each rank's own state")
        self.step = int(sd["step"])
        if self.inner is not None:
            if sd.get("inner") is not None:
                self.inner.load_state_dict(sd["inner"])
            self.inner.step = self.step

    def reset(self) -> None:
        """Forget residuals and velocities (the leader's)."""
        if self.inner is not None:
            self.inner.reset()


class _Unbound(Transport):
    """The transport of the keyword-validating probe (never used)."""

    rank = 0
    size = 1

    def _fail(self, *a):
        raise RuntimeError("HierarchicalReducer: reducer used before setup()")

    _raw_sendrecv = _raw_send = _raw_recv = _raw_allreduce_sum_ = _raw_allreduce_max_ = _fail
    _raw_allgather_object = _fail

