"""Host arithmetic of the CUDA back end: segment layouts and buffer sizes.

Pure Python and torch (no CuPy): for one ``(offsets, k)`` pattern, where each
segment's blocks, candidate slots and output slots start, which sampled
bound the exact top-k may start from, and the threshold rule's parameters.
:mod:`.cuda` caches the result per pattern and passes it to the kernels of
``csrc/cuda``; the constants must match ``csrc/cuda/radix.cuh`` and
``select.cu``.  Kept apart from the launching code so that the arithmetic can
be read (and tested against numpy models) on its own.
"""
from __future__ import annotations

import math
from typing import List, Tuple

import torch

from gtopk_plugin.kernels import reference

#: Value dtypes the kernels handle: name suffix and magnitude-key bits.
_VALUES = {torch.float32: ("f32", 31), torch.float64: ("f64", 63),
           torch.float16: ("f16", 15), torch.bfloat16: ("bf16", 15)}
SUPPORTED = tuple(_VALUES)
_INDEX = {torch.int32: "i32", torch.int64: "i64"}
_IMAX = {torch.int32: 2**31 - 1, torch.int64: 2**63 - 1}

# Must match csrc/cuda/radix.cuh and select.cu.
THREADS = 256
CHUNK = 256 * 64          # items per block (GTOPK_CHUNK)
BINS = 2048               # histogram bins per segment (GTOPK_BINS)
ST_N = 8                  # per-segment state words
DIGIT = 11
KERNEL_SAMPLE, KERNEL_RUN = 4096, 128  # GTOPK_SAMPLE, GTOPK_RUN


class _Layout:
    """One pattern's layout: plain attributes set by :func:`_make_layout`
    and :func:`merge_layout` (device tensors the kernels read, host ints)."""


def _cum(sizes: List[int]) -> List[int]:
    out = [0]
    for v in sizes:
        out.append(out[-1] + v)
    return out


