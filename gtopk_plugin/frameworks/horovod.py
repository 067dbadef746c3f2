"""Horovod layer: a :class:`~gtopk_plugin.Transport` on Horovod's collectives,
and a drop-in ``DistributedOptimizer`` whose ``compression=`` argument picks
dense Horovod allreduce or a sparse method of the core::

    import horovod.torch as hvd
    from gtopk_plugin.horovod import DistributedOptimizer, Compression

    hvd.init()
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               named_parameters=model.named_parameters(),
                               compression=Compression.gtopk(0.01))

This is the only module of the package that imports Horovod (DESIGN.md §2);
everything it does to gradients is the core's ``GradientReducer``.

How the two paths work
----------------------
* ``Compression.none`` / ``Compression.fp16`` (or any Horovod ``Compressor``):
  exactly what ``horovod.torch.DistributedOptimizer`` does — one named
  ``allreduce_async_`` per gradient as soon as it is ready (Horovod's own
  tensor fusion batches them), waited for in ``step()``/``synchronize()``.
* A sparse ``Compression.topk/gtopk/rtopk/randomk/threshold(density)``: the
  parameters are cut into fixed buckets (reverse registration order, about
  ``fusion_threshold`` bytes each, or the caller's ``groups``); when every
  gradient of a bucket is ready, a worker thread runs
  ``GradientReducer.reduce`` on it while backward continues.  Buckets are
  reduced in a fixed order on every rank and every Horovod op carries a
  name derived from (bucket, position in the schedule), so Horovod's
  coordinator pairs the same op on every rank whatever the hook order.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import pickle
import time
import warnings
from typing import Dict, List, Optional, Tuple

import torch

try:
    import horovod.torch as hvd
    from horovod.torch import mpi_ops as _ops
    from horovod.torch.compression import Compression as _HvdCompression
    from horovod.torch.compression import Compressor as _HvdCompressor
    from horovod.torch.elastic import state as _hvd_elastic_state
except ImportError as _e:  # pragma: no cover - exercised only without Horovod
    raise ImportError(
        "gtopk_plugin.horovod needs Horovod built with PyTorch support "
        f"(import failed: {_e}). Install it into this environment with:  "
        "bash scripts/install_horovod.sh  (builds horovod==0.28.1 against the installed torch, "
        "cached after the first build)") from _e

from .. import config
from ..collectives.transport import Transport
from ..config import ReducerConfig
from ..reducer import GradientReducer, local_grad_norm
from ..stats import ReduceStats
from .compression_names import SPARSE_METHODS, CompressionNames

__all__ = ["HorovodTransport", "Compression", "SparseCompression", "DistributedOptimizer",
           "SparseOptimizerStateHandler"]

Tensor = torch.Tensor
_HEADER = 8           # bytes of one int64 size header (as Transport counts them)
_STATE_KEY = "gtopk_plugin"  # our entry in optimizer.state_dict()
_NONFINITE = ("raise", "skip", "propagate")


# ---------------------------------------------------------------------------
# Transport
# ---------------------------------------------------------------------------
class HorovodTransport(Transport):
    """Transport on Horovod collectives over ``process_set``.

    Horovod has no point-to-point send/recv.  The butterfly is written as a
    schedule every rank walks (:meth:`Transport.phase`), so each step is one
    ``hvd.alltoall`` with ``splits``: a rank's split is non-zero only for its
    partner, and ranks idle in that step send nothing but still take part.
    Sparse allgather is one ``hvd.allgather`` (sizes ride in an 8-byte
    prefix when they are not known in advance).  Byte, message and round
    counts follow the base class's rules exactly (ring model for allreduce
    and allgather), so statistics equal those of the torch.distributed
    transport for the same run.

    Op names are ``{prefix}.{scope}.{kind}.{n}``: ``scope`` is set by the
    caller per unit of work (a bucket) and ``n`` counts ops within it, so the
    same op has the same name on every rank and on every step (which also
    lets Horovod's response cache recognise it).
    """

    def __init__(self, process_set=None, prefix: str = "gtopk"):
        super().__init__()
        self.process_set = hvd.global_process_set if process_set is None else process_set
        self.prefix = prefix
        self._scope = "main"
        self._seq = 0

    def set_scope(self, scope: str) -> None:
        """Start a new naming scope (op counter back to 0)."""
        self._scope = scope
        self._seq = 0

    def _name(self, kind: str) -> str:
        self._seq += 1
        return f"{self.prefix}.{self._scope}.{kind}.{self._seq}"

    @property
    def rank(self) -> int:
        return self.process_set.rank()

    @property
    def size(self) -> int:
        return self.process_set.size()

    def comm_device(self, device) -> torch.device:
        # A CPU-only Horovod moves CPU tensors; CUDA tensors stay on the GPU
        # only when Horovod was built with NCCL (GPU collectives).
        device = torch.device(device)
        if device.type == "cuda" and hvd.nccl_built():
            return device
        return torch.device("cpu")

    # Errors are left as Horovod raises them (HorovodInternalError): elastic
    # training recognises a lost peer by that type.
    @staticmethod
    def _wait(handle):
        """``hvd.synchronize`` after polling with short sleeps: Horovod's own
        wait spins on a core, which would take CPU from the backward pass
        that this thread overlaps with.  The sleep (≤ 0.5 ms) stays below
        Horovod's 1 ms cycle, so it adds almost no latency."""
        pause = 2e-5
        while not _ops.poll(handle):
            time.sleep(pause)
            pause = min(pause * 2, 5e-4)
        return _ops.synchronize(handle)

    def _alltoall(self, t: Tensor, splits: Tensor, kind: str) -> Tuple[Tensor, Tensor]:
        h = _ops.alltoall_async(t, splits=splits, name=self._name(kind), process_set=self.process_set)
        out, got = self._wait(h)
        return out, got

    def _allgather(self, t: Tensor, kind: str) -> Tensor:
        return self._wait(_ops.allgather_async(t, name=self._name(kind), process_set=self.process_set))

    # -- counted operations, Horovod style --------------------------------
    def phase(self, send_to, blob, recv_from, recv_nbytes, device, headers):
        P = self.size
        dev = self.comm_device(torch.device(device) if blob is None else blob.device)
        send = blob.to(dev) if send_to is not None else torch.empty(0, dtype=torch.uint8, device=dev)
        splits = torch.zeros(P, dtype=torch.int32)
        if send_to is not None:
            splits[send_to] = send.numel()
        out, got = self._alltoall(send, splits, "phase")
        c = self.counters
        if send_to is not None:
            c.payload_bytes_sent += send.numel()
            c.messages_sent += 1
            if headers:  # the sizes travel inside Horovod's alltoall; counted as the base class does
                c.header_bytes_sent += _HEADER
        if recv_from is None:
            if out.numel():
                raise RuntimeError(f"gtopk_plugin: rank {self.rank} received {out.numel()} unexpected "
                                   "bytes in a butterfly step (ranks disagree on the schedule)")
            return None
        n = int(got[recv_from])
        if n != out.numel() or (not headers and recv_nbytes is not None and n != recv_nbytes):
            raise RuntimeError(
                f"gtopk_plugin: rank {self.rank} expected {recv_nbytes} bytes from rank {recv_from} "
                f"in a butterfly step, got {n} (splits {got.tolist()})")
        c.payload_bytes_received += n
        if headers:
            c.header_bytes_received += _HEADER
        return out

    def allgather_blobs(self, blob: Tensor, nbytes: Optional[List[int]] = None) -> List[Tensor]:
        P, r = self.size, self.rank
        dev = self.comm_device(blob.device)
        blob = blob.to(dev)
        with_sizes = nbytes is None
        send = torch.cat([_int64_bytes(blob.numel(), dev), blob]) if with_sizes else blob
        out = self._allgather(send, "allgather")
        parts, sizes, pos = [], [], 0
        for q in range(P):
            if with_sizes:
                n = _read_int64(out, pos)
                pos += _HEADER
            else:
                n = int(nbytes[q])
            parts.append(out[pos:pos + n])
            sizes.append(n)
            pos += n
        if pos != out.numel():
            raise RuntimeError(f"gtopk_plugin: allgather returned {out.numel()} bytes on rank {r}, "
                               f"expected {pos} (ranks disagree on message sizes)")
        parts[r] = blob
        c = self.counters
        if with_sizes:
            c.header_bytes_sent += _HEADER * (P - 1)
            c.header_bytes_received += _HEADER * (P - 1)
        # Ring model, as Transport.allgather_blobs: a worker forwards every
        # block but its right neighbour's and receives every block but its own.
        total = sum(sizes)
        c.payload_bytes_sent += total - sizes[(r + 1) % P]
        c.payload_bytes_received += total - sizes[r]
        c.messages_sent += P - 1
        return parts

    # -- raw primitives ----------------------------------------------------
    def _raw_sendrecv(self, dst, send, src, recv):
        # Valid when every rank of the set calls it at once (a ring step).
        splits = torch.zeros(self.size, dtype=torch.int32)
        splits[dst] = send.numel()
        out, got = self._alltoall(send, splits, "sendrecv")
        start = int(got[:src].sum())
        if int(got[src]) != recv.numel():
            raise RuntimeError(f"gtopk_plugin: expected {recv.numel()} bytes from rank {src}, got {int(got[src])}")
        recv.copy_(out[start:start + recv.numel()].view(recv.dtype) if recv.dtype == out.dtype
                   else out[start:start + recv.numel()])

    def _raw_send(self, peer, send):
        raise NotImplementedError(
            "Horovod has no point-to-point send; HorovodTransport runs pairwise schedules as "
            "collective steps through phase()")

    def _raw_recv(self, peer, recv):
        raise NotImplementedError(
            "Horovod has no point-to-point receive; HorovodTransport runs pairwise schedules as "
            "collective steps through phase()")

    def _raw_allreduce_sum_(self, t):
        self._wait(_ops.allreduce_async_(t, name=self._name("sum"), op=hvd.Sum, process_set=self.process_set))

    def _raw_allreduce_max_(self, t):
        self._wait(_ops.allreduce_async_(t, name=self._name("max"), op=hvd.Max, process_set=self.process_set))

    def _raw_allgather_object(self, obj):
        # hvd.allgather_object has no process_set argument in 0.28.1: pickle
        # into bytes with a size prefix and allgather those.
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        out = self._allgather(torch.cat([_int64_bytes(data.numel(), data.device), data]), "object")
        objs, pos = [], 0
        for _ in range(self.size):
            n = _read_int64(out, pos)
            objs.append(pickle.loads(out[pos + _HEADER:pos + _HEADER + n].numpy().tobytes()))
            pos += _HEADER + n
        return objs


def _int64_bytes(n: int, device) -> Tensor:
    return torch.tensor([n], dtype=torch.int64).view(torch.uint8).to(device)


def _read_int64(buf: Tensor, pos: int) -> int:
    return int(buf[pos:pos + _HEADER].cpu().clone().view(torch.int64)[0])


# ---------------------------------------------------------------------------
# Compression
# ---------------------------------------------------------------------------
class SparseCompression:
    """A sparse method of the core, selected as a Horovod ``compression=``.

    Made by ``Compression.topk/gtopk/rtopk/randomk/threshold(density, ...)``;
    validated at construction (``ValueError`` naming the bad keyword).

    Args:
        method, density: as :class:`~gtopk_plugin.GradientReducer`.
        r_factor: rTop-k's r (keep k of the top r·k).
        value_dtype: ``None``, ``torch.float16`` or ``torch.bfloat16`` values
            on the wire.
        warmup: density schedule (``DensityWarmup``, a sequence, or a callable).
        merge, granularity, seed, error_feedback, kernels: as GradientReducer
            (``granularity="global"`` selects per bucket).
        nonfinite: ``"raise"`` (every rank raises, nothing applied),
            ``"skip"`` (every rank applies zero for the step, residuals kept),
            or ``"propagate"`` (as "skip", but the skipped bucket's gradients
            are set to NaN on every rank, so a ``torch.cuda.amp.GradScaler``
            sees the overflow, skips ``optimizer.step`` and lowers its scale,
            as it would with dense Horovod allreduce).
        fusion_threshold: bucket size in bytes (default ``GTOPK_FUSION_THRESHOLD``
            or 64 MiB).  Smaller buckets start their exchange earlier in
            backward; each costs a consistency check and its own rounds.
        momentum_correction: DGC momentum correction with factor masking,
            using the wrapped SGD optimizer's own momentum, nesterov,
            dampening and weight decay (read at every step; the optimizer's
            ``step()`` then runs with momentum and weight decay 0 for those
            groups, restored right after).  Adam/AdamW: ``ValueError`` (use
            plain error feedback).  See docs/momentum.md.
        momentum, nesterov, momentum_masking: explicit correction settings
            (as GradientReducer) for an optimizer built without momentum.
        clip_norm: DGC local clipping (threshold × P^-1/2, global norm over
            all buckets of the step: with it, buckets are reduced after
            backward, in ``synchronize()``).

    Objects of this class only work with ``gtopk_plugin.horovod.DistributedOptimizer``.
    """

    def __init__(self, method: str, density: float, *, r_factor: float = 4.0,
                 value_dtype: Optional[torch.dtype] = None, warmup=None, merge: Optional[str] = None,
                 granularity: str = "layer", seed: int = 0, nonfinite: str = "raise",
                 error_feedback: bool = True, kernels: Optional[str] = None,
                 fusion_threshold: Optional[int] = None, momentum_correction: bool = False,
                 momentum: Optional[float] = None, nesterov: bool = False,
                 momentum_masking: bool = True, clip_norm: Optional[float] = None):
        if method == "dense":
            raise ValueError("dense reduction is Compression.none (Horovod's own allreduce), not a sparse "
                             "compression")
        if nonfinite not in _NONFINITE:
            raise ValueError(f"unknown nonfinite policy {nonfinite!r}; pass 'raise', 'skip' or 'propagate'")
        if fusion_threshold is None:
            fusion_threshold = config.env_fusion_threshold_bytes()
        if isinstance(fusion_threshold, bool) or not isinstance(fusion_threshold, int) or fusion_threshold < 1:
            raise ValueError(f"fusion_threshold must be a positive number of bytes; got {fusion_threshold!r}")
        self.nonfinite = nonfinite
        self.fusion_threshold = fusion_threshold
        kw = dict(method=method, density=density, r_factor=r_factor, merge=merge,
                  granularity=granularity, value_dtype=value_dtype, seed=seed, warmup=warmup,
                  nonfinite="skip" if nonfinite == "propagate" else nonfinite,
                  error_feedback=bool(error_feedback), momentum=momentum, nesterov=bool(nesterov),
                  momentum_masking=bool(momentum_masking), clip_norm=clip_norm)
        if momentum_correction and momentum is not None:
            raise ValueError("pass either momentum_correction=True (momentum read from the optimizer) "
                             "or momentum=<float>, not both")
        self.momentum_correction = bool(momentum_correction)
        if kernels is not None:
            kw["kernels"] = kernels
        self.config = ReducerConfig(**kw)  # validates (ValueError)
        self._reducer_kwargs = kw

    @property
    def method(self) -> str:
        return self.config.method

    @property
    def density(self) -> float:
        return self.config.density

    def reducer_kwargs(self) -> dict:
        """GradientReducer keywords (all but ``op`` and ``transport``)."""
        return dict(self._reducer_kwargs)

    def __repr__(self):
        extra = "".join(f", {k}={v!r}" for k, v in self._reducer_kwargs.items()
                        if k not in ("method", "density") and v != _DEFAULTS.get(k))
        if self.momentum_correction:
            extra += ", momentum_correction=True"
        return f"Compression.{self.method}({self.density!r}{extra})"

    # Horovod's own optimizer calls these: say plainly that it cannot run us.
    def compress(self, tensor):
        raise TypeError(f"{self!r} is a sparse gtopk_plugin compression: pass it to "
                        "gtopk_plugin.horovod.DistributedOptimizer, not horovod.torch.DistributedOptimizer")

    decompress = compress


_DEFAULTS = dict(r_factor=4.0, merge=None, granularity="layer", value_dtype=None, seed=0, warmup=None,
                 nonfinite="raise", error_feedback=True, momentum=None, nesterov=False,
                 momentum_masking=True, clip_norm=None)


class Compression(CompressionNames):
    """Gradient compression for :func:`DistributedOptimizer`.

    ``none`` and ``fp16`` are Horovod's own compressors (dense allreduce,
    identical behaviour).  The others select a sparse method of the core and
    take the density (fraction of entries sent per tensor) plus optional
    keywords of :class:`SparseCompression` (``value_dtype``, ``warmup``,
    ``nonfinite``, ``fusion_threshold``, ...):

    * ``topk(density)``: exact top-k, sparse allgather (Top-k S-SGD);
    * ``gtopk(density)``: exact top-k, gTop-k butterfly (log2 P rounds);
    * ``rtopk(density, r_factor=4)``: k random of the top r·k, allgather;
    * ``randomk(density)``: k shared random indices, values allreduced;
    * ``threshold(density)``: DGC-style sampled threshold, allgather.
    """

    none = _HvdCompression.none
    fp16 = _HvdCompression.fp16
    _sparse = SparseCompression
    _public_name = "gtopk_plugin.horovod.Compression"


def _is_dense_compressor(c) -> bool:
    if isinstance(c, type):
        return issubclass(c, _HvdCompressor)
    return isinstance(c, _HvdCompressor) or (callable(getattr(c, "compress", None)) and
                                             callable(getattr(c, "decompress", None)) and
                                             not isinstance(c, SparseCompression))


# ---------------------------------------------------------------------------
# Optimizer
# ---------------------------------------------------------------------------
class _GtopkHorovodOptimizer:
    """Marker base of every optimizer made by :func:`DistributedOptimizer`
    (lets the elastic state handler below find them)."""


class _DistributedOptimizer(torch.optim.Optimizer):
    """Body of the optimizer class that :func:`DistributedOptimizer` builds.

    As in Horovod, its methods are copied into a new class whose base is the
    user's optimizer class, so ``isinstance(opt, torch.optim.SGD)`` holds and
    ``super(self.__class__, self)`` is the user's optimizer.
    """

    def __init__(self, params, named_parameters, compression, backward_passes_per_step, op,
                 gradient_predivide_factor, groups, sparse_as_dense, process_set, grad_scaler=None):
        super(self.__class__, self).__init__(params)
        # Horovod's broadcast_optimizer_state initialises an empty optimizer
        # state with a plain local step() when the optimizer's module is
        # Horovod's optimizer module, and with a collective step() otherwise.
        # A wrapped optimizer must get the local one, as Horovod's does.
        self.__module__ = _HVD_OPTIMIZER_MODULE
        self._compression = compression
        self._spec: Optional[SparseCompression] = compression if isinstance(compression, SparseCompression) else None
        self.backward_passes_per_step = backward_passes_per_step
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set

        all_params = [p for g in self.param_groups for p in g["params"]]
        self._parameter_names = _name_parameters(named_parameters, self.param_groups)
        self._requires_update = [p for p in all_params if p.requires_grad]
        self._delay = {p: backward_passes_per_step for p in self._requires_update}
        self._handles: Dict[object, tuple] = {}
        self._synchronized = False
        self._should_synchronize = True
        self._hooks = []
        self.last_step_traffic: Optional[Dict[str, int]] = None
        self._groups = _resolve_groups(groups, self._requires_update, self._parameter_names)
        self._dense_nbytes = self._grad_nbytes = 0

        self._reducer: Optional[GradientReducer] = None
        if self._spec is not None:
            if op not in (hvd.Average, hvd.Sum):
                raise ValueError("sparse compression supports op=hvd.Average or hvd.Sum; got "
                                 f"{_op_name(op)}")
            self._transport = HorovodTransport(process_set)
            self._reducer = GradientReducer(transport=self._transport,
                                            op="average" if op == hvd.Average else "sum",
                                            **self._spec.reducer_kwargs())
            if grad_scaler is not None and not callable(getattr(grad_scaler, "get_scale", None)):
                raise ValueError("grad_scaler must be a torch.amp.GradScaler (an object with get_scale())")
            self._grad_scaler = grad_scaler
            self._step_loss_scale: Optional[float] = None
            # local clipping needs the whole step's norm: buckets wait for synchronize()
            self._hold_buckets = self._spec.config.clip_norm is not None
            self._step_grad_norm: Optional[float] = None
            if self._spec.momentum_correction:
                self._reducer.correct_momentum(
                    self, [(n, p) for p, n in self._parameter_names.items()])
            elif self._spec.config.momentum is None and any(
                    float(g.get("momentum", 0.0) or 0.0) > 0.0 for g in self.param_groups):
                warnings.warn(
                    f"{self._spec!r} with an optimizer that has momentum: the optimizer applies its "
                    "momentum to the sparse update, which usually trains worse than dense; pass "
                    "momentum_correction=True to the compression (DGC momentum correction, "
                    "docs/momentum.md)", UserWarning, stacklevel=3)
            self._buckets = _make_buckets(self._requires_update, self._groups, self._spec.fusion_threshold)
            self._bucket_of = {p: i for i, b in enumerate(self._buckets) for p in b}
            self._executor = None
            # The step counter (density warm-up, random draws, layout check)
            # must agree on all ranks; a fresh optimizer takes the largest one
            # at its first step (e.g. rank 0 loaded a checkpoint).  Elastic
            # sync clears this flag after broadcasting rank 0's counter.
            self._agree_step = True
            self._reset_sparse_step()
        else:
            self._group_of = {p: g for g in self._groups for p in g}
            self._group_left = {g: len(g) for g in self._groups}

        if self.process_set.included():
            for p in self._requires_update:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._make_hook(p)))

    # -- public API (Horovod's) -------------------------------------------
    def synchronize(self):
        """Wait for every gradient's reduction and write the results into
        ``p.grad``.  Parameters that got no gradient this step take part
        with zeros (another rank may have one)."""
        if not self.process_set.included():
            self._synchronized = True
            return
        if self._spec is not None:
            self._synchronize_sparse()
        else:
            self._synchronize_dense()
        self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self):
        """``step()`` inside this context does not synchronize (call
        ``synchronize()`` yourself first, e.g. to clip or unscale)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        try:
            if self._should_synchronize:
                if self._synchronized:
                    warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context "
                                  "after optimizer.synchronize(). This can cause training slowdown. You may "
                                  "want to consider using optimizer.skip_synchronize() context if you use "
                                  "optimizer.synchronize() in your code.")
                self.synchronize()
            self._synchronized = False
            return super(self.__class__, self).step(closure)
        except BaseException:
            # the step hooks' post half never runs after an exception: give
            # momentum and weight decay back to the optimizer's groups
            binding = None if self._reducer is None else self._reducer.binding
            if binding is not None:
                binding.abort_step()
            raise

    def zero_grad(self, set_to_none: bool = True):
        if self._handles or (self._spec is not None and self._sparse_started()):
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but before "
                                 "optimizer.step() or optimizer.synchronize(). This is prohibited as it "
                                 "can cause a race condition.")
        return super(self.__class__, self).zero_grad(set_to_none=set_to_none)

    def set_backward_passes_per_step(self, passes: int):
        self.backward_passes_per_step = passes
        for p in self._delay:
            self._delay[p] = passes

    def state_dict(self, *args, **kwargs):
        """The wrapped optimizer's state, plus (sparse compression) this
        rank's error-feedback residuals and the step counter under
        ``"gtopk_plugin"``, so checkpoints and ``hvd.elastic.TorchState``
        commits keep them."""
        sd = super(self.__class__, self).state_dict(*args, **kwargs)
        if self._reducer is not None:
            sd[_STATE_KEY] = self._reducer.state_dict()
        return sd

    def load_state_dict(self, state_dict):
        sd = dict(state_dict)  # never modify the caller's (e.g. TorchState's saved) copy
        ours = sd.pop(_STATE_KEY, None)
        self._abandon_step()
        super(self.__class__, self).load_state_dict(sd)
        if ours is not None and self._reducer is not None:
            self._reducer.load_state_dict(ours)

    @property
    def reducer(self) -> Optional[GradientReducer]:
        """The core reducer (sparse compression), else None."""
        return self._reducer

    @property
    def last_stats(self) -> Optional[ReduceStats]:
        """Statistics of the last bucket reduced (sparse compression)."""
        return None if self._reducer is None else self._reducer.last_stats

    @property
    def buckets(self) -> List[List[str]]:
        """Parameter names per bucket, in reduction order (sparse), or per
        Horovod group (dense)."""
        groups = self._buckets if self._spec is not None else self._groups
        return [[self._parameter_names[p] for p in b] for b in groups]

    # -- hooks ---------------------------------------------------------------
    def _make_hook(self, p):
        def hook(_param):
            self._grad_ready(p)
        return hook

    def _grad_ready(self, p):
        if self._delay[p] <= 0:
            raise AssertionError("Gradients were computed more than backward_passes_per_step times "
                                 "before call to step(). Increase backward_passes_per_step to "
                                 "accumulate gradients locally.")
        self._delay[p] -= 1
        if self._delay[p] > 0:
            return
        if self._spec is not None:
            self._sparse_param_ready(p)
        elif p in self._group_of:
            g = self._group_of[p]
            self._group_left[g] -= 1
            if self._group_left[g] == 0:
                self._handles[g] = self._grouped_allreduce_async(g)
        else:
            self._handles[p] = self._allreduce_async(p)

    # -- dense path (Horovod's allreduce) ---------------------------------
    def _prepare_dense(self, p):
        if p.grad is None:
            # Unused this step here, perhaps used on another rank: take part with zeros.
            p.grad = torch.zeros_like(p)
        t = p.grad
        if t.is_sparse and self.sparse_as_dense:
            t = t.to_dense()
        return t

    def _scales(self):
        # Horovod splits the average into a pre-scale 1/f and a post-scale f
        # (the engine adds the 1/size for op=Average).
        if self.op == hvd.Average:
            return 1.0 / self.gradient_predivide_factor, self.gradient_predivide_factor
        return 1.0, 1.0

    def _allreduce_async(self, p):
        name = self._parameter_names[p]
        t = self._prepare_dense(p)
        if t.is_sparse:
            return ("sparse", _ops.sparse_allreduce_async(t, name=name, op=self.op,
                                                          process_set=self.process_set), None)
        # Horovod 0.28.1 has no bfloat16 kernels: such gradients travel as fp32.
        orig = t.dtype
        if orig == torch.bfloat16:
            t = t.float()
        c, ctx = self._compression.compress(t)
        self._count_dense(p, c)
        pre, post = self._scales()
        h = _ops.allreduce_async_(c, name=name, op=self.op, prescale_factor=pre, postscale_factor=post,
                                  process_set=self.process_set)
        return ("dense", h, (ctx, orig))

    def _grouped_allreduce_async(self, g):
        ts, ctxs = [], []
        for p in g:
            t = self._prepare_dense(p)
            if t.is_sparse:
                raise ValueError(f"parameter {self._parameter_names[p]!r} has a sparse gradient; grouped "
                                 "allreduce needs dense ones (pass sparse_as_dense=True)")
            orig = t.dtype
            if orig == torch.bfloat16:
                t = t.float()
            c, ctx = self._compression.compress(t)
            self._count_dense(p, c)
            ts.append(c)
            ctxs.append((ctx, orig))
        pre, post = self._scales()
        h = _ops.grouped_allreduce_async_(ts, name=self._parameter_names[g[0]], op=self.op,
                                          prescale_factor=pre, postscale_factor=post,
                                          process_set=self.process_set)
        return ("grouped", h, ctxs)

    def _count_dense(self, p, sent: Tensor):
        # bytes on the wire (after compression) and of the gradient itself
        self._dense_nbytes += sent.numel() * sent.element_size()
        self._grad_nbytes += p.numel() * p.element_size()

    def _set_grad(self, p, out):
        if p.grad.is_sparse:
            if not out.is_sparse:
                out = out.to_sparse()
            p.grad.zero_().add_(out)
        elif out is not p.grad:
            p.grad.set_(out.to(p.grad.dtype) if out.dtype != p.grad.dtype else out)

    def _synchronize_dense(self):
        done = set()
        for key in self._handles:
            done.update(key) if isinstance(key, tuple) else done.add(key)
        # Incomplete groups go as a whole (same op name on every rank).
        for g in self._groups:
            if g not in self._handles and any(p not in done for p in g):
                self._handles[g] = self._grouped_allreduce_async(g)
                done.update(g)
        for p in self._requires_update:
            if p not in done:
                self._handles[p] = self._allreduce_async(p)
        try:
            for key, (kind, h, ctx) in self._handles.items():
                if kind == "grouped":
                    for p, out, (c, orig) in zip(key, _ops.synchronize(h), ctx):
                        self._set_grad(p, self._compression.decompress(out, c).to(orig))
                elif kind == "sparse":
                    self._set_grad(key, h())
                else:
                    c, orig = ctx
                    self._set_grad(key, self._compression.decompress(_ops.synchronize(h), c).to(orig))
            # Horovod's engine is not observable: the ring model of the base
            # Transport, so figures compare with the sparse paths' counts.
            P = self.process_set.size()
            ring = 2 * (P - 1) * self._dense_nbytes // P
            self.last_step_traffic = {"bytes_sent": ring, "bytes_received": ring,
                                      "payload_bytes_sent": ring, "payload_bytes_received": ring,
                                      "header_bytes_sent": 0, "header_bytes_received": 0,
                                      "control_bytes": 0,
                                      "dense_bytes": 2 * (P - 1) * self._grad_nbytes // P}
        finally:
            self._handles.clear()
            self._dense_nbytes = self._grad_nbytes = 0
            for p in self._delay:
                self._delay[p] = self.backward_passes_per_step
            for g in self._groups:
                self._group_left[g] = len(g)

    # -- sparse path (the core's GradientReducer) -------------------------
    def _reset_sparse_step(self):
        self._step_grad_norm = None
        self._step_loss_scale = None
        self._ready = set()
        self._bucket_left = [len(b) for b in self._buckets]
        self._futures: List[Optional[concurrent.futures.Future]] = [None] * len(self._buckets)
        self._next_bucket = 0
        for p in self._delay:
            self._delay[p] = self.backward_passes_per_step

    def _sparse_started(self) -> bool:
        return bool(self._ready)

    def _sparse_param_ready(self, p):
        if p in self._ready:
            return
        self._ready.add(p)
        self._bucket_left[self._bucket_of[p]] -= 1
        self._launch_ready_buckets()

    def _launch_ready_buckets(self):
        # Fixed order on every rank: bucket i+1 never starts before bucket i,
        # so the single worker thread walks the same op sequence everywhere.
        if self._hold_buckets and self._step_grad_norm is None:
            return
        if self._next_bucket == 0 and self._step_loss_scale is None:
            pre = 1.0 / self.gradient_predivide_factor if self.op == hvd.Average else 1.0
            scale = 1.0 if self._grad_scaler is None else float(self._grad_scaler.get_scale())
            self._step_loss_scale = scale * pre
        while self._next_bucket < len(self._buckets) and self._bucket_left[self._next_bucket] == 0:
            i = self._next_bucket
            grads = {self._parameter_names[p]: p.grad for p in self._buckets[i]}
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(
                    max_workers=1, thread_name_prefix="gtopk-horovod")
            self._futures[i] = self._executor.submit(self._reduce_bucket, i, grads)
            self._next_bucket += 1

    def _reduce_bucket(self, i: int, grads: Dict[str, Tensor]):
        """Runs on the worker thread: one GradientReducer call per bucket."""
        t = self._transport
        t.set_scope(f"b{i}")
        if i == 0:
            self._step_start = t.counters.copy()
            if self._agree_step:
                v = torch.tensor([self._reducer.step], dtype=torch.int64)
                if t.size > 1:
                    v = t.control_allreduce_max(v)
                self._reducer.step = int(v[0])
                self._agree_step = False
        pre = 1.0 / self.gradient_predivide_factor if self.op == hvd.Average else 1.0
        prepared = {}
        for n, g in grads.items():
            g = g.detach()
            if g.is_sparse:
                g = g.to_dense()
            prepared[n] = g * pre if pre != 1.0 else g
        scaled = self._grad_scaler is not None or pre != 1.0
        out = self._reducer.reduce(prepared, advance_step=(i == len(self._buckets) - 1),
                                   grad_norm=self._step_grad_norm,
                                   loss_scale=self._step_loss_scale if scaled else None)
        return out, self._reducer.last_stats

    def _synchronize_sparse(self):
        for p in self._requires_update:
            if p not in self._ready:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                self._sparse_param_ready(p)
        if self._hold_buckets:
            # this worker's gradient norm over the whole step (DGC local clipping)
            pre = 1.0 / self.gradient_predivide_factor if self.op == hvd.Average else 1.0
            self._step_grad_norm = pre * local_grad_norm(
                p.grad.to_dense() if p.grad.is_sparse else p.grad for p in self._requires_update)
            self._launch_ready_buckets()
        first_error, stats = None, []
        post = self.gradient_predivide_factor if self.op == hvd.Average else 1.0
        try:
            for i, fut in enumerate(self._futures):
                try:
                    out, st = fut.result()
                except BaseException as e:  # noqa: BLE001 - wait for every bucket, then raise
                    first_error = first_error or e
                    continue
                stats.append(st)
                poison = st.skipped and self._spec.nonfinite == "propagate"
                for p in self._buckets[i]:
                    u = out[self._parameter_names[p]]
                    if post != 1.0:
                        u = u * post
                    if poison:
                        u = torch.full_like(u, float("nan"))
                    if p.grad.is_sparse:
                        p.grad = u.to_sparse()
                    else:
                        p.grad.copy_(u)
        finally:
            self._reset_sparse_step()
        if first_error is not None:
            raise first_error
        d = self._transport.counters.copy().minus(self._step_start)
        self.last_step_traffic = {
            "bytes_sent": d.payload_bytes_sent + d.header_bytes_sent,
            "bytes_received": d.payload_bytes_received + d.header_bytes_received,
            "payload_bytes_sent": d.payload_bytes_sent, "payload_bytes_received": d.payload_bytes_received,
            "header_bytes_sent": d.header_bytes_sent, "header_bytes_received": d.header_bytes_received,
            "control_bytes": d.control_bytes, "messages_sent": d.messages_sent,
            "dense_bytes": sum(s.dense_bytes for s in stats), "numel": sum(s.numel for s in stats),
            "k": sum(s.k for s in stats), "sent_entries": sum(s.sent_entries for s in stats),
            "rounds": sum(s.rounds for s in stats), "buckets": len(stats),
            "skipped": any(s.skipped for s in stats)}

    def _abandon_step(self):
        """Forget a half-done step (load_state_dict, elastic restore): wait
        for reductions already running, drop their results."""
        if self._spec is not None:
            for fut in self._futures:
                if fut is not None:
                    try:
                        fut.result()
                    except BaseException:  # noqa: BLE001 - the step is being discarded
                        pass
            self._reset_sparse_step()
        else:
            self._handles.clear()
            self._dense_nbytes = self._grad_nbytes = 0
            for p in self._delay:
                self._delay[p] = self.backward_passes_per_step
            for g in self._groups:
                self._group_left[g] = len(g)
        self._synchronized = False
        self._should_synchronize = True

    def _elastic_sync(self):
        """Called by the elastic state handler on every rank after Horovod
        broadcast the optimizer state: every rank takes rank 0's step counter
        (residuals stay per rank: they are this worker's unsent mass)."""
        if self._reducer is None:
            return
        v = torch.tensor([self._reducer.step], dtype=torch.int64)
        if self.process_set.size() > 1:
            v = _ops.broadcast_(v, root_rank=0, name="gtopk.elastic.step", process_set=self.process_set)
        self._reducer.step = int(v[0])
        self._agree_step = False


_HVD_OPTIMIZER_MODULE = hvd.DistributedOptimizer.__module__


def _op_name(op) -> str:
    for n in ("Average", "Sum", "Adasum", "Min", "Max", "Product"):
        if getattr(hvd, n, object()) == op:
            return f"hvd.{n}"
    return repr(op)


def _name_parameters(named_parameters, param_groups) -> Dict[Tensor, str]:
    """param -> name; Horovod's rules (unique names, every optimizer
    parameter named) with errors that say which parameter is missing."""
    if named_parameters is None:
        return {p: f"allreduce.noname.{i}.{j}" for i, g in enumerate(param_groups)
                for j, p in enumerate(g["params"])}
    named = list(named_parameters)
    if any(not (isinstance(x, tuple) and len(x) == 2) for x in named):
        raise ValueError("named_parameters should be a sequence of tuples (name, parameter), usually "
                         "produced by model.named_parameters().")
    seen, dups = set(), set()
    for n, _ in named:
        (dups if n in seen else seen).add(n)
    if dups:
        raise ValueError("Parameter names in named_parameters must be unique. Found duplicates: "
                         + ", ".join(sorted(dups)))
    by_id = {id(p): n for n, p in named}
    missing = [f"param_groups[{i}]['params'][{j}] (shape {tuple(p.shape)})"
               for i, g in enumerate(param_groups) for j, p in enumerate(g["params"]) if id(p) not in by_id]
    if missing:
        raise ValueError(f"named_parameters was specified, but {len(missing)} optimizer parameter(s) are "
                         f"not named in it: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}. "
                         "Pass the named_parameters() of the model whose parameters the optimizer updates.")
    return {p: by_id[id(p)] for g in param_groups for p in g["params"]}


def _resolve_groups(groups, params: List[Tensor], names) -> List[Tuple[Tensor, ...]]:
    """Horovod's ``groups``: an int n (split the parameters into n groups) or
    a list of lists of tensors (each list a group)."""
    if groups is None or groups == 0:
        return []
    if isinstance(groups, bool) or not (isinstance(groups, list) or (isinstance(groups, int) and groups > 0)):
        raise ValueError("groups should be a non-negative integer or a list of list of torch.Tensor.")
    if isinstance(groups, int):
        n = min(groups, len(params))
        base, extra = divmod(len(params), n) if n else (0, 0)
        out, pos = [], 0
        for i in range(n):
            size = base + (1 if i < extra else 0)
            out.append(tuple(params[pos:pos + size]))
            pos += size
        return [g for g in out if g]
    member = {id(p) for p in params}
    seen = set()
    out = []
    for grp in groups:
        for p in grp:
            if not isinstance(p, torch.Tensor):
                raise ValueError("groups must consist of torch.Tensor.")
            if id(p) in seen:
                raise ValueError("A parameter can only appear once in groups.")
            seen.add(id(p))
        g = tuple(p for p in grp if id(p) in member)
        if g:
            out.append(g)
    return out


def _make_buckets(params: List[Tensor], groups, threshold: int) -> List[List[Tensor]]:
    """Fixed buckets for the sparse path: explicit groups first, the rest in
    reverse registration order (roughly the order backward produces
    gradients) cut at ``threshold`` bytes."""
    grouped = {id(p) for g in groups for p in g}
    buckets = [list(g) for g in groups]
    cur, cur_bytes = [], 0
    for p in reversed(params):
        if id(p) in grouped:
            continue
        nb = p.numel() * p.element_size()
        if cur and cur_bytes + nb > threshold:
            buckets.append(cur)
            cur, cur_bytes = [], 0
        cur.append(p)
        cur_bytes += nb
    if cur:
        buckets.append(cur)
    return buckets


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none,
                         backward_passes_per_step=1, op=hvd.Average, gradient_predivide_factor=1.0,
                         num_groups=0, groups=None, sparse_as_dense=False,
                         process_set=hvd.global_process_set, grad_scaler=None):
    """Wrap ``optimizer`` so that ``step()`` applies gradients reduced across
    the Horovod workers — ``horovod.torch.DistributedOptimizer`` with the
    same signature and behaviour, plus sparse ``compression=`` choices.

    Args:
        optimizer: the torch optimizer to wrap.
        named_parameters: ``model.named_parameters()``; names identify each
            gradient's reduction (and residual) on every rank.  Every
            parameter of the optimizer must be named (``ValueError``).
        compression: ``Compression.none`` / ``Compression.fp16`` (Horovod's
            dense allreduce) or a sparse ``Compression.topk/gtopk/rtopk/
            randomk/threshold(density, ...)``.
        backward_passes_per_step: backward passes accumulated locally before
            the reduction (gradients are summed, as in Horovod).
        op: ``hvd.Average`` or ``hvd.Sum`` (``hvd.Adasum`` for dense compression:
            Horovod's own Adasum optimizer is returned).
        gradient_predivide_factor: with op=Average, scale by 1/f before and
            f/size after the sum.
        num_groups: deprecated alias of ``groups``.
        groups: int n or a list of lists of parameters: parameters reduced
            together (dense: Horovod grouped allreduce; sparse: one bucket each).
        sparse_as_dense: reduce ``torch.sparse`` gradients as dense tensors
            (sparse compression always does).
        process_set: reduce over this Horovod process set.
        grad_scaler: (sparse compression) the ``torch.amp.GradScaler`` of an
            AMP loop: residuals and velocities follow its loss scale
            (rescaled exactly when it changes) and the clipping threshold
            is scaled with it; use ``nonfinite="propagate"`` so that every
            rank's scaler sees an overflow on any rank.

    With a sparse compression the returned optimizer also has ``reducer``,
    ``last_stats`` (last bucket), ``last_step_traffic`` (bytes of the last
    step, summed over buckets) and ``buckets``; its ``state_dict()`` holds
    the residuals and step counter under ``"gtopk_plugin"``.
    """
    if gradient_predivide_factor != 1.0 and op != hvd.Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed in "
                      "v0.23.0.", DeprecationWarning)
        if groups is None:
            groups = num_groups
    if backward_passes_per_step <= 0:
        raise ValueError("backward_passes_per_step must be > 0")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizer must be a torch.optim.Optimizer; got {type(optimizer).__name__}")
    if isinstance(compression, SparseCompression):
        if op == hvd.Adasum:
            raise ValueError("op=hvd.Adasum works with dense compression only; sparse compression "
                             "supports hvd.Average and hvd.Sum")
    elif not _is_dense_compressor(compression):
        hint = (f" (did you mean Compression.{compression}(density)?)"
                if isinstance(compression, str) and compression in SPARSE_METHODS else "")
        raise ValueError(
            f"unknown compression {compression!r}{hint}: pass Compression.none, Compression.fp16, "
            "Compression.topk/gtopk/rtopk/randomk/threshold(density), or a Horovod Compressor")
    elif op == hvd.Adasum and hvd.size() > 1:
        # Adasum's delta-model optimizer is Horovod's own; nothing sparse to add.
        return hvd.DistributedOptimizer(optimizer, named_parameters, compression,
                                        backward_passes_per_step, op, gradient_predivide_factor,
                                        0, groups, sparse_as_dense, process_set)
    body = {k: v for k, v in _DistributedOptimizer.__dict__.items() if k not in ("__dict__", "__weakref__")}
    cls = type(optimizer.__class__.__name__, (optimizer.__class__, _GtopkHorovodOptimizer), body)
    if grad_scaler is not None and not isinstance(compression, SparseCompression):
        raise ValueError("grad_scaler= is for sparse compressions (error-feedback state follows the "
                         "loss scale); Horovod's dense allreduce needs none")
    return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step, op,
               gradient_predivide_factor, groups, sparse_as_dense, process_set, grad_scaler)


# ---------------------------------------------------------------------------
# Elastic
# ---------------------------------------------------------------------------
class SparseOptimizerStateHandler(_hvd_elastic_state.OptimizerStateHandler):
    """``hvd.elastic.TorchState`` handler for our optimizers.  Commit and
    restore go through ``state_dict()`` / ``load_state_dict()`` (so residuals
    and the step counter are committed and restored with the optimizer);
    ``sync()`` broadcasts the optimizer state as Horovod does and then rank
    0's step counter, keeping each worker's own residuals (a new worker
    starts with none; no mass is double-counted)."""

    def sync(self):
        super().sync()
        self.value._elastic_sync()


def _register_elastic_handler():
    reg = list(_hvd_elastic_state.get_handler_registry())
    if not any(h is SparseOptimizerStateHandler for _, h in reg):
        # Before Horovod's generic optimizer entry: the first isinstance match wins.
        _hvd_elastic_state.set_handler_registry([(_GtopkHorovodOptimizer, SparseOptimizerStateHandler)] + reg)


_register_elastic_handler()

# The elastic scheduler's Horovod back end registers itself for HorovodTransport.
from . import elastic_horovod as _elastic_horovod  # noqa: E402,F401
