"""An emulated cluster for benchmarks: P network namespaces on one bridge,
each worker's link shaped to ``rate`` in both directions with ``tc tbf``.

    with ShapedNet(2, rate="1gbit") as net:
        run_workers(2, target, payload, prefix=net.prefix, ifname=net.iface)

Worker ``r`` runs under ``ip netns exec`` in its own namespace with
address ``10.214.0.(r+1)`` on ``eth0``; a ``tbf`` on that interface shapes
what it sends, one on its bridge port what it receives (P−1 senders to one
worker share its rate, as at a switch port).  Needs root and iproute2
(``ip``, ``tc``); :func:`available` says why not, and a benchmark then runs
on loopback and labels its figures unshaped.  Namespace names carry the
creating process id: :func:`cleanup` removes those of runs that died.

:func:`run`, :func:`available`, :func:`add_bridge`, :func:`wire_worker` and
:func:`add_tbf` are the building blocks; the lab's cluster emulator builds
its richer topologies from them too (its own namespace prefix and error
class passed in).
"""
from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import subprocess
import time
from typing import List, Optional, Sequence, Tuple, Type

PREFIX = "gtob"
IFACE = "eth0"
_NAME = re.compile(rf"^{PREFIX}-(\d+)-[0-9a-f]+-(br|w\d+)$")


class ShapedNetError(RuntimeError):
    pass


