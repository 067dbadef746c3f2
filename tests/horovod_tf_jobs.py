"""Worker script run under ``horovodrun`` by tests/test_horovod_tf.py.

    horovodrun -np N -H localhost:N --gloo python tests/horovod_tf_jobs.py OUTDIR

Every rank runs every check and pickles ``OUTDIR/rank{r}.pkl`` (a dict of
results: numpy arrays); the parent test compares ranks with each other and
with the single-process oracle of the PyTorch side.  One job batches all
checks because starting TensorFlow under horovodrun costs many seconds.  A
check that raises is recorded as an error and the job goes on.
"""
import os
import pickle
import sys
import time
import traceback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import horovod.tensorflow as hvd  # noqa: E402
import horovod.tensorflow.keras as hvd_keras  # noqa: E402

tf.config.threading.set_inter_op_parallelism_threads(int(os.environ.get("GTOPK_TF_INTER_OP", "1")))
tf.config.threading.set_intra_op_parallelism_threads(1)
hvd.init()

from gtopk_plugin import DensityWarmup  # noqa: E402
from gtopk_plugin.consistency import NonFiniteGradientError  # noqa: E402
from gtopk_plugin.tensorflow import Compression, DistributedGradientTape, DistributedOptimizer  # noqa: E402

R, P = hvd.rank(), hvd.size()
STEPS = 3
SHAPES = [(12, 10), (10,), (10, 6), (6,), (6, 3), (3,)]

# name -> (Compression factory, tape op); the parent holds the oracle settings
SPARSE = {
    "topk": (lambda: Compression.topk(0.1), hvd.Sum),
    "gtopk": (lambda: Compression.gtopk(0.1), hvd.Sum),
    "rtopk": (lambda: Compression.rtopk(0.1, r_factor=3.0, seed=5), hvd.Sum),
    "randomk": (lambda: Compression.randomk(0.1, seed=3), hvd.Sum),
    "threshold": (lambda: Compression.threshold(0.1), hvd.Sum),
    "gtopk_fp16wire": (lambda: Compression.gtopk(0.1, value_dtype=tf.float16), hvd.Sum),
    "threshold_butterfly": (lambda: Compression.threshold(0.1, merge="gtopk"), hvd.Sum),
    "topk_global": (lambda: Compression.topk(0.05, granularity="global"), hvd.Sum),
    "gtopk_average": (lambda: Compression.gtopk(0.1), hvd.Average),
    # density warm-up (eager: k from the agreed step in Python)
    "gtopk_warmup": (lambda: Compression.gtopk(0.1, warmup=DensityWarmup(2, 0.5)), hvd.Sum),
}
# traced (tf.function): name -> Compression factory, op hvd.Sum
GRAPH = {
    # with P = 3 one rank idles in the butterfly's rounds (see _Ops.phase)
    "gtopk_graph": lambda: Compression.gtopk(0.1),
    "threshold_butterfly_graph": lambda: Compression.threshold(0.1, merge="gtopk"),
    "topk_graph": lambda: Compression.topk(0.1),
    # warm-up: run-time k in one graph for every step
    "gtopk_warmup_graph": lambda: Compression.gtopk(0.1, warmup=DensityWarmup(2, 0.5)),
    "threshold_warmup_graph": lambda: Compression.threshold(0.1, warmup=[0.5, 0.3]),
    "rtopk_warmup_graph": lambda: Compression.rtopk(0.1, r_factor=2.0, seed=4, warmup=[0.3]),
    "randomk_warmup_graph": lambda: Compression.randomk(0.1, seed=2, warmup=DensityWarmup(2, 0.4)),
}


def grads_for(rank, step):
    """Local gradients of (rank, step): coarse values, so ties are common."""
    rng = np.random.default_rng(1000 * step + rank)
    return [np.round(rng.standard_normal(s) * 4).astype(np.float32) / 4 for s in SHAPES]


def make_vars():
    return [tf.Variable(tf.zeros(s), name=f"v{i}") for i, s in enumerate(SHAPES)]


