"""Node topology for the two-level reduction (which node every rank is on,
agreed by every rank) and the transports of the two levels.

A topology is ``node_of_rank``, one node id per rank of the group: ids
``0 .. nodes-1`` in order of first appearance (so node n is rank n of the
cross-node group of leaders); a node's ranks need not be contiguous and
nodes may differ in size; a node's leader is its lowest rank.
``local_size=L`` means rank r on node r // L (L divides the world size).
:func:`agree` gathers every rank's request and raises the same
``ValueError`` on every rank when they disagree or one is invalid.

:class:`TorchEngine` makes the two levels' transports once the topology
is agreed (``torch.distributed`` groups, cached); the Horovod layer has
its own.  :func:`node_broadcast` (the leader's result, a binomial tree of
counted ``Transport.phase`` steps) and its blob format live here too.
See docs/hierarchical.md.
"""
from __future__ import annotations

import datetime
import pickle
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch


from gtopk_plugin.collectives.transport import SingleProcessTransport, Transport

__all__ = ["Topology", "resolve", "agree", "TorchEngine", "node_broadcast"]

Tensor = torch.Tensor


@dataclass(frozen=True)
class Topology:
    """Agreed node layout, seen from ``rank``."""

    node_of_rank: Tuple[int, ...]
    rank: int

    @property
    def size(self) -> int:
        return len(self.node_of_rank)

    @property
    def nodes(self) -> int:
        return max(self.node_of_rank) + 1

    @property
    def node(self) -> int:
        return self.node_of_rank[self.rank]

    def members(self, node: Optional[int] = None) -> List[int]:
        """Ranks of ``node`` (default: this rank's), in rank order."""
        node = self.node if node is None else node
        return [r for r, n in enumerate(self.node_of_rank) if n == node]

    @property
    def local_rank(self) -> int:
        return self.members().index(self.rank)

    @property
    def local_size(self) -> int:
        return len(self.members())

    @property
    def leaders(self) -> List[int]:
        """The lowest rank of every node, by node id (= rank order)."""
        return [self.members(n)[0] for n in range(self.nodes)]

    @property
    def is_leader(self) -> bool:
        return self.local_rank == 0

    def local_sizes(self) -> List[int]:
        return [len(self.members(n)) for n in range(self.nodes)]


def _check_list(node_of_rank, world_size: int) -> Tuple[int, ...]:
    try:
        ids = tuple(node_of_rank)
    except TypeError:
        raise ValueError(f"node_of_rank must be a list of node ids, one per rank; got {node_of_rank!r}") \
            from None
    if len(ids) != world_size:
        raise ValueError(f"node_of_rank has {len(ids)} entries but the group has {world_size} ranks; "
                         "give one node id per rank")
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in ids):
        raise ValueError(f"node_of_rank must hold ints >= 0; got {list(ids)}")
    seen: List[int] = []
    for n in ids:
        if n not in seen:
            seen.append(n)
    if seen != list(range(len(seen))):
        raise ValueError(
            f"node ids must be 0, 1, 2, ... numbered in order of first appearance (rank 0 on node "
            f"0, the next new node 1, ...); got {list(ids)} (first appearances {seen})")
    return ids


def node_keywords(hierarchical: bool, local_size=None, node_of_rank=None,
                  intra_fabric=None) -> Optional[dict]:
    """A framework layer's ``hierarchical=`` / ``local_size=`` /
    ``node_of_rank=`` / ``intra_fabric=`` arguments as the
    :class:`~gtopk_plugin.HierarchicalReducer`'s node keywords, or ``None``
    for a flat reduction.  Node keywords without ``hierarchical=True`` are
    refused rather than ignored: the user meant a hierarchy they would not
    get."""
    if not hierarchical:
        if local_size is not None or node_of_rank is not None or intra_fabric is not None:
            raise ValueError("local_size= / node_of_rank= / intra_fabric= describe the nodes of a "
                             "hierarchical reduction: pass hierarchical=True with them")
        return None
    return {"local_size": local_size, "node_of_rank": None if node_of_rank is None else list(node_of_rank),
            **({} if intra_fabric is None else {"intra_fabric": intra_fabric})}


