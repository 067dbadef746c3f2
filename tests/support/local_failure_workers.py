"""Workers of tests/distributed/test_local_failures.py."""
import torch

import gtopk_plugin as gp


def _outcome(fn):
    try:
        fn()
        return None, ""
    except Exception as e:  # noqa: BLE001 - the test reads the type
        return type(e).__name__, str(e)


def one_rank_fails_locally(rank, world, kind):
    """Rank 1 fails before the exchange (its own state or input); every
    other rank must raise PeerInputError naming it -- at once, not after
    the transport's timeout (300 s here, past the job's limit) -- and the
    reducer must stay usable for an agreeing next call."""
    red = gp.GradientReducer(method="gtopk", density=0.1,
                             transport=gp.TorchDistributedTransport(timeout=300))
    grads = {"w": torch.randn(64), "b": torch.randn(8)}
    red.reduce(grads)  # a first step everywhere: the residuals exist
    before = {n: r.clone() for n, r in red.memory.residuals.items()}
    bad = dict(grads)
    if rank == 1:
        if kind == "state":  # a residual that no longer fits its gradient
            red.memory.residuals["w"] = torch.zeros(7)
        elif kind == "memory":  # an expanded tensor whose buffers cannot fit
            bad = dict(grads, huge=torch.zeros(1).expand(2 ** 37))
        elif kind == "meta":
            bad = dict(grads, w=torch.empty(64, device="meta"))
    first = _outcome(lambda: red.reduce(bad))
    if rank == 1 and kind == "state":
        red.memory.residuals["w"] = before["w"].clone()  # repaired by the user
    unchanged = all(torch.equal(red.memory.residuals[n], before[n]) for n in before)
    second = _outcome(lambda: red.reduce(grads))
    return {"first": first, "unchanged": unchanged, "second": second, "step": red.step}


def every_kind(rank, world, kinds):
    return [one_rank_fails_locally(rank, world, k) for k in kinds]
