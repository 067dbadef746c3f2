"""Layers as the elastic scheduler sees them: a *unit* is one module's own
parameters (``module.parameters(recurse=False)``) that the optimizer trains.

Units are the granularity of everything: one reduction per unit and step,
one wait decision per unit before its module's forward.  A parameter
registered in several modules (tied weights) belongs to the first one in
``model.named_modules()`` order, and every module registering it waits for
that unit.  Parameters the optimizer does not hold, or that do not require
gradients, are not scheduled (they never change through this optimizer).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Tuple

import torch

from gtopk_plugin.elastic.backend import UnitSpec


@dataclass
class Unit:
    index: int
    name: str
    params: List[torch.nn.Parameter]
    param_names: List[str]
    #: (param group index, positions in ``params``) per group the unit touches
    groups: List[Tuple[int, List[int]]] = field(default_factory=list)

    def spec(self) -> UnitSpec:
        return UnitSpec(self.index, self.name, tuple(self.param_names),
                        tuple(tuple(p.shape) for p in self.params), tuple(p.dtype for p in self.params))


def build_units(model: torch.nn.Module, optimizer: torch.optim.Optimizer):
    """(units in registration order, module -> unit indices it must wait for).

    Raises ``ValueError`` when the optimizer holds a parameter that is not
    in the model (the scheduler could not tell when it is used)."""
    group_of: Dict[int, int] = {}
    for gi, g in enumerate(optimizer.param_groups):
        for p in g["params"]:
            group_of[id(p)] = gi
    units: List[Unit] = []
    unit_of: Dict[int, int] = {}
    module_units: Dict[torch.nn.Module, List[int]] = {}
    for mname, m in model.named_modules():
        own = [(n, p) for n, p in m.named_parameters(recurse=False)
               if id(p) in group_of and p.requires_grad]
        waits: List[int] = []
        fresh = [(n, p) for n, p in own if id(p) not in unit_of]
        if fresh:
            u = Unit(len(units), mname or "<root>", [p for _, p in fresh],
                     [f"{mname}.{n}" if mname else n for n, _ in fresh])
            for p in u.params:
                unit_of[id(p)] = u.index
            by_group: Dict[int, List[int]] = {}
            for i, p in enumerate(u.params):
                by_group.setdefault(group_of[id(p)], []).append(i)
            u.groups = sorted(by_group.items())
            units.append(u)
        for _, p in own:
            if unit_of[id(p)] not in waits:
                waits.append(unit_of[id(p)])
        if waits:
            module_units[m] = waits
    missing = [f"param_groups[{gi}] (shape {tuple(p.shape)})" for gi, g in enumerate(optimizer.param_groups)
               for p in g["params"] if p.requires_grad and id(p) not in unit_of]
    if missing:
        raise ValueError(f"{len(missing)} optimizer parameter(s) are not parameters of the model: "
                         f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}. The elastic "
                         "scheduler waits for a parameter before the forward of the module that "
                         "registers it; pass the model whose parameters the optimizer updates.")
    if not units:
        raise ValueError("the optimizer holds no parameter of the model that requires a gradient; "
                         "nothing to schedule")
    return units, module_units, unit_of