def _threshold_params(n: int, k: int):
    """(tpar, cmin, cmax, slots) of one segment, with the reference's
    arithmetic (reference._threshold_segment): tpar = the sample rank ks, or
    0 (take everything) / -1 (nothing)."""
    if k >= n:
        return 0, 0, n, n
    if k <= 0:
        return -1, 0, 0, 0
    m = n if n <= reference.THRESHOLD_SAMPLE else (
        reference.THRESHOLD_SAMPLE // reference.THRESHOLD_RUN) * reference.THRESHOLD_RUN
    q = k * m / n
    ks = max(1, min(m, math.ceil(q + reference.THRESHOLD_BIAS * math.sqrt(max(q, 0.0)))))
    lo = (1 - reference.THRESHOLD_TOLERANCE) * k
    hi = (1 + reference.THRESHOLD_TOLERANCE) * k
    cmin, cmax = math.ceil(lo), math.floor(hi)
    return ks, cmin, cmax, max(cmax, k)


def _bound_rank(n: int, k: int, cap: int) -> int:
    """Sample rank R of the exact top-k's sampled start (select.cu), or -1
    for none: the R-th largest of the 4096 sampled keys lies, with high
    probability, a little below the k-th largest key of the segment (R is 4
    standard deviations plus 8 above k's expected rank in the sample, as
    csrc/cpu/select.cpp's sample_bound)."""
    if cap <= 0 or k <= 0 or k >= n or n <= KERNEL_SAMPLE:
        return -1
    q = k * KERNEL_SAMPLE / n
    r = math.ceil(q + 4.0 * math.sqrt(q) + 8.0)
    return r if r < KERNEL_SAMPLE else -1


def _cand_capacity(n: int, k: int) -> int:
    """Candidate slots of a segment: room for the bucket of a typical first
    digit (about k entries); larger buckets keep reading x instead."""
    if n <= CHUNK:
        return 0  # one block reads the whole segment anyway
    return min(n, max(4 * max(k, 0), n // 32, CHUNK))


def _make_layout(device, offs: List[int], ks: List[int], kind: str) -> _Layout:
    S = len(ks)
    L = _Layout()
    L.S = S
    L.has_bound = False
    sizes = [offs[s + 1] - offs[s] for s in range(S)]
    L.blocks_per = [(n + CHUNK - 1) // CHUNK for n in sizes]
    blk = _cum(L.blocks_per)
    caps = [_cand_capacity(sizes[s], ks[s]) for s in range(S)]
    cap = _cum(caps)
    if kind == "topk":
        slots = [max(0, min(ks[s], sizes[s])) for s in range(S)]
        bpar = [_bound_rank(sizes[s], ks[s], caps[s]) for s in range(S)]
        L.has_bound = any(r > 0 for r in bpar)
        L.bpar = torch.tensor(bpar, dtype=torch.int64).to(device) if L.has_bound else None
    else:  # "threshold"
        par = [_threshold_params(sizes[s], ks[s]) for s in range(S)]
        slots = [p[3] for p in par]
        L.tpar = torch.tensor([p[0] for p in par], dtype=torch.int64).to(device)
        L.cpar = torch.tensor([v for p in par for v in (p[1], p[2])], dtype=torch.int64).to(device)
    outo = _cum(slots)
    L.nblocks, L.ncand, L.nslots = blk[-1], cap[-1], outo[-1]
    L.lay = torch.tensor(offs + blk + cap + outo, dtype=torch.int64).to(device)
    L.seg = L.lay[: S + 1]
    L.outo = L.lay[3 * (S + 1):]
    L.k = torch.tensor(ks, dtype=torch.int64).to(device)
    L.wbits = max(1, (max(sizes, default=1) - 1).bit_length())
    return L




def _passes(kbits: int, wbits: int) -> int:
    return -(-kbits // DIGIT) + -(-wbits // DIGIT)


def _work(L: _Layout, device) -> Tuple[torch.Tensor, ...]:
    S = L.S
    st = torch.empty(max(1, S * ST_N), dtype=torch.int64, device=device)
    zeros = torch.zeros(S * BINS + 3 * S + 1, dtype=torch.int64, device=device)  # one memset
    hist, ctr = zeros[: S * BINS], zeros[S * BINS:]
    cand = torch.empty(2 * max(1, L.ncand), dtype=torch.int64, device=device)
    return st, hist, ctr, cand




def merge_layout(device, offs: List[int], ks: List[int], a_bounds: List[int],
                 b_bounds: List[int]) -> _Layout:
    """The layout of a merge's union: segment s of the union holds operand
    a's entries ``a_bounds[s]:a_bounds[s+1]`` and b's likewise (what
    ``gtopk_merge_bounds_*`` found), so it starts at ``a_bounds[s] +
    b_bounds[s]``; the radix select then runs over the union as over a dense
    segment, with the key width of the dense segment (index range) it
    came from."""
    S = len(ks)
    useg = [a_bounds[s] + b_bounds[s] for s in range(S + 1)]
    usize = [useg[s + 1] - useg[s] for s in range(S)]
    dsize = [offs[s + 1] - offs[s] for s in range(S)]
    blk = _cum([(n + CHUNK - 1) // CHUNK for n in usize])
    cap = _cum([_cand_capacity(usize[s], ks[s]) for s in range(S)])
    outo = _cum([max(0, min(ks[s], usize[s])) for s in range(S)])
    L = _Layout()
    L.S, L.has_bound = S, False
    L.nblocks, L.ncand, L.nslots = blk[-1], cap[-1], outo[-1]
    L.lay = torch.tensor(useg + blk + cap + outo, dtype=torch.int64).to(device)
    L.seg = L.lay[: S + 1]
    L.k = torch.tensor(ks, dtype=torch.int64).to(device)
    L.wbits = max(1, (max(dsize, default=1) - 1).bit_length())
    return L
