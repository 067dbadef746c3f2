"""The α-β model of each method's exchange, fitted to measurement 1.

For one step of method m on P workers, with N dense elements, K selected
entries in all, e bytes per sparse entry (8 for int32 index + fp32 value, 6
with fp16) and s bytes per dense element:

=========  =====================  ===========================================
method     messages (sequential)  bytes sent by the busiest worker
=========  =====================  ===========================================
dense      2(P−1)                 2(P−1)/P · s·N          (ring allreduce;
                                  a 2-byte wire: see :func:`dense_bytes`)
topk       P−1                    (P−1) · e·K             (ring allgather)
gtopk      ⌊log2 P⌋ (+2 folding)  ⌊log2 P⌋·e·K (+ e·K + ⌈K/8⌉ folding)
=========  =====================  ===========================================

t = α·messages + β·bytes + γ·work·load, fitted per (engine, method) by
non-negative least squares on relative error (every point counts alike,
whether it took a millisecond or a second).  α is per message (latency plus
per-call software cost), β per byte (1/bandwidth), γ per unit of CPU work a
worker does inside the exchange:

=========  ==============================================================
method     work per worker
=========  ==============================================================
dense      2(P−1)/P · N     (gloo's ring: reduce and copy every element)
topk       N + (P−1)·K      (the dense sum: zero N elements, add P−1 sets)
gtopk      rounds · K       (one merge of two K-entry sets per round)
=========  ==============================================================

``load`` = max(1, P / cores) is how many workers share a CPU core.  On the
emulated cluster P workers share this machine's cores, so their compute
inside the exchange is stretched by ``load``; a real cluster has a machine
per worker (``load`` = 1).  Fitting ``load`` explicitly lets the same
α, β, γ predict the emulator (load = P/cores) and extrapolate to a real
cluster (load = 1).
"""
from __future__ import annotations

import itertools
from typing import Dict, Iterable, List, Optional, Sequence

FEATURES = ("messages", "bytes", "work_load", "numel")


from gtopk_plugin.pipeline.traffic import (StepTraffic, allgather_bytes, gtopk_bytes,
                                           sharded_allreduce_bytes)

#: bytes per sparse entry (int32 index + value) -> the package's wire name
_WIRES = {8: "fp32", 6: "fp16"}
_DENSE_WIRES = {2: "fp16"}


def butterfly_rounds(P: int) -> int:
    if P <= 1:
        return 0
    return (P.bit_length() - 1) + (0 if P & (P - 1) == 0 else 2)


def dense_bytes(P: int, N: int, elem_bytes: int = 4) -> int:
    """Bytes the busiest worker sends in a dense sum of N elements, from the
    package's byte model (:mod:`gtopk_plugin.pipeline.traffic`): values in
    the gradients' dtype go through the engine's ring allreduce
    (2(P−1)/P·s·N); a 2-byte wire is the library's reduce-scatter plus
    allgather, counted exactly per rank."""
    if elem_bytes >= 4:
        return StepTraffic.ring_allreduce(P, N * elem_bytes, N * elem_bytes).payload_bytes_sent
    wire = _DENSE_WIRES[elem_bytes]
    return max(sharded_allreduce_bytes(P, r, N, wire)[0] for r in range(P))


def traffic(method: str, P: int, N: int, K: Optional[int], entry_bytes: int = 8,
            elem_bytes: int = 4, load: float = 1.0) -> Dict[str, float]:
    """Messages, bytes and CPU work of the busiest worker for one exchange
    (the tables above).  The bytes are the package's byte model
    (:mod:`gtopk_plugin.pipeline.traffic`, which the collectives' counters
    equal); messages and work are this model's.  ``load``: workers per CPU
    core."""
    if P <= 1:
        return {"messages": 0, "bytes": 0, "work": 0, "work_load": 0, "numel": N}
    if method == "dense":
        out = {"messages": 2 * (P - 1), "bytes": dense_bytes(P, N, elem_bytes), "work": 2 * (P - 1) * N / P}
    elif method == "topk":
        out = {"messages": P - 1, "bytes": allgather_bytes(P, K, _WIRES[entry_bytes]), "work": N + (P - 1) * K}
    elif method == "gtopk":
        busiest = max(gtopk_bytes(P, r, K, _WIRES[entry_bytes])[0] for r in range(P))
        out = {"messages": butterfly_rounds(P), "bytes": busiest, "work": butterfly_rounds(P) * K}
    else:
        raise ValueError(f"no traffic model for method {method!r}")
    out["work_load"] = out["work"] * max(1.0, load)
    out["numel"] = N
    return out


def load_factor(P: int, cores: Optional[int]) -> float:
    """Workers per core when P workers share ``cores`` cores (None: a
    machine per worker)."""
    return max(1.0, P / cores) if cores else 1.0


