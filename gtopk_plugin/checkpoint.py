"""Whole-job checkpoints of a :class:`~gtopk_plugin.GradientReducer`, and
moving one to another world size.

A reducer's state is per rank (its residuals and velocities are that
worker's share of the unapplied gradient mass, docs/design.md §7), so
every rank saves and loads its own::

    gp.checkpoint.save_job(red, "ckpt/reducer")      # every rank: ckpt/reducer/rank{r}.pt, job.pt
    gp.checkpoint.load_job(red, "ckpt/reducer", named_parameters=model.named_parameters())

On P' ranks reading a checkpoint of P ranks, new rank j gets the sum of the
states of old ranks i ≡ j (mod P'), added in increasing i
(:func:`redistribute` does the same in memory; :func:`exchange_live` on the
live states for Horovod elastic resizes): Σ_ranks residual and Σ_ranks
velocity are kept, bit for bit where no sum is needed.  Compressor state
that differs between ranks (onebit's server residuals) cannot move: an
error.  :class:`gtopk_plugin.HierarchicalReducer` states are not handled
here.  Details: docs/checkpointing.md.
"""
from __future__ import annotations

import hashlib
import os
import secrets
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from gtopk_plugin.pipeline.reducer_state import (MATCHED_SETTINGS, STATE_VERSION, CheckpointError, layout_of, param_sizes, tensors_in,
                            validate_state)

__all__ = ["save_job", "load_job", "redistribute", "upgrade_state", "CheckpointError", "rank_file",
           "MANIFEST"]

FORMAT = "gtopk_plugin.checkpoint"
JOB_VERSION = 1
MANIFEST = "job.pt"  # written by rank 0 once every rank's file is in place


def rank_file(path: str, rank: int) -> str:
    """The file of ``rank``'s state in the job checkpoint at ``path``."""
    return os.path.join(path, f"rank{int(rank)}.pt")


# ---------------------------------------------------------------- helpers
def _flat_reducer(reducer):
    from gtopk_plugin.reducer import GradientReducer

    if not isinstance(reducer, GradientReducer):
        raise TypeError(f"gtopk_plugin.checkpoint handles a GradientReducer (SparseState.reducer, the Horovod "
                        f"optimizer's .reducer); got {type(reducer).__name__} (a HierarchicalReducer's state "
                        "is per topology: save and load its state_dict() per rank)")
    return reducer


def state_digest(obj) -> str:
    """SHA-256 of nested dicts/lists of tensors and plain values (equal
    digests: equal keys, dtypes, shapes and bits)."""
    h = hashlib.sha256()

    def feed(o):
        if isinstance(o, torch.Tensor):
            t = o.detach().cpu().contiguous().clone()  # a compact storage: exactly its bytes
            h.update(f"T{t.dtype}{tuple(t.shape)}:".encode())
            h.update(bytes(t.untyped_storage()))
        elif isinstance(o, dict):
            h.update(f"D{len(o)}:".encode())
            for k in sorted(o, key=repr):
                h.update(repr(k).encode() + b"=")
                feed(o[k])
        elif isinstance(o, (list, tuple)):
            h.update(f"L{len(o)}:".encode())
            for v in o:
                feed(v)
        else:
            h.update(f"V{o!r};".encode())

    feed(obj)
    return h.hexdigest()


def _has_tensors(obj) -> bool:
    return any(True for _ in tensors_in(obj, ""))


def _info(sd: dict) -> dict:
    """What the job's consistency checks need of one rank's state."""
    small = sd.get("small")
    return {"rank": sd["rank"], "world_size": sd["world_size"], "step": int(sd["step"]),
            "method": sd["method"], "seed": sd["seed"],
            "settings": {k: sd["settings"][k] for k in MATCHED_SETTINGS},
            "loss_scale": sd["loss_scale"], "small": None if small is None else small["loss_scale"],
            "has_small": small is not None,
            # None: no tensor in it (nothing a rank could hold differently)
            "compressor": state_digest(sd["compressor"]) if _has_tensors(sd["compressor"]) else None}


