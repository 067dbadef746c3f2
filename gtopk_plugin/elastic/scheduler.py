"""``ElasticScheduler``: the elastic consistency scheduler of Nadiradze,
Markov et al. 2020 (arXiv 2001.05918, §6) for any ``torch.optim`` optimizer.

Usage, where a synchronous data-parallel loop would call ``optimizer.step()``::

    sched = ElasticScheduler(model, optimizer, policy="norm", beta=0.5)
    for x, y in data:
        sched.zero_grad()
        loss_fn(model(x), y).backward()   # reductions start layer by layer
        sched.step()                      # closes the step; does not wait
    sched.finish()                        # every update applied

Reductions start during backward in a fixed launch order; each update is
applied by the user's optimizer as soon as it arrives and its layer is not
in use; a layer's forward waits for step t's update only until step t's
barrier breaks (the policy), and never beyond ``max_staleness``.  Policy
``"barrier"`` is synchronous SGD bit for bit.  Exact rules: :mod:`.core`
and docs/elastic.md, "Semantics".
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch

from gtopk_plugin.pipeline.input_check import LayoutMismatchError, PeerInputError
from gtopk_plugin.elastic.apply import OptimizerApplier, check_optimizer
from gtopk_plugin.elastic.backend import AsyncReduction
from gtopk_plugin.elastic.fusion_buckets import BucketedReduction
from gtopk_plugin.elastic.core import ElasticCore
from gtopk_plugin.elastic.policies import make_policy
from gtopk_plugin.elastic.resolution import resolve
from gtopk_plugin.elastic.settings import ElasticConfig
from gtopk_plugin.elastic.scheduler_stats import ElasticStats
from gtopk_plugin.elastic.units import build_units

_STATE_VERSION = 1


class ElasticScheduler:
    """Elastic consistency scheduler (one state object, DDP comm-hook style).

    Args (bad values: ``ValueError`` on that rank, ``PeerInputError`` on others):
        policy: ``"barrier"``, ``"norm"`` (default) or ``"variance"``.
        beta: (norm, in [0, 1]) step t's barrier breaks once ‖applied part of
            its update‖₂ ≥ β·‖whole update‖₂.
        variance_factor: (variance, ≥ 0) breaks once ‖missing‖₂² ≤ factor × the
            running gradient-variance estimate.
        max_staleness: int ≥ 0 (default 1): no parameter lags more steps.
        bucket_cap_mb: fuse consecutive layers' reductions up to this MiB (0: off).
        momentum_correction: True: DGC momentum correction with ``optimizer``'s
            own momentum, through a sparse ``reducer`` (a fixed momentum is
            the reducer's own ``momentum_correction=``).
        reducer: ``None`` (dense average) or a :class:`~gtopk_plugin.GradientReducer`
            run per layer on a background thread.
        transport: ``None`` (torch.distributed), a Transport, or an
            :class:`~.backend.AsyncReduction`; leave it None with a ``reducer``.

    ``state_dict()``: step counter, variance estimate, reducer state, ``stats``.
    Parameters are read inside their modules' ``forward``; one backward per
    ``step()``; equal ``step()`` counts on every rank.  See docs/elastic.md.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, reducer=None,
                 policy: str = "norm", beta: float = 0.5, variance_factor: float = 1.0,
                 max_staleness: int = 1, transport=None, momentum_correction=None,
                 bucket_cap_mb: float = 0.0):
        bad: Optional[str] = None
        try:
            if reducer is not None and getattr(getattr(reducer, "config", None), "clip_norm", None) is not None:
                raise ValueError(
                    "clip_norm needs this worker's norm over the whole step, but the elastic scheduler "
                    "reduces each layer as soon as its gradient exists; build the reducer without "
                    "clip_norm (or clip per layer yourself before the gradients are reduced)")
            if momentum_correction is not None and not isinstance(momentum_correction, bool):
                raise ValueError("ElasticScheduler(momentum_correction=) is True or False (the optimizer's "
                                 "momentum); a fixed momentum is the reducer's own momentum_correction=")
            if momentum_correction:
                if reducer is None:
                    raise ValueError("momentum_correction=True applies to a sparse reducer; with dense "
                                     "reduction the optimizer's own momentum is already exact")
                reducer.bind_optimizer(optimizer, model.named_parameters())
            self.config = ElasticConfig(policy=policy, beta=beta, variance_factor=variance_factor,
                                        max_staleness=max_staleness, bucket_cap_mb=bucket_cap_mb)
            if not isinstance(model, torch.nn.Module):
                raise ValueError(f"model must be a torch.nn.Module; got {type(model).__name__}")
            check_optimizer(optimizer)
            units, module_units, unit_of = build_units(model, optimizer)
        except ValueError as e:
            bad = str(e)
        try:
            backend = resolve(transport, reducer)
        except ValueError:
            raise
        except Exception as e:  # noqa: BLE001 - e.g. no process group: the settings error is the news
            if bad is not None:
                raise ValueError(bad) from e
            raise
        if bad is not None:
            # Other ranks may be fine: run the same collectives as they do
            # (setup, agree), so every rank raises (ValueError here,
            # PeerInputError there) instead of some hanging.
            try:
                backend.setup([], max_in_flight=2)
                backend.agree([("elastic", "invalid")], bad)
            except (ValueError, PeerInputError, LayoutMismatchError):
                raise
            except Exception as e:  # noqa: BLE001 - no process group etc.: the settings error is the news
                raise ValueError(bad) from e
            raise ValueError(bad)
        if self.config.bucket_cap_mb > 0:
            backend = BucketedReduction(backend, max(1, int(self.config.bucket_cap_mb * 2 ** 20)))
        self.model = model
        self.optimizer = optimizer
        self.backend: AsyncReduction = backend
        self.units = units
        self.policy = make_policy(self.config, backend)
        self.stats = ElasticStats()
        s = self.config.max_staleness
        backend.setup([u.spec() for u in units], max_in_flight=s + 2)
        layout = [(u.name, tuple(u.param_names), tuple(tuple(p.shape) for p in u.params),
                   tuple(str(p.dtype) for p in u.params)) for u in units]
        layout.append(("settings", "max_staleness", s, "bucket_cap_mb", self.config.bucket_cap_mb))
        backend.agree(layout, None)

        self._applier = OptimizerApplier(optimizer, units)
        self._core = ElasticCore(backend, self.policy, s, len(units), self._applier.apply, self.stats,
                                 on_complete=self._applier.forget, unit_names=[u.name for u in units])
        self._module_units = module_units
        self._unit_of = unit_of
        # Launch order: reverse registration order, roughly the order in
        # which backward produces gradients; fixed, so every rank issues
        # its collectives in the same order.
        self._order = list(reversed(range(len(units))))
        self._step = 0
        self._next = 0
        self._used = [False] * len(units)
        self._left = [len(u.params) for u in units]
        self._got_grad: Dict[int, bool] = {}
        self._functional: Dict[int, None] = {}  # units used outside their modules' forward
        self._hooks = []
        for m in module_units:
            self._hooks.append(m.register_forward_pre_hook(self._pre_forward))
        if model not in module_units:
            self._hooks.append(model.register_forward_pre_hook(self._pre_forward))
        for u in units:
            for p in u.params:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))

    # ------------------------------------------------------------------ API
    @property
    def step_count(self) -> int:
        """Steps closed so far."""
        return self._step

    def step(self, closure=None) -> None:
        """Close the step (where ``optimizer.step()`` would be called):
        launch the layers that got no gradient (with zeros), record the
        step's hyper-parameters, apply whatever has arrived.  Does not wait
        for the reductions."""
        if closure is not None:
            raise ValueError("ElasticScheduler.step() takes no closure (each layer's update is applied "
                             "when it arrives)")
        for i in range(self._next, len(self._order)):
            self._launch(self._order[i])
        self._next = len(self._order)
        self._applier.snapshot(self._step)
        # The optimizer's step happened, logically: tell torch's LR schedulers
        # (they warn when lr_scheduler.step() comes before any optimizer.step();
        # the updates of this step use the hyper-parameters recorded above).
        self.optimizer._opt_called = True
        self._core.close_step(self._step)
        self._step += 1
        self.stats.steps += 1
        self._next = 0
        self._used = [False] * len(self.units)
        self._left = [len(u.params) for u in self.units]
        self._got_grad.clear()
        self._core.poll(lambda u: True)  # backward is over: every layer may change

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``optimizer.zero_grad`` (the reductions hold their own copies);
        also applies updates that have arrived."""
        self.optimizer.zero_grad(set_to_none=set_to_none)
        if self._core.has_pending():
            self._core.poll(self._eligible)

    def finish(self) -> None:
        """Wait for every outstanding reduction and apply it: afterwards the
        parameters hold every update of every closed step (and, with dense
        reduction, are identical on all ranks).  Training may continue."""
        if self._next or self._got_grad:
            raise RuntimeError("ElasticScheduler.finish() called after a backward pass that no step() "
                               "closed: call step() first")
        self._core.drain()

    def close(self) -> None:
        """``finish()``, then remove the hooks and stop background threads."""
        try:
            self.finish()
        finally:
            for h in self._hooks:
                h.remove()
            self._hooks = []
            self.backend.close()

    def state_dict(self) -> dict:
        """Step counter, policy state (variance estimate), the reducer's
        state (residuals) and the statistics counters.  Drains first
        (``finish()``): a checkpoint holds no update in flight, and the
        model's and optimizer's state saved after this call are complete."""
        self.finish()
        return {"version": _STATE_VERSION, "step": self._step, "policy": self.config.policy,
                "policy_state": self.policy.state_dict(), "reducer": self.backend.state_dict(),
                "stats": self.stats.as_dict()}

    def load_state_dict(self, sd: dict) -> None:
        if not isinstance(sd, dict) or sd.get("version") != _STATE_VERSION:
            raise ValueError(f"unsupported ElasticScheduler state (version "
                             f"{sd.get('version') if isinstance(sd, dict) else None!r})")
        if sd.get("policy") != self.config.policy:
            raise ValueError(f"state was saved with policy {sd.get('policy')!r}, this scheduler runs "
                             f"{self.config.policy!r}")
        self.finish()
        self.backend.load_state_dict(sd.get("reducer"))
        self.policy.load_state_dict(sd.get("policy_state", {}))
        self.stats.load(sd.get("stats", {}))
        self._step = int(sd["step"])

    # ------------------------------------------------------------- internals
    def _eligible(self, u: int) -> bool:
        return not self._used[u]

    def _pre_forward(self, module, args):
        units = self._module_units.get(module, ())
        if module is self.model and self._functional:
            units = list(units) + [u for u in self._functional if u not in units]
        todo = [u for u in units if not self._used[u]]
        if not todo:
            return None
        core = self._core
        if core.has_pending():
            core.poll(self._eligible)
            for u in todo:
                core.ensure(u, self._step, self._eligible)
        if torch.is_grad_enabled():
            # From here until backward is over, autograd may hold these
            # parameters: no update is applied to them before step().
            for u in todo:
                self._used[u] = True
                self.stats.record_use(core.missing(u))
        return None

    def _on_grad(self, p) -> None:
        u = self._unit_of[id(p)]
        if id(p) in self._got_grad:
            raise RuntimeError(
                f"parameter {self._name_of(p)!r} got a second gradient in step {self._step}: "
                "ElasticScheduler reduces each parameter once per step; call step() after every "
                "backward pass (gradient accumulation over several passes is not supported)")
        self._got_grad[id(p)] = True
        if not self._used[u]:
            # A gradient, but no module registering the parameter ran its
            # forward: the parameter is read elsewhere.  Wait for it before
            # the model's forward from now on.
            self._functional[u] = None
        self._left[u] -= 1
        if self._left[u] == 0:
            while self._next < len(self._order) and self._left[self._order[self._next]] == 0:
                self._launch(self._order[self._next])
                self._next += 1

    def _name_of(self, p) -> str:
        unit = self.units[self._unit_of[id(p)]]
        for n, q in zip(unit.param_names, unit.params):
            if q is p:
                return n
        return "?"

    def _launch(self, u: int) -> None:
        unit = self.units[u]
        grads: List[torch.Tensor] = []
        for p in unit.params:
            g = p.grad
            if g is None:
                g = torch.zeros_like(p)
            elif g.is_sparse:
                g = g.to_dense()
            grads.append(g)
        self._left[u] = 0
        self._core.launch(u, self._step, unit.param_names, grads,
                          last_of_step=(u == self._order[-1]))

    def __repr__(self):
        c = self.config
        return (f"ElasticScheduler(policy={c.policy!r}, beta={c.beta}, variance_factor={c.variance_factor}, "
                f"max_staleness={c.max_staleness}, backend={self.backend.kind!r}, layers={len(self.units)})")

