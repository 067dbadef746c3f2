"""What a :class:`gtopk_plugin.GradientReducer` carries from one call to the
next (:class:`ReducerState`, an object the reducer holds): the step, the
AMP loss scale its residuals and velocities are expressed in, the optimizer
binding, and the checkpoint of all of it -- the state a bit-exact resume
needs.

A state dict (version 2) says where it comes from: the rank and world size
that produced it, the method and the settings that give its tensors their
meaning, and the layout (name -> shape, dtype) of its residuals and
velocities.  Residuals and velocities are one worker's share of the job's
unsent mass (docs/design.md §3: Σ_ranks Σ_steps grad = Σ_steps result +
Σ_ranks residual), so a state belongs to one rank of one world size:
``load_state_dict`` refuses any other, and :mod:`gtopk_plugin.checkpoint`
writes and reads a whole job (and moves the mass to another world size).

Loading validates everything first and applies only then: a state that is
refused leaves the reducer exactly as it was.
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Callable, Dict, Mapping, NamedTuple, Optional, Tuple

import torch

STATE_VERSION = 2

# every key of a version-2 state ("small" only with dense_below)
_KEYS = ("version", "rank", "world_size", "method", "seed", "settings", "step", "residuals",
         "velocities", "loss_scale", "compressor", "layout", "small")
# settings that give the saved tensors their meaning: a state loads only
# into a reducer with the same values (the rest of "settings" is a record)
MATCHED_SETTINGS = ("aggregation", "hyper", "error_feedback", "dense_below")


class CheckpointError(ValueError):
    """A reducer state (or a job checkpoint) that cannot be loaded here:
    malformed, non-finite, from another method or settings, or from another
    rank or world size.  Raised before anything is changed."""


class _Plan(NamedTuple):
    """A validated state, ready to apply."""

    step: int
    residuals: Dict[str, torch.Tensor]
    velocities: Dict[str, torch.Tensor]
    loss_scale: Optional[float]
    compressor: dict
    small: Optional[dict]
    origin: Optional[Tuple[int, int]]


def _fail(msg: str) -> CheckpointError:
    return CheckpointError(f"gtopk_plugin: cannot load this reducer state: {msg}")


def layout_of(tensors: Mapping[str, torch.Tensor]) -> Dict[str, dict]:
    """``{name: {"shape": (...), "dtype": "torch.float32"}}`` of a tensor dict."""
    return {n: {"shape": tuple(int(d) for d in t.shape), "dtype": str(t.dtype)} for n, t in tensors.items()}


def per_rank_content(sd: Mapping) -> bool:
    """Whether a state holds anything that belongs to its rank (residuals,
    velocities, any tensor of the compressor state)."""
    small = sd.get("small") or {}
    return bool(sd.get("residuals") or sd.get("velocities")
                or any(True for _ in tensors_in(sd.get("compressor") or {}, ""))
                or (isinstance(small, Mapping) and small.get("velocities")))


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _check_loss_scale(v, what: str) -> Optional[float]:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not (float(v) > 0.0) or math.isinf(float(v)):
        raise _fail(f"{what} must be None or a positive finite number; got {v!r}")
    return float(v)


def _check_tensors(d, what: str, recorded) -> Dict[str, torch.Tensor]:
    """``d``: name -> finite floating-point dense tensor, exactly as the
    state's layout records it."""
    if not isinstance(d, Mapping):
        raise _fail(f"{what} must be a dict name -> tensor; got {type(d).__name__}")
    if not isinstance(recorded, Mapping):
        raise _fail(f"the layout of {what} is missing or not a dict (got {type(recorded).__name__})")
    out = {}
    for n, t in d.items():
        if not isinstance(n, str):
            raise _fail(f"{what}: names must be strings; got {n!r}")
        if not isinstance(t, torch.Tensor):
            raise _fail(f"{what}[{n!r}] is a {type(t).__name__}, not a tensor")
        if t.is_meta or t.layout != torch.strided:
            raise _fail(f"{what}[{n!r}] is a {'meta' if t.is_meta else str(t.layout)} tensor; a state "
                        "holds dense tensors with values")
        if not t.is_floating_point():
            raise _fail(f"{what}[{n!r}] has dtype {t.dtype}; residuals and velocities are floating point")
        if not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise _fail(f"{what}[{n!r}] holds {bad} non-finite value(s) (NaN or Inf) of {t.numel()}; "
                        "such a state would make every later update non-finite")
        rec = recorded.get(n)
        if not isinstance(rec, Mapping) or tuple(rec.get("shape", ())) != tuple(t.shape) \
                or rec.get("dtype") != str(t.dtype):
            raise _fail(f"{what}[{n!r}] is {tuple(t.shape)}/{t.dtype} but the state's layout records "
                        f"{None if rec is None else (tuple(rec.get('shape', ())), rec.get('dtype'))}")
        out[n] = t
    extra = sorted(set(recorded) - set(out))
    if extra:
        raise _fail(f"the state's layout records {what} {extra[:5]} that it does not hold")
    return out