def loss_with_grads(variables, grads):
    """A loss whose gradient w.r.t. variable i is exactly grads[i]."""
    return tf.add_n([tf.reduce_sum(v * g) for v, g in zip(variables, grads)])


def run_tape(comp, op, steps=STEPS, graph=False):
    variables = make_vars()

    def step_fn(*grads):
        with tf.GradientTape() as tape:
            loss = loss_with_grads(variables, grads)
        tape = DistributedGradientTape(tape, compression=comp, op=op)
        return tape.gradient(loss, variables)

    if graph:
        step_fn = tf.function(step_fn)
    raw, out = [], []
    for s in range(steps):
        g = grads_for(R, s)
        raw.append(g)
        out.append([u.numpy() for u in step_fn(*[tf.constant(x) for x in g])])
    return {"raw": raw, "out": out, "residuals": comp.residual_values(), "step": int(comp.step.numpy()),
            "traffic": comp.last_step_traffic}


# -- Keras ---------------------------------------------------------------------
def keras_data(rank, n=32):
    rng = np.random.default_rng(77 + rank)
    return rng.standard_normal((n, 8)).astype(np.float32), rng.integers(0, 3, n)


def make_model():
    tf.keras.utils.set_random_seed(0)
    return tf.keras.Sequential([tf.keras.Input((8,)), tf.keras.layers.Dense(16, activation="relu"),
                                tf.keras.layers.Dense(3)])


def compile_fit(model, opt, epochs=1, batch=8):
    model.compile(optimizer=opt, loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = keras_data(R)
    model.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0)
    return [w.numpy() for w in model.weights]


def check_keras_dense(cname):
    comp = getattr(Compression, cname)
    ours = compile_fit(make_model(), DistributedOptimizer(tf.keras.optimizers.SGD(0.1), compression=comp))
    stock = compile_fit(make_model(), hvd_keras.DistributedOptimizer(tf.keras.optimizers.SGD(0.1),
                                                                     compression=comp))
    return {"ours": ours, "stock": stock}


def check_keras_backward_passes():
    """backward_passes_per_step=2 (average_aggregated_gradients) on batches
    of 8 reduces the mean gradient of 16 samples: the same training as
    batches of 16 with one pass per step, up to float rounding."""
    out = {}
    for key, bpps, batch in (("bpps2", 2, 8), ("bpps1", 1, 16)):
        opt = DistributedOptimizer(tf.keras.optimizers.SGD(0.1), compression=Compression.gtopk(0.1),
                                   backward_passes_per_step=bpps, average_aggregated_gradients=True)
        out[key] = {"weights": compile_fit(make_model(), opt, batch=batch),
                    "step": int(opt.gtopk_compression.step.numpy()),
                    "residuals": opt.gtopk_compression.residual_values()}
    return out


