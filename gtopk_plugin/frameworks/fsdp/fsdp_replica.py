"""FSDP2 / HSDP: the cross-replica reduction of each gradient shard through
a :class:`~gtopk_plugin.GradientReducer`::

    mesh = init_device_mesh("cuda", (nodes, gpus_per_node), mesh_dim_names=("replicate", "shard"))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    reduction = gp.torch_fsdp.sparse_replica_reduction(model, method="gtopk", density=0.01)

FSDP reduce-scatters each gradient over the shard dimension as usual (the
fast links inside a node); the all-reduce over the replicate dimension is
replaced by ONE ``reduce()`` per step of every local gradient shard across
the replicas, at the end of backward.  Residuals and velocities are this
rank's: one per (replica, shard).  See docs/fsdp.md.
"""
from __future__ import annotations

import sys
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from gtopk_plugin.collectives.torch_distributed import TorchDistributedTransport
from gtopk_plugin.frameworks.fsdp import fsdp_state
from gtopk_plugin.frameworks.fsdp.fsdp_mesh import ReplicaTopology, find_topology, fsdp_units
from gtopk_plugin.frameworks.reducer_keywords import check_reducer_kwargs
from gtopk_plugin.pipeline import input_check
from gtopk_plugin.pipeline.input_check import NonFiniteGradientError
from gtopk_plugin.pipeline.traffic import StepTraffic
from gtopk_plugin.reducer import GradientReducer

__all__ = ["SparseReplicaState", "sparse_replica_reduction"]

_HALF = (torch.float16, torch.bfloat16)


def sparse_replica_reduction(model: torch.nn.Module, method: str = "gtopk", density: float = 0.01, *,
                             mesh=None, replicate_group: Optional[dist.ProcessGroup] = None,
                             timeout: Optional[float] = None, momentum_correction=None,
                             optimizer: Optional[torch.optim.Optimizer] = None,
                             **reducer_kwargs) -> "SparseReplicaState":
    r"""Reduce ``model``'s gradient shards across replicas with ``method``.

    Args:
        model: the root module, sharded with ``fully_shard`` on a 2-D mesh
            (replicate, shard), or on a 1-D shard mesh with the replicas
            given by ``replicate_group`` or by a 2-D ``mesh``.
        method, density, ...: every :class:`~gtopk_plugin.GradientReducer`
            keyword except ``transport`` (``clip_norm=``, ``value_dtype=``,
            ``warmup=``, the method's own hyper-parameters ...).
            ``value_dtype`` defaults to the ``MixedPrecisionPolicy``'s
            reduce dtype when that is float16/bfloat16.
        timeout: seconds one exchange may take (``GTOPK_TIMEOUT`` or 300).
        momentum_correction, optimizer: DGC momentum correction: ``True``
            with the SGD ``optimizer``, or the momentum itself.

    Returns the :class:`SparseReplicaState` (``remove()`` undoes the call).
    ``ValueError`` for a model or mesh that does not fit, on every rank.
    """
    topo = find_topology(model, mesh, replicate_group)
    return SparseReplicaState(model, topo, method, density, timeout, momentum_correction, optimizer,
                              reducer_kwargs)


