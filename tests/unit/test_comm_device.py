"""Where ``TorchDistributedTransport`` hands tensors to the engine: gloo
takes CPU tensors only, NCCL alone (``"nccl"``) accelerator tensors only,
a ``"cpu:gloo,cuda:nccl"`` pair either.  The reducer's check, the
overflow agreement and the error path build small CPU vectors: on an
NCCL-only group they must reach the engine on the accelerator (the
engine's own rule, checked here with a stand-in accelerator device)."""
import pytest
import torch

from gtopk_plugin.collectives.torch_distributed import TorchDistributedTransport
from gtopk_plugin.collectives.transport import UseGuard

ACC = torch.device("meta", 0)  # a stand-in accelerator: tensors move there on a CPU-only build


class Engine(TorchDistributedTransport):
    """The transport's device logic over a recording engine of 2 ranks."""

    def __init__(self, backend):
        self.group, self.timeout, self._guard_of = None, 5.0, None
        super(TorchDistributedTransport, self).__init__()
        self._backend, self.seen = backend, []
        self._guard = UseGuard("test engine")

    backend = property(lambda self: self._backend)
    rank = property(lambda self: 0)
    size = property(lambda self: 2)

    def _use_guard(self):
        return self._guard

    def _raw_allreduce_max_(self, t):
        self.seen.append(("max", t.device.type))

    def _raw_sendrecv(self, dst, send, src, recv):  # the check's dissemination rounds
        self.seen.append(("max", send.device.type))
        assert recv.device == send.device
        recv.copy_(send)

    def _raw_allreduce_sum_(self, t):
        self.seen.append(("sum", t.device.type))


@pytest.fixture
def accelerator(monkeypatch):
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: torch.device(ACC.type))
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda *a, **k: ACC.index)


@pytest.mark.parametrize("backend,given,want", [
    ("gloo", "cpu", "cpu"), ("gloo", ACC, "cpu"),
    ("nccl", "cpu", ACC), ("nccl", ACC, ACC),
    ("cpu:gloo,cuda:nccl", "cpu", "cpu"), ("cpu:gloo,cuda:nccl", ACC, ACC),
    ("mpi", "cpu", "cpu"),
])
def test_comm_device(accelerator, backend, given, want):
    assert Engine(backend).comm_device(torch.device(given)) == torch.device(want)


def test_nccl_alone_gets_the_check_on_the_accelerator(accelerator):
    eng = Engine("nccl")
    # (the result's copy back out of the stand-in's meta tensors is the only failure)
    with pytest.raises(NotImplementedError, match="meta"):
        eng.control_allreduce_max(torch.tensor([1, 2], dtype=torch.int64))
    assert eng.seen == [("max", ACC.type)]
    with pytest.raises(NotImplementedError, match="meta"):
        eng.allreduce_sum_(torch.zeros(1, dtype=torch.float64))
    assert eng.seen[-1] == ("sum", ACC.type)


def test_without_an_accelerator_cpu_stays(monkeypatch):
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: None)
    assert Engine("nccl").comm_device(torch.device("cpu")) == torch.device("cpu")