def tensors_in(obj, path: str):
    """(path, tensor) of every tensor inside nested dicts/lists/tuples."""
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            yield from tensors_in(v, f"{path}[{k!r}]")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from tensors_in(v, f"{path}[{i}]")


def validate_state(sd) -> None:
    """The checks a version-2 state passes on its own, whatever reducer it
    goes to: its keys and types, a non-negative integer step, rank and
    world size, finite residuals, velocities and compressor tensors that
    match the recorded layout.  Raises :class:`CheckpointError`."""
    if not isinstance(sd, Mapping):
        raise _fail(f"a GradientReducer state is a dict; got {type(sd).__name__}")
    v = sd.get("version")
    if v == 1:
        raise _fail("it is a version-1 state, which records neither the rank nor the world size that "
                    "saved it; if you know them, convert it with gtopk_plugin.checkpoint.upgrade_state("
                    "sd, reducer, rank=r, world_size=P) and load that")
    if v != STATE_VERSION:
        raise _fail(f"unsupported state version {v!r} (this version reads {STATE_VERSION})")
    unknown = sorted(str(k) for k in set(sd) - set(_KEYS))
    if unknown:
        raise _fail(f"unknown keys {unknown}")
    missing = [k for k in _KEYS if k != "small" and k not in sd]
    if missing:
        raise _fail(f"missing keys {missing}")
    step = sd["step"]
    if not _is_int(step) or int(step) < 0:
        raise _fail(f"step must be a non-negative int; got {step!r}")
    rank, world = sd["rank"], sd["world_size"]
    if (rank is None) != (world is None):
        raise _fail(f"rank and world_size are both given or both None; got {rank!r}, {world!r}")
    if rank is not None and not (_is_int(rank) and _is_int(world) and 0 <= rank < world):
        raise _fail(f"rank must be an int in [0, world_size) and world_size a positive int; "
                    f"got rank={rank!r}, world_size={world!r}")
    if not isinstance(sd["method"], str):
        raise _fail(f"method must be a string; got {sd['method']!r}")
    if not _is_int(sd["seed"]):
        raise _fail(f"seed must be an int; got {sd['seed']!r}")
    settings = sd["settings"]
    if not isinstance(settings, Mapping) or any(k not in settings for k in MATCHED_SETTINGS):
        raise _fail(f"settings must be a dict holding {list(MATCHED_SETTINGS)}")
    _check_loss_scale(sd["loss_scale"], "loss_scale")
    layout = sd["layout"]
    if not isinstance(layout, Mapping):
        raise _fail(f"layout must be a dict; got {type(layout).__name__}")
    _check_tensors(sd["residuals"], "residuals", layout.get("residuals"))
    _check_tensors(sd["velocities"], "velocities", layout.get("velocities"))
    comp = sd["compressor"]
    if not isinstance(comp, Mapping):
        raise _fail(f"compressor must be a dict; got {type(comp).__name__}")
    for path, t in tensors_in(comp, "compressor"):
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise _fail(f"{path} holds non-finite values (NaN or Inf)")
    if "small" in sd:
        small = sd["small"]
        if not isinstance(small, Mapping) or set(small) != {"velocities", "loss_scale"}:
            raise _fail("small (the dense_below part) must be a dict with exactly 'velocities' and "
                        "'loss_scale'")
        _check_tensors(small["velocities"], "small velocities", layout.get("small"))
        _check_loss_scale(small["loss_scale"], "small loss_scale")
    if rank is None and per_rank_content(sd):
        raise _fail("it holds residuals, velocities or compressor state but records no rank and world size")


def param_sizes(named_parameters) -> Dict[str, int]:
    """name -> entries, from ``model.named_parameters()`` (read once) or a
    dict name -> tensor, shape or number of entries."""
    items = named_parameters.items() if isinstance(named_parameters, Mapping) else named_parameters
    out = {}
    for n, p in items:
        out[str(n)] = int(p.numel()) if isinstance(p, torch.Tensor) else int(p) if _is_int(p) else math.prod(p)
    return out


