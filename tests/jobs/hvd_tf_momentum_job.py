"""Run by tests/horovod/test_horovod_tf.py in one process (Horovod-TF with
one rank, no horovodrun): DGC momentum correction (plain, Nesterov,
dampening, no masking) and local clipping of the TensorFlow layer against
the single-process oracle of the PyTorch side, bit for bit -- updates,
residuals and velocities over four steps, fp32, fp16 and bf16, eagerly and
inside tf.function.  Prints one ``ok`` line per case; a mismatch raises.
"""
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import torch  # noqa: E402

import horovod.tensorflow as hvd  # noqa: E402

hvd.init()

from gtopk_plugin.tensorflow import Compression  # noqa: E402
from gtopk_plugin.testing import Oracle  # noqa: E402

SHAPES = [(12, 10), (10,), (10, 6), (3,)]
CASES = [
    dict(method="gtopk", momentum_correction=0.9),
    dict(method="topk", momentum_correction=0.9, nesterov=True),
    dict(method="topk", momentum_correction=0.9, dampening=0.5, momentum_masking=False),
    dict(method="rtopk", momentum_correction=0.9, seed=3),
    dict(method="gtopk", momentum_correction=0.9, clip_norm=3.0),
    dict(method="topk", momentum_correction=0.9, nesterov=True, clip_norm=2.0),
    dict(method="topk", clip_norm=2.0, granularity="global"),
]
DTYPES = {"float32": (torch.float32, tf.float32), "float16": (torch.float16, tf.float16),
          "bfloat16": (torch.bfloat16, tf.bfloat16)}


def bits(t) -> bytes:
    return t.reshape(-1).view(torch.int16 if t.dtype == torch.bfloat16 else t.dtype).numpy().tobytes()


def tf_bits(x) -> bytes:
    return (tf.bitcast(x, tf.int16) if x.dtype == tf.bfloat16 else x).numpy().reshape(-1).tobytes()


def check(kw, graph, dtype):
    tdt, fdt = DTYPES[dtype]
    comp = getattr(Compression, kw["method"])(0.1, **{k: v for k, v in kw.items() if k != "method"})
    oracle = Oracle(1, density=0.1, **kw)
    fn = (lambda *g: comp.reduce(list(g), op=hvd.Sum))
    fn = tf.function(fn) if graph else fn
    rng = np.random.default_rng(1)
    for step in range(4):
        g = [torch.from_numpy((rng.standard_normal(s) * 3).astype(np.float32)).to(tdt) for s in SHAPES]
        got = fn(*[tf.cast(tf.constant(x.float().numpy()), fdt) for x in g])
        want = oracle.step([{f"t{i:04d}": x for i, x in enumerate(g)}])
        for i, x in enumerate(got):
            assert tf_bits(x) == bits(want[f"t{i:04d}"]), f"{kw} {dtype} graph={graph} step {step}: update {i}"
    for kind, mine, theirs in (("residual", comp.residuals, oracle.residuals[0]),
                               ("velocity", comp.velocities, oracle.velocity[0].velocities)):
        for key, var in mine.items():
            assert tf_bits(var) == bits(theirs["t" + key[1:]]), f"{kw} {dtype} graph={graph}: {kind} {key}"
    assert set(comp.velocities) == ({f"u{i:04d}" for i in range(len(SHAPES))} if "momentum_correction" in kw else set())
    print("ok", kw, dtype, "graph" if graph else "eager", flush=True)


if __name__ == "__main__":
    for graph in (False, True):
        for dtype in DTYPES:
            for kw in CASES:
                check(kw, graph, dtype)
    sys.exit(0)
