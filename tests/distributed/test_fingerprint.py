"""Every setting that changes the result is part of the cross-rank check: one
rank built with a different value makes every rank raise the same clear
LayoutMismatchError on the first call, instead of replicas silently drifting
apart (random-k drawing other positions under another seed, the stochastic
int8 wire rounding differently, one rank raising on a NaN while the others
skip it, ...)."""
import pytest
import torch

from dist_utils import run_workers
from fingerprint_workers import every_variant

pytestmark = pytest.mark.distributed

BASE = dict(method="randomk", density=0.1, seed=0)
VARIANTS = [
    (BASE, dict(seed=1), {}),
    (BASE, dict(nonfinite="skip"), {}),
    (BASE, dict(error_feedback=False), {}),
    (BASE, dict(momentum_correction=0.9), {}),
    (dict(BASE, momentum_correction=0.9), dict(momentum_correction=0.8), {}),
    (dict(BASE, momentum_correction=0.9), dict(nesterov=True), {}),
    (dict(BASE, momentum_correction=0.9), dict(dampening=0.1), {}),
    (dict(BASE, momentum_correction=0.9), dict(momentum_masking=False), {}),
    (BASE, dict(clip_norm=1.0), {}),
    (BASE, dict(dense_below=50), {}),
    (BASE, dict(op="sum"), {}),
    (BASE, dict(density=0.2), {}),
    (BASE, dict(value_dtype=torch.float16), {}),
    (dict(BASE, value_dtype=torch.int8), dict(wire_rounding="stochastic"), {}),
    (dict(method="rtopk", density=0.1), dict(r_factor=2.0), {}),
    (dict(method="gtopk", density=0.1), dict(granularity="global"), {}),
    (dict(method="qsgd"), dict(levels=8), {}),
    (BASE, {}, dict(loss_scale=1024.0)),
]


def test_a_setting_that_differs_on_one_rank_is_an_error_on_every_rank():
    """One spawn runs every variant, then the agreeing control."""
    out = run_workers(3, every_variant, VARIANTS + [(BASE, {}, {})], timeout=300)
    for i, (_, variant, reduce_kw) in enumerate(VARIANTS):
        got = [per_rank[i] for per_rank in out]
        assert [t for t, _ in got] == ["LayoutMismatchError"] * 3, (variant, reduce_kw, got)
        assert len({m for _, m in got}) == 1  # the same message everywhere
    assert [per_rank[-1][0] for per_rank in out] == [None] * 3  # agreeing settings pass
