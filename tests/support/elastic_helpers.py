"""Shared pieces of the elastic-scheduler tests (gloo workers, the Horovod
job, single-process tests): a small model, deterministic batches, the
optimizers under test, and two wrappers around a REAL back end:

- ``Recorder`` passes everything through and records each reduction's input
  (this rank's local gradient) and output (the reduced update);
- ``Gate`` is fault injection: the real reduction runs, but its arrival is
  made visible to the scheduler only when the gate releases it — one per
  ``idle()`` call (the scheduler idles only while it waits), in a fixed
  order per step, or when the scheduler blocks on it (``wait``).  Arrival
  order is therefore deterministic, whatever the network does.
"""
import math

import torch

from gtopk_plugin.elastic import AsyncReduction

WIDTHS = (12, 10, 8, 6, 3)


def make_model(seed=0, widths=WIDTHS):
    torch.manual_seed(seed)
    layers = []
    for i in range(len(widths) - 1):
        layers.append(torch.nn.Linear(widths[i], widths[i + 1]))
        if i < len(widths) - 2:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


def batch(step, rank, n=8):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, WIDTHS[0], generator=g), torch.randint(0, WIDTHS[-1], (n,), generator=g)


def loss_of(model, step, rank):
    x, y = batch(step, rank)
    return torch.nn.functional.cross_entropy(model(x), y)


OPTIMIZERS = {
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=1e-3, nesterov=True),
    "adam": lambda p: torch.optim.Adam(p, lr=0.01),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.05),
}


def units_of(model):
    """Modules with their own parameters, in registration order (the
    scheduler's layers for these models)."""
    return [m for m in model.modules() if list(m.parameters(recurse=False))]


def params_of(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def train_sync(model, opt, steps, rank, reduce_flat):
    """Synchronous data-parallel training, the reference: after backward,
    every layer's gradients in one flat buffer (registration order) are
    reduced by ``reduce_flat`` (blocking), then ``opt.step()``."""
    for s in range(steps):
        opt.zero_grad()
        loss_of(model, s, rank).backward()
        for m in units_of(model):
            ps = list(m.parameters(recurse=False))
            flat = reduce_flat(torch.cat([p.grad.reshape(-1) for p in ps]))
            pos = 0
            for p in ps:
                p.grad.copy_(flat[pos:pos + p.numel()].view_as(p))
                pos += p.numel()
        opt.step()
    return params_of(model)


def train_elastic(sched, model, steps, rank):
    for s in range(steps):
        sched.zero_grad()
        loss_of(model, s, rank).backward()
        sched.step()
    sched.finish()
    return params_of(model)


def sq_norm(tensors):
    return math.fsum(float(t.double().square().sum()) for t in tensors)


class Recorder(AsyncReduction):
    """Pass-through around a real back end that records inputs and outputs."""

    def __init__(self, inner):
        self.inner = inner
        self.kind = inner.kind
        self.timeout = inner.timeout
        self.local = {}    # (unit, step) -> [tensors] as launched
        self.reduced = {}  # (unit, step) -> [tensors] as returned
        self.launch_order = []

    @property
    def rank(self):
        return self.inner.rank

    @property
    def size(self):
        return self.inner.size

    def setup(self, units, max_in_flight):
        self.inner.setup(units, max_in_flight)

    def agree(self, layout, bad_input):
        self.inner.agree(layout, bad_input)

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, sd):
        self.inner.load_state_dict(sd)

    def close(self):
        self.inner.close()

    def launch(self, unit, step, names, tensors, last_of_step):
        self.local[(unit, step)] = [t.detach().clone() for t in tensors]
        self.launch_order.append((unit, step))
        return (unit, step, self.inner.launch(unit, step, names, tensors, last_of_step))

    def ready(self, h):
        return self.inner.ready(h[2])

    def wait(self, h):
        out = self.inner.wait(h[2])
        self.reduced[(h[0], h[1])] = [t.clone() for t in out]
        return out

    def idle(self, rounds):
        self.inner.idle(rounds)


class _Gated:
    def __init__(self, unit, step, handle):
        self.unit, self.step, self.handle = unit, step, handle
        self.result = None


class Gate(Recorder):
    """Deterministic arrival order (see the module docstring).

    ``order``: the units of one step in release order (e.g. a delayed layer
    last).  Handles of steps below ``from_step`` are not gated."""

    def __init__(self, inner, order, from_step=0):
        super().__init__(inner)
        self.order = list(order)
        self.from_step = from_step
        self.held = {}
        self.released = []   # (unit, step) in release order
        self.forced = []     # released because the scheduler blocked on them

    def launch(self, unit, step, names, tensors, last_of_step):
        h = _Gated(unit, step, super().launch(unit, step, names, tensors, last_of_step))
        if step >= self.from_step:
            self.held[(unit, step)] = h
        else:
            self._release(h)
        return h

    def _release(self, h):
        h.result = super().wait(h.handle)  # the real reduction must be complete first
        self.held.pop((h.unit, h.step), None)
        self.released.append((h.unit, h.step))

    def ready(self, h):
        return h.result is not None

    def wait(self, h):
        if h.result is None:
            self.forced.append((h.unit, h.step))
            self._release(h)
        return h.result

    def idle(self, rounds):
        if not self.held:
            return
        step = min(s for _, s in self.held)
        for u in self.order:
            if (u, step) in self.held:
                self._release(self.held[(u, step)])
                return


class RecordingSGD(torch.optim.SGD):
    """Plain SGD that records every gradient it applies, per parameter."""

    def __init__(self, params, names, **kw):
        super().__init__(params, **kw)
        self.names = names   # id(param) -> name
        self.applied = {}    # name -> [grad, ...] in application order

    def step(self, closure=None):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    self.applied.setdefault(self.names[id(p)], []).append(p.grad.detach().clone())
        return super().step(closure)
