"""Persistent CPU buffers backed by transparent huge pages.

The reducer's long-lived N-sized buffers (residual, scratch accumulator,
update and momentum buffers) are read in full every step and written at k
scattered positions; with 2 MB pages each scattered write avoids most TLB
misses.  The buffer is allocated empty, its 2 MB-aligned interior advised
with ``madvise(MADV_HUGEPAGE)`` before the pages are first touched, then
filled (pages the process touched before stay on 4 KB pages).  The advice
is a hint: where the kernel refuses it (another OS, THP ``never``, no
``libc``) the buffer is an ordinary one.  ``GTOPK_HUGE_PAGES=0`` turns it
off (docs/design.md §9, "Persistent buffers").
"""
from __future__ import annotations

import ctypes
import ctypes.util
import sys
from typing import List, Optional

import torch

from gtopk_plugin import config

_HUGE = 2 * 1024 * 1024
#: Buffers smaller than this are left alone (the interior would be at most a
#: page or two, and small tensors come from glibc's heap, already touched).
MIN_BYTES = 4 * _HUGE
_MADV_HUGEPAGE = 14  # linux/mman.h

_madvise = None  # resolved on first use; False where unavailable


def _libc_madvise():
    global _madvise
    if _madvise is None:
        _madvise = False
        if sys.platform.startswith("linux"):
            try:
                libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
                fn = libc.madvise
                fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
                fn.restype = ctypes.c_int
                _madvise = fn
            except (OSError, AttributeError):
                _madvise = False
    return _madvise


def _wanted(numel: int, dtype: torch.dtype, device) -> bool:
    """Whether a buffer of this size and place gets the advice at all.
    Decided before allocating, so that every other buffer is made exactly
    as before (``torch.zeros`` stays one op for allocation counters)."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    return (dev.type == "cpu" and numel * dtype.itemsize >= MIN_BYTES
            and config.env_huge_pages() and bool(_libc_madvise()))


def interior(t: torch.Tensor):
    """(lo, hi): the 2 MB-aligned addresses inside ``t``'s memory, the part
    the advice covers (empty when hi <= lo)."""
    start, nbytes = t.data_ptr(), t.numel() * t.element_size()
    return (start + _HUGE - 1) // _HUGE * _HUGE, (start + nbytes) // _HUGE * _HUGE


def _advise_interior(t: torch.Tensor) -> bool:
    """madvise the 2 MB-aligned interior of ``t``'s memory (checks done)."""
    lo, hi = interior(t)
    return hi > lo and _libc_madvise()(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_HUGEPAGE) == 0


def advise(t: torch.Tensor) -> bool:
    """Ask for huge pages under the 2 MB-aligned interior of ``t``'s memory
    (a CPU tensor of at least :data:`MIN_BYTES`).  True when the kernel
    accepted the advice (it still decides at each fault); False when the
    tensor is too small, not on the CPU, turned off or refused."""
    return _wanted(t.numel(), t.dtype, t.device) and _advise_interior(t)


def empty(numel: int, dtype: torch.dtype, device=None) -> torch.Tensor:
    """``torch.empty(numel)``, advised before anything touches it.  Its
    pages are faulted in by whoever writes it first."""
    t = torch.empty(numel, dtype=dtype, device=device)
    advise(t)
    return t


def zeros(numel: int, dtype: torch.dtype, device=None) -> torch.Tensor:
    """``torch.zeros(numel)`` whose zeros are written after the advice."""
    if not _wanted(numel, dtype, device):
        return torch.zeros(numel, dtype=dtype, device=device)
    t = torch.empty(numel, dtype=dtype, device=device)
    _advise_interior(t)
    return t.zero_()


def empty_like(ref: torch.Tensor) -> torch.Tensor:
    """:func:`empty` with ``ref``'s numel, dtype and device (1-D)."""
    return empty(ref.numel(), ref.dtype, ref.device)


def smaps_field(lo: int, hi: int, key: str) -> List[List[str]]:
    """The values of field ``key`` (e.g. ``"AnonHugePages:"``, ``"VmFlags:"``)
    of every mapping in /proc/self/smaps that overlaps addresses [lo, hi),
    split into words; [] where unreadable.  The kernel's own account."""
    out, inside = [], False
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(None, 1)[0]
                if "-" in head and not head.endswith(":"):
                    a, b = (int(x, 16) for x in head.split("-"))
                    inside = a < hi and lo < b
                elif inside and head == key:
                    out.append(line.split()[1:])
    except OSError:
        return []
    return out


def huge_kb(t: Optional[torch.Tensor] = None) -> int:
    """KB of this process's memory on huge pages (``AnonHugePages`` summed
    over /proc/self/smaps; 0 where unreadable).  With ``t``, only over the
    mappings that overlap ``t``'s memory.  For tests and benchmarks."""
    lo, hi = (0, 1 << 64) if t is None else (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
    return sum(int(v[0]) for v in smaps_field(lo, hi, "AnonHugePages:"))
