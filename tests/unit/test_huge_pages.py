"""gtopk_plugin.pipeline.huge_pages: persistent buffers advised onto transparent huge
pages.  Whether the kernel took the advice and backed them is read from
/proc/self/smaps (the kernel's own account, independent of the module's
advice call): ``VmFlags`` ``hg`` marks advised memory, ``AnonHugePages``
counts what is backed.

Backing is checked in a fresh interpreter: in a long test session glibc may
serve even a 40 MB buffer from memory an earlier test touched (a clean-clone
CI run saw 6 of 40 MB backed, with no fallback counted by the kernel), and
touched pages stay on 4 KB pages whatever the advice."""
import json
import os
import subprocess
import sys

import pytest
import torch

from gtopk_plugin.pipeline import huge_pages

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


def _vm_flags(t):
    """VmFlags of every mapping that overlaps ``t``'s 2 MB-aligned interior."""
    return huge_pages.smaps_field(*huge_pages.interior(t), "VmFlags:")


def _fresh(code):
    """Run ``code`` in a new interpreter (clean allocator state); its last
    stdout line, parsed as JSON."""
    env = {k: v for k, v in os.environ.items() if k != "GTOPK_HUGE_PAGES"}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@needs_madvise
def test_the_kernel_records_the_advice_on_the_whole_interior():
    z = huge_pages.zeros(N, torch.float32)
    flags = _vm_flags(z)
    # every mapping under the interior is advised (that a plain tensor's is
    # not is checked in a fresh interpreter below: here it may reuse memory
    # an earlier test advised)
    assert flags and all("hg" in f for f in flags)


@needs_madvise
def test_advised_buffer_is_backed_by_huge_pages():
    kb = _fresh(f"""
import json, torch
from gtopk_plugin.pipeline import huge_pages
z = huge_pages.zeros({N}, torch.float32)
print(json.dumps(huge_pages.huge_kb(z)))
""")
    # at least all but the unaligned ends: N * 4 bytes less 2 MB per end
    assert kb >= (N * 4 - 4 * 1024 * 1024) // 1024


@pytest.mark.skipif(_thp_mode() != "madvise", reason="needs THP in madvise mode")
def test_off_switch_and_plain_tensors():
    plain, off = _fresh(f"""
import json, os, torch
from gtopk_plugin.pipeline import huge_pages
plain = huge_pages.huge_kb(torch.zeros({N}))        # unadvised memory: 4 KB pages
os.environ["GTOPK_HUGE_PAGES"] = "0"
off = huge_pages.huge_kb(huge_pages.zeros({N}, torch.float32))
print(json.dumps([plain, off]))
""")
    assert plain == 0 and off == 0


@needs_madvise
@pytest.mark.parametrize("method", ["gtopk", "dense"])
def test_reducer_persistent_buffers_use_huge_pages(method):
    update_kb, residual_kb = _fresh(f"""
import json, torch
import gtopk_plugin as gp
from gtopk_plugin.pipeline import huge_pages
from gtopk_plugin.collectives.transport import SingleProcessTransport
g = torch.Generator().manual_seed(0)
grads = {{"a": torch.randn({N // 2}, generator=g), "b": torch.randn({N // 2}, generator=g)}}
red = gp.GradientReducer(method={method!r}, density=0.01, transport=SingleProcessTransport())
for _ in range(2):
    out = red.reduce(grads)
res = red.memory.residuals.get("a") if {method!r} == "gtopk" else None
# the update returned is a view into the persistent update ring
print(json.dumps([huge_pages.huge_kb(out["a"]), None if res is None else huge_pages.huge_kb(res)]))
""")
    assert update_kb > 0
    if method == "gtopk":
        assert residual_kb > 0


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
