"""Runs worker jobs on an emulated cluster (or on loopback when namespaces
are unavailable): network set-up and tear-down, engine rendezvous, Horovod's
rendezvous helper, signal handling, progress bars."""
from __future__ import annotations

import contextlib
import datetime
import os
import platform
import re
import signal
import subprocess
import sys
import time
from typing import Callable, Dict, Iterator, List, Optional

from gtopk_plugin.bench import bench_launch as launch
from lab.cluster import hvd_engines, netns

TORCH_PORT = 29500
HVD_PORT = 29600


def parse_rate(rate: Optional[str]) -> Optional[float]:
    """tc rate string -> bits per second (tc: "bit" units are bits, "bps"
    units are bytes per second)."""
    if rate is None:
        return None
    m = re.fullmatch(r"\s*([0-9.]+)\s*([kmgt]?)(i?)(bit|bps)?\s*", rate.lower())
    if not m:
        raise ValueError(f"cannot parse rate {rate!r} (use e.g. 1gbit, 100mbit)")
    num, mult, binary, unit = m.groups()
    scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[mult]
    if binary:
        scale = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}[mult]
    bits = float(num) * scale
    return bits * 8 if unit == "bps" else bits


def horovod_status():
    """(usable, sentence): our Horovod layer exists and imports."""
    try:
        import horovod.torch  # noqa: F401
        from gtopk_plugin.frameworks import horovod as _h  # noqa: F401
        from horovod.runner.http.http_server import RendezvousHTTPServer  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any failure means: not usable here
        return False, f"Horovod not used: {type(e).__name__}: {e}"
    return True, "Horovod with gloo (gtopk_plugin.frameworks.horovod.HorovodTransport)"


def horovod_netns_preflight(prog: str, netns_need: str = "") -> bool:
    """For a benchmark that runs Horovod jobs on namespaced links: True when
    both are usable here, else False after saying on stderr which is not
    (``netns_need``: what the namespaces are for)."""
    from lab.cluster import netns

    ok, why = horovod_status()
    if ok:
        ok, why = netns.available()
        why = f"needs network namespaces{f' ({netns_need})' if netns_need else ''}: {why}"
    if not ok:
        print(f"{prog}: {why}", file=sys.stderr)
    return ok


class Loopback:
    """Stand-in for NetCluster without namespaces: every worker on 127.0.0.1."""

    def __init__(self, P: int, reason: str):
        self.P, self.reason = P, reason

    def addr(self, rank):
        return "127.0.0.1"

    def prefix(self, rank):
        return []

    iface = "lo"

    def describe(self):
        return {"shaped": False, "label": "unshaped", "rate": None, "why": f"plain loopback: {self.reason}",
                "topology": f"{self.P} processes on loopback"}

    def qdisc_stats(self):
        return {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@contextlib.contextmanager
def signals_as_exceptions() -> Iterator[None]:
    """SIGTERM/SIGHUP raise SystemExit (Ctrl-C already raises
    KeyboardInterrupt), so every ``with`` block below tears down."""
    def _raise(signum, frame):
        raise SystemExit(f"stopped by signal {signum}")

    old = {s: signal.signal(s, _raise) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def network(P: int, opts) -> object:
    """A NetCluster when namespaces work (and were not declined), else
    Loopback with the reason.  ``opts``: rate, burst, tbf_latency, delay,
    jitter, no_netns."""
    if opts.no_netns:
        return Loopback(P, "--no-netns given")
    ok, why = netns.available()
    if not ok:
        return Loopback(P, why)
    rate = None if str(opts.rate).lower() in ("none", "0", "off") else opts.rate
    sysctls = dict(kv.split("=", 1) for kv in (getattr(opts, "sysctl", None) or []))
    return netns.NetCluster(P, rate=rate, burst=opts.burst, tbf_latency=opts.tbf_latency,
                            delay=opts.delay, jitter=opts.jitter, sysctls=sysctls)


class Progress:
    """One bar over a whole command (tqdm when installed, else lines)."""

    def __init__(self, total: int, desc: str, disable: bool = False):
        self.total, self.n, self.desc, self.disable = total, 0, desc, disable
        self._bar = None
        if not disable:
            try:
                from tqdm import tqdm
                self._bar = tqdm(total=total, desc=desc, unit="cfg", dynamic_ncols=True, file=sys.stderr)
            except ImportError:
                pass

    def step(self, what: str = ""):
        self.n += 1
        if self._bar is not None:
            self._bar.set_postfix_str(what[-60:])
            self._bar.update(1)
        elif not self.disable:
            print(f"[{self.n}/{self.total}] {what}", file=sys.stderr, flush=True)

    def note(self, text: str):
        """Messages that matter (fallbacks, skips, waits) print even with --quiet."""
        if self._bar is not None:
            self._bar.write(text)
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self):
        if self._bar is not None:
            self._bar.close()


@contextlib.contextmanager
def _hvd_rendezvous(net, P: int) -> Iterator[Dict[int, Dict[str, str]]]:
    """Horovod's rendezvous server inside worker 0's namespace."""
    from lab.cluster.hvd_rdzv import worker_env

    addr = net.addr(0)
    port = HVD_PORT if net.prefix(0) else launch.free_port()
    cmd = net.prefix(0) + [sys.executable, "-m", f"{__package__}.hvd_rdzv", addr, str(port), str(P)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [launch.ROOT, os.environ.get("PYTHONPATH")])))
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=launch.ROOT, env=env, start_new_session=True,
                            preexec_fn=launch.die_with_parent)
    try:
        line = proc.stdout.readline()
        if line.strip() != "READY":
            rest = proc.stdout.read() if proc.poll() is not None else ""
            raise RuntimeError(f"Horovod rendezvous did not start: {line}{rest}")
        yield {r: worker_env(r, P, addr, port, net.iface) for r in range(P)}
    finally:
        try:
            proc.stdin.close()
            proc.wait(5)
        except (subprocess.TimeoutExpired, OSError):
            launch.stop_all([proc])


