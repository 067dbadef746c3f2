"""Single-process oracle: simulates all P workers of every method, written
independently of the collectives (dense masks instead of sparse messages,
explicit group bookkeeping instead of the butterfly's survivor tracking), so
that distributed results can be checked against it.  Also used by the
convergence study to simulate many workers quickly and exactly.

Only the selection kernels (the reference back end) and ``k_for`` are
shared: they are the spec, tested separately against a brute-force oracle.
The int8 wire is modelled here from its specification (numpy,
float64; see :func:`_int8_model`), not by calling collectives/wire.py.
"""
from __future__ import annotations

import hashlib
import math
from typing import Dict, List, Mapping, Optional, Sequence

import numpy as np
import torch

from gtopk_plugin import kernels
from gtopk_plugin.compress import SelectionContext
from gtopk_plugin import registry
from gtopk_plugin.compress.momentum import MomentumCorrection, MomentumSpec
from gtopk_plugin.config import ReducerConfig
from gtopk_plugin.reducer import global_segment_name, k_for, local_grad_norm

Tensor = torch.Tensor


def _topk_positions(idx: np.ndarray, mag: np.ndarray, k: int) -> np.ndarray:
    """Brute force: indices of the top-k by (|v| desc, index asc)."""
    order = np.lexsort((idx, -mag))
    return idx[order[:k]]


