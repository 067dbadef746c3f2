"""Worker functions for tests/distributed/test_wire_precision.py (run inside real gloo
process groups by tests/dist_utils.run_workers)."""
import torch

import gtopk_plugin as gp

SHAPES = {"a": (150,), "b": (6, 9)}  # N = 204: P = 3, 4 divide it, P = 7 does not


def wire_grads(rank: int, step: int, kind: str):
    """Deterministic per-rank gradients.

    "wide": magnitudes from ~1e-3 to ~1e3 (most values are not fp16/bf16
    numbers, so every rounding matters).  "big": the same plus values up to
    1e6 and 40000 at entries 0..3 of "a" on every rank (so any two ranks'
    sum exceeds fp16's 65504)."""
    g = torch.Generator().manual_seed(step * 7919 + rank * 104_729 + (0 if kind == "wide" else 1))
    out = {}
    for n, s in SHAPES.items():
        out[n] = torch.randn(s, generator=g) * torch.exp(1.5 * torch.randn(s, generator=g))
    if kind == "big":
        a = out["a"]
        a[:4] = 40000.0
        a[4:12] = (torch.rand(8, generator=g) * 2 - 1) * 1e6
        out["b"][0, :3] = -1e6 * torch.rand(3, generator=g)
    return out


def flat(d):
    return torch.cat([d[n].reshape(-1) for n in sorted(d)])


def wire_run(rank, world_size, configs, steps, kind):
    """For each config: ``steps`` reduce() calls; returns the flat update of
    every step, the final residuals and the last step's traffic."""
    results = []
    for kw in configs:
        red = gp.GradientReducer(transport=gp.TorchDistributedTransport(timeout=60), **kw)
        outs = []
        for s in range(steps):
            outs.append(flat(red.reduce(wire_grads(rank, s, kind))))
        st = red.last_stats
        results.append({"outs": torch.stack(outs), "residuals": flat(red.state_dict()["residuals"]),
                        "sent": st.payload_bytes_sent, "received": st.payload_bytes_received,
                        "headers": st.header_bytes_sent})
    return results
