"""Where the C++ kernel sources live and how they are compiled.

Shared by ``setup.py`` (build at install) and :mod:`gtopk_plugin.kernels.cpu`
(compile on first use).  Imports nothing beyond the standard library at module
level, so ``setup.py`` can load this file by path without importing the
package (or torch).
"""
from __future__ import annotations

import hashlib
import sys
from pathlib import Path
from typing import List, Optional

#: Name stem of the library built at install time: gtopk_plugin/_cpu_kernels_<hash>.<ext>
#: (the source hash in the name: a library built from other sources is never picked up).
INSTALLED_STEM = "_cpu_kernels"

_PKG = Path(__file__).resolve().parent.parent  # .../gtopk_plugin


def source_dir(kind: str = "cpu") -> Optional[Path]:
    """Directory holding ``csrc/<kind>``: inside the installed package
    (``gtopk_plugin/csrc``, package data of a wheel) or next to it (a source
    checkout or an editable install)."""
    for cand in (_PKG / "csrc" / kind, _PKG.parent / "csrc" / kind):
        if cand.is_dir() and any(cand.glob("*.cpp" if kind == "cpu" else "*")):
            return cand
    return None


def source_files(directory) -> List[Path]:
    """The C++ sources (``.cpp``) and headers (``.h``) of one kernel directory, sorted."""
    d = Path(directory)
    return sorted(p for p in d.iterdir() if p.suffix in (".cpp", ".h") and p.is_file())


def source_hash(files) -> str:
    """Short hash of the sources (names and bytes): a module built from other
    sources is never used, and compiled modules are cached under it."""
    h = hashlib.sha256()
    for f in sorted(Path(p) for p in files):
        h.update(f.name.encode())
        h.update(b"\0")
        h.update(f.read_bytes())
        h.update(b"\0")
    return h.hexdigest()[:16]


def installed_library(src_hash: str) -> Optional[Path]:
    """The library ``setup.py`` built from these sources, if any."""
    for p in sorted(_PKG.glob(f"{INSTALLED_STEM}_{src_hash}*")):
        if p.suffix in (".so", ".pyd", ".dylib"):
            return p
    return None


def openmp(torch_module) -> bool:
    """Whether torch's intra-op thread pool is OpenMP: at::parallel_for is
    then inlined as an ``omp parallel`` region, which needs -fopenmp (the
    extension then shares torch's own libgomp)."""
    try:
        return "OpenMP" in torch_module.__config__.parallel_info().split("ATen parallel backend:")[1].splitlines()[0]
    except Exception:  # pragma: no cover - unusual torch builds
        return sys.platform.startswith("linux")


def cflags(torch_module, src_hash: str) -> List[str]:
    # The hash travels unquoted (quotes do not survive every build tool) and
    # is stringified in bindings.cpp.
    flags = ["-O3", "-fno-strict-aliasing", f"-DGTOPK_SOURCE_HASH={src_hash}"]
    if openmp(torch_module):
        flags.append("-fopenmp")
    return flags


def ldflags(torch_module) -> List[str]:
    return ["-fopenmp"] if openmp(torch_module) else []


def cache_root(cache_home: str) -> Path:
    """Per-user cache of compiled kernels under ``cache_home``
    (gtopk_plugin.config.env_cache_home(): this file stays free of package
    imports, so the caller reads the environment)."""
    return Path(cache_home) / "gtopk_plugin" / "cpu_kernels"


def build_tag(torch_module) -> str:
    """What a compiled module depends on besides its sources."""
    ver = torch_module.__version__.replace("+", "_")
    return f"torch{ver}-{sys.implementation.cache_tag}"