def run(cmd: Sequence[str], check: bool = True,
        error: Type[Exception] = ShapedNetError) -> subprocess.CompletedProcess:
    """Run ``cmd`` (output captured as text); with ``check``, a non-zero
    exit raises ``error`` naming the command, its status and its stderr."""
    p = subprocess.run(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if check and p.returncode != 0:
        raise error(f"`{' '.join(cmd)}` failed ({p.returncode}): {p.stderr.strip()}")
    return p


def available(prefix: str = PREFIX) -> Tuple[bool, str]:
    """Whether shaped namespaces can be made here, and if not, why: root,
    ``ip`` and ``tc``, and a probe namespace named ``<prefix>-<pid>-<tag>-w0``
    (a name :func:`cleanup` of that prefix knows) holding a veth with a tbf."""
    if os.geteuid() != 0:
        return False, "not root (network namespaces and tc need root)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"`{tool}` (iproute2) is not installed"
    probe = f"{prefix}-{os.getpid()}-{secrets.token_hex(2)}-w0"
    try:
        run(["ip", "netns", "add", probe])
        try:
            run(["ip", "-n", probe, "link", "add", "pa", "type", "veth", "peer", "name", "pb"])
            run(["tc", "-n", probe, "qdisc", "add", "dev", "pa", "root", "tbf", "rate", "1gbit", "burst",
             "128kb", "latency", "50ms"])
        finally:
            run(["ip", "netns", "del", probe], check=False)
    except ShapedNetError as e:
        return False, f"cannot make a shaped network namespace: {e}"
    return True, "network namespaces with tc tbf"


def add_bridge(ns: str, name: str, error: Type[Exception] = ShapedNetError) -> None:
    """A bridge ``name`` in namespace ``ns``, up."""
    run(["ip", "-n", ns, "link", "add", name, "type", "bridge"], error=error)
    run(["ip", "-n", ns, "link", "set", name, "up"], error=error)


def wire_worker(bridge_ns: str, port: str, master: str, ns: str, cidr: str, mtu: Optional[int] = None,
                error: Type[Exception] = ShapedNetError) -> None:
    """Join namespace ``ns`` to bridge ``master`` (in ``bridge_ns``): a veth
    whose end ``port`` is a port of the bridge and whose other end is
    :data:`IFACE` in ``ns`` with address ``cidr``; both ends and ``ns``'s
    loopback up.  ``mtu`` (both ends) when given, else the kernel's."""
    mtu_arg = [] if mtu is None else ["mtu", str(mtu)]
    run(["ip", "-n", bridge_ns, "link", "add", port, *mtu_arg, "type", "veth",
         "peer", "name", IFACE, *mtu_arg, "netns", ns], error=error)
    run(["ip", "-n", bridge_ns, "link", "set", port, "master", master, "up"], error=error)
    run(["ip", "-n", ns, "addr", "add", cidr, "dev", IFACE], error=error)
    run(["ip", "-n", ns, "link", "set", IFACE, "up"], error=error)
    run(["ip", "-n", ns, "link", "set", "lo", "up"], error=error)


def add_tbf(ns: str, dev: str, rate: str, burst: str, latency: str, parent: Sequence[str] = ("root",),
            error: Type[Exception] = ShapedNetError) -> None:
    """A ``tbf`` at ``rate`` on ``dev`` in ``ns``, attached at ``parent``
    (``tc`` words: ``root``, or e.g. ``parent 1:1 handle 10:``)."""
    run(["tc", "-n", ns, "qdisc", "add", "dev", dev, *parent, "tbf", "rate", rate, "burst", burst,
         "latency", latency], error=error)


def _pids_in(ns: str) -> List[int]:
    return [int(x) for x in run(["ip", "netns", "pids", ns], check=False).stdout.split() if x.isdigit()]


def _delete(ns: str) -> None:
    # only this module starts processes in these namespaces: end stragglers
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = _pids_in(ns)
        for p in pids:
            try:
                os.kill(p, sig)
            except ProcessLookupError:
                pass
        if not pids:
            break
        time.sleep(0.5)
    run(["ip", "netns", "del", ns], check=False)


def cleanup() -> List[str]:
    """Remove the namespaces of runs whose process is gone; their names."""
    names = [ln.split()[0] for ln in run(["ip", "netns", "list"], check=False).stdout.splitlines() if ln.strip()]
    gone = []
    for ns in names:
        m = _NAME.match(ns)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            _delete(ns)
            gone.append(ns)
    return gone


class ShapedNet:
    """P shaped worker namespaces; a context manager that removes all it
    made, also when setting up fails part-way."""

    def __init__(self, P: int, rate: str = "1gbit", burst: str = "128kb", latency: str = "50ms"):
        if not 1 <= P <= 250:
            raise ValueError(f"P must be in 1..250; got {P}")
        self.P, self.rate, self.burst, self.latency = P, rate, burst, latency
        base = f"{PREFIX}-{os.getpid()}-{secrets.token_hex(3)}"
        self.bridge = f"{base}-br"
        self.workers = [f"{base}-w{r}" for r in range(P)]
        self._made: List[str] = []

    iface = IFACE

    def addr(self, rank: int) -> str:
        return f"10.214.0.{rank + 1}"

    def prefix(self, rank: int) -> List[str]:
        return ["ip", "netns", "exec", self.workers[rank]]

    def describe(self) -> dict:
        return {"shaped": True, "rate": self.rate, "burst": self.burst, "tbf_latency": self.latency,
                "topology": f"{self.P} namespaces on one bridge, tbf both ways"}

    def _tbf(self, ns: str, dev: str) -> None:
        add_tbf(ns, dev, self.rate, self.burst, self.latency)

    def up(self) -> "ShapedNet":
        cleanup()
        try:
            for ns in [self.bridge] + self.workers:
                run(["ip", "netns", "add", ns])
                self._made.append(ns)
            b = self.bridge
            add_bridge(b, "br0")
            for r, w in enumerate(self.workers):
                port = f"p{r}"
                wire_worker(b, port, "br0", w, f"{self.addr(r)}/24")
                self._tbf(w, IFACE)   # what worker r sends
                self._tbf(b, port)    # what it receives
        except BaseException:
            self.down()
            raise
        return self

    def down(self) -> None:
        for ns in reversed(self._made):
            _delete(ns)
        self._made = []

    def __enter__(self) -> "ShapedNet":
        return self.up()

    def __exit__(self, *exc) -> bool:
        self.down()
        return False


def network(P: int, rate: Optional[str]):
    """A :class:`ShapedNet` when ``rate`` is set and namespaces work here,
    else ``None`` with the reason (run on loopback, labelled unshaped)."""
    if rate is None or str(rate).lower() in ("none", "off", "0"):
        return None, "no rate given"
    ok, why = available()
    return (ShapedNet(P, rate=rate), why) if ok else (None, why)
