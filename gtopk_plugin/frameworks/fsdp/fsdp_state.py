"""The replica reduction's checkpoint in ``torch.distributed.checkpoint``
(DCP) form.

A rank's residuals and velocities are its share of the unsent gradient mass
of one (replica, shard): replica j's residual of a parameter is a DTensor
on the replica's 1-D shard mesh, sharded as the parameter is (global shape
the parameter's), under the key ``replica<j>``.  DCP writes every replica's
shards and reads them back on any number of shards -- an exact resharding,
since a residual entry belongs to one parameter entry whichever rank holds
it.  The step, settings and the replica count travel as one pickled
``meta`` value (the same on every rank); a compressor that keeps state
(PowerSGD's factors, shaped by the local shard) saves it per rank and
resumes only on the same mesh.  Another number of replicas is refused:
residuals are not replicated, and DCP has no entry to read for a new
replica (docs/fsdp.md).
"""
from __future__ import annotations

import pickle
from typing import Dict

import torch
from torch.distributed.tensor import DTensor

from gtopk_plugin.compress.compressor import Compressor
from gtopk_plugin.pipeline.layout import state_dtype
from gtopk_plugin.pipeline.reducer_state import STATE_VERSION, CheckpointError, layout_of

_META_VERSION = 1


def _shard_mesh(state):
    mesh = getattr(state, "_shard_mesh", None)
    if mesh is None:
        mesh = state._shard_mesh = state.topology.shard_mesh()
    return mesh


def _params(state):
    return [(n, p) for n, p in state.model.named_parameters() if p.requires_grad]


def _stateful_compressor(reducer) -> bool:
    return type(reducer.compressor).state_dict is not Compressor.state_dict


def _velocity_names(reducer, names):
    cfg = reducer.config
    if cfg.momentum_correction is not None:
        return list(names)
    if reducer.binding is not None:
        return [n for n in names if reducer.binding.spec(n) is not None]
    return []


def to_checkpoint(state) -> dict:
    """``state``'s DCP state dict (see the module docstring)."""
    red, topo = state.reducer, state.topology
    sd = red.state_dict()
    mesh = _shard_mesh(state)
    params = _params(state)
    small = (sd.get("small") or {}).get("velocities") or {}

    def as_dtensor(saved: Dict[str, torch.Tensor], name: str, p) -> DTensor:
        local = p.to_local()
        t = saved.get(name)
        t = (torch.zeros(local.shape, dtype=state_dtype(p.dtype)) if t is None else t.reshape(local.shape))
        return DTensor.from_local(t.to(local.device), mesh, [p.placements[-1]], run_check=False,
                                  shape=p.shape, stride=p.stride())

    mine = {}
    if red.config.error_feedback:
        mine["residuals"] = {n: as_dtensor(sd["residuals"], n, p) for n, p in params}
    vel = set(_velocity_names(red, [n for n, _ in params]))
    if vel:
        mine["velocities"] = {n: as_dtensor({**sd["velocities"], **small}, n, p) for n, p in params if n in vel}
    meta = {"version": _META_VERSION, "replicas": topo.replicas, "shards": topo.shards,
            "method": sd["method"], "seed": sd["seed"], "settings": sd["settings"], "step": sd["step"],
            "loss_scale": sd["loss_scale"], "small_loss_scale": (sd.get("small") or {}).get("loss_scale")}
    out = {"meta": pickle.dumps(meta), f"replica{topo.replica}": mine}
    if _stateful_compressor(red):
        out[f"compressor{topo.replica}_{topo.shard}"] = pickle.dumps(
            {"shards": topo.shards, "state": sd["compressor"]})
    return out


def from_checkpoint(state, sd: dict) -> None:
    """Load what :func:`to_checkpoint` gave (after DCP filled it in)."""
    red, topo = state.reducer, state.topology
    try:
        meta = pickle.loads(sd["meta"])
        mine = sd[f"replica{topo.replica}"]
    except (KeyError, TypeError, pickle.UnpicklingError) as e:
        raise CheckpointError(f"gtopk_plugin.torch_fsdp: not a replica-reduction state ({e!r})") from e
    if meta.get("version") != _META_VERSION:
        raise CheckpointError(f"gtopk_plugin.torch_fsdp: unsupported state version {meta.get('version')!r}")
    if meta["replicas"] != topo.replicas:
        raise CheckpointError(
            f"gtopk_plugin.torch_fsdp: the checkpoint was saved with {meta['replicas']} replicas, this job "
            f"has {topo.replicas}: residuals are each replica's own unsent gradient mass and move only "
            "between shards; resume on a mesh with the same replicate dimension (any shard dimension)")
    compressor = {}
    if _stateful_compressor(red):
        comp = pickle.loads(sd[f"compressor{topo.replica}_{topo.shard}"])
        if comp["shards"] != topo.shards and comp["state"]:
            raise CheckpointError(
                f"gtopk_plugin.torch_fsdp: method {red.config.method!r} keeps state shaped by the local "
                f"shard; it resumes only on the mesh it was saved on ({meta['shards']} shards, this job "
                f"has {topo.shards})")
        compressor = comp["state"]
    sizes = {n: p.to_local().numel() for n, p in _params(state)}
    below = red.config.dense_below

    def local(d) -> Dict[str, torch.Tensor]:
        return {n: t.to_local().detach().reshape(-1).cpu().clone() for n, t in (d or {}).items()
                if sizes.get(n)}

    residuals, velocities = local(mine.get("residuals")), local(mine.get("velocities"))
    small = {n: v for n, v in velocities.items() if below and v.numel() < below}
    velocities = {n: v for n, v in velocities.items() if n not in small}
    out = {"version": STATE_VERSION, "rank": topo.replica, "world_size": topo.replicas,
           "method": meta["method"], "seed": meta["seed"], "settings": meta["settings"], "step": meta["step"],
           "residuals": residuals, "velocities": velocities, "loss_scale": meta["loss_scale"],
           "compressor": compressor,
           "layout": {"residuals": layout_of(residuals), "velocities": layout_of(velocities)}}
    if below:
        out["small"] = {"velocities": small, "loss_scale": meta["small_loss_scale"]}
        out["layout"]["small"] = layout_of(small)
    red.load_state_dict(out, named_parameters=sizes)
