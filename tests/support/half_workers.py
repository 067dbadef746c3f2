"""Workers of tests/distributed/test_half_precision.py: fp16/bf16 gradients
through every selector, with the float64 record of what each rank fed in,
what every rank was handed back and its final residual."""
import torch

import gtopk_plugin as gp

SIZES = {"w": (40, 50), "b": (173,)}


def half_grads(rank: int, step: int, dtype, scale: float = 1050.0):
    """All-finite gradients with |g| <= scale (fp16 holds them exactly up to
    its rounding), the same on every run."""
    g = torch.Generator().manual_seed(step * 7919 + rank)
    return {n: ((torch.rand(s, generator=g) * 2 - 1) * scale).to(dtype) for n, s in SIZES.items()}


def run_half(rank, world, dtype, kw, steps):
    """``steps`` reduce() calls; returns the float64 sums of the gradients
    fed and the updates applied, the final residuals (float64) and dtypes,
    whether every update was finite, and one update (for rank agreement)."""
    kw = dict(kw)
    use_out = kw.pop("use_out", False)  # updates written into caller tensors (as DDP does)
    red = gp.GradientReducer(transport=gp.TorchDistributedTransport(timeout=60), **kw)
    fed = {n: torch.zeros(s, dtype=torch.float64) for n, s in SIZES.items()}
    applied = {n: torch.zeros(s, dtype=torch.float64) for n, s in SIZES.items()}
    finite, last = True, None
    for step in range(steps):
        g = half_grads(rank, step, dtype)
        u = red.reduce(g, out={n: torch.empty_like(t) for n, t in g.items()} if use_out else None)
        for n in SIZES:
            assert u[n].dtype == dtype, (n, u[n].dtype)
            finite &= bool(torch.isfinite(u[n]).all())
            fed[n] += g[n].double()
            applied[n] += u[n].double()
        last = {n: u[n].clone() for n in SIZES}
    res = {n: r.detach().double().clone().reshape(SIZES[n]) for n, r in red.memory.residuals.items()}
    return {"fed": fed, "applied": applied, "residuals": res, "finite": finite, "last": last,
            "res_dtypes": sorted({str(r.dtype) for r in red.memory.residuals.values()}),
            "vel_dtypes": sorted({str(v.dtype) for v in red.momentum.velocities.values()})}


def overflow_state(rank, world, fused):
    """Finite float32 gradients whose accumulator overflows float32: with
    the fused path (no momentum) the step is non-finite under the policy;
    with momentum correction (the general path) a NonFiniteStateError on
    every rank.  Returns (type name, message) of what this rank raised."""
    kw = {} if fused else {"momentum_correction": 0.9}
    red = gp.GradientReducer(method="topk", density=0.01, transport=gp.TorchDistributedTransport(timeout=30),
                             **kw)
    # rank 0: finite gradients of half float32's range everywhere; 990 of
    # 1000 entries stay in its residual each step, which overflows by step 3
    x = torch.full((1000,), torch.finfo(torch.float32).max / 2)
    try:
        for _ in range(4):
            red.reduce({"w": x.clone() if rank == 0 else torch.ones(1000)})
    except Exception as e:  # noqa: BLE001 - the test reads the type
        return type(e).__name__, str(e), red.step
    return None, None, red.step


def run_half_cases(rank, world, cases, steps):
    """:func:`run_half` for each ``(dtype, kwargs)`` of ``cases`` in turn,
    in one process group."""
    return [run_half(rank, world, dtype, kw, steps) for dtype, kw in cases]


def overflow_both(rank, world):
    """:func:`overflow_state` on the fused path, then on the general path."""
    return [overflow_state(rank, world, fused) for fused in (True, False)]
