"""The CUDA back end's sources as NVRTC compiles them, and the kernel names.

``csrc/cuda/*.cu`` ship as package data (``gtopk_plugin/csrc/cuda``, or
``csrc/cuda`` next to the package in a checkout).  :func:`sources` pastes
their ``#include "..."`` lines in, so that each file is self-contained and
CuPy's compile cache, keyed by the source text, is never stale;
:func:`kernel_names` lists every entry point :mod:`.cuda` may launch (the
compile test checks each one exists in the compiled code).
"""
from __future__ import annotations

import re
from typing import Dict, List

from gtopk_plugin.kernels import _build
from gtopk_plugin.kernels._cuda_layout import _INDEX, _VALUES

FILES = ("select.cu", "merge.cu", "scatter.cu", "compensate.cu")

_sources: Dict[str, str] = {}


def _inline(path, seen) -> str:
    """The source of ``path`` with its ``#include "..."`` lines replaced by
    the included files (each at most once)."""
    out: List[str] = []
    for line in path.read_text(encoding="utf-8").splitlines():
        m = re.match(r'\s*#\s*include\s*"([^"]+)"', line)
        if m:
            inc = path.parent / m.group(1)
            if inc.name not in seen:
                seen.add(inc.name)
                out.append(_inline(inc, seen))
            continue
        if re.match(r"\s*#\s*pragma\s+once", line):
            continue
        out.append(line)
    return "\n".join(out) + "\n"


def sources() -> Dict[str, str]:
    """file name -> self-contained source text (what NVRTC compiles)."""
    if not _sources:
        d = _build.source_dir("cuda")
        if d is None:
            raise FileNotFoundError("the csrc/cuda sources are missing from this installation")
        for f in FILES:
            _sources[f] = _inline(d / f, {f})
    return _sources


def kernel_names() -> Dict[str, List[str]]:
    """file -> every kernel name this module may launch from it (the compile
    test checks each one exists in the compiled code)."""
    vals = [v for v, _ in _VALUES.values()]
    idxs = list(_INDEX.values())
    return {
        "select.cu": (["gtopk_radix_init", "gtopk_thr_decide", "gtopk_bound_decide"]
                      + [f"gtopk_thr_clear_{i}" for i in idxs]
                      + [f"gtopk_{op}_{v}" for op in ("thr_sample", "bound_collect") for v in vals]
                      + [f"gtopk_{op}_{v}_{i}" for op in ("topk_pass", "thr_count")
                         for v in vals for i in idxs]),
        "merge.cu": (["gtopk_radix_init", "gtopk_merge_keep"]
                     + [f"gtopk_merge_bounds_{i}" for i in idxs]
                     + [f"gtopk_merge_pass_{v}" for v in vals]
                     + [f"gtopk_merge_{op}_{v}_{i}" for op in ("union", "finish")
                        for v in vals for i in idxs]),
        "scatter.cu": [f"gtopk_scatter_{v}_{i}" for v in vals for i in idxs],
        "compensate.cu": ([f"gtopk_{op}_{v}" for op in ("compensate", "comp_sample", "comp_collect",
                                                       "div_count") for v in vals]
                          + [f"gtopk_{op}_{v}_{i}" for op in ("subtract_at", "zero_at")
                             for v in vals for i in idxs]),
    }
