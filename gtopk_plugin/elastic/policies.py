"""When may the barrier of a step break?  (Nadiradze, Markov et al. 2020,
arXiv 2001.05918, "elastic consistency", §6: the synchronization-avoiding
scheduler.)

A policy looks at one step t of training.  Every layer (a module's own
parameters) launched one reduction at step t; the step's *whole update* is
the concatenation of all layers' local gradients at launch, and its *applied
part* the concatenation of the layers whose reduced gradient has already
been applied to the parameters.  Norms are taken over that concatenation:

    ‖applied‖² = Σ_{applied layers} ‖g_layer‖²,   ‖whole‖² = Σ_{all layers} ‖g_layer‖²,
    ‖missing‖² = ‖whole‖² − ‖applied‖²  (computed as the sum over missing layers)

— a sum of squared norms, never a sum of per-layer norms.  The local
gradient is what a worker knows when the reductions start; the reduced
gradient is not known until it arrives, which is the point.

The scheduler asks ``broken(...)`` only while some update of step t is
missing; a step whose updates are all applied is complete, not broken.
Hyper-parameters are validated by :class:`~.settings.ElasticConfig`.
"""
from __future__ import annotations

import abc
import math
from typing import Dict, Optional, Type

from .settings import ElasticConfig


class Policy(abc.ABC):
    """One rule for breaking a step's barrier."""

    name = "?"
    #: The barrier cannot break before every update of the step is applied
    #: (the scheduler then waits for a layer's own update, nothing else).
    requires_all = False
    #: The policy learns from ‖local − reduced‖² of complete steps.
    needs_deviation = False

    @abc.abstractmethod
    def broken(self, applied_sq: float, missing_sq: float, total_sq: float) -> bool:
        """True once the forward pass may go ahead without the missing part."""

    def bound(self) -> Optional[float]:
        """The threshold in force (for statistics): β²·‖whole‖²'s β², or B²."""
        return None

    def observe(self, deviation_sq: float) -> None:
        """A step completed; ``deviation_sq`` = Σ_layers ‖local − reduced‖²."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, sd: dict) -> None:
        pass


class BarrierPolicy(Policy):
    """Never break: every layer waits for its own update of the previous step,
    which is synchronous data-parallel SGD (bit-identical to it)."""

    name = "barrier"
    requires_all = True

    def broken(self, applied_sq, missing_sq, total_sq):
        return False


class NormPolicy(Policy):
    """Norm-bounded: break once ‖applied‖₂ ≥ β·‖whole‖₂, tested as
    ‖applied‖² ≥ β²·‖whole‖² (both sides non-negative).  β = 0 never waits
    (only ``max_staleness`` bounds the lag); β = 1 waits for every layer,
    even one whose local gradient is zero (another rank's need not be)."""

    name = "norm"

    def __init__(self, beta: float):
        self.beta = float(beta)
        self.requires_all = self.beta >= 1.0

    def broken(self, applied_sq, missing_sq, total_sq):
        return applied_sq >= self.beta * self.beta * total_sq

    def bound(self):
        return self.beta * self.beta


class VariancePolicy(Policy):
    """Variance-bounded: break once ‖missing‖² ≤ B² with
    B² = variance_factor · σ̂², where σ̂² is a running estimate of the
    stochastic gradient's variance: after each complete step,
    d_t = Σ_layers ‖local gradient − reduced update‖² (how far this worker's
    gradient is from the global one), and σ̂² ← d_0, then
    σ̂² ← (1 − m)·σ̂² + m·d_t with m = ``momentum`` (0.1).  The missing part
    is then no larger than the noise SGD already tolerates.  Until a first
    step has completed there is no estimate and the barrier holds.
    """

    name = "variance"
    needs_deviation = True
    momentum = 0.1

    def __init__(self, variance_factor: float):
        self.variance_factor = float(variance_factor)
        self.estimate: Optional[float] = None
        self.samples = 0

    def broken(self, applied_sq, missing_sq, total_sq):
        b2 = self.bound()
        return b2 is not None and missing_sq <= b2

    def bound(self):
        return None if self.estimate is None else self.variance_factor * self.estimate

    def observe(self, deviation_sq):
        if not math.isfinite(deviation_sq):
            return  # a non-finite step says nothing about the variance
        if self.estimate is None:
            self.estimate = float(deviation_sq)
        else:
            self.estimate = (1.0 - self.momentum) * self.estimate + self.momentum * float(deviation_sq)
        self.samples += 1

    def state_dict(self):
        return {"estimate": self.estimate, "samples": self.samples}

    def load_state_dict(self, sd):
        self.estimate = sd.get("estimate")
        self.samples = int(sd.get("samples", 0))


_POLICIES: Dict[str, Type[Policy]] = {"barrier": BarrierPolicy, "norm": NormPolicy,
                                      "variance": VariancePolicy}


def make_policy(cfg: ElasticConfig) -> Policy:
    """The policy object of a validated configuration."""
    if cfg.policy == "norm":
        return NormPolicy(cfg.beta)
    if cfg.policy == "variance":
        return VariancePolicy(cfg.variance_factor)
    return _POLICIES[cfg.policy]()


def names():
    return tuple(_POLICIES)
