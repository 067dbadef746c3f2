"""A CUDA-semantics executor for the CPU: runs the kernels of csrc/cuda
without a GPU, with the checks of a GPU sanitizer.  A test-time tool of
this repository (not shipped in the wheel).

    ex = Executor(schedule="rotate")
    mod = ex.cupy.RawModule(code=source, options=("--std=c++14",))
    k = mod.get_function("kernel")
    k((blocks,), (threads,), (ex.ptr(tensor), np.int64(n)), shared_mem=0)

The source is compiled by the host g++ against include/cuda_executor.h
(cached by hash, see _build.py); a launch runs its blocks one after another
in the schedule's order, the threads of a block as fibers (forward,
reverse, or a seeded random order with preemption at memory accesses;
"rotate" cycles through the three, launch after launch).  Pointer
arguments must be CPU tensors registered with :meth:`Executor.ptr`: their
extents are the bounds of global memory.  After a launch, any report
(race, uninitialized shared read, out-of-bounds access, divergent barrier,
bad warp mask, deadlock; see src/runtime.cpp) raises
:class:`ExecutorError` naming the source lines involved.
"""
from __future__ import annotations

import ctypes
import types
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

from cuda_executor import _build, _runtime
from cuda_executor._build import BuildError  # noqa: F401

SCHEDULES = ("forward", "reverse", "random")


class ExecutorError(RuntimeError):
    """A launch produced sanitizer reports (or was abandoned); ``reports``
    holds them as text."""

    def __init__(self, message: str, reports: Sequence[str] = (), kinds: Sequence[int] = ()):
        super().__init__(message)
        self.reports = list(reports)
        self.kinds = list(kinds)


class Executor:
    """One test's view of the executor: the registered tensors (global
    memory), the schedule, the launches made and the reports seen.

    ``schedule``: "forward", "reverse", "random" or "rotate"; ``seed`` seeds
    the random schedules; ``preempt``: mean number of memory accesses
    between preemptions in the random schedule; ``strict``: raise on any
    report (else they are only collected in ``reports``).  One executor at
    a time: creating one forgets the tensors registered before."""

    def __init__(self, schedule: str = "rotate", seed: int = 0, preempt: int = 24,
                 strict: bool = True, timeout_s: float = 300.0):
        if schedule not in SCHEDULES + ("rotate",):
            raise ValueError(f"schedule must be one of {SCHEDULES + ('rotate',)}, got {schedule!r}")
        self.schedule, self.seed, self.preempt = schedule, seed, preempt
        self.strict, self.timeout_s = strict, timeout_s
        self.launches: List[str] = []
        self.reports: List[str] = []
        self.report_kinds: List[int] = []
        self.on_launch: Optional[Callable[[str, tuple], None]] = None
        self._tensors: Dict[int, object] = {}
        _runtime.lib().cuda_exec_regions_clear()
        self.cupy = types.SimpleNamespace(
            RawModule=lambda code=None, options=(), **kw: RawModule(code, options, executor=self))

    # -- global memory ------------------------------------------------------
    def ptr(self, t) -> np.uint64:
        """Register a CPU tensor as global memory; its address as an argument."""
        if t.device.type != "cpu":
            raise ValueError(f"the CPU executor takes CPU tensors, got one on {t.device}")
        p = t.data_ptr()
        if t.numel():
            span = 1 + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()))
            st = t.untyped_storage()
            _runtime.lib().cuda_exec_region_add(p, span * t.element_size(), st.data_ptr(),
                                                st.nbytes())
            self._tensors[p] = t  # kept alive: its memory stays registered
        return np.uint64(p)

    def reset(self) -> None:
        """Forget every registered tensor."""
        _runtime.lib().cuda_exec_regions_clear()
        self._tensors.clear()

    def tensor_at(self, p: int):
        """The registered tensor at address ``p`` (for launch hooks)."""
        return self._tensors.get(int(p))

    def _policy(self) -> tuple:
        n = len(self.launches)
        name = SCHEDULES[n % 3] if self.schedule == "rotate" else self.schedule
        return SCHEDULES.index(name), self.seed * 1_000_003 + n


