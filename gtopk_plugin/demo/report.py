"""The demo's report: the side-by-side table and the JSON file."""
from __future__ import annotations

import json
import os
from typing import List


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000.0
    return f"{n:.1f} GB"  # pragma: no cover


def fmt_ratio(sent: float, dense: float) -> str:
    return f"{sent / dense:.2%}" if dense else "n/a"


def format_table(results: List[dict]) -> str:
    """method | test accuracy | bytes sent/step/worker | total bytes | wall time."""
    head = ["method", "density", "test accuracy", "bytes sent/step/worker", "vs dense", "total bytes",
            "wall time"]
    rows = [[r["method"], f"{r['density']:g}", f"{r['test_accuracy']:.2%}",
             fmt_bytes(r["bytes_per_step_per_worker"]),
             fmt_ratio(r["bytes_per_step_per_worker"], r["dense_bytes_per_step_per_worker"]),
             fmt_bytes(r["total_bytes"]), f"{r['wall_time_s']:.1f} s"] for r in results]
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]

    def line(cells):
        return " | ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()

    return "\n".join([line(head), "-+-".join("-" * w for w in widths)] + [line(r) for r in rows])


def write_json(path: str, obj) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
    os.replace(tmp, path)
