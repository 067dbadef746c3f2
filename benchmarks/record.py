"""The JSON record a benchmark leaves in benchmarks/results/: what ran, when,
on which machine (CPUs, platform, load average, framework versions) and with
which settings, next to the results; written atomically."""
from __future__ import annotations

import importlib
import json
import os
import platform
import time
from typing import Iterable


def write_json(path: str, benchmark: str, settings: dict, results, packages: Iterable[str] = ()) -> None:
    """Write ``{"benchmark", "when", "machine", "settings", "results"}`` to
    ``path``; ``packages``: modules whose ``__version__`` to record (those
    that do not import are left out)."""
    machine = {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
               "load_average_1_5_15min": list(os.getloadavg())}
    for name in packages:
        try:
            machine[name] = importlib.import_module(name).__version__
        except ImportError:
            pass
    doc = {"benchmark": benchmark, "when": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine,
           "settings": settings, "results": results}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(path + ".tmp", path)
