"""DDP communication hook in steady state: how many tensors of at
least half the model's gradient size a training step allocates, counted on a
real gloo group (P = 2) after warm-up.

Counted with a ``TorchDispatchMode`` that sees every aten op of the step (the
forward, DDP's C++ reducer, the hook, the optimizer): an op's output counts
as an allocation when it has >= N/2 elements and shares storage with none of
the op's inputs (views, in-place and ``out=`` ops reuse an input's storage).
The model's layers are each smaller than N/2, so only bucket-sized and
model-sized tensors count.
"""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import gtopk_plugin as gp
from dist_utils import run_workers

WARMUP = 3
MEASURED = 3
# Model-sized allocations per step outside the hook (docs/ddp.md, "Memory"):
# none -- DDP reduces into its persistent bucket buffers and copies into
# .grad in place; SGD without momentum updates in place.
STEP_ALLOWED = 0


class BigAllocs(TorchDispatchMode):
    """Counts fresh tensors of at least ``threshold`` elements per op name."""

    def __init__(self, threshold):
        super().__init__()
        self.threshold = threshold
        self.hits = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        ins = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
               if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if (isinstance(t, torch.Tensor) and t.numel() >= self.threshold
                    and t.untyped_storage().data_ptr() not in ins):
                self.hits.append(str(func))
        return out


def _model(width=256, depth=6):
    """depth Linear(width, width) layers: every layer < N/2."""
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers)


def _alloc_worker(rank, world, kwargs, bucket_cap_mb):
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    model = _model()
    N = sum(p.numel() for p in model.parameters())
    ddp = DDP(model, bucket_cap_mb=bucket_cap_mb)
    state = None
    if kwargs is not None:
        state = gp.torch_ddp.SparseState(named_parameters=model.named_parameters(), **kwargs)
    mode = BigAllocs(N // 2)
    in_hook, sizes = [], {}

    def hook(st, bucket):
        # inside the hook: count tensors of half the smallest bucket or more
        sizes[bucket.index()] = bucket.buffer().numel()
        before, mode.threshold = len(mode.hits), min(sizes.values()) // 2
        try:
            fut = gp.torch_ddp.sparse_hook(st, bucket)
        finally:
            mode.threshold = N // 2
        in_hook.extend(mode.hits[before:])
        return fut

    if state is not None:
        ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    step_hits, hook_hits = [], []
    for step in range(WARMUP + MEASURED):
        x = torch.randn(32, 256, generator=g)
        measure = step >= WARMUP
        if step == 1:
            sizes.clear()  # DDP rebuilds its buckets after the first step
        del mode.hits[:], in_hook[:]
        if measure:
            with mode:
                opt.zero_grad(set_to_none=False)
                ddp(x).pow(2).mean().backward()
                opt.step()
            step_hits.append(list(mode.hits))
            hook_hits.append(list(in_hook))
        else:
            opt.zero_grad(set_to_none=False)
            ddp(x).pow(2).mean().backward()
            opt.step()
    return {"N": N, "step": step_hits, "hook": hook_hits, "bucket_sizes": sorted(sizes.values())}


def _many(rank, world, cases):
    return [_alloc_worker(rank, world, kw, cap) for kw, cap in cases]


# (SparseState kwargs or None for DDP's allreduce, bucket_cap_mb) -> bucket-sized
# allocations per bucket per step, in the hook.  gTop-k: none.  Top-k (sparse
# allgather) and dense: one, the aggregation's own summed vector (collectives/,
# divided in place and copied into the bucket; see docs/ddp.md "Memory").
CASES = [
    (None, 25.0, 0),
    ({"method": "gtopk", "density": 0.01}, 25.0, 0),   # one bucket of N
    ({"method": "gtopk", "density": 0.01}, 0.3, 0),    # three buckets
    ({"method": "gtopk", "density": 0.01, "clip_norm": 1.0}, 0.3, 0),
    ({"method": "topk", "density": 0.01}, 0.3, 1),
    ({"method": "dense"}, 0.3, 1),
]


@pytest.fixture(scope="module")
def reports():
    return run_workers(2, _many, [(kw, cap) for kw, cap, _ in CASES], timeout=300)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_steady_state_allocations_per_step(reports, case):
    """After warm-up (DDP's bucket rebuild included), per step: at most
    ``per_bucket`` bucket-sized allocations per bucket in the hook; in the
    whole step (forward, DDP, hook, SGD) no model-sized one beyond those."""
    kw, cap, per_bucket = CASES[case]
    for rank_reports in reports:
        rep = rank_reports[case]
        nb = max(1, len(rep["bucket_sizes"]))
        for hook, step in zip(rep["hook"], rep["step"]):
            assert len(hook) <= per_bucket * nb, (kw, cap, hook)
            big = [h for h in step if h not in hook] if per_bucket else step
            assert len(big) <= STEP_ALLOWED, (kw, cap, step)
        assert len(rep["hook"]) == MEASURED


class _CountingScaler:
    """A GradScaler stand-in: a fixed scale, counting get_scale() calls."""

    def __init__(self):
        self.calls = 0

    def get_scale(self):
        self.calls += 1
        return 1024.0


def _scale_worker(rank, world, steps):
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    model = _model()
    ddp = DDP(model, bucket_cap_mb=0.3)
    scaler = _CountingScaler()
    state = gp.torch_ddp.SparseState(method="gtopk", density=0.01, grad_scaler=scaler,
                                     named_parameters=model.named_parameters())
    buckets = []

    def hook(st, bucket):
        buckets.append(bucket.index())
        return gp.torch_ddp.sparse_hook(st, bucket)

    ddp.register_comm_hook(state, hook)
    g = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        ddp(torch.randn(8, 256, generator=g)).pow(2).mean().backward()
    return {"calls": scaler.calls, "hooks": len(buckets), "step": state.step}


def test_grad_scaler_scale_read_once_per_step():
    """GradScaler.get_scale() (a device sync on CUDA) once per step, not per
    bucket: the scale only changes in scaler.update(), after the step."""
    for rep in run_workers(2, _scale_worker, 4, timeout=120):
        assert rep["step"] == 4 and rep["hooks"] > 4, rep
        assert rep["calls"] == 4, rep
