"""What a multi-rank run with accelerator gradients relies on, checked on
a CPU-only machine with stand-ins: ``TorchDistributedTransport`` hands the
engine tensors where the backend takes them (gloo: CPU only; NCCL alone:
the rank's accelerator only; a ``"cpu:gloo,cuda:nccl"`` pair: either),
pairs a send with a receive in one batch on NCCL (apart, both ranks of a
pair block), and the reference kernels index accelerator tensors with the
layout's CPU offsets.  Stand-ins: the ``meta`` device for an accelerator
(tensors move there without data), recorded ``torch.distributed`` calls,
and fake CUDA tensors (FakeTensorMode checks devices without a GPU)."""
import types

import pytest
import torch
import torch.distributed as dist

from gtopk_plugin.collectives.torch_distributed import TorchDistributedTransport
from gtopk_plugin.collectives.transport import UseGuard
from gtopk_plugin.kernels import reference
from gtopk_plugin.pipeline import input_check

ACC = torch.device("meta", 0)  # the stand-in accelerator


class Work:
    def wait(self, timeout=None):
        return True


class Engine(TorchDistributedTransport):
    """The transport's own code over recorded ``torch.distributed`` calls, 2 ranks."""

    def __init__(self, backend, group=None):
        super().__init__()
        self._backend = backend
        self.group = group
        self._guard = UseGuard("test engine")

    backend = property(lambda self: self._backend)
    rank = property(lambda self: 0)
    size = property(lambda self: 2)

    def _use_guard(self):
        return self._guard

    def _global(self, peer):
        return peer


@pytest.fixture
def seen(monkeypatch):
    """Every torch.distributed call the transport makes: (what, device type)."""
    calls = []

    def op(name):
        def record(t, *a, **k):
            calls.append((name, t.device.type))
            return Work()
        record.__name__ = name
        return record

    monkeypatch.setattr(dist, "irecv", op("irecv"))
    monkeypatch.setattr(dist, "isend", op("isend"))
    monkeypatch.setattr(dist, "all_reduce", op("all_reduce"))

    def batch(ops):
        calls.append(("batch", [(o.op.__name__, o.tensor.device.type) for o in ops]))
        return [Work()]
    monkeypatch.setattr(dist, "batch_isend_irecv", batch)
    monkeypatch.setattr(dist, "P2POp", lambda op, tensor, peer, group=None: types.SimpleNamespace(
        op=op, tensor=tensor, peer=peer))
    return calls


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


def test_cpu_vectors_go_to_the_ranks_own_device(accelerator):
    """Not the current device (cuda:0 on a rank that never called
    set_device): the device of the tensors the group carried, else the
    group's bound device."""
    eng = Engine("nccl")
    eng.comm_device(torch.device("meta", 3))
    assert eng.comm_device(torch.device("cpu")) == torch.device("meta", 3)
    bound = Engine("nccl", group=types.SimpleNamespace(bound_device_id=torch.device("meta", 2)))
    assert bound.comm_device(torch.device("cpu")) == torch.device("meta", 2)


def test_without_an_accelerator_cpu_stays(monkeypatch):
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: None)
    assert Engine("nccl").comm_device(torch.device("cpu")) == torch.device("cpu")


def test_nccl_alone_gets_the_check_on_the_accelerator(accelerator, seen):
    eng = Engine("nccl")
    # (copying the result back out of the stand-in's meta tensors is the only failure)
    with pytest.raises(NotImplementedError, match="meta"):
        eng.control_allreduce_max(torch.tensor([1, 2], dtype=torch.int64))
    assert seen and all(dev == ACC.type for _, ops in seen for _, dev in ops)
    seen.clear()
    with pytest.raises(NotImplementedError, match="meta"):
        eng.allreduce_sum_(torch.zeros(1, dtype=torch.float64))
    assert seen == [("all_reduce", ACC.type)]


def test_the_check_travels_on_the_gradients_device(seen):
    """input_check builds its vector where the gradients are: on an NCCL
    group the engine gets it there, whatever the current device."""
    eng = Engine("nccl")
    eng.max_by_dissemination = False
    with pytest.raises(NotImplementedError, match="meta"):
        input_check.check_flagged(eng, [("w", (3,), "float32")], None, [], device=ACC)
    assert seen == [("all_reduce", ACC.type)]


def test_an_accelerator_exchange_is_one_batch(seen):
    eng = Engine("nccl")
    eng._raw_sendrecv(1, torch.ones(4, device=ACC), 1, torch.empty(4, device=ACC))
    assert seen == [("batch", [("irecv", ACC.type), ("isend", ACC.type)])]
    seen.clear()
    gloo = Engine("gloo")  # CPU tensors: gloo's separate calls, as before
    gloo._raw_sendrecv(1, torch.ones(4), 1, torch.empty(4))
    assert seen == [("irecv", "cpu"), ("isend", "cpu")]


def test_reference_segments_of_accelerator_indices():
    """The layout's offsets live on the CPU; the merge's indices on the
    gradients' device (the reference merge is the fallback without CuPy)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    with FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv()):
        idx = torch.tensor([1, 7], device="cuda")
        seg = reference.segment_of(idx, torch.tensor([0, 5, 10]))
        assert seg.device.type == "cuda"


class Node:
    """A node group's transport stand-in: records each phase's device."""

    def __init__(self, rank, size=2):
        self.rank, self.size, self.phases = rank, size, []

    def phase(self, send_to, blob, recv_from, nbytes, device, headers):
        self.phases.append((send_to, None if blob is None else blob.device.type, recv_from,
                            torch.device(device).type))
        return None if recv_from is None else torch.zeros(3, device=device)


def test_node_broadcast_sends_and_receives_on_the_gradients_device():
    """A "cpu:gloo,cuda:nccl" node group picks the engine by device: the
    leader's blob and every receive must be on the same one."""
    from gtopk_plugin.two_level.topology import node_broadcast

    leader, other = Node(0), Node(1)
    node_broadcast(leader, torch.ones(3), ACC)  # a CPU status blob from the leader
    node_broadcast(other, None, ACC)
    assert leader.phases == [(1, ACC.type, None, ACC.type)]
    assert other.phases == [(None, None, 0, ACC.type)]


def test_the_elastic_worker_runs_on_the_gradients_device():
    """Its CommWorker is made for the gradients' device (on CUDA: the
    device's context and a side stream ordered after the submitting one)."""
    import gtopk_plugin as gp
    from gtopk_plugin.elastic.threaded import ThreadedReduction

    red = gp.GradientReducer(method="gtopk", transport=gp.SingleProcessTransport())
    back = ThreadedReduction(red)
    back.setup([], 2)
    fut = back.launch(0, 0, ["w"], [torch.ones(4, device=ACC)], True)
    try:
        fut.wait()
    except Exception:  # noqa: BLE001 - the meta gradients cannot be reduced; only the worker's device counts
        pass
    assert red.worker().device is not None and red.worker().device.type == ACC.type
    back.close()
