"""The JSON record a benchmark leaves (in :data:`RESULTS` unless told
otherwise): what ran, when,
on which machine (CPUs, platform, load average, framework versions) and with
which settings, next to the results; written atomically and compactly.

Every benchmark writes its results through :func:`write_json`.  Compact by
default: one line (no indentation) and every non-integral float rounded to
:data:`SIGNIFICANT` significant digits.  The per-step curves of a long run
are most of a result file; six digits keep every figure a table or plot
shows (and any conservation error's order of magnitude) at a third of the
size.  Integers, integral floats (byte counts), booleans and strings are
written exactly.
"""
from __future__ import annotations

import importlib
import json
import math
import os
import platform
import time
from typing import Any, Callable, Iterable, Optional

#: Where ``gtopk-bench`` writes its results by default (``--json``/``--out``
#: elsewhere): ``gtopk-bench-results/`` in the current directory.
RESULTS = "gtopk-bench-results"

#: Significant digits kept of a non-integral float.
SIGNIFICANT = 6


def compact(obj: Any, digits: int = SIGNIFICANT) -> Any:
    """``obj`` with every non-integral finite float rounded to ``digits``
    significant digits (dicts, lists and tuples walked; all else as is)."""
    if isinstance(obj, bool):
        return obj
    if isinstance(obj, float):
        if not math.isfinite(obj) or obj.is_integer():
            return float(obj)
        return float(f"{obj:.{digits}g}")
    if isinstance(obj, dict):
        return {k: compact(v, digits) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [compact(v, digits) for v in obj]
    return obj


def dump(path: str, obj: Any, *, digits: Optional[int] = SIGNIFICANT,
         default: Optional[Callable[[Any], Any]] = None) -> None:
    """Write ``obj`` to ``path`` as one line of JSON, atomically (a reader
    never sees half a file); ``digits=None`` keeps floats exact."""
    if digits is not None:
        obj = compact(obj, digits)
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, separators=(",", ":"), default=default)
        f.write("\n")
    os.replace(path + ".tmp", path)


def machine(packages: Iterable[str] = ()) -> dict:
    """CPUs, platform, Python, load average, and the ``__version__`` of each
    of ``packages`` that imports."""
    info = {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "load_average_1_5_15min": list(os.getloadavg())}
    for name in packages:
        try:
            info[name] = importlib.import_module(name).__version__
        except ImportError:
            pass
    return info


def write_json(path: str, benchmark: str, settings: Optional[dict] = None, results: Any = None,
               packages: Iterable[str] = (), *, document: Optional[dict] = None,
               digits: Optional[int] = SIGNIFICANT, default: Optional[Callable[[Any], Any]] = None) -> None:
    """Write ``{"benchmark", "when", "machine", "settings", "results"}`` to
    ``path``; ``packages``: modules whose ``__version__`` to record (those
    that do not import are left out).

    A benchmark whose file has its own layout (read back by its reports,
    tests and docs) passes it as ``document``: the record's ``benchmark``,
    ``when`` and ``machine`` are added to it (where it has no such key) and
    ``settings``/``results`` are not used.  ``digits`` and ``default`` as in
    :func:`dump`."""
    record = {"benchmark": benchmark, "when": time.strftime("%Y-%m-%d %H:%M:%S"),
              "machine": machine(packages)}
    if document is None:
        doc = dict(record, settings=settings, results=results)
    else:
        doc = dict(document)
        for k, v in record.items():
            doc.setdefault(k, v)
    dump(path, doc, digits=digits, default=default)
