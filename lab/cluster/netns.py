"""An emulated cluster: P worker network namespaces joined by a bridge that
lives in a namespace of its own, every link shaped with ``tc``.

    with NetCluster(4, rate="1gbit") as net:
        net.prefix(r)      # ip netns exec <worker r's namespace>, host name "w<r>"
        net.addr(r)        # 10.213.0.(r+1), on interface "eth0" inside it

Topology (nothing is created in the caller's namespace)::

    gtkb-<pid>-<tag>-w0  eth0 ─veth─ p0 ┐
    gtkb-<pid>-<tag>-w1  eth0 ─veth─ p1 ├ br0   in gtkb-<pid>-<tag>-br
    ...                                 ┘

Shaping: a ``tbf`` on the worker's ``eth0`` (what it sends) and one on the
bridge port ``pI`` (what it receives), both at ``rate``: a worker's link is
limited in both directions, so P−1 senders converging on one worker share
its rate (incast) as they would at a real switch port.  With ``delay`` (and
``jitter``), a ``netem`` sits above the worker-side ``tbf``: one-way
worker-to-worker latency ``delay``, round trip 2·delay.  The addresses exist
only inside these namespaces, so the traffic cannot reach anything else.

Each worker is a host of its own name too: :meth:`NetCluster.prefix` runs
the command in a UTS namespace of its own whose host name is ``w<r>``, and
every worker's ``/etc/hosts`` resolves ``w0 .. w<P-1>`` to the workers'
addresses, as a cluster's DNS would.  Software that tells its peers where
to connect by host name (the Horovod transport's gloo side channel sends
rank 0's ``gethostname()``) then reaches the right worker; with one shared
host name every worker would resolve it to its own address.

Besides the namespaces, the only thing written is ``/etc/netns/<ns>/hosts``
(see :meth:`NetCluster._hosts_file`), removed with its namespace.

Names carry the creating process id, so :func:`cleanup` can tell leftovers
of a dead run (removed) from the namespaces of a run still going (kept).

The namespace plumbing (commands, probe, bridge, worker veth, tbf) is the
package's :mod:`gtopk_plugin.bench.shaped_net`, called with this module's
prefix and error class; netem, host names, sysctls, MTU and the zombie-aware
teardown are the lab's own.
"""
from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import time
from typing import Dict, List, Optional, Tuple

from gtopk_plugin.bench import shaped_net

PREFIX = "gtkb"
IFACE = "eth0"
ETC_NETNS = "/etc/netns"
_NAME_RE = re.compile(rf"^{PREFIX}-(\d+)-([0-9a-f]+)-(br|w\d+)$")


class NetnsError(RuntimeError):
    pass


def _run(cmd: List[str], check: bool = True) -> subprocess.CompletedProcess:
    return shaped_net.run(cmd, check=check, error=NetnsError)


def available() -> Tuple[bool, str]:
    """Whether namespaces + veth + bridge + tbf can be created here, and if
    not, why (a sentence for the user); the probe namespace carries this
    module's prefix, so :func:`cleanup` removes it if the run dies."""
    ok, why = shaped_net.available(PREFIX)
    return (True, "network namespaces, veth, bridge and tc tbf available") if ok else (False, why)