class SparseReplicaState:
    """The replica reduction of one FSDP model: its reducer (residuals, step,
    settings), the hooks on the model, the last step's traffic.  A
    ``torch.distributed.checkpoint`` ``Stateful``: save it beside the model
    and optimizer (docs/fsdp.md)."""

    def __init__(self, model, topology: ReplicaTopology, method, density, timeout, momentum_correction,
                 optimizer, reducer_kwargs: dict):
        check_reducer_kwargs("sparse_replica_reduction", method, reducer_kwargs,
                             ("mesh", "replicate_group", "timeout", "momentum_correction", "optimizer"),
                             "the replicate dimension", "do not pass transport=")
        if reducer_kwargs.get("op", "average") != "average":
            raise ValueError("the replica reduction averages over replicas, as HSDP does; op must be 'average'")
        for g in topology.param_groups:
            if g.gradient_divide_factor is not None:
                raise ValueError("set_gradient_divide_factor() is not supported with the replica reduction "
                                 "(it averages over the replicas as HSDP does by default)")
        self.model, self.topology = model, topology
        named = list(model.named_parameters())
        self._names: Dict[int, str] = {id(p): n for n, p in named}
        kwargs = dict(reducer_kwargs, method=method, density=density)
        if "value_dtype" not in kwargs:
            kwargs["value_dtype"] = _policy_wire(topology.param_groups)
        self.reducer = GradientReducer(
            transport=TorchDistributedTransport(group=topology.replicate_group, timeout=timeout),
            momentum_correction=momentum_correction, optimizer=optimizer,
            named_parameters=named if momentum_correction is True else None, **kwargs)
        self._shard_transport = TorchDistributedTransport(group=topology.shard_group, timeout=timeout)
        self.reducer.joint_check = self._joint_check
        self._reducing: list = []   # parameter groups FSDP reduce-scattered in this backward
        self._stash: dict = {}      # param -> its gradient from earlier steps (already reduced)
        self._local: set = set()    # ids of params whose .grad holds shards not yet reduced
        self._queued = False
        self.last_step_traffic: Optional[dict] = None
        self._units = fsdp_units(model)
        _refuse_compiled_autograd()
        # FSDP2's hooks (and so this reduction) do not run under compiled
        # autograd: checked at every forward, which compiled autograd follows
        self._pre_forward = model.register_forward_pre_hook(lambda *_: _refuse_compiled_autograd())
        topology.detach()
        for unit in self._units:
            for g in unit._get_fsdp_state()._fsdp_param_groups:
                unit.set_all_reduce_hook(lambda _out, g=g: self._on_reduce(g))

    # ------------------------------------------------------------------ API
    @property
    def step(self) -> int:
        """Training steps reduced so far."""
        return self.reducer.step

    @property
    def last_stats(self):
        """The reducer's :class:`~gtopk_plugin.ReduceStats` of the last step."""
        return self.reducer.last_stats

    def state_dict(self) -> dict:
        """This rank's residuals and velocities as DTensors sharded like the
        parameters (one entry per replica), and the reducer's step and
        settings: the ``Stateful`` side of ``torch.distributed.checkpoint``."""
        return fsdp_state.to_checkpoint(self)

    def load_state_dict(self, sd: dict) -> None:
        """Load what :meth:`state_dict` gave, possibly saved with another
        number of shards (the residuals are resharded exactly); another
        number of replicas raises :class:`~gtopk_plugin.CheckpointError`."""
        fsdp_state.from_checkpoint(self, sd)

    def remove(self) -> None:
        """Give the model back to FSDP's own replica all-reduce."""
        for unit in self._units:
            unit.set_all_reduce_hook(None)
        self._pre_forward.remove()
        self.topology.attach()
        if self.reducer.binding is not None:
            self.reducer.binding.remove()
            self.reducer.binding = None

    def __repr__(self):
        cfg = self.reducer.config
        return (f"SparseReplicaState(method={cfg.method!r}, density={cfg.density}, replicas="
                f"{self.topology.replicas}, shards={self.topology.shards}, step={self.step})")

    # ------------------------------------------------------------ internals
    def _on_reduce(self, group) -> None:
        """FSDP reduce-scattered ``group``'s gradients (its all-reduce hook,
        before the shards reach ``.grad``)."""
        params = [fp.sharded_param for fp in group.fsdp_params]
        if not group.all_reduce_grads:  # set_requires_all_reduce(False): accumulate, reduce later
            self._local.update(id(p) for p in params)
            return
        if not self._queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            self._queued = True
        self._reducing.append(group)
        for p in params:
            if p.grad is not None and id(p) not in self._local:
                # a gradient of earlier steps, reduced then: FSDP would add this
                # step's shard to it; it is added back after the reduction
                self._stash[p], p.grad = p.grad, None

    def _finish(self) -> None:
        """End of backward: one reduction of every shard FSDP produced."""
        groups, stash = self._reducing, self._stash
        self._reducing, self._stash, self._queued = [], {}, False
        params = [fp.sharded_param for g in groups for fp in g.fsdp_params]
        try:
            grads = {}
            for p in params:
                if p.grad is not None:
                    grads[self._name_of(p)] = p.grad.to_local()
            self._reduce(grads)
        finally:
            with torch.no_grad():
                for p, old in stash.items():
                    if p.grad is not None:
                        old.to_local().add_(p.grad.to_local())
                    p.grad = old
            self._local.difference_update(id(p) for p in params)

    def _name_of(self, p) -> str:
        name = self._names.get(id(p))
        if name is None:  # FSDP replaced the parameter object (e.g. after to_empty)
            self._names = {id(q): n for n, q in self.model.named_parameters()}
            name = self._names.get(id(p))
            if name is None:
                raise RuntimeError("gtopk_plugin.torch_fsdp: a parameter FSDP reduced is not among "
                                   "model.named_parameters()")
        return name

    def _reduce(self, grads: Dict[str, torch.Tensor]) -> None:
        grads = {n: g for n, g in grads.items() if g.numel() > 0}  # uneven sharding: empty shards
        # clipping: this replica's norm over all its shards, before the call
        norm = self._replica_norm(grads) if self.reducer.config.clip_norm is not None else None
        if not grads:
            self._empty_step()
            return
        out = {n: g if g.is_contiguous() else g.contiguous() for n, g in grads.items()}
        # the reducer's check joins this replica's other shards (_joint_check)
        self.reducer.reduce(grads, out=out, grad_norm=norm)
        for n, g in grads.items():
            if out[n] is not g:
                g.copy_(out[n])
        stats = self.reducer.last_stats
        self.last_step_traffic = None if stats is None or stats.skipped else _traffic(stats)

    def _joint_check(self, bad: Optional[str], nonfinite: List[str]):
        """The reducer's check across the replicas, joined with this
        replica's other shards first (``GradientReducer.joint_check``): one
        int64 MAX over the shard group; the replicas' agreement then carries
        it, so that every rank of the mesh takes the same path -- raises, or
        skips the step -- and none is left waiting in FSDP's next collective.
        Details travel only when a rank has something to report."""
        tr = self._shard_transport
        flags = torch.tensor([int(bad is not None), int(bool(nonfinite))], dtype=torch.int64, device=self._device())
        if tr.size == 1 or not bool(tr.control_allreduce_max(flags).any()):
            return bad, nonfinite
        # named by the mesh's rank: the replicas' messages number ranks in the replica group
        me, first, joined = dist.get_rank(), None, []
        for rank, peer_bad, peer_names in tr.allgather_object((me, bad, list(nonfinite))):
            if first is None and peer_bad is not None:
                first = f"global rank {rank}: {peer_bad}"
            joined += [f"{n} (on global rank {rank})" for n in peer_names]
        return (first if bad is None else f"global rank {me}: {bad}"), joined

    def _device(self) -> torch.device:
        """This rank's device for the small agreement vectors: the
        parameters' (an NCCL group takes them there, not on the CPU); read
        each time, as a model sharded on meta moves on ``to_empty``."""
        p = next(iter(self.model.parameters()), None)
        return p.device if p is not None else torch.device("cpu")

    def _replica_norm(self, grads) -> float:
        """This replica's gradient norm over all its shards: float64, as the
        reducer's own norm (docs/design.md §5), summed over the shard group."""
        try:
            sq = sum((float(torch.linalg.vector_norm(g, dtype=torch.float64)) ** 2 for g in grads.values()), 0.0)
        except (RuntimeError, TypeError):  # not a float tensor: the reducer's check raises it on every rank
            sq = float("nan")
        v = torch.tensor([sq], dtype=torch.float64, device=self._device())
        if self._shard_transport.size > 1:
            self._shard_transport.allreduce_sum_(v)
        return float(v[0]) ** 0.5

    def _empty_step(self) -> None:
        """No entries on this rank (nor on its replicas, which hold the same
        shards): it takes part in the joined check as a reducer call would,
        so that a fault elsewhere reaches it too, and the step advances."""
        bad, nonfinite = self._joint_check(None, [])
        self.last_step_traffic = None
        tr = self.reducer.transport  # its replicas hold no entries either: they mirror the same calls
        any_nonfinite, where, _ = input_check.check_flagged(tr, [("no entries",)], bad, nonfinite,
                                                            device=self._device())
        if any_nonfinite and self.reducer.config.nonfinite == "raise":
            names = "; ".join(", ".join(n) for _, n in where)
            raise NonFiniteGradientError(
                f"gtopk_plugin.torch_fsdp: non-finite gradient (NaN or Inf) in {names} (global rank "
                f"{dist.get_rank()} holds no entries); nothing was reduced.  nonfinite='skip' drops such "
                "steps on every rank")
        if not any_nonfinite and self.reducer.joint_agreements > 1:  # the accumulator's overflow check
            input_check.check_state_finite(tr, self._joint_check(None, [])[1], device=self._device())
        self.reducer.step += 1