def transport_origin(transport) -> Optional[Tuple[int, int]]:
    """(rank, world size) of ``transport``, or None while it cannot tell
    (torch.distributed not initialised yet, Horovod not running)."""
    try:
        r, p = transport.rank, transport.size
    except (RuntimeError, ValueError):
        return None
    if not (_is_int(r) and _is_int(p)) or not 0 <= r < p:
        return None
    return int(r), int(p)


class ReducerState:
    """One reducer's state between calls.  ``step``, ``loss_scale`` and
    ``binding`` are its own; ``memory`` (residuals), ``momentum``
    (velocities), ``compressor`` (its state) and ``small`` (the
    ``dense_below`` side, or None) are the reducer's collaborators whose
    state it checkpoints.  ``config``, ``aggregation`` and ``transport`` say
    which states fit (method, settings, rank and world size)."""

    def __init__(self, config, aggregation: str, transport, compressor, memory, momentum, small=None):
        self.config, self.aggregation, self.transport = config, aggregation, transport
        self.compressor, self.memory, self.momentum, self.small = compressor, memory, momentum, small
        self.step = 0
        # the loss scale the residuals and velocities are expressed in (AMP)
        self.loss_scale: Optional[float] = None
        self.binding = None  # OptimizerBinding: momentum and weight decay from an optimizer
        self.loaded_origin: Optional[Tuple[int, int]] = None
        # ranks outside the transport whose calls take the same path (see
        # GradientReducer.joint_check)
        self.joint_check: Optional[Callable] = None

    def follow_loss_scale(self, loss_scale: Optional[float]) -> None:
        """Keep residuals and velocities in the units of the incoming
        gradients: when the AMP loss scale changed since the last call,
        multiply them by new/old (a power of two for GradScaler: exact)."""
        if loss_scale is None:
            return
        s = float(loss_scale)
        if not (s > 0.0) or math.isinf(s):
            raise ValueError(f"loss_scale must be a positive finite number; got {loss_scale!r}")
        if self.loss_scale is not None and s != self.loss_scale:
            f = s / self.loss_scale
            self.memory.rescale_(f)
            self.momentum.rescale_(f)
        self.loss_scale = s

    # ------------------------------------------------------------ checkpoints
    def settings(self) -> Dict[str, Any]:
        """The settings a state records (MATCHED_SETTINGS must agree on load)."""
        cfg = self.config
        return {"aggregation": self.aggregation, "hyper": dict(self.compressor.hyper),
                "error_feedback": bool(cfg.error_feedback), "dense_below": int(cfg.dense_below),
                # a record only (free to change at a resume)
                "granularity": cfg.granularity, "op": cfg.op, "value_dtype": str(cfg.value_dtype),
                "wire_rounding": cfg.wire_rounding, "momentum_correction": cfg.momentum_correction,
                "nesterov": cfg.nesterov, "dampening": cfg.dampening, "momentum_masking": cfg.momentum_masking}

    def origin(self) -> Optional[Tuple[int, int]]:
        """Where this state belongs: the transport's (rank, world size);
        before the transport can tell, that of the last loaded state."""
        where = transport_origin(self.transport)
        return where if where is not None else self.loaded_origin

    def state_dict(self) -> dict:
        """See :meth:`gtopk_plugin.GradientReducer.state_dict`."""
        where = self.origin()
        residuals, velocities = self.memory.state_dict(), self.momentum.state_dict()
        sd = {"version": STATE_VERSION,
              "rank": None if where is None else where[0],
              "world_size": None if where is None else where[1],
              "method": self.config.method, "seed": self.config.seed, "settings": self.settings(),
              "step": self.step, "residuals": residuals, "velocities": velocities,
              "loss_scale": self.loss_scale, "compressor": self.compressor.state_dict(),
              "layout": {"residuals": layout_of(residuals), "velocities": layout_of(velocities)}}
        if self.small is not None:
            sd["small"] = self.small.state_dict()
            sd["layout"]["small"] = layout_of(sd["small"]["velocities"])
        return sd

    def load(self, sd: dict, named_parameters=None) -> None:
        """Validate ``sd`` for this rank of this world size, then apply it."""
        self.apply(self.check(sd, transport_origin(self.transport), named_parameters))

    def load_own(self, sd: dict) -> None:
        """Load a state this process saved itself, in the world it was in
        then (elastic restore: the job may have failed, so the transport's
        rank is not asked); it keeps its recorded rank and world size."""
        self.apply(self.check(sd, None, None, own=True))

    def check(self, sd, where: Optional[Tuple[int, int]], named_parameters=None, own: bool = False) -> _Plan:
        """Validate ``sd`` for this reducer at ``where`` = (rank, world
        size) (None: not known yet); returns what to apply."""
        validate_state(sd)
        cfg = self.config
        if sd["method"] != cfg.method:
            raise _fail(f"it was saved by method {sd['method']!r}, this reducer runs {cfg.method!r}")
        if sd["seed"] != cfg.seed:
            raise _fail(f"it was saved with seed={sd['seed']}, this reducer has seed={cfg.seed} (random "
                        "draws are keyed by (seed, step): build the reducer with the saved seed)")
        ours = self.settings()
        for key in MATCHED_SETTINGS:
            if sd["settings"][key] != ours[key]:
                raise _fail(f"it was saved with {key}={sd['settings'][key]!r}, this reducer has "
                            f"{key}={ours[key]!r}")
        if sd["residuals"] and not cfg.error_feedback:
            raise _fail("it holds residuals but this reducer has error_feedback=False")
        if ("small" in sd) != (self.small is not None):
            raise _fail("its dense_below part ('small') does not match this reducer's dense_below")
        origin = None if sd["rank"] is None else (int(sd["rank"]), int(sd["world_size"]))
        if origin is not None and not own:
            _check_origin(sd, origin, where)
        if named_parameters is not None:
            _check_names(sd, param_sizes(named_parameters))
        comp = dict(sd["compressor"])
        try:  # the compressor validates its own state: on a fresh instance first
            type(self.compressor)(**cfg.method_hyper).load_state_dict(comp)
        except Exception as e:  # noqa: BLE001 - any refusal is this state's fault
            raise _fail(f"the compressor state does not load into method {cfg.method!r}: "
                        f"{type(e).__name__}: {e}") from e
        small = None
        if "small" in sd:
            small = {"velocities": dict(sd["small"]["velocities"]),
                     "loss_scale": _check_loss_scale(sd["small"]["loss_scale"], "small loss_scale")}
        return _Plan(int(sd["step"]), dict(sd["residuals"]), dict(sd["velocities"]),
                     _check_loss_scale(sd["loss_scale"], "loss_scale"), comp, small,
                     origin if origin is not None else where)

    def apply(self, plan: _Plan) -> None:
        """Apply a validated state (the loaders copy the tensors)."""
        self.step = plan.step
        self.memory.load_state_dict(plan.residuals)
        self.momentum.load_state_dict(plan.velocities)
        self.loss_scale = plan.loss_scale
        self.compressor.load_state_dict(plan.compressor)
        if self.small is not None:
            self.small.load_state_dict(plan.small)
        self.loaded_origin = plan.origin

    def reset(self) -> None:
        """Forget residuals and velocities."""
        self.memory.reset()
        self.momentum.reset()
        if self.small is not None:
            self.small.reset()


