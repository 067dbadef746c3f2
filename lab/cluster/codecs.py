"""Codec rows of measurement 1: the quantizers and the low-rank
codec (``onebit``, ``qsgd``, ``powersgd``) timed on the same harness, in
the same worker job, as the dense ring, the Top-k allgather and gTop-k.

A codec encodes this worker's whole accumulator into a payload (1-bit
signs and scales, QSGD levels and bucket norms) or, for PowerSGD, runs
rounds of allreduces whose messages it computes between them.  The timed
region is the library's aggregation, as for the selecting methods:
``allgather_payloads`` (a ring of P−1 payload exchanges, then every rank
decodes and sums all P payloads) or ``allreduce_rounds`` (PowerSGD's two
allreduces, with ``P = M Q``, the orthonormalization and ``Q = Mᵀ P̂`` in
between: the codec cannot be split from its exchange).  PowerSGD sees the
measurement's layers as near-square matrices (:func:`matrix_shape`).  Encoding a
payload (onebit, qsgd) is left out, as selection is for the sparse
methods; the payload is encoded once and sent every step, so every step
moves the same bytes.  PowerSGD gets a fresh contribution every step (its
warm-started Q carries over, as in training).

``onebit_rs`` is ``onebit`` with ``merge="reduce_scatter_payloads"``, the
two-phase compressed allreduce (a reduce-scatter of payload shards, owner
re-compression with a server residual, an allgather of the compressed
shards: about 2·(P−1)/P of a payload each way and O(N) decode per rank
instead of (P−1) payloads and O(P·N)).  The harness keys its rows by
registered method name, so this module registers ``onebit_rs`` -- in the
benchmark's processes only, not in the library -- as the row beside
``onebit`` (``--methods onebit,onebit_rs``); its server residual carries
from step to step, as in training.

Hyper-parameters come from ``--hyper METHOD.NAME=VALUE`` (default
``powersgd.rank=4``) and are validated by the registry.  Codecs have no
density and no wire dtype: their rows carry ``density=None`` and run for
fp32 only.
"""
from __future__ import annotations

import math
import statistics
from typing import Dict, List

from gtopk_plugin import kernels
from gtopk_plugin.collectives import Selection, payloads
from gtopk_plugin.collectives.rounds import ROUNDS, codec_contribution
from gtopk_plugin import registry
from gtopk_plugin.compress.compressor import SelectionContext
from gtopk_plugin.compress.onebit import OneBitCodec

DEFAULT_HYPER = ["powersgd.rank=4"]
ORDER = ["dense", "topk", "gtopk", "onebit", "onebit_rs", "qsgd", "powersgd"]


class OneBitReduceScatter(OneBitCodec):
    """onebit with merge='reduce_scatter_payloads' (a benchmark row: see the module docstring)."""

    aggregation = payloads.NAME
    merges = ()


registry.register("onebit_rs", OneBitReduceScatter)
CODEC_DTYPES = ("fp32",)


def is_codec(method: str) -> bool:
    return registry.get(method).kind == "codec"


def uses_density(method: str) -> bool:
    """Rows of ``method`` come per density (selecting methods but dense)."""
    c = registry.get(method)
    return c.kind != "codec" and c.aggregation != "dense"