def _refuse_compiled_autograd() -> None:
    """Compiled autograd skips FSDP2's post-backward hooks: no gradient
    would be reduce-scattered or reduced across replicas, silently."""
    ca = sys.modules.get("torch._dynamo.compiled_autograd")
    cfg = sys.modules.get("torch._dynamo.config")
    if (ca is not None and getattr(ca, "compiled_autograd_enabled", False)) or \
            (cfg is not None and getattr(cfg, "compiled_autograd", False)):
        raise RuntimeError(
            "gtopk_plugin.torch_fsdp: compiled autograd is on, and FSDP2's post-backward hooks do not run "
            "under it (no gradient would be reduce-scattered or reduced across replicas): run backward "
            "without compiled autograd (torch._dynamo.config.compiled_autograd = False); torch.compile "
            "of the model itself is fine")


def _policy_wire(groups) -> Optional[torch.dtype]:
    """The MixedPrecisionPolicy's reduce dtype (default: its param dtype)
    when it is float16/bfloat16 for every group: the wire HSDP would use."""
    dts = {g.mp_policy.reduce_dtype or g.mp_policy.param_dtype for g in groups}
    return dts.pop() if len(dts) == 1 and next(iter(dts)) in _HALF else None


def _traffic(stats) -> Optional[dict]:
    if stats is None:
        return None
    t = StepTraffic()
    t.add(stats)
    return t.as_dict()
