"""The GradientReducer's checkpoint and loss-scale bookkeeping (a mixin, out
of reducer.py to keep that module one screenful of pipeline): the state a
bit-exact resume needs, and residuals/velocities kept in the units of the
incoming (AMP loss-scaled) gradients."""
from __future__ import annotations

import math
from typing import Optional


class ReducerState:
    """Mixin of :class:`gtopk_plugin.GradientReducer` (uses its ``config``,
    ``step``, ``memory``, ``momentum``, ``compressor``, ``loss_scale``,
    ``binding``, ``_updates`` and ``_small``, the dense side of
    ``dense_below``)."""

    def _follow_loss_scale(self, loss_scale: Optional[float]) -> None:
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

    def state_dict(self) -> dict:
        """Residuals and step: everything a bit-exact resume needs (random
        draws are keyed by (seed, step, name), so the step is the RNG state);
        with ``dense_below``, the dense part's velocities under "small"."""
        sd = {"version": 1, "method": self.config.method, "seed": self.config.seed,
              "step": self.step, "residuals": self.memory.state_dict(),
              "velocities": self.momentum.state_dict(), "loss_scale": self.loss_scale,
              "compressor": self.compressor.state_dict()}
        if self._small is not None:
            sd["small"] = self._small.state_dict()
        return sd

    def load_state_dict(self, sd: dict) -> None:
        if sd.get("version") != 1:
            raise ValueError(f"unsupported GradientReducer state version {sd.get('version')!r}")
        if sd.get("method") != self.config.method:
            raise ValueError(f"state was saved by method {sd.get('method')!r}, this reducer runs "
                             f"{self.config.method!r}")
        self.step = int(sd["step"])
        self.memory.load_state_dict(sd["residuals"])
        self.momentum.load_state_dict(sd.get("velocities", {}))
        self.loss_scale = sd.get("loss_scale")
        self.compressor.load_state_dict(sd.get("compressor", {}))
        if self._small is not None:
            self._small.load_state_dict(sd.get("small", {}))

    def correct_momentum(self, optimizer, named_parameters) -> "ReducerState":
        """Turn on DGC momentum correction with ``optimizer``'s own settings:
        its SGD momentum (nesterov, dampening) and weight decay move in
        front of the compressor, read from its param groups at every call,
        and ``optimizer.step()`` runs with momentum and weight decay 0 for
        those groups (restored right after the step).  ``named_parameters``
        gives the names this reducer sees.  Returns ``self``.

        Raises ``ValueError`` for optimizers without SGD momentum (Adam,
        AdamW: use plain error feedback)."""
        from .compress.optimizer_binding import OptimizerBinding

        if self.binding is not None:
            self.binding.remove()
        self.binding = OptimizerBinding(optimizer, named_parameters)
        return self

    def reset(self) -> None:
        """Forget residuals and velocities (e.g. after the set of parameters changed)."""
        self.memory.reset()
        self.momentum.reset()
        self._updates.clear()
        if self._small is not None:
            self._small.reset()