def _check_origin(sd, origin: Tuple[int, int], where: Optional[Tuple[int, int]]) -> None:
    """A state saved by rank ``origin[0]`` of ``origin[1]`` loads only there."""
    if where is None:
        if per_rank_content(sd):
            raise _fail(
                f"it belongs to rank {origin[0]} of a {origin[1]}-rank job, and this reducer's "
                "transport cannot tell its rank yet (torch.distributed not initialised?): "
                "initialise the process group first")
    elif origin[1] != where[1]:
        raise _fail(
            f"it was saved by rank {origin[0]} of a {origin[1]}-rank job, this job has {where[1]} "
            "ranks: residuals are each rank's share of the unsent gradient mass; use "
            "gtopk_plugin.checkpoint.load_job (or checkpoint.redistribute) to move a whole job's "
            "checkpoint to another world size")
    elif origin[0] != where[0]:
        raise _fail(
            f"it was saved by rank {origin[0]}, this is rank {where[0]} (of {where[1]}): each "
            "rank loads its own state (gtopk_plugin.checkpoint.save_job/load_job write and read "
            "one per rank)")


def _check_names(sd, sizes: Dict[str, int]) -> None:
    """Residuals and velocities only for the named parameters, of their sizes."""
    parts = [("residual", sd["residuals"]), ("velocity", sd["velocities"])]
    if "small" in sd:
        parts.append(("velocity", sd["small"]["velocities"]))
    for what, d in parts:
        foreign = sorted(n for n in d if n not in sizes)
        if foreign:
            raise _fail(f"it holds a {what} for {foreign[:5]}, which named_parameters does not "
                        "name (a state of another model?)")
        for n, t in d.items():
            if t.numel() != sizes[n]:
                raise _fail(f"its {what} of {n!r} has {t.numel()} entries, the parameter has "
                            f"{sizes[n]}")
