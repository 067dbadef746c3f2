"""Applying one layer's reduced gradient with the user's optimizer, without
changing the optimizer's mathematics.

A layer's step is the ordinary ``optimizer.step()`` run with
``param_groups`` temporarily narrowed to that layer's parameters: the same
code path, the same per-parameter state.  The reduced gradient is swapped
into ``p.grad`` (the loop's own ``p.grad`` restored after), and a step's
hyper-parameters (lr, betas, weight decay, ...) are those captured at
``ElasticScheduler.step()``, not whatever an LR scheduler has set since.
So under the barrier policy training is bit-identical to
``optimizer.step()`` after a synchronous reduction.

Optimizers whose step couples parameters (LBFGS, which needs a closure over
the whole model) are refused.  See docs/elastic.md, "Optimizers".
"""
from __future__ import annotations

from typing import Dict, List, Sequence

import torch

from gtopk_plugin.elastic.units import Unit


def check_optimizer(optimizer) -> None:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizer must be a torch.optim.Optimizer; got {type(optimizer).__name__}")
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("LBFGS re-evaluates the whole model in a closure and cannot be applied layer by "
                         "layer; the elastic scheduler supports per-parameter optimizers (SGD, Adam, AdamW, "
                         "RMSprop, ...)")


def _copy(v):
    return v.detach().clone() if isinstance(v, torch.Tensor) else v


class OptimizerApplier:
    """Applies ``updates`` of unit ``u`` at ``step`` through ``optimizer``."""

    def __init__(self, optimizer: torch.optim.Optimizer, units: Sequence[Unit]):
        self.optimizer = optimizer
        self.units = list(units)
        self._hparams: Dict[int, List[dict]] = {}

    def snapshot(self, step: int) -> None:
        """Hyper-parameters in force for ``step`` (call where optimizer.step() would run)."""
        self._hparams[step] = [{k: _copy(v) for k, v in g.items() if k != "params"}
                               for g in self.optimizer.param_groups]

    def forget(self, step: int) -> None:
        self._hparams.pop(step, None)

    def apply(self, u: int, step: int, updates: Sequence[torch.Tensor]) -> None:
        unit = self.units[u]
        opt = self.optimizer
        hp = self._hparams.get(step)
        groups = []
        for gi, pos in unit.groups:
            g = dict(hp[gi]) if hp is not None else {k: v for k, v in opt.param_groups[gi].items()
                                                      if k != "params"}
            g["params"] = [unit.params[i] for i in pos]
            groups.append(g)
        saved_grads = [p.grad for p in unit.params]
        saved_groups = opt.param_groups
        try:
            for p, upd in zip(unit.params, updates):
                p.grad = upd if upd.dtype == p.dtype and upd.shape == p.shape else upd.to(p.dtype).view_as(p)
            opt.param_groups = groups
            opt.step()
        finally:
            opt.param_groups = saved_groups
            for p, g in zip(unit.params, saved_grads):
                p.grad = g
