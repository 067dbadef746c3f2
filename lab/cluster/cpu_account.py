"""Machine-wide CPU time from /proc/stat, for the benchmarks' breakdowns.

On this project's test machines every worker of an emulated cluster shares
the same few cores: the training compute, the collectives' copies and sums
and the kernel's network stack (veth and bridge traffic runs in softirq)
all draw on them.  Whether a step waited on the link or on the CPU is read
here: the share of all CPUs busy while the steps ran.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

#: /proc/stat's first eight fields of the aggregate "cpu" line (USER_HZ ticks)
FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def parse_cpu_line(line: str) -> Dict[str, int]:
    """The aggregate ``cpu`` line of /proc/stat as ticks per field."""
    parts = line.split()
    if not parts or parts[0] != "cpu":
        raise ValueError(f"not the aggregate cpu line of /proc/stat: {line[:40]!r}")
    return dict(zip(FIELDS, (int(x) for x in parts[1:1 + len(FIELDS)])))


def cpu_jiffies() -> Optional[Dict[str, int]]:
    """Ticks per field since boot, all CPUs together; None where there is
    no /proc/stat."""
    try:
        with open("/proc/stat") as f:
            return parse_cpu_line(f.readline())
    except (OSError, ValueError):
        return None


def fractions(ticks: Optional[Dict[str, int]]) -> Tuple[Optional[float], Optional[float]]:
    """(fraction of all CPUs busy, fraction in softirq: the network stack)
    of a tick count per field; (None, None) without ticks."""
    if not ticks:
        return None, None
    tot = sum(ticks.values())
    if tot <= 0:
        return None, None
    return 1 - (ticks["idle"] + ticks["iowait"]) / tot, ticks["softirq"] / tot


def busy_split(a: Optional[Dict[str, int]], b: Optional[Dict[str, int]]) -> Tuple[Optional[float], Optional[float]]:
    """:func:`fractions` between samples ``a`` and ``b`` of :func:`cpu_jiffies`."""
    if not a or not b:
        return None, None
    return fractions({k: b[k] - a[k] for k in b})


def parse_schedstat(text: str) -> Tuple[float, float]:
    """(seconds on a CPU, seconds runnable but waiting for one) from a
    task's ``schedstat`` (nanoseconds: run time, run-queue wait, slices)."""
    parts = text.split()
    if len(parts) < 2:
        raise ValueError(f"not a schedstat line: {text[:40]!r}")
    return int(parts[0]) / 1e9, int(parts[1]) / 1e9


def thread_schedstat() -> Optional[Tuple[float, float]]:
    """:func:`parse_schedstat` of the calling thread; None where the kernel
    does not keep it (no CONFIG_SCHED_INFO, or no /proc).  The wait is
    the time the thread was ready to run while every core ran something
    else: on a shared machine, time a step lost to the CPU, not the link."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return parse_schedstat(f.read())
    except (OSError, ValueError):
        return None


class Windows:
    """Ticks summed over chosen windows only (the training steps, not the
    evaluations between them): ``start()`` … ``stop()`` around each."""

    def __init__(self):
        self.total: Dict[str, int] = {k: 0 for k in FIELDS}
        self._a: Optional[Dict[str, int]] = None
        self.ok = True

    def start(self) -> None:
        self._a = cpu_jiffies()
        self.ok = self.ok and self._a is not None

    def stop(self) -> None:
        b = cpu_jiffies()
        if self._a is None or b is None:
            self.ok = False
            return
        for k in FIELDS:
            self.total[k] += b[k] - self._a[k]
        self._a = None

    def as_dict(self) -> Optional[Dict[str, int]]:
        return dict(self.total) if self.ok else None
