"""Worker functions run inside real gloo process groups (tests/dist_utils)."""
import os

import torch

import gtopk_plugin as gp

SHAPES = {"conv.weight": (6, 3, 3), "fc.weight": (10, 12), "fc.bias": (10,)}


def grads_for(rank: int, step: int, seed: int = 0):
    """Deterministic per-rank gradients with many ties (quarter steps), so
    merges meet equal magnitudes and equal indices."""
    g = torch.Generator().manual_seed(seed * 100_003 + step * 101 + rank)
    return {n: (torch.randn(s, generator=g) * 4).round() / 4 for n, s in SHAPES.items()}


def run_configs(rank, world_size, configs, steps):
    """For each config: run ``steps`` reduce() calls and return outputs, final
    state and per-step stats."""
    results = []
    for kw in configs:
        kw = dict(kw)
        seed = kw.pop("grad_seed", 0)
        red = gp.GradientReducer(transport=gp.TorchDistributedTransport(timeout=60), **kw)
        outs, stats = [], []
        for s in range(steps):
            outs.append(red.reduce(grads_for(rank, s, seed)))
            stats.append(red.last_stats.as_dict())
        results.append({"outs": outs, "state": red.state_dict(), "stats": stats})
    return results


def layout_faults(rank, world_size):
    """Mismatched names, shapes, dtypes, settings and one rank's bad input:
    every rank must raise, nobody hangs, and the reducer stays usable."""
    red = gp.GradientReducer(method="gtopk", density=0.2,
                             transport=gp.TorchDistributedTransport(timeout=30))
    bad = {
        "name": {"a": torch.randn(8), ("b" if rank != 1 else "b2"): torch.randn(4, 2)},
        "shape": {"a": torch.randn(8), "b": torch.randn(4, 2) if rank != 2 else torch.randn(2, 4)},
        "dtype": {"a": torch.randn(8), "b": torch.randn(4, 2).to(torch.float64 if rank == 1 else torch.float32)},
        "bad_input": {"a": torch.randn(8), "b": torch.randn(4, 2) if rank != 1 else torch.tensor(1.0)},
        "nonfinite": {"a": torch.randn(8), "b": torch.randn(4, 2) if rank != 2 else torch.full((4, 2), float("nan"))},
    }
    out = {}
    for case, grads in bad.items():
        before = red.state_dict()
        try:
            red.reduce(grads)
            out[case] = ("no error", "")
        except Exception as e:  # noqa: BLE001
            out[case] = (type(e).__name__, str(e))
        after = red.state_dict()
        out[case + "_state_kept"] = after["step"] == before["step"] and all(
            torch.equal(after["residuals"][n], before["residuals"][n]) for n in before["residuals"])
    # still usable afterwards
    res = red.reduce({"a": torch.full((8,), float(rank)), "b": torch.ones(4, 2)})
    out["after"] = res
    # a different density on one rank is a settings mismatch, not a hang
    red2 = gp.GradientReducer(method="gtopk", density=0.2 if rank else 0.5,
                              transport=gp.TorchDistributedTransport(timeout=30))
    try:
        red2.reduce({"a": torch.randn(8)})
        out["settings"] = ("no error", "")
    except Exception as e:  # noqa: BLE001
        out["settings"] = (type(e).__name__, str(e))
    return out


def nonfinite_skip(rank, world_size, steps):
    red = gp.GradientReducer(method="gtopk", density=0.2, op="sum", nonfinite="skip",
                             transport=gp.TorchDistributedTransport(timeout=30))
    outs, skipped = [], []
    for s in range(steps):
        g = grads_for(rank, s)
        if s % 4 == 1 and rank == s % world_size:
            g["fc.bias"][0] = float("inf")
        outs.append(red.reduce(g))
        skipped.append(red.last_stats.skipped)
    return outs, skipped, red.state_dict()


def dies_mid_run(rank, world_size, victim, timeout):
    red = gp.GradientReducer(method="gtopk", density=0.2,
                             transport=gp.TorchDistributedTransport(timeout=timeout))
    for s in range(10):
        if s == 3 and rank == victim:
            os._exit(3)
        red.reduce(grads_for(rank, s))
    return "finished"
