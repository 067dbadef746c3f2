"""When may the barrier of a step break?  (Nadiradze, Markov et al. 2020,
arXiv 2001.05918, "elastic consistency", §6.)

A policy looks at one step t.  Every layer (a module's own parameters)
launched one reduction at step t; the step's *whole update* is the
concatenation of all layers' local gradients at launch, its *applied part*
that of the layers whose reduced gradient is already applied.  Norms are
over that concatenation:

    ‖applied‖² = Σ_{applied layers} ‖g_layer‖²,   ‖whole‖² = Σ_{all layers} ‖g_layer‖²,
    ‖missing‖² = Σ_{missing layers} ‖g_layer‖²

— sums of squared norms, never of per-layer norms.  ``broken(...)`` is asked
only while some update of step t is missing.  Hyper-parameters are
validated by :class:`~.settings.ElasticConfig`.
"""
from __future__ import annotations

import abc
import math
import warnings
from typing import Dict, Optional, Sequence, Type

import torch

from gtopk_plugin.elastic.settings import ElasticConfig

Tensor = torch.Tensor


#: Entries per float64 chunk of :func:`squared_distance` (128 KB: cache-sized)
DISTANCE_CHUNK = 1 << 14


def squared_distance(local: Sequence[Tensor], reduced: Sequence[Tensor], div: float = 1.0) -> float:
    """Σ‖a − b/div‖² over the pairs, in float64, chunk by chunk (a float64 copy of a whole layer per operand and step was five fresh
    allocations of twice its size, page faults included; the chunks stay in
    cache).  The chunks' sums are added with ``math.fsum``."""
    parts = []
    for a, b in zip(local, reduced):
        a, b = a.reshape(-1), b.reshape(-1)
        for i in range(0, a.numel(), DISTANCE_CHUNK):
            d = a[i:i + DISTANCE_CHUNK].double()
            e = b[i:i + DISTANCE_CHUNK].double()
            d.sub_(e.div_(div) if div != 1.0 else e)
            parts.append(float(torch.dot(d, d)))
    return math.fsum(parts)


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

    def deviation(self, local: Sequence[Tensor], reduced: Sequence[Tensor]) -> float:
        """One layer's contribution to the step's deviation (policies with
        ``needs_deviation``): Σ‖local − reduced‖² in float64 here."""
        return squared_distance(local, reduced)

    def observe(self, deviation_sq: float) -> None:
        """A step completed; ``deviation_sq`` = Σ_layers :meth:`deviation`."""

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
    """Variance-bounded: break once ‖missing‖² ≤ B², B² = variance_factor · σ̂².

    σ² bounds one worker's gradient noise, E‖g_i − ∇f(x)‖² ≤ σ² (arXiv
    2001.05918).  Each complete step gives the unbiased sample
    s_t = P/(P−1) · Σ_layers ‖g_i − ḡ‖², ḡ the dense mean of the raw
    gradients; σ̂² ← s_0, then σ̂² ← (1 − m)·σ̂² + m·s_t, m = ``momentum``.
    Until a first sample the barrier holds.

    :meth:`bind` (called by the scheduler from its back end) says what the
    reduction returns: ``op="average"``: ḡ; ``op="sum"``: P·ḡ (divided by P);
    ``exact=False`` (a compressing reducer, or dense with momentum correction
    or clipping) or ``world_size=1``: no sample is taken (:meth:`deviation`
    returns NaN), the barrier holds, and a ``RuntimeWarning`` says so.
    Unbound, the sample is the uncorrected Σ‖g_i − reduced‖².
    See docs/elastic.md, "Semantics".
    """

    name = "variance"
    needs_deviation = True
    momentum = 0.1

    def __init__(self, variance_factor: float):
        self.variance_factor = float(variance_factor)
        self.estimate: Optional[float] = None
        self.samples = 0
        self.world_size: Optional[int] = None
        self.op = "average"
        self.exact = True

    def bind(self, world_size: int, op: str = "average", exact: bool = True) -> "VariancePolicy":
        """What the reduction returns: ``world_size`` P ≥ 1, ``op``
        ("average": the mean, "sum": P times the mean) and ``exact`` (False
        for a compressing reducer).  Returns ``self``."""
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1; got {world_size!r}")
        if op not in ("average", "sum"):
            raise ValueError(f"op must be 'average' or 'sum'; got {op!r}")
        self.world_size, self.op, self.exact = world_size, op, bool(exact)
        if not self.exact and world_size > 1:
            warnings.warn("gtopk_plugin elastic: policy='variance' with a compressing reducer cannot "
                          "estimate the gradient variance (the reduced update is a compressed "
                          "approximation of the workers' mean, not the mean); the barrier holds, as "
                          "synchronous SGD. Use policy='norm', or a dense reduction.", RuntimeWarning,
                          stacklevel=2)
        return self

    def deviation(self, local: Sequence[Tensor], reduced: Sequence[Tensor]) -> float:
        """One layer's Σ‖g_i − ḡ‖² (float64), ḡ recovered from the reduced
        update as bound; NaN when no sample can be taken (see the class)."""
        if self.world_size is not None and (not self.exact or self.world_size < 2):
            return float("nan")
        div = float(self.world_size) if (self.world_size is not None and self.op == "sum") else 1.0
        return squared_distance(local, reduced, div)

    def sample(self, deviation_sq: float) -> float:
        """The variance sample s_t of a step from Σ_layers ‖g_i − ḡ‖²."""
        P = self.world_size
        if P is None:
            return float(deviation_sq)      # unbound: uncorrected (see the class)
        if P < 2 or not self.exact:
            return float("nan")
        return float(deviation_sq) * P / (P - 1)

    def broken(self, applied_sq, missing_sq, total_sq):
        b2 = self.bound()
        return b2 is not None and missing_sq <= b2

    def bound(self):
        return None if self.estimate is None else self.variance_factor * self.estimate

    def observe(self, deviation_sq):
        """A step completed; ``deviation_sq`` = Σ_layers ‖g_i − ḡ‖² (the sum
        of :meth:`deviation` over the step's layers)."""
        s = self.sample(deviation_sq)
        if not math.isfinite(s):
            return  # a non-finite step (or no sample possible) says nothing about the variance
        if self.estimate is None:
            self.estimate = s
        else:
            self.estimate = (1.0 - self.momentum) * self.estimate + self.momentum * s
        self.samples += 1

    def state_dict(self):
        return {"estimate": self.estimate, "samples": self.samples}

    def load_state_dict(self, sd):
        self.estimate = sd.get("estimate")
        self.samples = int(sd.get("samples", 0))