def _check_job(infos: Sequence[dict], moving: bool) -> None:
    """The ranks of one job's checkpoint agree: ranks 0..P-1 once each, one
    world size, step, method, seed and settings; when the job moves to
    another world size, also the loss scales and the compressor state."""
    P = len(infos)
    for i, inf in enumerate(infos):
        if inf["rank"] != i or inf["world_size"] != P:
            raise CheckpointError(f"gtopk_plugin: the job's states are not ranks 0..{P - 1} of a {P}-rank job: "
                                  f"position {i} holds rank {inf['rank']} of {inf['world_size']}")
    first = infos[0]
    keys = ("step", "method", "seed", "settings", "has_small") + (("loss_scale", "small", "compressor")
                                                                  if moving else ())
    for k in keys:
        vals = [inf[k] for inf in infos]
        if any(v != vals[0] for v in vals):
            what = {"compressor": "compressor state (per-rank compressor state, such as onebit's server "
                                  "residuals with merge='reduce_scatter_payloads', cannot move to another "
                                  "world size)",
                    "small": "loss scale of the dense_below part"}.get(k, k)
            shown = vals if k != "compressor" else [None if v is None else v[:8] for v in vals]
            raise CheckpointError(f"gtopk_plugin: the ranks' states disagree on the {what}: {shown} "
                                  f"(rank 0: {first[k] if k != 'compressor' else shown[0]})")


def _sum_by_name(dicts: Sequence[Dict[str, torch.Tensor]], what: str) -> Dict[str, torch.Tensor]:
    """name -> the sum of that name's tensors over ``dicts``, added in the
    given order in the tensors' own dtype."""
    names = sorted(set().union(*[set(d) for d in dicts])) if dicts else []
    out = {}
    for n in names:
        ts = [d[n] for d in dicts if n in d]
        for t in ts[1:]:
            if t.shape != ts[0].shape or t.dtype != ts[0].dtype:
                raise CheckpointError(f"gtopk_plugin: the ranks' {what} of {n!r} differ in shape or dtype: "
                                      f"{tuple(ts[0].shape)}/{ts[0].dtype} and {tuple(t.shape)}/{t.dtype}")
        acc = ts[0].detach().to("cpu", copy=True)
        for t in ts[1:]:
            acc.add_(t.detach().cpu())
        out[n] = acc
    return out


def _merge(sources: Sequence[dict], rank: int, world_size: int, base: dict, *, step: int,
           loss_scale, small_loss_scale, compressor: dict) -> dict:
    """New rank ``rank``'s state: the sums of ``sources``' residuals and
    velocities (in the given order), ``base``'s method and settings."""
    residuals = _sum_by_name([s["residuals"] for s in sources], "residuals")
    velocities = _sum_by_name([s["velocities"] for s in sources], "velocities")
    sd = {"version": STATE_VERSION, "rank": int(rank), "world_size": int(world_size),
          "method": base["method"], "seed": base["seed"], "settings": dict(base["settings"]),
          "step": int(step), "residuals": residuals, "velocities": velocities, "loss_scale": loss_scale,
          "compressor": compressor, "layout": {"residuals": layout_of(residuals),
                                               "velocities": layout_of(velocities)}}
    if "small" in base:
        sv = _sum_by_name([s["small"]["velocities"] for s in sources], "dense_below velocities")
        sd["small"] = {"velocities": sv, "loss_scale": small_loss_scale}
        sd["layout"]["small"] = layout_of(sv)
    return sd