class Function:
    """A kernel of a :class:`RawModule`, called as cupy.RawKernel is."""

    def __init__(self, module: "RawModule", index: int, entry):
        self.module, self.index = module, index
        self.name = entry.name.decode()
        self.sizes = [entry.sizes[i] for i in range(entry.nparams)]
        self.kinds = entry.kinds.decode() if entry.nparams else ""

    def _arg(self, i: int, a):
        size, kind = self.sizes[i], self.kinds[i]
        ex = self.module.executor
        if kind == "p" and hasattr(a, "data_ptr"):
            a = ex.ptr(a)
        if not isinstance(a, np.generic) or a.itemsize != size:
            raise TypeError(f"{self.name}: argument {i} is {type(a).__name__} "
                            f"{getattr(a, 'itemsize', '?')} bytes, the parameter takes {size}")
        if kind == "p" and int(a) and not _runtime.lib().cuda_exec_is_registered(int(a)):
            raise ValueError(f"{self.name}: argument {i} ({int(a):#x}) points into no tensor "
                             "registered with the executor")
        return (ctypes.c_char * size).from_buffer_copy(a.tobytes())

    def __call__(self, grid, block, args, shared_mem: int = 0, stream=None) -> None:
        ex = self.module.executor
        args = tuple(args)
        if len(args) != len(self.sizes):
            raise TypeError(f"{self.name}: {len(args)} arguments for {len(self.sizes)} parameters")
        g = (tuple(grid) + (1, 1, 1))[:3]
        b = (tuple(block) + (1, 1, 1))[:3]
        if min(g) < 1 or min(b) < 1 or b[0] * b[1] * b[2] > 1024:
            raise ValueError(f"{self.name}: bad launch shape grid={grid} block={block}")
        vals = [self._arg(i, a) for i, a in enumerate(args)]
        ptrs = (ctypes.c_void_p * max(1, len(vals)))(*[ctypes.addressof(v) for v in vals])
        pol, seed = ex._policy()
        L = _runtime.lib()
        rc = L.cuda_exec_launch(self.module._info, self.index, (ctypes.c_uint * 3)(*g),
                                (ctypes.c_uint * 3)(*b), int(shared_mem), ptrs, pol, seed,
                                int(ex.preempt), float(ex.timeout_s))
        ex.launches.append(self.name)
        if rc == -2:
            raise ValueError(f"{self.name}: block of {b} threads")
        reps = _runtime.fetch_reports()
        if reps:
            sm = self.module.srcmap
            sm.resolve([r.pc for r in reps] + [r.ppc for r in reps])
            texts = [_runtime.describe(r, self.name, sm) for r in reps]
            ex.reports.extend(texts)
            ex.report_kinds.extend(r.kind for r in reps)
            if ex.strict or rc != 0:
                more = L.cuda_exec_report_total() - sum(r.count for r in reps)
                msg = "\n".join(texts[:8]) + (f"\n... {len(texts) - 8} more" if len(texts) > 8 else "")
                if more > 0:
                    msg += f"\n({more} further reports dropped)"
                sched = SCHEDULES[pol]
                raise ExecutorError(f"CPU executor ({sched} schedule, seed {seed}), launch of "
                                    f"{self.name}{' abandoned' if rc else ''}:\n{msg}", texts,
                                    [r.kind for r in reps])
        if ex.on_launch is not None:
            ex.on_launch(self.name, args)


class RawModule:
    """``cupy.RawModule(code=..., options=...)`` for the executor."""

    def __init__(self, code: str, options: Sequence[str] = (), executor: Optional[Executor] = None):
        if code is None:
            raise ValueError("RawModule needs code=")
        self.executor = executor if executor is not None else Executor()
        self.path, names = _build.build_module(code, tuple(options))
        self._dll = ctypes.CDLL(str(self.path))
        fn = self._dll.cuda_exec_module_info
        fn.restype = ctypes.POINTER(_runtime.ModuleInfo)
        self._info = ctypes.cast(fn(), ctypes.c_void_p)
        info = fn().contents
        self._entries = {info.kernels[i].name.decode(): i for i in range(info.nkernels)}
        self._info_struct = info
        self.srcmap = _runtime.SourceMap(self.path, code)

    def get_function(self, name: str) -> Function:
        i = self._entries.get(name)
        if i is None:
            raise AttributeError(f"no kernel {name!r} in this module (extern \"C\" __global__ "
                                 f"kernels: {sorted(self._entries)[:8]} ...)")
        return Function(self, i, self._info_struct.kernels[i])
