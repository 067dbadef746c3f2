"""``GradientReducer.joint_check`` in one process: run exactly once per
call whatever path the call takes (``dense_below`` splits, the dense path,
the general path), and what it reports decides the call as a local
verdict would: an invalid input raises, a non-finite name raises or skips
with the residual untouched."""
import pytest
import torch

import gtopk_plugin as gp
from gtopk_plugin.pipeline.input_check import NonFiniteGradientError, NonFiniteStateError, PeerInputError

SIZES = {"w": 600, "b": 20, "g": 7}


class Joint:
    """A stand-in for the ranks outside the transport: records each call
    and reports what it is told to."""

    def __init__(self, bad=None, names=()):
        self.calls, self.bad, self.names = [], bad, list(names)

    def __call__(self, bad, nonfinite):
        self.calls.append((bad, list(nonfinite)))
        return bad or self.bad, list(nonfinite) + self.names


def _grads(names, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(SIZES[n], generator=g) for n in names}


CASES = [  # (reducer keywords, gradient names)
    (dict(method="gtopk"), ["w", "b", "g"]),
    (dict(method="gtopk", dense_below=21), ["w", "b", "g"]),  # split: the method's check is the one
    (dict(method="gtopk", dense_below=21), ["b", "g"]),       # only small tensors: the dense reducer's
    (dict(method="gtopk", dense_below=21), ["w"]),
    (dict(method="dense"), ["w", "b"]),
    (dict(method="topk", clip_norm=1.0), ["w", "b"]),          # the general path
    (dict(method="gtopk", momentum_correction=0.9, dense_below=21), ["b", "g"]),
    (dict(method="gtopk", momentum_correction=0.9, dense_below=21), ["w", "b", "g"]),
    (dict(method="qsgd"), ["w", "b"]),
]


@pytest.mark.parametrize("kw,names", CASES)
def test_called_once_per_call_with_the_local_verdict(kw, names):
    red = gp.GradientReducer(transport=gp.SingleProcessTransport(), density=0.05, **kw)
    red.joint_check = joint = Joint()
    grads = _grads(names)
    grads[names[0]][3] = float("nan")
    with pytest.raises(NonFiniteGradientError):
        red.reduce(grads)
    assert len(joint.calls) == 1 and joint.calls[0][0] is None and names[0] in joint.calls[0][1]
    red.reduce(_grads(names, 1))
    # the general path (clipping, momentum) agrees once more, on the accumulator
    general = "clip_norm" in kw or "momentum_correction" in kw
    assert joint.calls[1:] == [(None, [])] * (2 if general else 1)
    assert red.joint_agreements == (2 if general else 1)  # what a rank with no entries mirrors


def test_mixed_dtypes_take_the_general_path_without_another_joint_check():
    """Mixed dtypes send one rank's call down the general path while its
    peers' (holding other tensors) may take the fast one: the overflow
    agreement then stays on the transport, so the count of joint checks
    does not depend on one rank's gradients."""
    red = gp.GradientReducer(transport=gp.SingleProcessTransport(), method="gtopk", density=0.05)
    red.joint_check = joint = Joint()
    grads = _grads(["w", "b"])
    grads["b"] = grads["b"].to(torch.bfloat16)
    red.reduce(grads)
    assert len(joint.calls) == 1 and red.joint_agreements == 1


@pytest.mark.parametrize("kw,names", CASES)
def test_a_peer_nonfinite_skips_the_step_here(kw, names):
    red = gp.GradientReducer(transport=gp.SingleProcessTransport(), density=0.05, nonfinite="skip", **kw)
    grads = _grads(names)
    red.reduce(grads)  # a residual to keep
    before = {n: r.clone() for n, r in red.state_dict()["residuals"].items()}
    red.joint_check = Joint(names=["x (on global rank 3)"])
    out = red.reduce(_grads(names, 1))
    assert red.last_stats.skipped and red.step == 2
    assert all(bool((u == 0).all()) for u in out.values()) and sorted(out) == sorted(names)
    after = red.state_dict()["residuals"]
    assert sorted(after) == sorted(before) and all(torch.equal(before[n], after[n]) for n in before)
    raising = gp.GradientReducer(transport=gp.SingleProcessTransport(), density=0.05, **kw)
    raising.joint_check = Joint(names=["x (on global rank 3)"])
    with pytest.raises(NonFiniteGradientError, match=r"x \(on global rank 3\)"):
        raising.reduce(_grads(names, 2))
    assert raising.step == 0


def test_a_peer_bad_input_raises_here():
    red = gp.GradientReducer(transport=gp.SingleProcessTransport(), method="gtopk", density=0.05)
    red.joint_check = Joint(bad="global rank 2 (another shard of this replica): gradient 'w' is not a tensor")
    with pytest.raises(PeerInputError, match="another rank passed invalid input.*global rank 2"):
        red.reduce(_grads(["w"]))
    assert red.step == 0


def test_a_peer_overflow_raises_here_on_the_general_path():
    """Finite gradients everywhere, but a peer's accumulator overflowed:
    NonFiniteStateError here too, naming it."""
    red = gp.GradientReducer(transport=gp.SingleProcessTransport(), method="gtopk", density=0.05,
                             momentum_correction=0.9)

    def joint(bad, names):
        return bad, list(names) + (["w (on global rank 1)"] if len(joint.calls) > 1 else [])
    joint.calls = []
    red.joint_check = lambda bad, names: (joint.calls.append(1), joint(bad, names))[1]
    with pytest.raises(NonFiniteStateError, match=r"w \(on global rank 1\)"):
        red.reduce(_grads(["w"]))
    assert len(joint.calls) == 2


def test_an_optimizer_binding_joins_the_overflow_check():
    """momentum_correction=True reads the SGD optimizer (a binding, no
    momentum in the settings): every call takes the general path, so its
    overflow agreement joins too."""
    params = {n: torch.nn.Parameter(torch.zeros(s)) for n, s in SIZES.items() if n != "g"}
    opt = torch.optim.SGD(params.values(), lr=0.1, momentum=0.9)
    red = gp.GradientReducer(transport=gp.SingleProcessTransport(), method="gtopk", density=0.05,
                             momentum_correction=True, optimizer=opt, named_parameters=list(params.items()))
    assert red.binding is not None and red.joint_agreements == 2
    red.joint_check = joint = Joint()
    red.reduce(_grads(["w", "b"]))
    assert joint.calls == [(None, [])] * 2
