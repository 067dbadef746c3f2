"""lab/cluster/cpu_account.py: /proc/stat's CPU ticks, parsed and
summed over chosen windows.  Oracles: a /proc/stat line and tick sums
written out by hand, and the kernel's own account of a thread kept busy."""
import os
import time

import pytest

from lab.cluster import cpu_account

LINE = "cpu  100 5 30 400 20 1 7 0 0 0\n"


def test_the_aggregate_line_is_read_field_by_field():
    t = cpu_account.parse_cpu_line(LINE)
    assert t == {"user": 100, "nice": 5, "system": 30, "idle": 400, "iowait": 20, "irq": 1,
                 "softirq": 7, "steal": 0}
    with pytest.raises(ValueError):
        cpu_account.parse_cpu_line("cpu0 1 2 3 4 5 6 7 8")   # one CPU's line, not the sum


def test_busy_and_softirq_fractions_between_two_samples():
    a = cpu_account.parse_cpu_line(LINE)
    b = dict(a, user=a["user"] + 30, idle=a["idle"] + 50, softirq=a["softirq"] + 20)
    busy, soft = cpu_account.busy_split(a, b)
    assert abs(busy - 50 / 100) < 1e-12 and abs(soft - 20 / 100) < 1e-12
    assert cpu_account.busy_split(None, b) == (None, None)
    assert cpu_account.fractions({k: 0 for k in cpu_account.FIELDS}) == (None, None)


def test_windows_sum_only_the_ticks_inside_them(monkeypatch):
    samples = iter([{"user": u, "nice": 0, "system": 0, "idle": i, "iowait": 0, "irq": 0, "softirq": 0,
                     "steal": 0} for u, i in ((0, 0), (10, 5), (50, 50), (52, 58))])
    monkeypatch.setattr(cpu_account, "cpu_jiffies", lambda: next(samples))
    w = cpu_account.Windows()
    w.start(); w.stop()            # 10 busy, 5 idle
    w.start(); w.stop()            # (the gap from 10/5 to 50/50 is outside) 2 busy, 8 idle
    assert w.as_dict()["user"] == 12 and w.as_dict()["idle"] == 13


def test_a_window_without_proc_stat_reports_nothing(monkeypatch):
    monkeypatch.setattr(cpu_account, "cpu_jiffies", lambda: None)
    w = cpu_account.Windows()
    w.start(); w.stop()
    assert w.as_dict() is None


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="needs /proc/stat")
def test_a_busy_thread_shows_in_the_machines_account():
    stop = time.process_time() + 0.6
    w = cpu_account.Windows()
    w.start()
    while time.process_time() < stop:   # 0.6 s of this process's CPU, on one core
        pass
    w.stop()
    t = w.as_dict()
    busy_s = (sum(t.values()) - t["idle"] - t["iowait"]) / os.sysconf("SC_CLK_TCK")
    assert busy_s >= 0.45            # at least the spin (ticks are 10 ms; other load only adds)


def test_schedstat_is_read_as_seconds_on_a_cpu_and_waiting_for_one():
    assert cpu_account.parse_schedstat("1500000000 250000000 42\n") == (1.5, 0.25)
    with pytest.raises(ValueError):
        cpu_account.parse_schedstat("")


@pytest.mark.skipif(cpu_account.thread_schedstat() is None, reason="the kernel keeps no schedstat")
def test_the_calling_threads_schedstat_counts_its_own_cpu():
    a = cpu_account.thread_schedstat()
    stop = time.thread_time() + 0.3
    while time.thread_time() < stop:     # 0.3 s of this thread's CPU (the kernel's own account is the oracle)
        pass
    b = cpu_account.thread_schedstat()
    assert 0.28 <= b[0] - a[0] <= 0.40 and b[1] >= a[1] >= 0