def _lstsq(X: List[List[float]], y: List[float]) -> Optional[List[float]]:
    """Least squares by the normal equations (tiny systems)."""
    n = len(X[0])
    A = [[sum(r[i] * r[j] for r in X) for j in range(n)] for i in range(n)]
    b = [sum(r[i] * t for r, t in zip(X, y)) for i in range(n)]
    # Gaussian elimination with partial pivoting
    M = [row[:] + [bb] for row, bb in zip(A, b)]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(M[r][c]))
        if abs(M[p][c]) < 1e-300:
            return None
        M[c], M[p] = M[p], M[c]
        for r in range(n):
            if r != c:
                f = M[r][c] / M[c][c]
                M[r] = [a - f * bb for a, bb in zip(M[r], M[c])]
    return [M[i][n] / M[i][i] for i in range(n)]


def nnls(X: List[List[float]], y: List[float]) -> List[float]:
    """Non-negative least squares for a handful of columns: the best
    feasible solution over all column subsets."""
    n = len(X[0])
    best, best_err = [0.0] * n, sum(t * t for t in y)
    for k in range(1, n + 1):
        for cols in itertools.combinations(range(n), k):
            sol = _lstsq([[r[c] for c in cols] for r in X], y)
            if sol is None or any(v < 0 for v in sol):
                continue
            coef = [0.0] * n
            for c, v in zip(cols, sol):
                coef[c] = v
            err = sum((sum(a * b for a, b in zip(r, coef)) - t) ** 2 for r, t in zip(X, y))
            if err < best_err - 1e-18:
                best, best_err = coef, err
    return best


class Fit:
    """α (s/message), β (s/byte), γ (s/element) of one (engine, method)."""

    def __init__(self, engine: str, method: str, coef: Dict[str, float], points: List[dict]):
        self.engine, self.method, self.coef, self.points = engine, method, coef, points

    @property
    def alpha(self) -> float:
        return self.coef.get("messages", 0.0)

    @property
    def beta(self) -> float:
        return self.coef.get("bytes", 0.0)

    @property
    def gamma(self) -> float:
        return self.coef.get("work_load", 0.0)

    def time(self, feats: Dict[str, float]) -> float:
        return sum(self.coef.get(f, 0.0) * feats[f] for f in FEATURES if f in feats)

    def predict(self, P: int, N: int, K: Optional[int], entry_bytes: int = 8, elem_bytes: int = 4,
                load: float = 1.0) -> float:
        return self.time(traffic(self.method, P, N, K, entry_bytes, elem_bytes, load))

    def errors(self) -> List[float]:
        """Relative error of the fit on its own points."""
        return [(self.time(p) - p["time_s"]) / p["time_s"] for p in self.points]

    def to_dict(self) -> dict:
        errs = self.errors()
        return {"engine": self.engine, "method": self.method, "features": list(self.coef),
                "alpha_s": self.alpha, "beta_s_per_byte": self.beta, "gamma_s_per_work": self.gamma,
                "delta_s_per_element": self.coef.get("numel", 0.0),
                "bandwidth_gbit_s": (8 / self.beta / 1e9) if self.beta else None,
                "points": len(self.points),
                "median_abs_rel_err": _median([abs(e) for e in errs]) if errs else None,
                "max_abs_rel_err": max(abs(e) for e in errs) if errs else None}


def _median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def fit(points: Iterable[dict], engine: str, method: str, features: Sequence[str] = ("messages", "bytes")) -> Fit:
    """Fit t = Σ coef_f · f over ``points`` (dicts with the features and
    ``time_s``), minimising relative error, coefficients ≥ 0."""
    pts = [p for p in points if p["time_s"] > 0]
    if not pts:
        raise ValueError(f"no points to fit for {engine}/{method}")
    X = [[p[f] / p["time_s"] for f in features] for p in pts]
    y = [1.0] * len(pts)
    # scale columns for conditioning, then undo
    scale = [max(abs(r[i]) for r in X) or 1.0 for i in range(len(features))]
    Xs = [[v / s for v, s in zip(r, scale)] for r in X]
    c = nnls(Xs, y)
    coef = {f: ci / s for f, ci, s in zip(features, c, scale)}
    return Fit(engine, method, coef, pts)


def points_from_comm(rows: Iterable[dict], cores: Optional[int]) -> Dict[tuple, List[dict]]:
    """Measurement-1 rows -> fit points per (engine, method), with the
    features computed from the measured counters (bytes), the schedule
    (messages) and the workers per core of the run (``cores``: the CPUs of
    the machine the emulated cluster ran on)."""
    out: Dict[tuple, List[dict]] = {}
    for r in rows:
        if r["method"] not in ("dense", "topk", "gtopk"):
            continue  # codecs: no α-β traffic model here
        eb = 6 if r["dtype"] == "fp16" else 8
        sb = 2 if r["dtype"] == "fp16" else 4
        f = traffic(r["method"], r["P"], r["numel"], r.get("k"), eb, sb, load_factor(r["P"], cores))
        f["bytes"] = r["bytes_sent"]  # measured (equals the formula; see tests)
        f["time_s"] = r["time_s"]
        f.update({k: r[k] for k in ("P", "numel", "dtype", "density")})
        out.setdefault((r["engine"], r["method"]), []).append(f)
    return out


def efficiency(compute_s: float, select_s: float, comm_s: float) -> float:
    """Scaling efficiency with weak scaling (same per-worker batch): the
    single worker runs compute only (no exchange, no selection)."""
    return compute_s / (compute_s + select_s + comm_s)