_POLICIES: Dict[str, Type[Policy]] = {"barrier": BarrierPolicy, "norm": NormPolicy,
                                      "variance": VariancePolicy}


def make_policy(cfg: ElasticConfig, backend=None) -> Policy:
    """The policy object of a validated configuration; with the scheduler's
    back end (an :class:`~.backend.AsyncReduction`), the variance policy is
    bound to what the back end returns (:func:`bind_to_backend`)."""
    if cfg.policy == "norm":
        return NormPolicy(cfg.beta)
    if cfg.policy == "variance":
        pol = VariancePolicy(cfg.variance_factor)
        if backend is not None:
            bind_to_backend(pol, backend)
        return pol
    return _POLICIES[cfg.policy]()


def bind_to_backend(policy: VariancePolicy, backend) -> VariancePolicy:
    """Bind the variance policy to a back end: its world size, and, for a
    :class:`~gtopk_plugin.GradientReducer` back end (``backend.reducer``),
    the reducer's ``op`` and whether its update is the plain mean (or sum)
    of the gradients: only method "dense" without DGC momentum correction
    (the update is then a velocity) and without local clipping (a mean of
    clipped gradients).  Native dense back ends (torch.distributed, Horovod,
    BytePS, a Transport's allreduce) return the average."""
    red = getattr(backend, "reducer", None)
    if red is None:
        return policy.bind(int(backend.size), op="average", exact=True)
    cfg = red.config
    plain = cfg.method == "dense" and cfg.momentum_correction is None and cfg.clip_norm is None
    return policy.bind(int(backend.size), op=cfg.op, exact=plain)


def names():
    return tuple(_POLICIES)
