"""Validated hyper-parameters of the elastic scheduler.

Keyword arguments only: the environment is read in :mod:`gtopk_plugin.config`
(``BYTEPS_ELASTIC_*``, used by :mod:`gtopk_plugin.byteps`), never here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from gtopk_plugin.config import ELASTIC_POLICIES


@dataclass(frozen=True)
class ElasticConfig:
    """Settings of :class:`~gtopk_plugin.elastic.ElasticScheduler`.

    policy: ``"barrier"`` (never break: synchronous SGD), ``"norm"``
        (norm-bounded, Nadiradze et al. 2020 §6: break once
        ‖applied part‖₂ ≥ β·‖whole update‖₂) or ``"variance"``
        (variance-bounded: break once ‖missing part‖₂² ≤ B², B² = variance_factor
        × a running estimate of the gradient variance).
    beta: β of the norm policy, in [0, 1]; β = 1 waits for every layer.
    variance_factor: the user factor of B², finite and ≥ 0.
    max_staleness: hard bound, an int ≥ 0: no parameter is used more than this
        many steps behind, whatever the policy (0 is the barrier).
    bucket_cap_mb: fuse consecutive layers' reductions until their
        gradients reach this many MiB (the step's last layer closes its
        bucket): fewer messages where each pays a fixed latency
        (:mod:`.buckets`); 0 (default) reduces each layer on its own.
    """

    policy: str = "norm"
    beta: float = 0.5
    variance_factor: float = 1.0
    max_staleness: int = 1
    bucket_cap_mb: float = 0.0

    def __post_init__(self):
        if not isinstance(self.policy, str) or self.policy not in ELASTIC_POLICIES:
            raise ValueError(f"unknown elastic policy {self.policy!r}; pass one of "
                             f"{', '.join(repr(p) for p in ELASTIC_POLICIES)}")
        object.__setattr__(self, "beta", _number("beta", self.beta, "a number in [0, 1], e.g. 0.5"))
        if not (0.0 <= self.beta <= 1.0):
            raise ValueError(f"beta must be in [0, 1] (the fraction of the update's norm that must be "
                             f"applied before the barrier breaks), e.g. 0.5; got {self.beta!r}")
        vf = _number("variance_factor", self.variance_factor, "a finite number >= 0, e.g. 1.0")
        if not (vf >= 0.0) or math.isinf(vf):
            raise ValueError(f"variance_factor must be a finite number >= 0, e.g. 1.0; got {vf!r}")
        object.__setattr__(self, "variance_factor", vf)
        cap = _number("bucket_cap_mb", self.bucket_cap_mb, "a finite number >= 0 (MiB), e.g. 25")
        if not (cap >= 0.0) or math.isinf(cap):
            raise ValueError(f"bucket_cap_mb must be a finite number >= 0 (MiB of gradients per fused "
                             f"reduction; 0 reduces each layer on its own), e.g. 25; got {cap!r}")
        object.__setattr__(self, "bucket_cap_mb", cap)
        s = self.max_staleness
        if isinstance(s, bool) or not isinstance(s, int) or s < 0:
            raise ValueError(f"max_staleness must be an int >= 0 (steps a parameter may lag behind; "
                             f"0 is the barrier), e.g. 1; got {s!r}")


def _number(name: str, v, what: str) -> float:
    if isinstance(v, bool):
        raise ValueError(f"{name} must be {what}; got {v!r}")
    try:
        f = float(v)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be {what}; got {v!r}") from None
    if math.isnan(f):
        raise ValueError(f"{name} must be {what}; got NaN")
    return f
