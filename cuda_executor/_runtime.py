"""ctypes binding of the runtime library, and readable reports."""
from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from cuda_executor import _build

KINDS = {
    1: "race (read after an unordered write)",
    2: "race (write after an unordered write)",
    3: "race (write after an unordered read)",
    4: "uninitialized shared memory read",
    5: "out-of-bounds global access",
    6: "shared memory access in a redzone",
    7: "misaligned access",
    8: "divergent __syncthreads (threads exited)",
    9: "divergent __syncthreads (different barriers)",
    10: "warp collective mask without the calling lane",
    11: "warp collectives do not match",
    12: "shuffle from a lane outside the mask",
    13: "deadlock",
    14: "timeout",
}
RACES = (1, 2, 3)


class Report(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int32), ("space", ctypes.c_int32), ("addr", ctypes.c_uint64),
                ("size", ctypes.c_uint32), ("block", ctypes.c_uint32), ("tid", ctypes.c_uint32),
                ("pc", ctypes.c_uint32), ("pblock", ctypes.c_uint32), ("ptid", ctypes.c_uint32),
                ("ppc", ctypes.c_uint32), ("pkind", ctypes.c_uint32), ("count", ctypes.c_uint32),
                ("text", ctypes.c_char * 160)]


class Entry(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("fn", ctypes.c_void_p), ("invoke", ctypes.c_void_p),
                ("nparams", ctypes.c_uint), ("sizes", ctypes.POINTER(ctypes.c_uint)),
                ("kinds", ctypes.c_char_p)]


class ModuleInfo(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint), ("nkernels", ctypes.c_uint),
                ("kernels", ctypes.POINTER(Entry))]


_lib: Optional[ctypes.CDLL] = None


def lib() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        L = ctypes.CDLL(str(_build.runtime_library()), mode=ctypes.RTLD_GLOBAL)
        u64, c_int, vp = ctypes.c_uint64, ctypes.c_int, ctypes.c_void_p
        L.cuda_exec_region_add.argtypes = [u64, u64, u64, u64]
        L.cuda_exec_is_registered.argtypes = [u64]
        L.cuda_exec_launch.argtypes = [vp, ctypes.c_uint, ctypes.POINTER(ctypes.c_uint),
                                       ctypes.POINTER(ctypes.c_uint), ctypes.c_ulonglong, vp,
                                       c_int, ctypes.c_ulonglong, c_int, ctypes.c_double]
        L.cuda_exec_report_get.argtypes = [c_int, ctypes.POINTER(Report)]
        L.cuda_exec_report_total.restype = ctypes.c_uint
        assert L.cuda_exec_report_size() == ctypes.sizeof(Report), "Report layout mismatch"
        _lib = L
    return _lib


def fetch_reports() -> List[Report]:
    L = lib()
    out = []
    for i in range(L.cuda_exec_report_count()):
        r = Report()
        L.cuda_exec_report_get(i, ctypes.byref(r))
        out.append(r)
    return out


class SourceMap:
    """Source lines of a module's code offsets (addr2line on its -g1 line table)."""

    def __init__(self, so: Path, code: str):
        self.so = so
        self.lines = code.splitlines()
        self._cache: Dict[int, Tuple[int, str]] = {}

    def resolve(self, pcs) -> None:
        todo = sorted({p for p in pcs if p and p not in self._cache})
        if not todo:
            return
        try:
            r = subprocess.run(["addr2line", "-e", str(self.so)] + [hex(p - 1) for p in todo],
                               capture_output=True, text=True, timeout=60)
            outs = r.stdout.splitlines()
        except (OSError, subprocess.SubprocessError):
            outs = []
        for p, line in zip(todo, outs + [""] * len(todo)):
            n = 0
            if ".cu:" in line:
                try:
                    n = int(line.rsplit(":", 1)[1].split()[0])
                except ValueError:
                    n = 0
            text = self.lines[n - 1].strip() if 0 < n <= len(self.lines) else ""
            self._cache[p] = (n, text)

    def where(self, pc: int) -> str:
        n, text = self._cache.get(pc, (0, ""))
        return f"line {n}: {text[:110]}" if n else f"+{pc:#x}"


def describe(r: Report, kernel: str, srcmap: SourceMap) -> str:
    head = f"{KINDS.get(r.kind, r.kind)} in {kernel}"
    if r.size:
        head += f", {'shared' if r.space else 'global'} {r.size} bytes at {r.addr:#x}"
    s = [f"{head} (x{r.count})" if r.count > 1 else head,
         f"    block {r.block} thread {r.tid} at {srcmap.where(r.pc)}"]
    if r.kind in RACES or r.ppc:
        what = "atomic" if r.pkind & 4 else ("write" if r.pkind & 2 else "read")
        s.append(f"    earlier {what} by block {r.pblock} thread {r.ptid} at {srcmap.where(r.ppc)}")
    text = r.text.decode(errors="replace")
    if text:
        s.append(f"    {text}")
    return "\n".join(s)