@contextlib.contextmanager
def horovod_cycle_env(ms):
    """``HOROVOD_CYCLE_TIME`` for the workers of one job (they inherit the
    environment; Horovod reads it at ``hvd.init()``): ``ms`` milliseconds,
    ``"default"`` (unset: Horovod's own 1 ms) or ``None`` (the environment
    as it is)."""
    if ms is None:
        yield
        return
    old = os.environ.pop("HOROVOD_CYCLE_TIME", None)
    if ms != "default":
        os.environ["HOROVOD_CYCLE_TIME"] = f"{ms:g}"
    try:
        yield
    finally:
        os.environ.pop("HOROVOD_CYCLE_TIME", None)
        if old is not None:
            os.environ["HOROVOD_CYCLE_TIME"] = old


def run_job(net, P: int, target: Callable, payload, engine: str, progress: Optional[Progress] = None,
            timeout: float = 3600.0, echo: bool = False) -> list:
    """Run one worker job (all ranks) on ``net``; per-rank results."""
    def on_progress(rank, msg):
        if progress is not None:
            progress.step(msg.get("what", ""))

    common = dict(engine=hvd_engines.launcher_engine(engine), ifname=net.iface, prefix=net.prefix,
                  timeout=timeout, progress=on_progress, echo=echo)
    if engine in hvd_engines.HOROVOD_ENGINES:
        with _hvd_rendezvous(net, P) as envs:
            return launch.run_workers(P, target, payload, env=lambda r: envs[r], **common)
    port = TORCH_PORT if net.prefix(0) else launch.free_port()
    return launch.run_workers(P, target, payload, master_addr=net.addr(0), master_port=port, **common)


def loadavg() -> List[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def mem_available() -> Optional[int]:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def busy_fraction(seconds: float = 3.0) -> Optional[float]:
    """Share of all CPUs busy at normal priority over ``seconds`` (user,
    system, irq, softirq; niced processes excluded: they yield to us)."""
    def sample():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
        return v  # user nice system idle iowait irq softirq steal
    try:
        a = sample()
        time.sleep(seconds)
        b = sample()
    except (OSError, ValueError):
        return None
    d = [y - x for x, y in zip(a, b)]
    tot = sum(d) or 1
    return (d[0] + d[2] + d[5] + d[6]) / tot


def wait_for_quiet(max_load: float, max_wait: float, progress: Optional[Progress] = None,
                   max_busy: float = 0.0) -> List[float]:
    """Wait (up to ``max_wait`` s) until the 1-minute load average is below
    ``max_load`` and the normal-priority CPU use below ``max_busy`` (each
    check off when 0); returns the load average when starting."""
    t0 = time.monotonic()
    warned = False

    def busy():
        if max_load > 0 and loadavg() and loadavg()[0] > max_load:
            return f"load average {loadavg()} > {max_load}"
        if max_busy > 0:
            b = busy_fraction()
            if b is not None and b > max_busy:
                return f"CPUs {b:.0%} busy at normal priority > {max_busy:.0%}"
        return None

    while max_wait > 0 and time.monotonic() - t0 < max_wait:
        why = busy()
        if why is None:
            break
        if not warned and progress is not None:
            progress.note(f"{why}: waiting up to {max_wait:.0f} s")
            warned = True
        time.sleep(5)
    return loadavg()


# -- helpers of the cluster commands (cli.py, hier.py) -------------------------
def flat(xs):
    """Nested argparse lists (``nargs="+"`` of comma lists) made flat."""
    out = []
    for x in xs:
        out.extend(x if isinstance(x, list) else [x])
    return out


def run_meta(args, net_desc) -> dict:
    """The run's record: date, command, host, versions, network, load."""
    ok_h, why_h = horovod_status()
    import torch
    return {"date": datetime.datetime.now().isoformat(timespec="seconds"), "argv": sys.argv,
            "host": platform.node(), "cpus": os.cpu_count(), "torch": torch.__version__,
            "python": platform.python_version(), "horovod": why_h, "network": net_desc,
            "loadavg_start": loadavg()}


def warm_kernels(progress=None):
    """Load (compiling once if needed) the CPU kernels in this process, so
    that P workers do not all compile them at once."""
    try:
        from gtopk_plugin import kernels
        b = kernels.backend("cpu")
    except Exception as e:  # noqa: BLE001
        b = f"unavailable ({e})"
    if progress is not None:
        progress.note(f"selection kernels: {b}")
    return b


def summarise_qdisc(stats: dict) -> dict:
    """tc's counters per device: bytes and packets sent, drops, overlimits."""
    import re
    out = {}
    for dev, text in stats.items():
        m = re.search(r"Sent (\d+) bytes (\d+) pkt \(dropped (\d+), overlimits (\d+)", text)
        if m:
            out[dev] = {"sent_bytes": int(m.group(1)), "packets": int(m.group(2)),
                        "dropped": int(m.group(3)), "overlimits": int(m.group(4))}
    return out
