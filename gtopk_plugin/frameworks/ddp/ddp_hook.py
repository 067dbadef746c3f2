"""PyTorch DDP communication hook: sparse gradient reduction for
``DistributedDataParallel``, modelled on ``ddp_comm_hooks`` (one state
object holds every setting and all memory, ``hook(state, bucket) -> Future``
does the work)::

    ddp = DistributedDataParallel(model)
    state = gp.torch_ddp.SparseState(method="gtopk", density=0.01,
                                     named_parameters=model.named_parameters())
    ddp.register_comm_hook(state, gp.torch_ddp.sparse_hook)

The state wraps ONE :class:`gtopk_plugin.GradientReducer`: residuals, step
counter and RNG live in one place and are checkpointed together.  See
docs/ddp.md.

No ``from __future__ import annotations`` here: ``register_comm_hook``
compares the hook's annotations with the real ``dist.GradBucket`` /
``Future[Tensor]`` objects, and string annotations fail that check.
"""
import logging
from typing import Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist

from gtopk_plugin.config import split_momentum_correction
from gtopk_plugin.two_level.hierarchical_reducer import HierarchicalReducer
from gtopk_plugin.reducer import GradientReducer, local_grad_norm
from gtopk_plugin.pipeline.reduce_stats import ReduceStats
from gtopk_plugin.two_level.topology import node_keywords
from gtopk_plugin.pipeline.traffic import StepTraffic
from gtopk_plugin.frameworks.ddp.ddp_compile import check_bucket, check_ddp_mode
from gtopk_plugin.frameworks.ddp.ddp_buckets import (BucketItem, agree_used, fail_group, finish_bucket, reduce_buckets,
                                                     reduce_group, submit_group)
from gtopk_plugin.frameworks.ddp.ddp_naming import ParameterNaming
from gtopk_plugin.frameworks.ddp.ddp_usage import UsageTracker
from gtopk_plugin.frameworks.reducer_keywords import check_reducer_kwargs
from gtopk_plugin.collectives.torch_distributed import TorchDistributedTransport
from gtopk_plugin.pipeline.comm_worker import CommWorker

__all__ = ["SparseState", "sparse_hook"]

logger = logging.getLogger(__name__)

_STATE_VERSION = 1
#: With ``overlap``, consecutive DDP buckets are fused until they hold this
#: many elements (``coalesce_buckets`` left at its default).  Each reduction
#: has fixed costs that do not hide when the worker shares a core with
#: backward (its CPU work, the usage agreement, the consistency check, a
#: message per round); what it can hide is its wire time, which at 1 % and
#: 1 Gbit/s outweighs them only for groups of several million elements
#: (``gtopk-bench overlap`` measures both).  Models below this size reduce
#: once per step; larger ones in groups that overlap the rest of backward.
FUSE_ELEMENTS = 1 << 24