def redistribute(states: Sequence[dict], world_size: int) -> List[dict]:
    """The states of a job of ``world_size`` ranks made from ``states``, the
    states of every rank of a job of ``len(states)`` ranks (in any order):
    new rank j gets the sum of the residuals (and velocities) of old ranks
    i with i mod world_size == j, added in increasing i, and the step, loss
    scale and compressor state they all share.  Σ_ranks residual is kept
    (module docstring: exactly, or up to the rounding of those sums).
    Raises :class:`CheckpointError` for states that are invalid, not one
    job's (ranks missing or repeated, steps or settings that differ), or
    with per-rank compressor state."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int; got {world_size!r}")
    states = list(states)
    if not states:
        raise CheckpointError("gtopk_plugin: redistribute needs the state of every rank of the old job; got none")
    for sd in states:
        validate_state(sd)
    if any(sd["rank"] is None for sd in states):
        raise CheckpointError("gtopk_plugin: a state records no rank (saved before the transport could tell "
                              "its rank); it cannot be placed in a job")
    states.sort(key=lambda s: s["rank"])
    infos = [_info(s) for s in states]
    _check_job(infos, moving=True)
    comp = dict(states[0]["compressor"])
    return [_merge([s for s in states if s["rank"] % world_size == j], j, world_size, states[0],
                   step=infos[0]["step"], loss_scale=infos[0]["loss_scale"], small_loss_scale=infos[0]["small"],
                   compressor=comp) for j in range(world_size)]


def upgrade_state(sd: dict, reducer, *, rank: int, world_size: int) -> dict:
    """A version-1 state (which records neither its rank nor its world size,
    nor the settings it was saved with) as version 2, with the ``rank`` and
    ``world_size`` you know saved it and ``reducer``'s settings: you vouch
    for both.  Load the result with ``reducer.load_state_dict``, which then
    checks them as for any state (a version-1 state saved by every rank to
    one file is exactly what this cannot repair)."""
    if not isinstance(sd, dict) or sd.get("version") != 1:
        raise CheckpointError(f"gtopk_plugin: upgrade_state takes a version-1 state; got version "
                              f"{sd.get('version') if isinstance(sd, dict) else type(sd).__name__!r}")
    residuals = dict(sd.get("residuals") or {})
    velocities = dict(sd.get("velocities") or {})
    out = {"version": STATE_VERSION, "rank": rank, "world_size": world_size, "method": sd.get("method"),
           "seed": sd.get("seed"), "settings": _flat_reducer(reducer).state.settings(), "step": sd.get("step"),
           "residuals": residuals, "velocities": velocities, "loss_scale": sd.get("loss_scale"),
           "compressor": dict(sd.get("compressor") or {}),
           "layout": {"residuals": layout_of(residuals), "velocities": layout_of(velocities)}}
    if "small" in sd:
        small = dict(sd["small"] or {})
        sv = dict(small.get("velocities") or {})
        out["small"] = {"velocities": sv, "loss_scale": small.get("loss_scale")}
        out["layout"]["small"] = layout_of(sv)
    validate_state(out)
    return out


# ------------------------------------------------------------- job files
def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def _raise_if_any(errors: Sequence[Optional[str]], what: str, cause: Optional[BaseException]) -> None:
    bad = [(r, e) for r, e in enumerate(errors) if e is not None]
    if bad:
        raise CheckpointError(f"gtopk_plugin: {what} failed, on every rank: "
                              + "; ".join(f"rank {r}: {e}" for r, e in bad)) from cause


def _gather(transport, obj) -> list:
    return transport.allgather_object(obj) if transport.size > 1 else [obj]


def _agree(transport, error: Optional[str], what: str, cause: Optional[BaseException] = None) -> None:
    """Raises the same :class:`CheckpointError` on every rank if any rank
    has an ``error`` (None: fine)."""
    _raise_if_any(_gather(transport, error), what, cause)


def _atomic_save(obj, file: str) -> None:
    tmp = f"{file}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, file)  # readers see the old file or the whole new one


def save_job(reducer, path: str) -> str:
    """Write the job's checkpoint of ``reducer``'s state: every rank calls it
    (a collective on the reducer's transport) with the same ``path``, a
    directory on storage every rank can read at load time.  Each rank writes
    ``path/rank{r}.pt`` (its own state); rank 0 then writes
    ``path/job.pt``, the manifest (world size, step, and what each rank's
    state must agree on), once every rank's file is in place -- a save that
    did not finish leaves no manifest for its files.  Files are written to
    a temporary name and renamed.  A failure on any rank (unwritable path,
    non-finite state, ranks that disagree) raises the same
    :class:`CheckpointError` on every rank.  Returns ``path``."""
    red = _flat_reducer(reducer)
    t = red.transport
    r, P = t.rank, t.size
    sd, info, err, cause = None, None, None, None
    try:
        sd = red.state_dict()
        validate_state(sd)  # refuse to write what load would refuse (a NaN residual)
        if (sd["rank"], sd["world_size"]) != (r, P):
            raise CheckpointError(f"the state records rank {sd['rank']} of {sd['world_size']}, the transport "
                                  f"says {r} of {P}")
        info = _info(sd)
    except Exception as e:  # noqa: BLE001 - reported on every rank below
        err, cause = _describe(e), e
    got = _gather(t, {"token": secrets.token_hex(8), "info": info, "error": err, "path": os.fspath(path)})
    _raise_if_any([g["error"] for g in got], f"save_job({path!r})", cause)
    paths = [g["path"] for g in got]
    if any(p != paths[0] for p in paths):
        raise CheckpointError(f"gtopk_plugin: save_job: the ranks passed different paths: {paths}")
    token, infos = got[0]["token"], [g["info"] for g in got]
    _check_job(infos, moving=False)  # the same data on every rank: the same verdict
    err = cause = None
    try:
        os.makedirs(path, exist_ok=True)
        _atomic_save({"format": FORMAT, "kind": "rank", "token": token, "state": sd}, rank_file(path, r))
    except Exception as e:  # noqa: BLE001
        err, cause = _describe(e), e
    _agree(t, err, f"save_job({path!r}): writing the ranks' files", cause)
    err = cause = None
    if r == 0:
        try:
            _atomic_save({"format": FORMAT, "kind": "job", "version": JOB_VERSION, "token": token,
                          "world_size": P, "step": infos[0]["step"], "ranks": infos},
                         os.path.join(path, MANIFEST))
        except Exception as e:  # noqa: BLE001
            err, cause = _describe(e), e
    _agree(t, err, f"save_job({path!r}): writing the manifest", cause)
    return path


def _load(file: str):
    if not os.path.exists(file):
        raise CheckpointError(f"{file} does not exist")
    return torch.load(file, map_location="cpu", weights_only=True)


def read_manifest(path: str) -> dict:
    """The manifest of the job checkpoint at ``path`` (validated)."""
    file = os.path.join(path, MANIFEST)
    if not os.path.exists(file):
        raise CheckpointError(f"no job checkpoint at {path!r}: {MANIFEST} is missing (never saved with "
                              "save_job, or a save did not finish)")
    man = _load(file)
    if not isinstance(man, dict) or man.get("format") != FORMAT or man.get("kind") != "job":
        raise CheckpointError(f"{file} is not a gtopk_plugin job checkpoint manifest")
    if man.get("version") != JOB_VERSION:
        raise CheckpointError(f"{file}: unsupported job checkpoint version {man.get('version')!r}")
    P = man.get("world_size")
    if isinstance(P, bool) or not isinstance(P, int) or P < 1 or not isinstance(man.get("ranks"), list) \
            or len(man["ranks"]) != P:
        raise CheckpointError(f"{file}: malformed manifest (world_size {P!r})")
    _check_job(man["ranks"], moving=False)
    return man


def _read_rank(path: str, i: int, man: dict) -> dict:
    """Old rank ``i``'s state, checked against the manifest."""
    file = rank_file(path, i)
    obj = _load(file)
    if not isinstance(obj, dict) or obj.get("format") != FORMAT or obj.get("kind") != "rank":
        raise CheckpointError(f"{file} is not a gtopk_plugin rank checkpoint")
    if obj.get("token") != man["token"]:
        raise CheckpointError(f"{file} belongs to another save than {MANIFEST} (a save that did not "
                              "finish, or files mixed from two checkpoints)")
    sd = obj.get("state")
    validate_state(sd)
    if (sd["rank"], sd["world_size"], sd["step"]) != (i, man["world_size"], man["step"]):
        raise CheckpointError(f"{file} holds rank {sd['rank']} of {sd['world_size']} at step {sd['step']}; "
                              f"the manifest expects rank {i} of {man['world_size']} at step {man['step']}")
    return sd


def load_job(reducer, path: str, *, named_parameters=None) -> None:
    """Load the job checkpoint at ``path`` (written by :func:`save_job`) into
    ``reducer``: every rank calls it (a collective on the reducer's
    transport).  On the world size it was saved at, each rank loads its own
    state; on another world size P', rank j loads the sum of the states of
    old ranks i with i mod P' == j (module docstring).  Every rank reads and
    validates what it needs first (``named_parameters``: as in
    ``GradientReducer.load_state_dict``); if any rank fails, every rank
    raises the same :class:`CheckpointError` and no rank has changed."""
    red = _flat_reducer(reducer)
    t = red.transport
    j, P = t.rank, t.size
    plan, err, cause = None, None, None
    try:
        if named_parameters is not None:  # a generator is read once, here
            named_parameters = param_sizes(named_parameters)
        man = read_manifest(path)
        P_old = man["world_size"]
        if P_old == P:
            plan = red.state.check(_read_rank(path, j, man), (j, P), named_parameters)
        else:
            _check_job(man["ranks"], moving=True)
            sources = []
            for i in range(j, P_old, P):  # old ranks i ≡ j (mod P), increasing
                sd = _read_rank(path, i, man)
                red.state.check(sd, (i, P_old), named_parameters)  # each fits this reducer as saved
                sources.append(sd)
            base = sources[0] if sources else _read_rank(path, 0, man)
            merged = _merge(sources, j, P, base, step=man["step"], loss_scale=base["loss_scale"],
                            small_loss_scale=(base.get("small") or {}).get("loss_scale"),
                            compressor=dict(base["compressor"]))
            plan = red.state.check(merged, (j, P), named_parameters)
    except Exception as e:  # noqa: BLE001 - reported on every rank below
        err, cause = _describe(e), e
    _agree(t, err, f"load_job({path!r})", cause)
    red.state.apply(plan)


# --------------------------------------------------------- elastic resizes
def exchange_live(reducer, home: Optional[Tuple[int, int]], allgather: Callable[[object], list]) -> bool:
    """An elastic resize on the live states: ``reducer``'s transport is the
    new world (rank j of P'), its state is the one it had in the world
    ``home`` = (rank, world size) it was made in (None: it holds none).
    New rank j gets the sum of the states whose home rank is ≡ j (mod P'),
    in increasing home rank -- :func:`redistribute`'s rule, over the
    processes that are still there (a worker that left took its residual
    with it).  ``allgather(obj)`` returns every rank's ``obj`` in rank order
    (a collective every rank calls at the same point).  Settings, loss
    scales or compressor states that differ between ranks raise the same
    :class:`CheckpointError` on every rank, before anything changes.
    Returns whether any state moved."""
    red = _flat_reducer(reducer)
    j, P = red.transport.rank, red.transport.size
    sd = red.state_dict()
    holds = bool(sd["residuals"] or sd["velocities"] or (sd.get("small") or {}).get("velocities"))
    mine = _info(sd)
    mine.update(home=tuple(home) if holds and home is not None else None, holds=holds)
    if holds and home is None:
        raise CheckpointError("gtopk_plugin: exchange_live: this rank holds state but no home (rank, world size)")
    infos = allgather(mine)
    for k in ("method", "seed", "settings", "has_small"):
        if any(inf[k] != infos[0][k] for inf in infos):
            raise CheckpointError(f"gtopk_plugin: elastic resize: the ranks' reducers differ in {k}: "
                                  f"{[inf[k] for inf in infos]}")
    holders = [q for q, inf in enumerate(infos) if inf["holds"]]
    for k in ("loss_scale", "small"):
        vals = {infos[q][k] for q in holders}
        if len(vals) > 1:
            raise CheckpointError(f"gtopk_plugin: elastic resize: the ranks' states are in different loss "
                                  f"scales ({k}): {sorted(vals, key=repr)}")
    digests = {inf["compressor"] for inf in infos if inf["compressor"] is not None}
    if len(digests) > 1:
        raise CheckpointError("gtopk_plugin: elastic resize: the ranks' compressor states differ (per-rank "
                              "compressor state, such as onebit's server residuals with "
                              "merge='reduce_scatter_payloads', cannot move to another world)")
    comp_src = next((q for q, inf in enumerate(infos) if inf["compressor"] is not None), None)
    movers = [q for q in holders if infos[q]["home"][0] % P != q]
    lacking = comp_src is not None and any(inf["compressor"] is None for inf in infos)
    if not movers and not lacking:
        return False
    parts = None
    if j in movers:
        parts = {k: sd[k] for k in ("residuals", "velocities")}
        if "small" in sd:
            parts["small"] = sd["small"]
    got = allgather({"parts": parts, "compressor": sd["compressor"] if j == comp_src and lacking else None})
    sources = []  # (home, current rank, state), summed in increasing home rank
    if holds and j not in movers:
        sources.append((tuple(home), j, sd))
    for q in movers:
        if infos[q]["home"][0] % P == j:
            sources.append((infos[q]["home"], q, got[q]["parts"]))
    sources.sort(key=lambda s: (s[0][0], s[0][1], s[1]))
    ref = infos[holders[0]] if holders else mine
    comp = got[comp_src]["compressor"] if lacking else sd["compressor"]
    err, cause, plan = None, None, None
    try:
        merged = _merge([s for _, _, s in sources], j, P, sd, step=red.step, loss_scale=ref["loss_scale"],
                        small_loss_scale=ref["small"], compressor=dict(comp))
        plan = red.state.check(merged, (j, P))
    except Exception as e:  # noqa: BLE001 - reported on every rank below
        err, cause = _describe(e), e
    _raise_if_any(allgather(err), "elastic resize", cause)
    red.state.apply(plan)
    return True