def netem_available() -> Tuple[bool, str]:
    """netem (delay/jitter) is a separate kernel option (CONFIG_NET_SCH_NETEM)."""
    probe = f"{PREFIX}-{os.getpid()}-{secrets.token_hex(2)}-w0"
    try:
        _run(["ip", "netns", "add", probe])
    except NetnsError as e:
        return False, str(e)
    try:
        r = _run(["tc", "-n", probe, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"],
                 check=False)
        if r.returncode != 0:
            return False, ("this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM is not set: "
                           f"tc says {r.stderr.strip()!r}), so --delay/--jitter cannot be emulated")
        return True, "netem available"
    finally:
        _run(["ip", "netns", "del", probe], check=False)


def tx_bytes(iface: str) -> Optional[int]:
    """Bytes sent on ``iface`` so far, from this process's network namespace
    (``/proc/net/dev``); ``None`` on loopback, whose counter every process
    of the machine shares, or for an unknown interface."""
    if iface == "lo":
        return None
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == iface:
                return int(rest.split()[8])
    return None


def _pid_alive(pid: int) -> bool:
    """Running (a zombie, dead but not yet reaped by its parent, is not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def list_namespaces() -> List[str]:
    """Our namespaces (any run): names matching ``gtkb-<pid>-<tag>-(br|wN)``."""
    p = _run(["ip", "netns", "list"], check=False)
    names = [line.split()[0] for line in p.stdout.splitlines() if line.strip()]
    return [n for n in names if _NAME_RE.match(n)]


def _kill_pids_in(ns: str) -> None:
    """End the processes inside one of OUR namespaces (only the harness
    starts processes there), by pid: SIGTERM, then SIGKILL."""
    pids = [int(x) for x in _run(["ip", "netns", "pids", ns], check=False).stdout.split() if x.isdigit()]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        live = [p for p in pids if _pid_alive(p)]
        for p in live:
            try:
                os.kill(p, sig)
            except ProcessLookupError:
                pass
        if not live:
            return
        t = time.monotonic() + 3
        while time.monotonic() < t and any(_pid_alive(p) for p in live):
            time.sleep(0.05)


def _etc_dir(ns: str) -> str:
    return os.path.join(ETC_NETNS, ns)


def delete_namespace(ns: str) -> bool:
    """Remove one namespace (its veth ends and qdiscs go with it) and its
    /etc/netns/<ns> files."""
    _kill_pids_in(ns)
    _run(["ip", "netns", "del", ns], check=False)
    shutil.rmtree(_etc_dir(ns), ignore_errors=True)
    return ns not in list_namespaces()


def cleanup(all_runs: bool = False) -> List[str]:
    """Remove leftover namespaces of runs whose process is gone (``all_runs``:
    of every run, even live ones).  Returns the names removed."""
    removed = []
    # /etc/netns/<ns> files whose namespace is already gone
    if os.path.isdir(ETC_NETNS):
        live = set(list_namespaces())
        for d in os.listdir(ETC_NETNS):
            m = _NAME_RE.match(d)
            if m and d not in live and (all_runs or not _pid_alive(int(m.group(1)))):
                shutil.rmtree(_etc_dir(d), ignore_errors=True)
                removed.append(_etc_dir(d))
    for ns in list_namespaces():
        pid = int(_NAME_RE.match(ns).group(1))
        if all_runs or not _pid_alive(pid) or pid == os.getpid() and ns not in NetCluster._live:
            if delete_namespace(ns):
                removed.append(ns)
    return removed


class NetCluster:
    """P shaped worker namespaces on a bridge; a context manager that always
    removes what it created (also on error part-way through ``up()``)."""

    _live: set = set()  # namespaces of clusters up in this process

    def __init__(self, P: int, rate: Optional[str] = "1gbit", burst: str = "128kb",
                 tbf_latency: str = "50ms", delay: Optional[str] = None, jitter: Optional[str] = None,
                 subnet: str = "10.213.0", mtu: int = 1500, sysctls: Optional[Dict[str, str]] = None):
        if not 1 <= P <= 250:
            raise ValueError(f"P must be in 1..250; got {P}")
        self.P, self.rate, self.burst, self.tbf_latency = P, rate, burst, tbf_latency
        self.delay = None if delay in (None, "", "0", "0ms", "0us", "0s") else delay
        self.jitter = None if jitter in (None, "", "0", "0ms", "0us", "0s") else jitter
        if self.jitter and not self.delay:
            raise ValueError("--jitter needs a --delay")
        self.subnet, self.mtu = subnet, mtu
        self.sysctls = dict(sysctls or {})  # applied inside each worker namespace only
        self.tag = secrets.token_hex(3)
        base = f"{PREFIX}-{os.getpid()}-{self.tag}"
        self.bridge_ns = f"{base}-br"
        self.worker_ns = [f"{base}-w{i}" for i in range(P)]
        self._created: List[str] = []

    # -- addressing -------------------------------------------------------
    def addr(self, rank: int) -> str:
        return f"{self.subnet}.{rank + 1}"

    def hostname(self, rank: int) -> str:
        return f"w{rank}"

    def prefix(self, rank: int) -> List[str]:
        """Command prefix: worker ``rank``'s network namespace, and a UTS
        namespace whose host name is :meth:`hostname` (``unshare`` and
        ``sh`` exec, so the command keeps the process id the caller sees)."""
        return ["ip", "netns", "exec", self.worker_ns[rank], "unshare", "--uts", "sh", "-c",
                'hostname "$0" && exec "$@"', self.hostname(rank)]

    @property
    def iface(self) -> str:
        return IFACE

    def describe(self) -> Dict:
        return {"shaped": self.rate is not None, "label": "shaped" if self.rate else "unshaped",
                "why": None if self.rate else "namespaces and bridge without tc shaping (--rate none)",
                "rate": self.rate, "burst": self.burst,
                "tbf_latency": self.tbf_latency, "delay": self.delay, "jitter": self.jitter,
                "mtu": self.mtu, "sysctls": self.sysctls, "topology": f"{self.P} namespaces on one bridge (own namespace)",
                "namespaces": [self.bridge_ns] + self.worker_ns}

    # -- life cycle -------------------------------------------------------
    def _ns(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self._created.append(name)
        NetCluster._live.add(name)

    def _tbf(self, ns: str, dev: str, parent: List[str], rate: Optional[str] = None) -> None:
        """A tbf at ``rate`` (default: the cluster's) on ``dev`` in ``ns``."""
        shaped_net.add_tbf(ns, dev, rate or self.rate, self.burst, self.tbf_latency, parent=parent,
                           error=NetnsError)

    def _worker(self, rank: int, master: str) -> str:
        """Worker ``rank``'s namespace, joined through bridge port ``p<rank>``
        to bridge ``master``, with its hosts file and sysctls; its name."""
        w = self.worker_ns[rank]
        self._ns(w)
        shaped_net.wire_worker(self.bridge_ns, f"p{rank}", master, w, f"{self.addr(rank)}/24",
                               mtu=self.mtu, error=NetnsError)
        self._hosts_file(w, rank)
        for k, v in self.sysctls.items():
            _run(["ip", "netns", "exec", w, "sysctl", "-q", "-w", f"{k}={v}"])
        return w

    def _hosts_file(self, ns: str, rank: int) -> None:
        """/etc/netns/<ns>/hosts, which ``ip netns exec`` mounts over
        /etc/hosts: every worker's host name ``w<q>`` resolves to its
        address, and this machine's own host name to the worker's own
        address.  The worker's host name must resolve to its own address
        for Horovod 0.28.1, whose process-set gloo contexts ignore
        HOROVOD_GLOO_IFACE and bind to the hostname's address (127.0.0.1
        otherwise, unreachable from the peers)."""
        d = _etc_dir(ns)
        os.makedirs(d, exist_ok=True)
        host = socket.gethostname()
        lines = ["127.0.0.1\tlocalhost"]
        for q in range(self.P):
            lines.append(f"{self.addr(q)}\t{self.hostname(q)}" + (f" {host}" if q == rank else ""))
        with open(os.path.join(d, "hosts"), "w") as f:
            f.write("\n".join(lines) + "\n")

    def up(self) -> "NetCluster":
        if (self.delay or self.jitter):
            ok, why = netem_available()
            if not ok:
                raise NetnsError(why)
        try:
            self._ns(self.bridge_ns)
            b = self.bridge_ns
            shaped_net.add_bridge(b, "br0", error=NetnsError)
            for i in range(self.P):
                w, port = self._worker(i, "br0"), f"p{i}"
                if self.rate:
                    if self.delay:
                        netem = ["netem", "delay", self.delay] + ([self.jitter, "distribution", "normal"]
                                                                  if self.jitter else [])
                        _run(["tc", "-n", w, "qdisc", "add", "dev", IFACE, "root", "handle", "1:"] + netem)
                        self._tbf(w, IFACE, ["parent", "1:1", "handle", "10:"])
                    else:
                        self._tbf(w, IFACE, ["root", "handle", "1:"])
                    self._tbf(b, port, ["root", "handle", "1:"])
                elif self.delay:
                    netem = ["netem", "delay", self.delay] + ([self.jitter] if self.jitter else [])
                    _run(["tc", "-n", w, "qdisc", "add", "dev", IFACE, "root"] + netem)
        except BaseException:
            self.down()
            raise
        return self

    def down(self) -> List[str]:
        """Remove everything this cluster created; returns what could not be
        removed (empty when all is gone).  Idempotent."""
        left = []
        for ns in reversed(self._created):
            if not delete_namespace(ns):
                left.append(ns)
            NetCluster._live.discard(ns)
        self._created = left
        return left

    def __enter__(self):
        return self.up()

    def __exit__(self, *exc):
        left = self.down()
        if left and exc[0] is None:
            raise NetnsError(f"could not remove namespaces {left}; run `python -m lab.cluster "
                             "cleanup --all`")
        return False

    def qdisc_stats(self) -> Dict[str, str]:
        """``tc -s qdisc`` of every shaped device (sent bytes, drops,
        overlimits): where a shortfall in throughput shows up."""
        out = {}
        for i, w in enumerate(self.worker_ns):
            out[f"w{i}:{IFACE}"] = _run(["tc", "-s", "-n", w, "qdisc", "show", "dev", IFACE],
                                        check=False).stdout.strip()
            out[f"br:p{i}"] = _run(["tc", "-s", "-n", self.bridge_ns, "qdisc", "show", "dev", f"p{i}"],
                                   check=False).stdout.strip()
        return out