class SparseState(ParameterNaming):
    r"""State of :func:`sparse_hook`: the reducer's settings and memory.

    Args:
        method, density, ...: every :class:`~gtopk_plugin.GradientReducer`
            keyword except ``transport``; validated here (``ValueError``).
        process_group: the group DDP reduces over (``None``: the default).
        named_parameters: ``model.named_parameters()``: names key residuals
            and checkpoints (else ``"param0"``, ... in DDP's first-step order).
        timeout: seconds one exchange may take (``GTOPK_TIMEOUT`` or 300).
        momentum_correction: DGC momentum correction: True takes the SGD
            ``optimizer``'s own momentum and weight decay (pass
            ``optimizer=``), a number is the momentum (docs/recipes.md).
        grad_scaler: a ``torch.amp.GradScaler``: state follows its loss scale.
        overlap: reduce on the communication worker beside backward (default)
            or on the backward thread (False); results are the same.
        coalesce_buckets: True: one reduction per step; False: one per
            bucket; n: buckets fused up to n elements (docs/ddp.md).
        hierarchical, local_size, node_of_rank, intra_fabric: two-level
            reduction (docs/hierarchical.md).  Unused parameters: docs/ddp.md.
    """

    def __init__(self, method: str = "gtopk", density: float = 0.01, process_group=None,
                 named_parameters: Optional[Iterable[Tuple[str, torch.Tensor]]] = None,
                 timeout: Optional[float] = None, momentum_correction=None,
                 optimizer: Optional[torch.optim.Optimizer] = None, grad_scaler=None,
                 hierarchical: bool = False, local_size: Optional[int] = None, node_of_rank=None,
                 intra_fabric: Optional[str] = None, overlap: bool = True, coalesce_buckets=None,
                 **reducer_kwargs):
        check_ddp_mode()  # DDP's Python reducer (compiled autograd): refused (ddp_compile)
        # the state builds its own transport on process_group, so that pickling can drop and rebind the group
        check_reducer_kwargs("SparseState", method, reducer_kwargs,
                             ("method", "density", "process_group", "named_parameters", "timeout"),
                             "`process_group`", "pass process_group=<torch.distributed group> instead of transport=")
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise ValueError("process_group must be None (the default group) or a "
                             "torch.distributed ProcessGroup (e.g. from dist.new_group); got "
                             f"{type(process_group).__name__}")
        if grad_scaler is not None:
            if not callable(getattr(grad_scaler, "get_scale", None)):
                raise ValueError("grad_scaler must be a torch.amp.GradScaler (an object with get_scale())")
            nf = reducer_kwargs.setdefault("nonfinite", "propagate")
            if nf == "skip":
                raise ValueError("nonfinite='skip' with a grad_scaler would hide overflows from the "
                                 "scaler (it would never lower its scale); use 'propagate' (default "
                                 "with a grad_scaler) or 'raise'")
        momentum, bind = split_momentum_correction(momentum_correction, optimizer, named_parameters)
        if momentum is not None:
            reducer_kwargs["momentum_correction"] = momentum
        if bind:
            named_parameters = list(named_parameters)
        if not isinstance(overlap, bool):
            raise ValueError(f"overlap must be True or False, got {overlap!r}")
        if coalesce_buckets is None:  # one reduction per step where nothing overlaps, or k is global
            coalesce_buckets = FUSE_ELEMENTS if overlap and reducer_kwargs.get("granularity") != "global" else True
        if not isinstance(coalesce_buckets, (bool, int)) or coalesce_buckets < 0:
            raise ValueError("coalesce_buckets must be True, False or a number of elements >= 0, got "
                             f"{coalesce_buckets!r}")
        self.overlap, self.coalesce_buckets = overlap, coalesce_buckets
        self.grad_scaler = grad_scaler
        # -- hyper-parameters (kept so that unpickling can rebuild the reducer) --
        self._reducer_kwargs = dict(reducer_kwargs, method=method, density=density)
        self.process_group = process_group
        self.timeout = timeout
        # GradientReducer / ReducerConfig / the transport validate every
        # other value with a ValueError naming the keyword.
        self._hier = node_keywords(hierarchical, local_size, node_of_rank, intra_fabric)
        self.reducer = _make_reducer(self._reducer_kwargs, self._hier, process_group, timeout)
        self._needs_optimizer = False
        if bind:
            self.reducer.bind_optimizer(optimizer, named_parameters)
        # each bucket's persistent result buffer and the names last written
        # there (ddp_buckets._result_views)
        self._results: dict = {}
        self._written: dict = {}
        # which parameters received a gradient this step, and the transport
        # the ranks agree on it over (ddp_usage: DDP's unused parameters)
        self._usage = UsageTracker()
        self._usage_transport = TorchDistributedTransport(group=process_group, timeout=timeout)
        # buckets of the current step held back (coalescing, clipping: see sparse_hook)
        self._pending: List[tuple] = []
        self._init_overlap()
        # GradScaler.get_scale() of the current step (read at its first bucket)
        self._step_scale: Optional[float] = None
        self._init_naming(named_parameters)  # ddp_naming.ParameterNaming
        # -- per-step traffic (sum over the buckets of one training step) --
        self._traffic_acc = StepTraffic()
        self._intra = [0, 0]  # hierarchical: node-level bytes sent, received this step
        self.last_step_traffic: Optional[dict] = None

    # ------------------------------------------------------------------ API
    @property
    def last_stats(self) -> Optional[ReduceStats]:
        """The reducer's statistics of the last bucket reduced."""
        return self.reducer.last_stats

    @property
    def step(self) -> int:
        """Training steps completed (advanced once per step, at the last bucket)."""
        return self.reducer.step

    def close(self, timeout: Optional[float] = None) -> bool:
        """End the communication worker's thread (a later step starts a new
        one); True when it has ended within ``timeout`` seconds."""
        ok = self.reducer.close(timeout) if isinstance(self.reducer, GradientReducer) else True
        return (self._worker.close(timeout=timeout) if self._worker is not None else True) and ok

    def bind_optimizer(self, optimizer: torch.optim.Optimizer,
                       named_parameters: Iterable[Tuple[str, torch.Tensor]]) -> None:
        """(Re)bind the optimizer for momentum correction, e.g. after
        unpickling a state saved with ``momentum_correction=True``."""
        self.reducer.bind_optimizer(optimizer, named_parameters)
        self._needs_optimizer = False

    def state_dict(self) -> dict:
        """Everything a bit-exact resume needs: the reducer's residuals, step
        and RNG state, and the parameter names in first-appearance order."""
        self._settle()
        return {"version": _STATE_VERSION, "reducer": self.reducer.state_dict(),
                "named": self._named, "params": [(n, list(s)) for n, s in self._order]}

    def load_state_dict(self, sd: dict) -> None:
        if not isinstance(sd, dict) or sd.get("version") != _STATE_VERSION:
            raise ValueError(f"unsupported SparseState state version "
                             f"{sd.get('version') if isinstance(sd, dict) else sd!r}")
        self._settle()
        order = [(str(n), tuple(int(d) for d in s)) for n, s in sd["params"]]
        # a hierarchical state keeps the residuals in its leader's inner reducer
        residual_names = set(sd["reducer"].get("residuals") or (sd["reducer"].get("inner") or {}).get(
            "residuals", {}))
        known = {n for n, _ in order}
        if self._given:
            known = {name for _, name in self._given.values()}
        missing = sorted(residual_names - known)
        if missing:
            raise ValueError(
                f"the state holds residuals for {missing[:5]} which this SparseState does not "
                "name (saved with different named_parameters, or with automatic names while "
                "this state has named_parameters, or vice versa)")
        if not self._given:
            # Parameters already seen in this process must agree with the
            # recorded first-appearance order, or their residuals would be
            # attached to the wrong tensors.
            for i, (name, p_name) in enumerate(zip(order, (v[1] for v in self._seen.values()))):
                if name[0] != p_name:
                    raise ValueError(f"parameter {i} is named {p_name!r} here but {name[0]!r} in "
                                     "the state; load the state before the first backward")
        self.reducer.load_state_dict(sd["reducer"])
        self._order = order
        self._named = bool(sd.get("named", self._named)) or bool(self._given)

    # ------------------------------------------------------------- pickling
    # Process groups cannot be pickled (and a saved group would be meaningless
    # in another job), so they are dropped and the state rebinds to the
    # default group, as DDP's PowerSGDState does.  Parameter ids do not
    # survive a process either: the state keeps names in first-appearance
    # order instead (see ``name_of``).
    def __getstate__(self):
        if self.process_group is not None:
            logger.warning("NOTE: process group is not serializable and is excluded from the "
                           "saved SparseState.")
        return {"version": _STATE_VERSION, "reducer_kwargs": self._reducer_kwargs,
                "timeout": self.timeout, "state": self.state_dict(), "hierarchy": self._hier,
                "coalesce_buckets": self.coalesce_buckets, "overlap": self.overlap,
                "momentum_correction": self.reducer.binding is not None,
                "last_step_traffic": self.last_step_traffic}

    def __setstate__(self, d):
        if d.get("version") != _STATE_VERSION:
            raise ValueError(f"unsupported pickled SparseState version {d.get('version')!r}")
        self._reducer_kwargs = dict(d["reducer_kwargs"])
        self.process_group = None  # the default group, resolved lazily
        self.timeout = d["timeout"]
        self._hier = d.get("hierarchy")
        self.coalesce_buckets = d.get("coalesce_buckets", True)
        self.overlap = d.get("overlap", False)
        self._init_overlap()
        self.reducer = _make_reducer(self._reducer_kwargs, self._hier, None, self.timeout)
        self._given, self._seen, self._order = {}, {}, []
        self._named = False
        self._traffic_acc, self._intra = StepTraffic(), [0, 0]
        self._pending, self._results, self._written = [], {}, {}
        self._usage = UsageTracker()
        self._usage_transport = TorchDistributedTransport(group=None, timeout=self.timeout)
        self._step_scale = None
        self.grad_scaler = None  # rebind with state.grad_scaler = scaler
        self.last_step_traffic = d.get("last_step_traffic")
        # the optimizer does not travel with the state: correction stays off
        # (and the hook refuses to run) until bind_optimizer() rebinds it
        self._needs_optimizer = bool(d.get("momentum_correction", False))
        self.load_state_dict(d["state"])

    # ------------------------------------------------------------ internals
    def _init_overlap(self) -> None:
        self._group: List[BucketItem] = []  # buckets waiting to be fused (sparse_hook)
        self._fresh = True  # the next group starts a step (the worker's failure scope)
        self._worker: Optional[CommWorker] = None  # a hierarchical reducer's worker

    def _comm_worker(self, device) -> CommWorker:
        """The worker that runs the step's reductions: the reducer's own."""
        if isinstance(self.reducer, GradientReducer):
            return self.reducer.worker(device)
        if self._worker is None or self._worker.closed:
            self._worker = CommWorker("gtopk-comm-ddp", device=device)
        return self._worker

    def _settle(self) -> None:
        if self._worker is not None:
            self._worker.drain()

    def _record_traffic(self, last: bool, reduced: bool = True) -> None:
        st = self.reducer.last_stats
        if reduced and st is not None:
            self._traffic_acc.add(st)  # one bucket
            if self._hier is not None:  # hierarchical: the node level's bytes apart
                self._intra = [self._intra[0] + st.intra_bytes_sent, self._intra[1] + st.intra_bytes_received]
        if last:
            d = self._traffic_acc.as_dict()
            if self._hier is not None:
                d.update(intra_bytes_sent=self._intra[0], intra_bytes_received=self._intra[1],
                         inter_bytes_sent=d["bytes_sent"], inter_bytes_received=d["bytes_received"])
            self.last_step_traffic, self._traffic_acc, self._intra = d, StepTraffic(), [0, 0]

    def __repr__(self):
        kw = ", ".join(f"{k}={v!r}" for k, v in sorted(self._reducer_kwargs.items()))
        return f"SparseState({kw}, step={self.step})"


