"""Workers of tests/distributed/test_fingerprint.py."""
import torch

import gtopk_plugin as gp


def one_rank_differs(rank, world, base, variant, reduce_kw):
    """Every rank builds ``base``; the last rank also applies ``variant``
    (and passes ``reduce_kw`` to reduce()).  Returns what each rank raised
    on the first call, and whether a second, agreeing call still works."""
    kw = dict(base, **(variant if rank == world - 1 else {}))
    red = gp.GradientReducer(transport=gp.TorchDistributedTransport(timeout=30), **kw)
    g = torch.Generator().manual_seed(rank)
    grads = {"a": torch.randn(300, generator=g), "b": torch.randn(20, 5, generator=g)}
    try:
        red.reduce(grads, **(reduce_kw if rank == world - 1 else {}))
        first = (None, "")
    except Exception as e:  # noqa: BLE001 - the test reads the type
        first = (type(e).__name__, str(e))
    return first


def every_variant(rank, world, variants):
    """:func:`one_rank_differs` for each ``(base, variant, reduce_kw)`` in
    turn, in one process group (a mismatch leaves the group usable)."""
    return [one_rank_differs(rank, world, *v) for v in variants]
