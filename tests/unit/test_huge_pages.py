"""gtopk_plugin.huge_pages: persistent buffers advised onto transparent huge
pages.  Whether the kernel backed them is read from /proc/self/smaps (the
kernel's own account, independent of the module's advice call)."""
import os

import pytest
import torch

import gtopk_plugin as gp
from gtopk_plugin import huge_pages
from gtopk_plugin.collectives.transport import SingleProcessTransport

THP = "/sys/kernel/mm/transparent_hugepage/enabled"


def _thp_mode():
    try:
        with open(THP) as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return None


needs_madvise = pytest.mark.skipif(_thp_mode() not in ("madvise", "always"),
                                   reason="transparent huge pages unavailable on this kernel")
# 40 MB of float32: above glibc's largest mmap threshold (32 MB), so always a
# fresh mapping; a smaller buffer may reuse heap pages an earlier test
# touched, which stay on 4 KB pages (the advice only shapes new faults)
N = 10 * 1024 * 1024


def test_zeros_and_empty_like_are_ordinary_tensors():
    z = huge_pages.zeros(N, torch.float32)
    assert z.shape == (N,) and z.dtype == torch.float32 and not z.any()
    e = huge_pages.empty_like(torch.ones(3, dtype=torch.float64))
    assert e.shape == (3,) and e.dtype == torch.float64
    assert not huge_pages.advise(torch.zeros(10))  # small: left alone


@needs_madvise
def test_advised_buffer_is_backed_by_huge_pages():
    z = huge_pages.zeros(N, torch.float32)
    # at least all but the unaligned ends: N * 4 bytes less 2 MB per end
    assert huge_pages.huge_kb(z) >= (N * 4 - 4 * 1024 * 1024) // 1024


@pytest.mark.skipif(_thp_mode() != "madvise", reason="needs THP in madvise mode")
def test_off_switch_and_plain_tensors(monkeypatch):
    # 40 MB: above glibc's largest mmap threshold (32 MB), so always a fresh
    # mapping, never heap memory an earlier buffer's advice may have covered
    big = 10 * 1024 * 1024
    assert huge_pages.huge_kb(torch.zeros(big)) == 0  # unadvised memory: 4 KB pages
    monkeypatch.setenv("GTOPK_HUGE_PAGES", "0")
    assert huge_pages.huge_kb(huge_pages.zeros(big, torch.float32)) == 0


@needs_madvise
@pytest.mark.parametrize("method", ["gtopk", "dense"])
def test_reducer_persistent_buffers_use_huge_pages(method):
    g = torch.Generator().manual_seed(0)
    grads = {"a": torch.randn(N // 2, generator=g), "b": torch.randn(N // 2, generator=g)}
    red = gp.GradientReducer(method=method, density=0.01, transport=SingleProcessTransport())
    for _ in range(2):
        out = red.reduce(grads)
    # the update returned is a view into the persistent update ring
    assert huge_pages.huge_kb(out["a"]) > 0
    if method == "gtopk":
        res = red.memory.residuals["a"]
        assert huge_pages.huge_kb(res) > 0


def test_small_buffers_are_made_exactly_as_before():
    # below MIN_BYTES nothing changes: torch.zeros stays a single aten.zeros
    # op (allocation counters such as tests/distributed/test_elastic_alloc.py
    # recognise the update ring's growth by it)
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    with Ops() as m:
        z = huge_pages.zeros(1000, torch.float32)
    assert m.ops == ["aten.zeros.default"] and not z.any()
