"""Compiling for the executor: the runtime library and kernel modules.

A kernel module is CUDA source compiled by the host g++ against
``include/cuda_executor.h`` (force-included), with ``-fsanitize=thread``
instrumentation whose hooks the runtime implements (no sanitizer library
is linked).  Steps: ``__shared__`` declarations are rewritten (a redzone
after each variable; ``extern __shared__`` arrays point at the launch's
dynamic shared memory), the source is preprocessed, the ``extern "C"``
kernels are found in the preprocessed text and a registration table
(``cuda_exec::entry(&kernel, "name")``) is appended, then it is compiled
and linked against the runtime.  Results are cached by a hash of
everything that goes in (source, header, runtime, flags, compiler) under
``$CUDA_EXECUTOR_CACHE`` or ``~/.cache/gtopk_plugin/cuda_executor``.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import List, Sequence, Tuple

HERE = Path(__file__).resolve().parent
HEADER = HERE / "include" / "cuda_executor.h"
RUNTIME = HERE / "src" / "runtime.cpp"

RUNTIME_FLAGS = ["-std=c++17", "-O2", "-g", "-fPIC", "-shared", "-U_FORTIFY_SOURCE"]
# -fno-tree-vectorize: accesses stay the scalar ones the source makes (as on
# a GPU), so the instrumentation sees each element; -ffp-contract=off: the
# _rn intrinsics are single IEEE operations, never fused.
KERNEL_FLAGS = ["-O2", "-g1", "-fPIC", "-fno-strict-aliasing", "-ffp-contract=off",
                "-fno-tree-vectorize", "-fvisibility=hidden", "-w", "-fsanitize=thread",
                "--param", "tsan-distinguish-volatile=1",
                "--param", "tsan-instrument-func-entry-exit=0"]


class BuildError(RuntimeError):
    """The host compiler rejected a source (the message holds its output)."""


def cache_dir() -> Path:
    d = os.environ.get("CUDA_EXECUTOR_CACHE")
    if not d:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        d = os.path.join(base, "gtopk_plugin", "cuda_executor")
    p = Path(d)
    p.mkdir(parents=True, exist_ok=True)
    return p


def compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("g++")
    if not cxx:
        raise BuildError("the CPU executor needs g++ (apt-get install g++)")
    return cxx


_version_cache = {}


def _compiler_id(cxx: str) -> str:
    if cxx not in _version_cache:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True)
        _version_cache[cxx] = out.stdout.splitlines()[0] if out.stdout else cxx
    return _version_cache[cxx]


def _hash(*parts) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p if isinstance(p, bytes) else str(p).encode())
        h.update(b"\0")
    return h.hexdigest()[:24]


def _run(cmd: List[str], what: str) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise BuildError(f"{what} failed ({' '.join(cmd[:3])} ...):\n{(r.stdout + r.stderr)[-6000:]}")


def _publish(tmp: Path, final: Path) -> None:
    os.replace(tmp, final)  # atomic: concurrent builders race harmlessly


def runtime_library() -> Path:
    """The runtime shared library (built once per content hash)."""
    cxx = compiler()
    key = _hash(RUNTIME.read_bytes(), HEADER.read_bytes(), RUNTIME_FLAGS, _compiler_id(cxx))
    d = cache_dir()
    out = d / f"libcuda_exec_rt-{key}.so"
    if not out.exists():
        with tempfile.TemporaryDirectory(dir=d) as tmp:
            t = Path(tmp) / out.name
            _run([cxx] + RUNTIME_FLAGS + ["-o", str(t), str(RUNTIME)], "building the executor runtime")
            _publish(t, out)
    return out


# ``__shared__ T name[dims];`` and ``extern __shared__ T name[];`` (one line each)
_SHARED = re.compile(
    r"(?<![\w])(extern\s+)?__shared__\s+(?:__align__\(\s*\d+\s*\)\s+)?"
    r"((?:const\s+|volatile\s+)*[A-Za-z_][\w:]*(?:\s+[A-Za-z_][\w:]*)*?(?:\s*\*+)?)"
    r"\s*\b([A-Za-z_]\w*)\s*((?:\[[^\]\n]*\])*)\s*;")


def _shared_decl(m: "re.Match") -> str:
    ext, typ, name, dims = m.group(1), m.group(2).strip(), m.group(3), m.group(4)
    if ext:
        if dims.replace(" ", "") != "[]":
            return m.group(0)
        return f"{typ}* const {name} = reinterpret_cast<{typ}*>(::cuda_exec_dynamic_shared());"
    box = f"{name}_cuda_exec_box"
    return (f"static CUDA_EXEC_SHARED_ATTR struct {{ {typ} v{dims}; "
            f"unsigned char rz[CUDA_EXEC_REDZONE]; }} {box}; auto& {name} = {box}.v; "
            f"::cuda_exec_shared_decl(&{box}, sizeof({box}.v), sizeof({box}));")


def rewrite_shared(code: str) -> str:
    """The source with its __shared__ declarations rewritten (line numbers kept)."""
    return _SHARED.sub(_shared_decl, code)


_KERNEL = re.compile(r'extern\s+"C"\s+__attribute__\s*\(\(\s*used\s*,\s*noinline\s*\)\)\s+void\s+'
                     r"(\w+)\s*\(")


def _translate(options: Sequence[str]) -> List[str]:
    """NVRTC/nvcc options the host compiler understands (the others are dropped)."""
    out, it = [], iter(options)
    for o in it:
        if o.startswith(("--std=", "-std=")):
            out.append("-std=" + o.split("=", 1)[1])
        elif o.startswith(("-D", "-I", "-U")):
            out.append(o)
        elif o in ("--define-macro", "--include-path"):
            v = next(it, "")
            out.append(("-D" if o == "--define-macro" else "-I") + v)
    if not any(o.startswith("-std=") for o in out):
        out.append("-std=c++14")
    return out


def build_module(code: str, options: Sequence[str] = ()) -> Tuple[Path, List[str]]:
    """Compile ``code`` into a kernel module: (path of the .so, kernel names)."""
    cxx = compiler()
    rt = runtime_library()
    opts = _translate(options)
    key = _hash(code, HEADER.read_bytes(), rt.name, KERNEL_FLAGS, opts, _compiler_id(cxx))
    d = cache_dir()
    so, names_file, src = d / f"mod-{key}.so", d / f"mod-{key}.names", d / f"mod-{key}.cu"
    if so.exists() and names_file.exists():
        return so, names_file.read_text().split()
    with tempfile.TemporaryDirectory(dir=d) as tmp:
        tmpd = Path(tmp)
        t = tmpd / src.name
        t.write_text(rewrite_shared(code))
        _publish(t, src)  # kept: reports and addr2line name its lines
        ii = tmpd / "module.ii"
        base = [cxx] + KERNEL_FLAGS + opts
        _run(base + ["-E", "-x", "c++", "-include", str(HEADER), str(src), "-o", str(ii)],
             "preprocessing")
        text = ii.read_text()
        names = list(dict.fromkeys(_KERNEL.findall(text)))
        table = ",\n".join(f'  ::cuda_exec::entry(&{n}, "{n}")' for n in names) or "  {}"
        text += (
            f"\nstatic const ::cuda_exec::Entry cuda_exec_entries_[] = {{\n{table}\n}};"
            '\nextern "C" __attribute__((visibility("default"))) const ::cuda_exec::ModuleInfo*'
            "\ncuda_exec_module_info() {"
            f"\n  static const ::cuda_exec::ModuleInfo m = {{1u, {len(names)}u, cuda_exec_entries_}};"
            "\n  return &m;\n}\n")
        ii.write_text(text)
        obj = tmpd / "module.o"
        _run(base + ["-c", str(ii), "-o", str(obj)], "compiling")
        out = tmpd / so.name
        _run([cxx, "-shared", "-o", str(out), str(obj), str(rt), f"-Wl,-rpath,{rt.parent}",
              "-Wl,-z,defs"], "linking")
        nt = tmpd / names_file.name
        nt.write_text("\n".join(names) + "\n")
        _publish(out, so)
        _publish(nt, names_file)
    return so, names