class Oracle:
    """Simulate ``world_size`` workers of a GradientReducer configuration.

    ``step(grads_per_rank)`` takes one dict name -> gradient per rank and
    returns the dense update every rank would get (dict name -> tensor);
    ``residuals[r]`` holds worker r's residual per name afterwards.
    """

    def __init__(self, world_size: int, **reducer_kwargs):
        if world_size < 1:
            raise ValueError("world_size must be >= 1")
        self.P = world_size
        self.cfg = ReducerConfig(**reducer_kwargs)
        self.selector = registry.get(self.cfg.method)(**self.cfg.method_hyper)
        self.aggregation = self.cfg.aggregation
        self.residuals: List[Dict[str, Tensor]] = [dict() for _ in range(world_size)]
        # DGC momentum correction per simulated worker: the library's own
        # MomentumCorrection (the convergence study runs the library's code;
        # tests/support/oracles.py has an independent numpy twin)
        spec = None if self.cfg.momentum_correction is None else \
            MomentumSpec(self.cfg.momentum_correction, self.cfg.nesterov, self.cfg.dampening)
        self.velocity = [MomentumCorrection(spec, self.cfg.momentum_masking) for _ in range(world_size)]
        self.step_count = 0
        self.last_sent: List[Tensor] = []

    def step(self, grads_per_rank: Sequence[Mapping[str, Tensor]]) -> Dict[str, Tensor]:
        cfg, P = self.cfg, self.P
        names = sorted(grads_per_rank[0])
        shapes = [grads_per_rank[0][n].shape for n in names]
        sizes = [int(np.prod(s)) if len(s) else 1 for s in shapes]
        dtype = grads_per_rank[0][names[0]].dtype
        for n in names[1:]:
            dtype = torch.promote_types(dtype, grads_per_rank[0][n].dtype)
        wire = cfg.value_dtype or dtype
        density = cfg.density_at(self.step_count)
        key = f"{cfg.seed}:{self.step_count}:"  # + the call's salt and the stream (wire.Draws)
        if cfg.granularity == "layer":
            offs = np.cumsum([0] + sizes)
            ks = [k_for(density, s) for s in sizes]
            seg_names = names
        else:
            offs = np.array([0, sum(sizes)])
            ks = [k_for(density, sum(sizes))]
            seg_names = [global_segment_name(names)]
        N = int(offs[-1])
        offsets_t, k_t = torch.tensor(offs, dtype=torch.int64), torch.tensor(ks, dtype=torch.int64)
        key += f"{seg_names[0]}:"

        def to_wire(v: Tensor, stream: str, pos: Tensor) -> Tensor:
            """``v`` as the wire carries it (fp16/bf16: a cast; int8: one
            message quantized, decoded, in ``v``'s dtype); ``pos``: the
            entries' indices (the stochastic draws' counters)."""
            if wire != torch.int8:
                return _round_clamped(v, wire)
            u = _uniform_model(key + stream, pos.numpy()) if cfg.wire_rounding == "stochastic" else None
            return _int8_model(v, u)

        accs = []
        for r in range(P):
            flat = [grads_per_rank[r][n].detach().reshape(-1).to(dtype) for n in names]
            if cfg.clip_norm is not None:
                norm = local_grad_norm(flat)
                thr = cfg.clip_norm / P ** 0.5
                if norm > thr:
                    flat = [g * (thr / (norm + 1e-6 * thr)) for g in flat]
            if self.velocity[r].enabled:
                flat = self.velocity[r].accumulate(names, sizes, flat, dtype, flat[0].device)
            parts = []
            for n, g in zip(names, flat):
                res = self.residuals[r].get(n) if cfg.error_feedback else None
                parts.append(g.clone() if res is None else g + res)
            accs.append(torch.cat(parts))

        # -- selection (the reference kernels are the spec) --
        sel_idx, sel_wire = [], []
        for r in range(P):
            if self.aggregation == "dense":
                i = torch.arange(N)
                v = accs[r]
            else:
                ctx = SelectionContext(step=self.step_count, segment_names=seg_names, seed=cfg.seed,
                                       rank=r, kernels="reference")
                i, v = self.selector.select(accs[r], offsets_t, k_t, ctx)
            sel_idx.append(i.long())
            sel_wire.append(to_wire(v, f"rank{r}", i.long()))

        # A wire narrower than the gradients: sums in float32 (at least),
        # every re-rounding owned by one rank (docs/design.md §3, precision);
        # charges[r]: dense error vectors added to r's residual, in order.
        acc_dt = None if wire == dtype else torch.promote_types(dtype, torch.float32)
        charges: List[List[Tensor]] = [[] for _ in range(P)]
        reached = [torch.ones(i.numel(), dtype=torch.bool) for i in sel_idx]
        if self.aggregation == "butterfly":
            result = self._butterfly(sel_idx, sel_wire, reached, offs, ks, N, to_wire, acc_dt,
                                     charges).to(dtype)
        elif acc_dt is not None and self.aggregation in ("dense", "allreduce_values") and P > 1:
            # every rank's value vector (the same positions everywhere) summed
            # in rank order in acc_dt; position p belongs to the shard of
            # rank q (n·q//P <= p < n·(q+1)//P), which rounds it and owns the error
            total = torch.zeros(sel_wire[0].numel(), dtype=acc_dt)
            for r in range(P):
                total = total + sel_wire[r].to(acc_dt)
            n = total.numel()
            # each shard is rounded by its owner as one message (int8: its own scale)
            rounded = torch.cat([to_wire(total[n * q // P:n * (q + 1) // P], f"shard{q}",
                                         torch.arange(n * q // P, n * (q + 1) // P)) for q in range(P)])
            err = total - rounded.to(acc_dt)
            for q in range(P):
                e = torch.zeros(N, dtype=acc_dt)
                pos = torch.arange(n * q // P, n * (q + 1) // P)
                e[sel_idx[0][pos]] = err[pos]
                charges[q].append(e)
            result = torch.zeros(N, dtype=dtype)
            result[sel_idx[0]] = rounded.to(dtype)
        else:
            result = torch.zeros(N, dtype=dtype)
            for r in range(P):  # rank order
                dense = torch.zeros(N, dtype=dtype)
                dense[sel_idx[r]] = sel_wire[r].to(dtype)
                result = result + dense

        self.last_sent = []
        for r in range(P):
            res = accs[r].clone()
            i = sel_idx[r][reached[r]]
            res[i] = accs[r][i] - sel_wire[r][reached[r]].to(dtype)
            for e in charges[r]:
                res = res + e.to(dtype)
            self.last_sent.append(i)
            if self.velocity[r].enabled and self.aggregation != "dense":
                self.velocity[r].mask_(names, i)
            if cfg.error_feedback:
                for n, part in zip(names, torch.split(res, sizes)):
                    self.residuals[r][n] = part
        if cfg.op == "average":
            result = result / P
        self.step_count += 1
        return {n: u.view(s) for n, u, s in zip(names, torch.split(result, sizes), shapes)}

    def _butterfly(self, sel_idx, sel_wire, reached, offs, ks, N, to_wire, acc_dt, charges) -> Tensor:
        """Explicit group simulation: a group's set is a dense (mask, values)
        pair; a merge adds masked values and keeps the per-segment top-k by
        brute force.  Worker m's entry i reached the result iff i is in its
        group's set after every merge its group takes part in.

        ``acc_dt`` (a wire narrower than the gradients): values are held and
        added in ``acc_dt``; each group's set is rounded (clamped) to the wire
        before every butterfly round and once at the end, and the error goes
        to the group's lowest member -- kept only at indices that stay in the
        group's set through every later merge (``charges``, in order).
        ``to_wire(values, stream, indices)`` rounds one message.  Returns the
        result as the wire carries it."""
        P = self.P
        Pp = 1 << (P.bit_length() - 1)
        vdt = acc_dt or sel_wire[0].dtype

        def own(r):
            m = torch.zeros(N, dtype=torch.bool)
            m[sel_idx[r]] = True
            v = torch.zeros(N, dtype=vdt)
            v[sel_idx[r]] = sel_wire[r].to(vdt)
            return {"mask": m, "vals": v, "members": [r], "pending": []}

        def round_set(g, stream):
            if acc_dt is None:
                return
            pos = torch.nonzero(g["mask"]).squeeze(1)  # the set's message, ascending indices
            w = torch.zeros(N, dtype=acc_dt)
            w[pos] = to_wire(g["vals"][pos], stream, pos).to(acc_dt)
            err = torch.where(g["mask"], g["vals"] - w, torch.zeros((), dtype=acc_dt))
            g["vals"] = w
            if bool((err != 0).any()):
                g["pending"].append((min(g["members"]), err))

        def merge(a, b):
            m = a["mask"] | b["mask"]
            zero = torch.zeros((), dtype=vdt)
            v = torch.where(a["mask"], a["vals"], zero) + torch.where(b["mask"], b["vals"], zero)
            keep = torch.zeros(N, dtype=torch.bool)
            cand = torch.nonzero(m).squeeze(1).numpy()
            mag = kernels.reference.magnitude(v).numpy()
            for s in range(len(ks)):
                c = cand[(cand >= offs[s]) & (cand < offs[s + 1])]
                keep[torch.from_numpy(_topk_positions(c, mag[c], ks[s]).copy())] = True
            members = a["members"] + b["members"]
            for w in members:
                reached[w] &= keep[sel_idx[w]]
            pending = [(o, torch.where(keep, e, torch.zeros((), dtype=e.dtype)))
                       for o, e in a["pending"] + b["pending"]]
            return {"mask": keep, "vals": torch.where(keep, v, zero), "members": members,
                    "pending": pending}

        slots = [own(r) for r in range(Pp)]  # slot r: the group of rank r < P'
        for r in range(Pp, P):  # fold-in: own wire values, nothing to round
            slots[r - Pp] = merge(slots[r - Pp], own(r))
        j = 1
        while j < Pp:
            for r in range(0, Pp, j):  # one slot per group (groups are blocks of j)
                round_set(slots[r], f"round{j.bit_length() - 1}:group{r}")
            for r in range(0, Pp, 2 * j):
                g = merge(slots[r], slots[r + j])
                for q in range(r, r + 2 * j):
                    slots[q] = g
            j <<= 1
        round_set(slots[0], "final")
        for o, e in slots[0]["pending"]:
            charges[o].append(e)
        return slots[0]["vals"].to(sel_wire[0].dtype)


def _round_clamped(v: Tensor, dtype: torch.dtype) -> Tensor:
    """``v`` in ``dtype``, values beyond its finite range clamped to it (what
    the wire carries, docs/design.md §2)."""
    if v.dtype != dtype and torch.finfo(dtype).max < torch.finfo(v.dtype).max:
        big = torch.finfo(dtype).max
        v = v.clamp(-big, big)
    return v.to(dtype)


def _uniform_model(key: str, idx: np.ndarray) -> Tensor:
    """The int8 wire's stochastic draws, from their specification
    (``wire.uniform``): the 32-bit "lowbias32" hash applied to the index's
    low word xor the key's low word, then again with the high words; the
    uniform is the hash times 2^-32.  numpy uint64 arithmetic (wraps)."""
    h = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
    M = np.uint64(0xFFFFFFFF)

    def mix(x):
        x = x ^ (x >> np.uint64(16))
        x = (x * np.uint64(0x7FEB352D)) & M
        x = x ^ (x >> np.uint64(15))
        x = (x * np.uint64(0x846CA68B)) & M
        return x ^ (x >> np.uint64(16))

    i = idx.astype(np.uint64)
    x = mix((i & M) ^ np.uint64(h & 0xFFFFFFFF))
    x = mix(x ^ (i >> np.uint64(32)) ^ np.uint64(h >> 32))
    return torch.from_numpy(x.astype(np.float64) / 2.0 ** 32)


def _int8_model(v: Tensor, u: Optional[Tensor]) -> Tensor:
    """One int8-wire message, decoded, in ``v``'s dtype (docs/design.md §2 and
    collectives/wire.py's docstring are the spec): e is the smallest
    integer with max|v| <= 127·2^e, within [-128, 127] and no finer than
    ``v``'s dtype's smallest subnormal; q = v/2^e rounded to nearest (ties
    to even) or, with uniforms ``u``, down/up with probability of the
    fraction (|x| < 1/2: 0); |q| <= 127 and |q|·2^e finite in ``v``'s dtype."""
    a = v.detach().double().numpy()
    fi = torch.finfo(v.dtype)
    e_min = max(-128, round(math.log2(fi.smallest_normal * fi.eps)))
    m = float(np.abs(a).max()) if a.size else 0.0
    e = e_min
    if m > 0:
        e = math.ceil(math.log2(m / 127.0))
        while 127.0 * 2.0 ** e < m:
            e += 1
        while 127.0 * 2.0 ** (e - 1) >= m:
            e -= 1
        e = min(max(e, e_min), 127)
    x = a / 2.0 ** e
    if u is None:
        q = np.round(x)
    else:
        q = np.floor(x) + (u.numpy() < x - np.floor(x))
        q[np.abs(x) < 0.5] = 0.0
    cap = 127 if fi.max / 2.0 ** e >= 127 else math.floor(fi.max / 2.0 ** e)
    # + 0.0: an integer code has no signed zero (-0.0 + 0.0 = +0.0)
    return torch.from_numpy(np.clip(q, -cap, cap) * 2.0 ** e + 0.0).to(v.dtype)
