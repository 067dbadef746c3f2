"""Where a model sharded with ``fully_shard`` reduces across replicas, and
taking that reduction over from FSDP.

FSDP2 reduces an HSDP gradient in two steps: a reduce-scatter over the
shard dimension, then an all-reduce of each shard over the replicate
dimension.  :class:`ReplicaTopology` finds the model's FSDP units, its
mesh and the two process groups; :meth:`ReplicaTopology.detach` turns
FSDP's own all-reduce off (each parameter group reduces over the shard
dimension only, as FSDP on a 1-D mesh does) and :meth:`ReplicaTopology.
attach` gives it back.  The parameters stay DTensors on the model's mesh,
so optimizers, ``clip_grad_norm_`` and ``torch.distributed.checkpoint``
see a plain HSDP model.  A model sharded on a 1-D mesh with its replicas
elsewhere (``replicate_group=``) needs no detaching: FSDP never all-reduces
it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

import torch
import torch.distributed as dist

try:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard import _fsdp_common
except ImportError as e:  # pragma: no cover - torch without FSDP2
    raise ImportError("gtopk_plugin.torch_fsdp needs torch >= 2.6 with torch.distributed.fsdp.fully_shard "
                      "(pip install -U torch)") from e


def _fail(msg: str) -> ValueError:
    return ValueError(f"gtopk_plugin.torch_fsdp: {msg}")


def fsdp_units(model: torch.nn.Module) -> List[torch.nn.Module]:
    """The modules of ``model`` that ``fully_shard`` was applied to (the
    model itself must be one: the root)."""
    if not isinstance(model, torch.nn.Module):
        raise _fail(f"expected the model (a torch.nn.Module sharded with fully_shard); got "
                    f"{type(model).__name__}")
    if not isinstance(model, FSDPModule):
        raise _fail(f"{type(model).__name__} is not sharded with torch.distributed.fsdp.fully_shard: call "
                    "fully_shard(layer, mesh=mesh) on its blocks and fully_shard(model, mesh=mesh) on the "
                    "model itself, then this function on the model")
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _groups(unit) -> list:
    groups = unit._get_fsdp_state()._fsdp_param_groups
    if len(groups) > 1:
        raise _fail(f"{type(unit).__name__} holds parameters on several meshes (fully_shard's "
                    "shard_placement_fn with per-parameter meshes); the replica reduction needs one mesh")
    return list(groups)


@dataclass
class ReplicaTopology:
    """The model's FSDP parameter groups and the groups the replica
    reduction runs on: ``replicate_group`` (the reducer's transport: same
    shard, other replicas) and ``shard_group`` (this replica's shards)."""

    param_groups: list
    mesh: DeviceMesh
    replicate_group: dist.ProcessGroup
    shard_group: dist.ProcessGroup
    hsdp: bool  # a 2-D (replicate, shard) mesh: FSDP's own all-reduce is detached
    _saved: list = field(default_factory=list)

    @property
    def replica(self) -> int:
        return dist.get_rank(self.replicate_group)

    @property
    def replicas(self) -> int:
        return dist.get_world_size(self.replicate_group)

    @property
    def shard(self) -> int:
        return dist.get_rank(self.shard_group)

    @property
    def shards(self) -> int:
        return dist.get_world_size(self.shard_group)

    def shard_mesh(self) -> DeviceMesh:
        """A 1-D mesh of this replica's shards (the one the residuals live on
        in a checkpoint), on the existing shard group."""
        if self.mesh.ndim == 1:
            return self.mesh
        return DeviceMesh.from_group(self.shard_group, self.mesh.device_type)

    def detach(self) -> None:
        """Turn FSDP's replica all-reduce off: each group's mesh info becomes
        that of FSDP on the shard dimension alone (reduce-scatter, averaged
        over the shard group), on the same mesh."""
        if not self.hsdp or self._saved:
            return
        for g in self.param_groups:
            info, post = g.mesh_info, g.post_forward_mesh_info
            shard_only = _fsdp_common.FSDPMeshInfo(info.mesh, shard_mesh_dim=info.shard_mesh_dim)
            shard_only.reduce_scatter_process_group = info.reduce_scatter_process_group
            self._saved.append((g, info, post))
            g.mesh_info = shard_only
            if post is info:  # resharded after forward to the same mesh: keep it the same
                g.post_forward_mesh_info = shard_only

    def attach(self) -> None:
        """Give FSDP its replica all-reduce back."""
        for g, info, post in self._saved:
            g.mesh_info, g.post_forward_mesh_info = info, post
        self._saved = []


def find_topology(model: torch.nn.Module, mesh=None, replicate_group=None) -> ReplicaTopology:
    """The topology of ``model`` (sharded with ``fully_shard``): on a 2-D
    mesh (replicate, shard) the replicas are the mesh's dimension 0; on a
    1-D mesh they are ``replicate_group`` or dimension 0 of a 2-D ``mesh``
    whose shard dimension the model was sharded on.  ``ValueError`` for a
    model or mesh that does not fit, the same on every rank."""
    units = fsdp_units(model)
    groups = [g for u in units for g in _groups(u)]
    if not groups:
        raise _fail("the model has no parameters sharded by fully_shard")
    infos = [g.mesh_info for g in groups]
    model_mesh = infos[0].mesh
    for info in infos[1:]:
        if info.mesh != model_mesh:
            raise _fail("the model's FSDP units are sharded on different meshes; shard every unit on the "
                        "same mesh")
    if any(getattr(i, "is_spmd_mesh", False) for i in infos):
        raise _fail("models sharded with dp_mesh_dims (tensor parallel meshes) are not supported; shard "
                    "on a (replicate, shard) mesh")
    if not isinstance(infos[0], _fsdp_common.FSDPMeshInfo):
        raise _fail("the model is replicated, not sharded (fully_shard on a mesh without a shard "
                    "dimension); use gtopk_plugin.torch_ddp for data parallelism without sharding")
    if replicate_group is not None and not isinstance(replicate_group, dist.ProcessGroup):
        raise _fail(f"replicate_group must be a torch.distributed ProcessGroup; got "
                    f"{type(replicate_group).__name__}")
    if mesh is not None and not isinstance(mesh, DeviceMesh):
        raise _fail(f"mesh must be a torch.distributed.device_mesh.DeviceMesh; got {type(mesh).__name__}")
    if model_mesh.ndim == 2:
        if mesh is not None and mesh != model_mesh:
            raise _fail(f"the model is sharded on {model_mesh}, not on the mesh given ({mesh}); pass "
                        "the mesh given to fully_shard (or none)")
        if replicate_group is not None:
            raise _fail("the model is sharded on a 2-D mesh, whose dimension 0 holds the replicas: do not "
                        "pass replicate_group")
        return ReplicaTopology(groups, model_mesh, model_mesh.get_group(0), model_mesh.get_group(1), True)
    if model_mesh.ndim != 1:
        raise _fail(f"the model is sharded on a {model_mesh.ndim}-D mesh; expected a 2-D (replicate, "
                    "shard) mesh, or a 1-D shard mesh with replicate_group=")
    if mesh is not None:
        if mesh.ndim != 2:
            raise _fail(f"mesh has no replicate dimension (shape {tuple(mesh.shape)}): pass the 2-D "
                        "(replicate, shard) mesh whose shard dimension the model is sharded on, or "
                        "replicate_group=")
        row = mesh.mesh[mesh.get_coordinate()[0]].tolist()
        if row != model_mesh.mesh.tolist():
            raise _fail(f"the model is sharded over ranks {model_mesh.mesh.tolist()}, which is not a row "
                        f"(shard dimension) of the mesh given {mesh.mesh.tolist()}")
        if replicate_group is not None:
            raise _fail("pass either a 2-D mesh or replicate_group, not both")
        replicate_group = mesh.get_group(0)
    if replicate_group is None:
        raise _fail(f"the model is sharded on a 1-D mesh (ranks {model_mesh.mesh.tolist()}) without a "
                    "replicate dimension: shard it on a 2-D mesh, init_device_mesh(device, (replicas, "
                    "shards), mesh_dim_names=('replicate', 'shard')), or pass replicate_group=<the group of "
                    "this shard's replicas>")
    if dist.get_rank(replicate_group) < 0:
        raise _fail(f"global rank {dist.get_rank()} is not a member of replicate_group")
    shard_group = model_mesh.get_group(0)
    overlap = set(dist.get_process_group_ranks(replicate_group)) & set(dist.get_process_group_ranks(shard_group))
    if overlap != {dist.get_rank()}:
        raise _fail(f"replicate_group {dist.get_process_group_ranks(replicate_group)} and the shard mesh "
                    f"{dist.get_process_group_ranks(shard_group)} must share exactly this rank")
    return ReplicaTopology(groups, model_mesh, replicate_group, shard_group, False)