def resolve(world_size: int, local_size=None, node_of_rank=None, own_node: Optional[int] = None,
            env_local_size: Optional[int] = None) -> Tuple[int, ...]:
    """This rank's view of ``node_of_rank`` from its arguments, in order of
    precedence: ``node_of_rank``, ``local_size``, ``own_node`` (to be
    gathered: returns ``()``, see :func:`agree`), ``env_local_size``
    (``LOCAL_WORLD_SIZE`` as torchrun sets it).  ``ValueError`` when
    invalid or missing."""
    if node_of_rank is not None and local_size is not None:
        raise ValueError("pass local_size= or node_of_rank=, not both")
    if node_of_rank is not None:
        return _check_list(node_of_rank, world_size)
    if local_size is None and own_node is None:
        local_size = env_local_size
        if local_size is None:
            raise ValueError(
                "hierarchical reduction needs the node layout: pass local_size=<ranks per node> "
                "(rank r on node r // local_size, torchrun's layout) or node_of_rank=[node id per "
                "rank], or run under torchrun (LOCAL_WORLD_SIZE)")
    if local_size is not None:
        if isinstance(local_size, bool) or not isinstance(local_size, int) or local_size < 1:
            raise ValueError(f"local_size must be an int >= 1 (ranks per node); got {local_size!r}")
        if world_size % local_size:
            raise ValueError(
                f"local_size={local_size} does not divide the world size {world_size}; for nodes of "
                "different sizes pass node_of_rank=[node id per rank] (e.g. [0, 0, 0, 1, 1])")
        return tuple(r // local_size for r in range(world_size))
    if isinstance(own_node, bool) or not isinstance(own_node, int) or own_node < 0:
        raise ValueError(f"this rank's node id must be an int >= 0; got {own_node!r}")
    return ()


def agree(world: Transport, local_size=None, node_of_rank=None, own_node: Optional[int] = None,
          env_local_size: Optional[int] = None) -> Topology:
    """Collective over ``world`` (every rank of the group calls it): resolve
    every rank's view (:func:`resolve`), gather them, and return the one
    topology -- or raise the same ``ValueError`` on every rank (a rank's
    invalid arguments, ranks that disagree)."""
    P, r = world.size, world.rank
    try:
        view, err = resolve(P, local_size, node_of_rank, own_node, env_local_size), None
    except ValueError as e:
        view, err = None, str(e)
    mine = (err, view, own_node if view == () else None)
    views = world.allgather_object(mine) if P > 1 else [mine]
    errors = [f"rank {q}: {e}" for q, (e, _, _) in enumerate(views) if e is not None]
    if errors:
        raise ValueError("gtopk_plugin: invalid node topology -- " + "; ".join(errors))
    own = [v == () for _, v, _ in views]
    if all(own):  # every rank gave its own node id (Horovod's cross_rank): assemble the list
        lists = {_check_list_or_error([o for _, _, o in views], P)}
    else:
        lists = {v for _, v, _ in views}
    if len(lists) != 1 or (any(own) and not all(own)):
        desc = "; ".join(f"rank {q}: {list(v) if v else f'own node {o}'}" for q, (_, v, o) in enumerate(views))
        raise ValueError("gtopk_plugin: ranks disagree on the node topology (pass the same local_size= "
                         f"or node_of_rank= on every rank): {desc}")
    return Topology(next(iter(lists)), r)


def _check_list_or_error(ids, P):
    try:
        return _check_list(ids, P)
    except ValueError as e:
        raise ValueError(f"gtopk_plugin: invalid node topology from the ranks' own node ids: {e}") from None


# ---------------------------------------------------------------- engines
_TORCH_GROUPS: Dict[tuple, tuple] = {}


class TorchEngine:
    """The two levels on ``torch.distributed``: one group per node (its
    ranks in rank order, leader first) and one group of the node leaders.
    Groups are made once per (group, topology) in a process and shared by
    every reducer on them (making a gloo group costs a store round trip per
    rank).  A group of one rank is a :class:`SingleProcessTransport`."""

    def __init__(self, group=None, timeout: Optional[float] = None):
        from gtopk_plugin.collectives.torch_distributed import TorchDistributedTransport

        self.group = group
        self._world = TorchDistributedTransport(group=group, timeout=timeout)
        self.timeout = self._world.timeout

    def world(self) -> Transport:
        return self._world

    def split(self, topo: Topology) -> Tuple[Transport, Optional[Transport]]:
        import torch.distributed as dist

        # keyed by the group's global ranks (two group objects of the same
        # ranks share the node groups: the subgroup case's store prefix is
        # derived from the ranks) and the default group (a re-initialised job
        # gets new groups)
        ranks = None if self.group is None else tuple(dist.get_process_group_ranks(self.group))
        key = (id(dist.group.WORLD), ranks, topo.node_of_rank)
        groups = _TORCH_GROUPS.get(key)
        if groups is None:
            groups = _TORCH_GROUPS[key] = (self._world_groups(topo) if self.group is None
                                           else self._subgroup_groups(topo))
        intra_pg, lead_pg = groups
        intra, inter = self._transport(intra_pg), None
        if topo.is_leader:
            inter = self._transport(lead_pg)
        return intra, inter

    def _transport(self, pg) -> Transport:
        from gtopk_plugin.collectives.torch_distributed import TorchDistributedTransport

        if pg is None:
            return SingleProcessTransport()
        if isinstance(pg, GlooGroupTransport):
            return GlooGroupTransport(pg.pg, pg.rank, pg.size, self.timeout)  # own counters
        return TorchDistributedTransport(group=pg, timeout=self.timeout)

    def _world_groups(self, topo: Topology):
        """WORLD: every rank makes every group in the same order
        (torch.distributed's rule for new_group); singletons are skipped."""
        import torch.distributed as dist

        td = datetime.timedelta(seconds=self.timeout)
        intra_pg = lead_pg = None
        for n in range(topo.nodes):
            m = topo.members(n)
            if len(m) > 1:
                g = dist.new_group(m, timeout=td)
                intra_pg = g if n == topo.node else intra_pg
        if topo.nodes > 1:
            g = dist.new_group(topo.leaders, timeout=td)
            lead_pg = g if topo.is_leader else None
        return intra_pg, lead_pg

    def _subgroup_groups(self, topo: Topology):
        """A subgroup: ranks outside it never call in, and torch's
        group-local new_group (use_local_synchronization) deadlocks with
        overlapping groups (torch 2.13, gloo) -- so plain gloo groups on the
        default store, made by their members only, under a prefix every
        member derives alike (the group's global ranks and the topology)."""
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _get_default_store

        ranks = dist.get_process_group_ranks(self.group)
        base = f"gtopk_hier/{'_'.join(map(str, ranks))}/{'_'.join(map(str, topo.node_of_rank))}"

        def make(name, members):
            if topo.rank not in members:
                return None
            store = dist.PrefixStore(f"{base}/{name}", _get_default_store())
            pg = dist.ProcessGroupGloo(store, members.index(topo.rank), len(members),
                                       datetime.timedelta(seconds=self.timeout))
            return GlooGroupTransport(pg, members.index(topo.rank), len(members), self.timeout)

        m = topo.members()
        intra = make(f"node{topo.node}", m) if len(m) > 1 else None
        lead = make("leaders", topo.leaders) if topo.nodes > 1 else None
        return intra, lead


# ------------------------------------------------------ the node broadcast
def node_broadcast(intra: Transport, blob: Optional[Tensor], device=None) -> Tensor:
    """The leader's blob to every rank of the node: a binomial tree on the
    node group (round j: local ranks < j send to rank + j), each
    message with its size in front.  Every rank of the node calls it;
    ``blob`` is the leader's (others pass None) and is returned on all.
    ``device``: the gradients' (default: the CPU), where every rank sends
    and receives -- on a "cpu:gloo,cuda:nccl" group the device picks the
    engine, so sender and receiver must agree on it."""
    L, r = intra.size, intra.rank
    device = torch.device("cpu") if device is None else torch.device(device)
    if blob is not None:
        blob = blob.to(device)
    j = 1
    while j < L:
        send_to = r + j if r < j and r + j < L else None
        recv_from = r - j if j <= r < 2 * j else None
        got = intra.phase(send_to, blob if send_to is not None else None, recv_from, None, device, headers=True)
        if got is not None:
            blob = got
        j *= 2
    return blob


class GlooGroupTransport(Transport):
    """A Transport on a bare ``ProcessGroupGloo`` (not registered with
    torch.distributed: the subgroup case of :class:`TorchEngine`).  CPU
    bytes; tensors on another device travel through host memory."""

    max_by_dissemination = True  # pairwise sends are cheap (Transport.control_allreduce_max)

    def __init__(self, pg, rank: int, size: int, timeout: float):
        super().__init__()
        self.pg, self._rank, self._size, self.timeout = pg, rank, size, float(timeout)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    def comm_device(self, device):
        return torch.device("cpu")

    def _wait(self, works, what):
        td = datetime.timedelta(seconds=self.timeout)
        for w in works:
            try:
                w.wait(td)
            except RuntimeError as e:
                raise RuntimeError(f"gtopk_plugin: {what} failed on rank {self._rank} of a node-level "
                                   f"group (a peer died, or did not answer within {self.timeout:g} s): "
                                   f"{e}") from e

    def _raw_sendrecv(self, dst, send, src, recv):
        self._wait([self.pg.recv([recv], src, 0), self.pg.send([send.contiguous()], dst, 0)], "exchange")

    def _raw_send(self, peer, send):
        self._wait([self.pg.send([send.contiguous()], peer, 0)], "send")

    def _raw_recv(self, peer, recv):
        self._wait([self.pg.recv([recv], peer, 0)], "receive")

    def _raw_allreduce_sum_(self, t):
        import torch.distributed as dist

        self._wait([self.pg.allreduce([t], dist.ReduceOp.SUM)], "allreduce")

    def _raw_allreduce_max_(self, t):
        import torch.distributed as dist

        self._wait([self.pg.allreduce([t], dist.ReduceOp.MAX)], "consistency check")

    def _raw_allgather_object(self, obj):
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        n = torch.tensor([data.numel()], dtype=torch.int64)
        sizes = [torch.empty(1, dtype=torch.int64) for _ in range(self._size)]
        self._wait([self.pg.allgather([sizes], [n])], "allgather")
        m = max(int(x[0]) for x in sizes)
        outs = [torch.empty(m, dtype=torch.uint8) for _ in range(self._size)]
        pad = torch.cat([data, data.new_zeros(m - data.numel())])
        self._wait([self.pg.allgather([outs], [pad])], "allgather")
        return [pickle.loads(o[:int(x[0])].numpy().tobytes()) for o, x in zip(outs, sizes)]
