"""An emulated cluster of *nodes*: ``nodes`` machines with
``local`` workers each; the workers of one node share a fast, unshaped
link among themselves, and every node reaches the others through one
shaped uplink that its workers share.

    with NodeCluster(4, 2, rate="1gbit") as net:    # P = 8, ranks 2j, 2j+1 on node j
        net.node_of(r), net.prefix(r), net.addr(r)

Topology (everything inside namespaces of this run; names as
:class:`~.netns.NetCluster`'s, so :func:`~.netns.cleanup` knows them)::

    w0  eth0 ─veth─ p0 ┐
    w1  eth0 ─veth─ p1 ┴ n0 (bridge) ── u0 ═veth═ c0 ┐
    w2  eth0 ─veth─ p2 ┐                             ├ core (bridge)
    w3  eth0 ─veth─ p3 ┴ n1 (bridge) ── u1 ═veth═ c1 ┘
                          all bridges in gtkb-<pid>-<tag>-br

One L2 segment (10.213.0.0/24): a frame between two workers of one node
crosses only their node's bridge ``n<j>`` (unshaped: what the kernel's
veth and bridge carry, several Gbit/s here); a frame to another node
leaves through the node's uplink ``u<j>`` and enters the other node through
``c<i>``.  Shaping: a ``tbf`` at ``rate`` on ``u<j>`` (what node j sends)
and on ``c<j>`` (what it receives), so a node's 1 Gbit/s is shared by all
its workers in both directions, as on a real node's one NIC; two nodes
sending to one share its incoming rate (incast at the switch port).
``intra_rate`` (default: none) shapes the worker ports too, to emulate a
slower local fabric.  No netem: this is the tbf-only emulation of
:mod:`.netns` (the kernel here has no netem), so links add no latency.
"""
from __future__ import annotations

from typing import Dict, List, Optional

from gtopk_plugin.bench import shaped_net
from lab.cluster.netns import IFACE, NetCluster, NetnsError, _run


class NodeCluster(NetCluster):
    """``nodes`` × ``local`` worker namespaces (rank r on node r // local),
    a bridge per node, one shaped uplink per node into a core bridge; a
    context manager that removes all of it (also on error)."""

    def __init__(self, nodes: int, local: int, rate: Optional[str] = "1gbit", burst: str = "128kb",
                 tbf_latency: str = "50ms", intra_rate: Optional[str] = None, subnet: str = "10.213.0",
                 mtu: int = 1500, sysctls: Optional[Dict[str, str]] = None):
        if nodes < 1 or local < 1:
            raise ValueError(f"nodes and local must be >= 1; got {nodes} x {local}")
        super().__init__(nodes * local, rate=rate, burst=burst, tbf_latency=tbf_latency, subnet=subnet,
                         mtu=mtu, sysctls=sysctls)
        self.nodes, self.local, self.intra_rate = nodes, local, intra_rate

    def node_of(self, rank: int) -> int:
        return rank // self.local

    def describe(self) -> Dict:
        d = super().describe()
        d.update(nodes=self.nodes, local=self.local, intra_rate=self.intra_rate,
                 node_of_rank=[self.node_of(r) for r in range(self.P)],
                 topology=(f"{self.nodes} nodes x {self.local} workers: a bridge per node "
                           f"({'unshaped' if not self.intra_rate else self.intra_rate} between its workers), "
                           f"one uplink per node shaped to {self.rate or 'unshaped'} each way into a core bridge"))
        return d

    def _shape(self, ns: str, dev: str, rate: str) -> None:
        self._tbf(ns, dev, ["root", "handle", "1:"], rate=rate)

    def up(self) -> "NodeCluster":
        try:
            self._ns(self.bridge_ns)
            b = self.bridge_ns
            shaped_net.add_bridge(b, "core", error=NetnsError)
            for j in range(self.nodes):
                shaped_net.add_bridge(b, f"n{j}", error=NetnsError)
                _run(["ip", "-n", b, "link", "add", f"u{j}", "mtu", str(self.mtu), "type", "veth",
                      "peer", "name", f"c{j}", "mtu", str(self.mtu)])
                _run(["ip", "-n", b, "link", "set", f"u{j}", "master", f"n{j}", "up"])
                _run(["ip", "-n", b, "link", "set", f"c{j}", "master", "core", "up"])
                if self.rate:
                    self._shape(b, f"u{j}", self.rate)  # node j -> the others
                    self._shape(b, f"c{j}", self.rate)  # the others -> node j
            for i in range(self.P):
                w = self._worker(i, f"n{self.node_of(i)}")
                if self.intra_rate:
                    self._shape(w, IFACE, self.intra_rate)
                    self._shape(b, f"p{i}", self.intra_rate)
        except BaseException:
            self.down()
            raise
        return self

    def qdisc_stats(self) -> Dict[str, str]:
        """``tc -s qdisc`` of every uplink (``u<j>``: sent by node j; ``c<j>``:
        delivered to node j): the bytes that crossed the shaped links."""
        out = {}
        for j in range(self.nodes):
            for dev in (f"u{j}", f"c{j}"):
                out[f"br:{dev}"] = _run(["tc", "-s", "-n", self.bridge_ns, "qdisc", "show", "dev", dev],
                                        check=False).stdout.strip()
        return out

    def link_bytes(self) -> Dict[str, List[int]]:
        """Bytes each node sent and received over its uplink so far (the
        veth counters, Ethernet/IP/TCP headers included), by node."""
        def counter(dev, what):
            p = _run(["ip", "netns", "exec", self.bridge_ns, "cat",
                      f"/sys/class/net/{dev}/statistics/{what}_bytes"], check=False)
            return int(p.stdout.strip() or 0)
        # u<j> transmits towards the core: what node j sent
        return {"sent": [counter(f"u{j}", "tx") for j in range(self.nodes)],
                "received": [counter(f"c{j}", "tx") for j in range(self.nodes)]}


def network(nodes: int, local: int, opts):
    """A NodeCluster, or the loopback stand-in (every worker on 127.0.0.1,
    labelled unshaped, no node links) where namespaces cannot be made."""
    from lab.cluster import harness, netns

    P = nodes * local
    if opts.no_netns:
        return harness.Loopback(P, "--no-netns given")
    ok, why = netns.available()
    if not ok:
        return harness.Loopback(P, why)
    if str(opts.delay) not in ("0", "0ms", "", "None") or str(opts.jitter) not in ("0", "0ms", "", "None"):
        raise NetnsError("--nodes emulates links with tbf only (no --delay/--jitter)")
    rate = None if str(opts.rate).lower() in ("none", "0", "off") else opts.rate
    intra = getattr(opts, "intra_rate", None)
    sysctls = dict(kv.split("=", 1) for kv in (getattr(opts, "sysctl", None) or []))
    return NodeCluster(nodes, local, rate=rate, burst=opts.burst, tbf_latency=opts.tbf_latency,
                       intra_rate=None if str(intra).lower() in ("none", "0", "off", "") else intra,
                       sysctls=sysctls)