def _make_reducer(kwargs: dict, hier: Optional[dict], group, timeout):
    """A flat GradientReducer on ``group``, or a HierarchicalReducer
    splitting it into nodes."""
    if hier is None:
        return GradientReducer(transport=TorchDistributedTransport(group=group, timeout=timeout), **kwargs)
    return HierarchicalReducer(group=group, timeout=timeout, **hier, **kwargs)


def sparse_hook(state: SparseState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: reduce the bucket's gradients with
    ``state``'s :class:`~gtopk_plugin.GradientReducer` (sparse selection with
    error feedback, then sparse allgather, gTop-k butterfly or dense
    allreduce) and return the averaged update in the bucket buffer's layout.

    Parameters that no rank used this step (DDP's ``find_unused_parameters``
    / ``static_graph``: DDP leaves their ``.grad`` alone) are left out of the
    reduction, residuals and velocities untouched (:mod:`.ddp_usage`).

    Example::
        >>> ddp_model.register_comm_hook(SparseState(method="gtopk", density=0.01), sparse_hook)
    """
    check_bucket(bucket)  # DDP's Python reducer passes (grad, param): refused (ddp_compile)
    params = bucket.parameters()
    # Residuals are keyed by parameter name, not bucket index: DDP rebuilds
    # its buckets after the first iteration, so a bucket's index and content
    # change while each parameter keeps its name.
    names = [state.name_of(p) for p in params]
    if state._needs_optimizer:
        raise RuntimeError("this SparseState was saved with momentum_correction=True; the optimizer "
                           "does not travel with it: call state.bind_optimizer(optimizer, "
                           "model.named_parameters()) before training")
    dev = bucket.buffer().device
    fut: torch.futures.Future[torch.Tensor] = (
        torch.futures.Future(devices=[dev]) if state.overlap and dev.type == "cuda" else torch.futures.Future())
    item = BucketItem(names, bucket.gradients(), bucket.buffer(), bucket.index(), fut,
                      state._usage.used(params))
    last = bucket.is_last()
    if bucket.index() == 0 and (state._group or state._pending):
        # a step whose backward failed before its last bucket: drop its rest
        _abandon(state)
    if state.coalesce_buckets is not True and state.reducer.config.clip_norm is None:
        return _reduce_fused(state, item, last)
    # Hold the bucket back (DDP waits for the futures only after the last
    # bucket's hook has run) and reduce the step's buckets when the last is
    # ready: all in one call (coalesce_buckets), or in order with the
    # step's local norm for clipping.
    state._pending.append(item)
    if last:
        pending, state._pending = state._pending, []
        try:
            used = agree_used(state, pending)  # one agreement for the step
            norm = None
            if state.reducer.config.clip_norm is not None:
                # over what is reduced: DDP discards the parameters no rank used
                norm = local_grad_norm([g for it in pending for n, g in zip(it.names, it.grads) if used[n]])
            if state.coalesce_buckets:
                updates = reduce_buckets(state, pending, True, norm, used)
                for it in pending:
                    finish_bucket(state, it, updates)
            else:
                for j, it in enumerate(pending):
                    finish_bucket(state, it, reduce_buckets(state, [it], j == len(pending) - 1, norm, used))
        except BaseException as exc:
            # the held-back futures must not stay pending forever
            for it in pending:
                if not it.fut.done():
                    it.fut.set_exception(exc)
            raise
        finally:
            state._usage.end_step()
    return fut


def _reduce_fused(state: SparseState, item: BucketItem, last: bool) -> torch.futures.Future:
    """Buckets one by one, or consecutive ones fused up to
    ``coalesce_buckets`` elements: reduced on the backward thread, or with
    ``overlap`` submitted to the communication worker and the hook returns
    at once.  The last bucket's hook waits for the step's reductions: DDP's
    own collectives (the unused-parameter map) follow, and must not cross
    ours on the group; backward has nothing left to overlap by then."""
    state._group.append(item)
    fuse = 0 if state.coalesce_buckets is False else int(state.coalesce_buckets)
    if last or sum(it.buffer.numel() for it in state._group) >= fuse:
        group, state._group = state._group, []
        if state.overlap:
            submit_group(state, state._comm_worker(item.buffer.device), group, last, state._fresh)
            state._fresh = last
        else:
            try:
                reduce_group(state, group, last)
            except BaseException as exc:
                fail_group(group, exc)
                state._usage.end_step()
                raise
    if last:
        if state.overlap:
            state._comm_worker(item.buffer.device).drain()
        state._usage.end_step()
    return item.fut


def _abandon(state: SparseState) -> None:
    exc = RuntimeError("gtopk_plugin: this bucket's step ended before its last bucket (its backward failed)")
    fail_group(state._group + state._pending, exc)
    # (usage is kept: DDP too counts a parameter used by any backward since
    # the last completed step)
    state._group, state._pending, state._fresh = [], [], True
