"""Take a ``torch.optim`` optimizer's momentum and weight decay over into the
reducer, so that momentum correction (DGC, Lin et al. 2018) can be turned on
without the user rewriting their optimizer.

The binding reads ``momentum``, ``nesterov``, ``dampening`` and
``weight_decay`` from the param groups at every step (momentum schedules are
followed), adds ``weight_decay · p`` to each worker's clipped gradient
before the correction, and sets the groups' momentum and weight decay to 0
only for the duration of ``optimizer.step()`` (step pre/post hooks), so
``param_groups`` and ``state_dict()`` show the user's values between steps.
Only SGD-style groups (a ``momentum`` key) can be bound; others raise
``ValueError`` (docs/recipes.md, docs/design.md §5).
"""
from __future__ import annotations

from typing import Dict, Iterable, Optional, Tuple

import torch

from gtopk_plugin.compress.momentum import MomentumSpec

Tensor = torch.Tensor


class OptimizerBinding:
    """Momentum and weight decay of ``optimizer``'s groups, per parameter name.

    ``named_parameters``: (name, parameter) pairs with the names the reducer
    sees.  Groups with ``momentum == 0`` are left entirely to the optimizer
    (no correction, their weight decay stays there too).
    """

    def __init__(self, optimizer: torch.optim.Optimizer,
                 named_parameters: Iterable[Tuple[str, Tensor]]):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(f"optimizer must be a torch.optim.Optimizer; got {type(optimizer).__name__}")
        named = list(named_parameters)
        if not named:
            raise ValueError("named_parameters is empty: pass model.named_parameters()")
        self.optimizer = optimizer
        self.params: Dict[str, Tensor] = {}
        by_id = {}
        for n, p in named:
            if not isinstance(n, str) or not isinstance(p, torch.Tensor):
                raise ValueError("named_parameters must yield (str, torch.Tensor) pairs")
            self.params[n] = p
            by_id[id(p)] = n
        self._group_of: Dict[str, dict] = {}
        for g in optimizer.param_groups:
            for p in g["params"]:
                n = by_id.get(id(p))
                if n is None:
                    continue
                if "momentum" not in g:
                    raise ValueError(
                        f"momentum correction needs an SGD-style optimizer (param group with a "
                        f"'momentum' setting); {type(optimizer).__name__} keeps its own moments "
                        "(Adam/AdamW: use error feedback alone, momentum_correction=False; "
                        "see docs/recipes.md)")
                if g.get("maximize", False):
                    raise ValueError("momentum correction does not support maximize=True")
                self._group_of[n] = g
        self._corrected_groups = []
        for g in optimizer.param_groups:
            if any(self._group_of.get(by_id.get(id(p))) is g for p in g["params"]):
                self._corrected_groups.append(g)
                for p in g["params"]:
                    if id(p) not in by_id and p.requires_grad:
                        raise ValueError(
                            "a param group holds parameters that are not reduced by gtopk_plugin "
                            "(not in named_parameters); momentum correction would turn their "
                            "momentum off too -- put them in a separate param group")
        # group id -> the user's (momentum, weight_decay, nesterov) while a
        # step runs; a depth count because a wrapped optimizer class (Horovod's)
        # runs the step hooks of its own step() and of the base class's.
        self._saved: Dict[int, tuple] = {}
        self._stepping: list = []
        self._param_ids = {id(p) for p in self.params.values()}
        self._depth = 0
        self._handles = [optimizer.register_step_pre_hook(self._before_step),
                         optimizer.register_step_post_hook(self._after_step)]

    # -- what the reducer asks, every step ---------------------------------
    def _user(self, g) -> Tuple[float, float, bool]:
        """The user's (momentum, weight_decay, nesterov) of group ``g``, also
        while a step runs with them set to 0 (Horovod reduces inside step())."""
        saved = self._saved.get(id(g))
        if saved is not None:
            return saved
        return float(g["momentum"]), float(g.get("weight_decay", 0.0)), bool(g.get("nesterov", False))

    def spec(self, name: str) -> Optional[MomentumSpec]:
        g = self._group_of.get(name)
        if g is None:
            return None
        m, _, nesterov = self._user(g)
        if m == 0.0:
            return None
        return MomentumSpec(m, nesterov, float(g.get("dampening", 0.0)))

    def specs(self, names) -> Dict[str, Optional[MomentumSpec]]:
        return {n: self.spec(n) for n in names}

    def fingerprint(self, names) -> Tuple:
        """The settings this binding applies to ``names`` (momentum,
        nesterov, dampening, weight decay), for the cross-rank check: ranks
        whose optimizers differ there would reduce different quantities."""
        out = []
        for n in names:
            sp = self.spec(n)
            out.append(None if sp is None else (sp.momentum, sp.nesterov, sp.dampening,
                                                self.weight_decay(n)))
        return tuple(out)

    def weight_decay(self, name: str) -> float:
        """The weight decay the reducer applies for ``name`` (0 when the
        optimizer keeps it: groups without momentum)."""
        if self.spec(name) is None:
            return 0.0
        return self._user(self._group_of[name])[1]

    def add_weight_decay(self, name: str, flat_grad: Tensor, loss_scale: float = 1.0) -> Tensor:
        """``g + wd·p`` (``wd·scale·p`` for a loss-scaled gradient)."""
        wd = self.weight_decay(name)
        if wd == 0.0:
            return flat_grad
        p = self.params[name].detach()
        # a DTensor (FSDP2): this rank's local shard, read at every call since
        # FSDP may re-pad the shard's storage between steps
        p = (p.to_local() if hasattr(p, "to_local") else p).reshape(-1)
        return flat_grad.add(p.to(flat_grad.dtype), alpha=wd * loss_scale)

    # -- the optimizer's step runs without momentum and weight decay -------
    def _before_step(self, opt, _args, _kwargs):
        # The groups of *this* step: the elastic scheduler steps narrowed
        # copies of the groups, one layer at a time.
        self._depth += 1
        if self._depth > 1:
            return
        self._stepping = []
        for g in (opt.param_groups if opt is not None else self._corrected_groups):
            if not any(id(p) in self._param_ids for p in g["params"]):
                continue
            m, wd, nesterov = self._user(g)
            if m == 0.0:
                continue
            self._saved[id(g)] = (m, wd, nesterov)
            self._stepping.append(g)
            g["momentum"] = 0.0
            g["weight_decay"] = 0.0
            if "nesterov" in g:
                g["nesterov"] = False

    def _after_step(self, _opt, _args, _kwargs):
        self._depth = max(0, self._depth - 1)
        if self._depth:
            return
        for g in getattr(self, "_stepping", []):
            saved = self._saved.pop(id(g), None)
            if saved is None:
                continue
            g["momentum"], g["weight_decay"] = saved[0], saved[1]
            if "nesterov" in g:
                g["nesterov"] = saved[2]
        self._stepping = []

    def abort_step(self) -> None:
        """A step raised (its post hooks never run): give the user's values
        back and reset the depth count."""
        self._depth = 1
        self._after_step(None, None, None)

    def remove(self) -> None:
        """Give momentum and weight decay back to the optimizer."""
        for h in self._handles:
            h.remove()
        self._handles = []