def check_keras_sparse_and_checkpoint(outdir):
    """Keras fit with gtopk; checkpoint (model + optimizer, which tracks the
    residuals); a fresh model/optimizer restores it; one more step on both
    must give the same bits."""
    model = make_model()
    opt = DistributedOptimizer(tf.keras.optimizers.SGD(0.1), compression=Compression.gtopk(0.1))
    weights = compile_fit(model, opt)
    comp = opt.gtopk_compression
    res_before = comp.residual_values()
    ckpt = tf.train.Checkpoint(model=model, optimizer=opt)
    path = ckpt.write(os.path.join(outdir, f"ckpt_rank{R}"))

    model2 = make_model()
    opt2 = DistributedOptimizer(tf.keras.optimizers.SGD(0.1), compression=Compression.gtopk(0.1))
    model2.compile(optimizer=opt2, loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    tf.train.Checkpoint(model=model2, optimizer=opt2).read(path).expect_partial()
    x, y = keras_data(R)
    model.fit(x[:8], y[:8], batch_size=8, epochs=1, shuffle=False, verbose=0)
    model2.fit(x[:8], y[:8], batch_size=8, epochs=1, shuffle=False, verbose=0)
    return {"weights": weights, "residuals_before": res_before,
            "restored_step_after": int(opt2.gtopk_compression.step.numpy()),
            "step_after": int(comp.step.numpy()),
            "cont": [w.numpy() for w in model.weights], "cont_restored": [w.numpy() for w in model2.weights],
            "res_cont": comp.residual_values(), "res_cont_restored": opt2.gtopk_compression.residual_values()}


def check_tape_checkpoint(outdir):
    """Tape path: the compression object is the checkpointed state."""
    comp = Compression.gtopk(0.1)
    run_tape(comp, hvd.Sum, steps=2)
    before = comp.residual_values()
    path = tf.train.Checkpoint(gtopk=comp).write(os.path.join(outdir, f"tape_ckpt_rank{R}"))
    comp2 = Compression.gtopk(0.1)
    status = tf.train.Checkpoint(gtopk=comp2).read(path)  # residuals are created at the first step
    variables = make_vars()
    outs = []
    for c in (comp, comp2):
        g = grads_for(R, 2)
        with tf.GradientTape() as tape:
            loss = loss_with_grads(variables, g)
        outs.append([u.numpy() for u in DistributedGradientTape(tape, compression=c, op=hvd.Sum)
                     .gradient(loss, variables)])
    status.assert_consumed()
    return {"before": before, "out": outs[0], "out_restored": outs[1],
            "res": comp.residual_values(), "res_restored": comp2.residual_values(),
            "step": int(comp.step.numpy()), "step_restored": int(comp2.step.numpy())}


def check_nonfinite():
    """NaN on rank 0 only: every rank raises (eager); with "skip" every rank
    applies zero and keeps its residual."""
    out = {}
    variables = make_vars()
    g = grads_for(R, 0)
    if R == 0:
        g[1][3] = np.nan
    try:
        with tf.GradientTape() as tape:
            loss = loss_with_grads(variables, g)
        DistributedGradientTape(tape, compression=Compression.gtopk(0.1)).gradient(loss, variables)
        out["raise"] = "no error"
    except NonFiniteGradientError as e:
        out["raise"] = f"NonFiniteGradientError: {e}"
    comp = Compression.topk(0.1, nonfinite="skip")
    run_tape(comp, hvd.Sum, steps=1)
    before = comp.residual_values()
    with tf.GradientTape() as tape:
        loss = loss_with_grads(variables, g)
    upd = DistributedGradientTape(tape, compression=comp).gradient(loss, variables)
    out["skip_zero"] = all(float(np.abs(u.numpy()).max()) == 0.0 for u in upd)
    after = comp.residual_values()
    out["skip_residual_kept"] = all(np.array_equal(before[k], after[k]) for k in before)
    out["skip_step"] = int(comp.step.numpy())
    return out


def main(outdir):
    results = {"rank": R, "size": P}

    def record(key, fn):
        t0 = time.time()
        try:
            results[key] = ("ok", fn())
            print(f"rank {R}: {key} ok ({time.time() - t0:.1f} s)", flush=True)
        except BaseException as e:  # noqa: BLE001 - record and go on
            results[key] = ("error", (type(e).__name__, str(e)[:2000], traceback.format_exc()[-4000:]))

    for name, (make, op) in SPARSE.items():
        record(f"sparse/{name}", lambda make=make, op=op: run_tape(make(), op))
    for name, make in GRAPH.items():
        record(f"sparse/{name}", lambda make=make: run_tape(make(), hvd.Sum, graph=True))
    for cname in ("none", "fp16"):
        record(f"keras/dense/{cname}", lambda cname=cname: check_keras_dense(cname))
    record("keras/gtopk_checkpoint", lambda: check_keras_sparse_and_checkpoint(outdir))
    record("keras/backward_passes", check_keras_backward_passes)
    record("tape/checkpoint", lambda: check_tape_checkpoint(outdir))
    record("nonfinite", check_nonfinite)
    with open(os.path.join(outdir, f"rank{R}.pkl"), "wb") as f:
        pickle.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1])