def matrix_shape(n: int, min_side: int = 64):
    """The measurement's 1-D model-like layers (``bytes_per_step.layer_shapes``)
    viewed as near-square matrices for the low-rank codec: ``(a, n // a)``
    with ``a`` the largest divisor of ``n`` not above ``sqrt(n)`` (a real
    4096 × 4096 linear layer is the same kind of matrix); vectors and
    layers without a divisor of at least ``min_side`` stay 1-D, and PowerSGD
    sends them dense, as it does biases."""
    a = int(math.isqrt(n))
    while a >= min_side and n % a:
        a -= 1
    return (a, n // a) if a >= min_side else (n,)


def _value(text: str):
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text


def parse_hyper(specs: List[str]) -> Dict[str, Dict]:
    """``["powersgd.rank=4", "qsgd.levels=15"]`` -> ``{method: {name:
    value}}``, validated by the registry (a ``ValueError`` names what is
    wrong)."""
    out: Dict[str, Dict] = {}
    for spec in specs or []:
        key, sep, val = spec.partition("=")
        method, dot, name = key.partition(".")
        if not (sep and dot and method and name):
            raise ValueError(f"--hyper wants METHOD.NAME=VALUE; got {spec!r}")
        registry.get(method)
        out.setdefault(method, {})[name] = _value(val)
    for method, hyper in out.items():
        out[method] = registry.resolve(method, hyper)
    return out


def label(method: str, hyper: Dict[str, Dict]) -> str:
    """``powersgd (rank 4)``: a row's name with its hyper-parameters."""
    h = hyper.get(method) or {}
    shown = {"powersgd": ("rank",), "qsgd": ("levels",)}.get(method, ())
    extra = ", ".join(f"{k} {h[k]}" for k in shown if k in h)
    return f"{method} ({extra})" if extra else method


class CodecRow:
    """One codec in one worker: the compressor (built once, its state -- a
    warm-started Q -- carried from step to step) and the Selection to hand
    to the aggregation at each step."""

    def __init__(self, method: str, hyper: Dict[str, Dict], acc, offsets, shapes, names, rank: int):
        self.method = method
        self.codec = registry.get(method)(**registry.resolve(method, dict(hyper.get(method) or {})))
        self.rounds = self.codec.aggregation == ROUNDS
        self.acc, self.offsets, self.shapes, self.names, self.rank = acc, offsets, shapes, names, rank
        self._fixed = None

    def selection(self, step: int) -> Selection:
        if self._fixed is not None:
            return self._fixed
        ctx = SelectionContext(step=step, segment_names=self.names, seed=0, rank=self.rank,
                               shapes=self.shapes)
        numel = self.acc.numel()
        payload, vals = codec_contribution(self.codec, self.acc, self.offsets, numel, self.acc.dtype, ctx)
        if self.codec.aggregation == payloads.NAME:  # shards and the server residual
            payloads.bind(payload, self.codec, self.names)
        sizes = self.offsets[1:] - self.offsets[:-1]
        sel = Selection(idx=None, vals=vals, numel=numel, offsets=self.offsets, k=sizes,
                        idx_dtype=kernels.index_dtype(numel), sum_dtype=self.acc.dtype, static_count=True, payload=payload)
        if not self.rounds:  # the same payload every step (encoded once, like a cached top-k)
            self._fixed = sel
        return sel


# ---------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------
def _ms(t):
    return f"{t * 1e3:.1f}" if t >= 0.01 else f"{t * 1e3:.2f}"


def _density(res, density):
    if density is not None:
        return density
    ds = [r["density"] for r in res["rows"] if r["density"] is not None]
    return min(ds) if ds else None


def per_pass(r) -> List[float]:
    """Median of each pass's steps (``--repeat``: the passes' steps are
    pooled in ``times``, in order, the same number from each)."""
    n = max(1, r.get("passes", 1))
    m = len(r["times"]) // n
    return [statistics.median(r["times"][i * m:(i + 1) * m]) for i in range(n)] if m else []


def families_table(res, numel=None, density=None) -> List[str]:
    """Markdown: every method's bytes and exchange time per P (torch,
    fp32): dense, Top-k and gTop-k at ``density`` (default: the run's
    lowest), and the codecs."""
    density = _density(res, density)
    hyper = (res.get("settings") or {}).get("hyper") or {}
    rows = [r for r in res["rows"] if r["engine"] == "torch" and r["dtype"] == "fp32"
            and (numel is None or r["numel"] == numel)
            and (r["density"] is None or r["density"] == density)]
    if not any(is_codec(r["method"]) for r in rows if r["method"] in registry.available()):
        return []
    order = {m: i for i, m in enumerate(ORDER)}
    out = ["| N | P | method | exchange ms: median (min–max over steps) | per pass | in transport ms | worker CPU "
           "s/step | bytes sent per worker per step | × dense bytes | × dense time |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for N, P in sorted({(r["numel"], r["P"]) for r in rows}):
        grp = sorted((r for r in rows if r["numel"] == N and r["P"] == P),
                     key=lambda r: order.get(r["method"], 99))
        de = next((r for r in grp if r["method"] == "dense"), None)
        for r in grp:
            name = label(r["method"], hyper) + (f" {r['density']:g}" if r["density"] is not None else "")
            xb = f"{r['bytes_sent'] / de['bytes_sent']:.4f}" if de else "–"
            xt = f"{r['time_s'] / de['time_s']:.3f}" if de else "–"
            out.append(f"| {N:,} | {P} | {name} | {_ms(r['time_s'])} ({_ms(min(r['times']))}–"
                       f"{_ms(max(r['times']))}) | {', '.join(_ms(x) for x in per_pass(r))} | "
                       f"{_ms(r['wire_s'])} | {r.get('proc_cpu_s') or 0:.2f} | {r['bytes_sent']:,} | {xb} | {xt} |")
    return out


def plot_families(res, path, density=None):
    """Bars per P: exchange ms and bytes per step of every method (torch, fp32)."""
    density = _density(res, density)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = [r for r in res["rows"] if r["engine"] == "torch" and r["dtype"] == "fp32"
            and (r["density"] is None or r["density"] == density)]
    if not rows:
        return None
    N = max(r["numel"] for r in rows)
    rows = [r for r in rows if r["numel"] == N]
    Ps = sorted({r["P"] for r in rows})
    methods = [m for m in ORDER
               if any(r["method"] == m for r in rows)]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    w = 0.8 / max(1, len(methods))
    for i, m in enumerate(methods):
        for ax, key, scale in ((axes[0], "time_s", 1e3), (axes[1], "bytes_sent", 1e-6)):
            xs, ys, lo, hi = [], [], [], []
            for j, P in enumerate(Ps):
                r = next((r for r in rows if r["P"] == P and r["method"] == m), None)
                if r is None:
                    continue
                xs.append(j + (i - (len(methods) - 1) / 2) * w)
                ys.append(r[key] * scale)
                if key == "time_s":
                    lo.append((r[key] - min(r["times"])) * scale)
                    hi.append((max(r["times"]) - r[key]) * scale)
            kw = {"yerr": [lo, hi], "capsize": 2} if key == "time_s" else {}
            ax.bar(xs, ys, w, label=m, **kw)
    for ax, yl in ((axes[0], "exchange ms (median, min–max)"), (axes[1], "MB sent per worker per step")):
        ax.set_xticks(range(len(Ps)))
        ax.set_xticklabels([f"P = {P}" for P in Ps])
        ax.set_yscale("log")
        ax.set_ylabel(yl)
        ax.grid(True, axis="y", which="both", ls=":")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Compressor families, N = {N:,}, gTop-k/Top-k density {density or 0:g}, torch gloo, fp32 "
                 "(2 shared cores)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
