"""PowerSGD: rank-r low-rank approximation with error feedback and warm start
(Vogels, Karimireddy, Jaggi 2019, "PowerSGD: Practical Low-Rank Gradient
Compression for Distributed Optimization", arXiv 1905.13727, Algorithm 1),
with the semantics of PyTorch's ``powerSGD_hook``
(``torch.distributed.algorithms.ddp_comm_hooks``), which the tests use as
the oracle.

Each tensor is viewed as ``M = t.view(shape[0], -1)`` (n × m), rank ``r' =
min(n, m, rank)``; it is compressed when it has ≥ 2 dimensions and
``(n + m)·r'·min_compression_rate < n·m``, else it goes dense.  Per step:
Q (warm start: last step's ``ΣQ / W``; else a normal draw keyed by (seed,
step, tensor name), the same on every rank) orthonormalized; ``P = M Q``,
allreduce of every P and dense tensor in one message, ``P̂ =
orthonormalize(ΣP)``; ``Q = Mᵀ P̂``, allreduce; result ``P̂ (ΣQ)ᵀ``.
Orthonormalization as torch's (Gram-Schmidt for r' ≤ 2 or half precision,
else QR; ``epsilon`` added to column norms; with 0 a zero column stays 0).
Error feedback keeps ``M − P̂ (ΣQ / W)ᵀ``; dense tensors keep nothing.
Mass is conserved to float rounding.  Steps before ``start_iter`` are a
plain dense allreduce.  See docs/compressors.md.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from gtopk_plugin.compress.compressor import START_ITER, Codec, HyperParam, seeded_generator
from gtopk_plugin.registry import register

Tensor = torch.Tensor


def orthonormalize_(x: Tensor, epsilon: float = 0.0) -> Tensor:
    """Orthonormalize the columns of ``x`` (n × r, r ≤ n) in place."""
    r = x.shape[1]
    if r > 2 and x.dtype not in (torch.float16, torch.bfloat16):
        x.copy_(torch.linalg.qr(x).Q)
        return x
    for i in range(r):  # Gram-Schmidt, column by column
        col = x[:, i:i + 1]
        norm = torch.linalg.vector_norm(col, dim=0, keepdim=True)
        col /= norm + epsilon if epsilon else torch.where(norm > 0, norm, torch.ones_like(norm))
        if i + 1 < r:
            rest = x[:, i + 1:]
            rest -= torch.sum(col * rest, dim=0, keepdim=True) * col
    return x


def matrix_plan(shape: Sequence[int], rank: int, min_rate: float) -> Optional[Tuple[int, int, int]]:
    """``(n, m, r')`` when a tensor of ``shape`` is compressed, else None."""
    if len(shape) < 2:
        return None
    n = int(shape[0])
    m = 1
    for d in shape[1:]:
        m *= int(d)
    r = min(n, m, rank)
    return (n, m, r) if (n + m) * r * min_rate < n * m else None


@register("powersgd")
class PowerSGDCodec(Codec):
    """Rank-r low-rank approximation P·Qᵀ per matrix, two allreduces, error feedback and warm start (PowerSGD, Vogels et al. 2019)."""

    aggregation = "allreduce_rounds"
    hyperparams = (
        HyperParam("rank", 1, "approximation rank r per matrix (torch: matrix_approximation_rank)",
                   int, low=1),
        HyperParam("min_compression_rate", 2.0, "compress an n x m matrix only if (n+m)·r·rate < n·m",
                   float, low=0.0),
        START_ITER,
        HyperParam("warm_start", True, "reuse last step's Q (else a fresh draw every step)", bool),
        HyperParam("epsilon", 0.0, "added to column norms when orthonormalizing", float, low=0.0),
    )

    def __init__(self, **hyper):
        super().__init__(**hyper)
        self._q: Dict[str, Tensor] = {}  # name -> last step's ΣQ / W (m × r')

    def encode(self, acc, offsets, ctx):
        raise NotImplementedError("powersgd aggregates in two allreduce rounds (aggregation "
                                  "'allreduce_rounds'), not by a payload allgather; this layer "
                                  "supports only payload codecs")

    def _start_q(self, name: str, m: int, r: int, acc: Tensor, ctx) -> Tensor:
        q = self._q.get(name) if self.warm_start else None
        if q is None or tuple(q.shape) != (m, r):
            g = seeded_generator(ctx.seed, ctx.step, name)  # rank=None: every rank draws the same
            q = torch.randn(m, r, generator=g, dtype=torch.float32)
        return orthonormalize_(q.to(device=acc.device, dtype=acc.dtype).clone(), self.epsilon)

    def rounds(self, acc: Tensor, offsets: Tensor, ctx, world_size: int):
        o = offsets.tolist()
        if self.dense_at(ctx.step):
            total = yield acc.clone()
            return total, acc
        shapes = ctx.shapes
        if shapes is None or len(shapes) != len(o) - 1:
            raise ValueError("powersgd compresses each tensor as a matrix: use granularity='layer' "
                             "(one segment per tensor, shapes known)")
        mats, dense = [], []  # (name, lo, hi, M, Q) / (lo, hi)
        for name, shape, lo, hi in zip(ctx.segment_names, shapes, o[:-1], o[1:]):
            plan = matrix_plan(shape, self.rank, self.min_compression_rate)
            if plan is None:
                dense.append((lo, hi))
                continue
            n, m, r = plan
            mats.append((name, lo, hi, acc[lo:hi].view(n, m), self._start_q(name, m, r, acc, ctx)))
        msg = torch.cat([acc[lo:hi] for lo, hi in dense] +
                        [(M @ Q).reshape(-1) for _, _, _, M, Q in mats])
        summed = yield msg
        result = torch.empty_like(acc)
        contribution = torch.empty_like(acc)
        at = 0
        for lo, hi in dense:
            result[lo:hi] = summed[at:at + hi - lo]
            contribution[lo:hi] = acc[lo:hi]
            at += hi - lo
        ps: List[Tensor] = []
        for _, _, _, M, Q in mats:
            n, r = M.shape[0], Q.shape[1]
            ps.append(orthonormalize_(summed[at:at + n * r].view(n, r).clone(), self.epsilon))
            at += n * r
        if not mats:
            return result, contribution
        qsum = yield torch.cat([(M.t() @ p).reshape(-1) for (_, _, _, M, _), p in zip(mats, ps)])
        at = 0
        new_q = {}
        for (name, lo, hi, M, Q), p in zip(mats, ps):
            m, r = Q.shape
            qs = qsum[at:at + m * r].view(m, r)
            at += m * r
            qavg = qs / world_size
            result[lo:hi] = (p @ qs.t()).reshape(-1)
            contribution[lo:hi] = (p @ qavg.t()).reshape(-1)
            new_q[name] = qavg
        if self.warm_start:
            self._q.update(new_q)
        return result, contribution

    # warm-start state: bit-exact resume
    def state_dict(self) -> dict:
        return {"q": {n: q.detach().cpu().clone() for n, q in self._q.items()}}

    def load_state_dict(self, sd: dict) -> None:
        self._q = {str(n): q.clone() for n, q in sd.get("q", {}).items()}
