"""Worker script run under ``horovodrun`` by tests/horovod/test_horovod_tf*.py.

    horovodrun -np N -H localhost:N --gloo python tests/jobs/hvd_tf_jobs.py OUTDIR [PART,PART,...]

Runs the PARTs one after the other in the same processes (default
``all``); each pickles ``OUTDIR/PART/rank{r}.pkl`` (a dict of results:
numpy arrays), or writes ``OUTDIR/PART/error.txt`` when it raised.  Parts:
``all`` (every check of test_horovod_tf.py), ``dense`` (only Keras
Compression.none / fp16 against stock Horovod-TF: the P = 2 bit-identity
checks), ``rounds`` and ``registry`` (tests/jobs/hvd_tf_rounds_job.py and
hvd_tf_registry_job.py), ``example-fit`` and ``example-tape``
(examples/horovod_tf_train.py as ``python examples/horovod_tf_train.py
--compression gtopk --density 0.01 --epochs 3 [--tape]`` runs it; its
output is pickled).  The parent test compares ranks with each other and
with the single-process oracle of the PyTorch side.  One job batches the
checks because starting TensorFlow under horovodrun costs many seconds,
and so does AutoGraph's first conversion of the layer's code in each
process.  A check that raises is recorded as an error and the job goes on.
"""
import contextlib
import gc
import io
import os
import pickle
import runpy
import sys
import time
import traceback
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import horovod.tensorflow as hvd  # noqa: E402
import horovod.tensorflow.keras as hvd_keras  # noqa: E402

tf.config.threading.set_inter_op_parallelism_threads(int(os.environ.get("GTOPK_TF_INTER_OP", "1")))
tf.config.threading.set_intra_op_parallelism_threads(1)

from gtopk_plugin import DensityWarmup  # noqa: E402
from gtopk_plugin.pipeline.input_check import NonFiniteGradientError  # noqa: E402
from gtopk_plugin.tensorflow import Compression, DistributedGradientTape, DistributedOptimizer  # noqa: E402
from gtopk_plugin.tensorflow import SparseKerasState  # noqa: E402

R = P = None  # this rank and the world size, once init_horovod() ran
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
    "threshold_butterfly": (lambda: Compression.threshold(0.1, merge="butterfly"), hvd.Sum),
    "topk_global": (lambda: Compression.topk(0.05, granularity="global"), hvd.Sum),
    "gtopk_average": (lambda: Compression.gtopk(0.1), hvd.Average),
    # density warm-up (eager: k from the agreed step in Python)
    "gtopk_warmup": (lambda: Compression.gtopk(0.1, warmup=DensityWarmup(2, 0.5)), hvd.Sum),
}
# traced (tf.function): name -> Compression factory, op hvd.Sum
GRAPH = {
    # with P = 3 one rank idles in the butterfly's rounds (see _Ops.phase)
    "gtopk_graph": lambda: Compression.gtopk(0.1),
    "threshold_butterfly_graph": lambda: Compression.threshold(0.1, merge="butterfly"),
    "topk_graph": lambda: Compression.topk(0.1),
    # warm-up: run-time k in one graph for every step
    "gtopk_warmup_graph": lambda: Compression.gtopk(0.1, warmup=DensityWarmup(2, 0.5)),
    "threshold_warmup_graph": lambda: Compression.threshold(0.1, warmup=[0.5, 0.3]),
    "rtopk_warmup_graph": lambda: Compression.rtopk(0.1, r_factor=2.0, seed=4, warmup=[0.3]),
    "randomk_warmup_graph": lambda: Compression.randomk(0.1, seed=2, warmup=DensityWarmup(2, 0.4)),
}

# DGC momentum correction (momentum factor masking) and local clipping:
# name -> (Compression factory, traced); op hvd.Sum, MC_STEPS steps
MC_STEPS = 4
MOMENTUM = {
    "mc_gtopk": (lambda: Compression.gtopk(0.1, momentum_correction=0.9), False),
    "mc_gtopk_nesterov_graph": (lambda: Compression.gtopk(0.1, momentum_correction=0.9, nesterov=True), True),
    "mc_topk": (lambda: Compression.topk(0.1, momentum_correction=0.9), False),
    "mc_topk_nesterov": (lambda: Compression.topk(0.1, momentum_correction=0.9, nesterov=True), False),
    "mc_rtopk": (lambda: Compression.rtopk(0.1, r_factor=3.0, seed=5, momentum_correction=0.9), False),
    "mc_rtopk_nesterov_graph": (lambda: Compression.rtopk(0.1, r_factor=2.0, seed=6, momentum_correction=0.9,
                                                          nesterov=True), True),
    "mc_randomk_nesterov": (lambda: Compression.randomk(0.1, seed=3, momentum_correction=0.9, nesterov=True), False),
    "mc_gtopk_nomask": (lambda: Compression.gtopk(0.1, momentum_correction=0.9, momentum_masking=False), False),
    # the gradients' norm is ~15 (217 entries of about N(0, 1)): these clip
    "clip_mc_gtopk": (lambda: Compression.gtopk(0.1, momentum_correction=0.9, clip_norm=8.0), False),
    "clip_topk_global_graph": (lambda: Compression.topk(0.05, granularity="global", clip_norm=5.0), True),
}

# fp16/bf16 wire (docs/design.md §3): name -> (Compression factory,
# traced, gradients); op hvd.Sum
WIRE = {
    "gtopk_fp16_overflow": (lambda: Compression.gtopk(0.1, value_dtype=tf.float16), False, "overflow"),
    "gtopk_fp16_overflow_graph": (lambda: Compression.gtopk(0.1, value_dtype=tf.float16), True, "overflow"),
    "randomk_fp16_overflow": (lambda: Compression.randomk(0.2, seed=7, value_dtype=tf.float16), False, "overflow"),
    "topk_fp16_overflow": (lambda: Compression.topk(0.1, value_dtype=tf.float16), False, "overflow"),
    "gtopk_bf16wire": (lambda: Compression.gtopk(0.1, value_dtype=tf.bfloat16), False, "fine"),
    "randomk_bf16wire_graph": (lambda: Compression.randomk(0.1, seed=8, value_dtype=tf.bfloat16), True, "fine"),
    "threshold_butterfly_fp16wire": (lambda: Compression.threshold(0.1, merge="butterfly", value_dtype=tf.float16),
                                     False, "fine"),
    # int8 wire: codes + one exponent byte per message, on the core's aggregation
    "gtopk_int8": (lambda: Compression.gtopk(0.1, value_dtype=tf.int8), False, "overflow"),
    "gtopk_int8_stochastic_graph": (lambda: Compression.gtopk(0.1, value_dtype=tf.int8, wire_rounding="stochastic",
                                                              seed=2), True, "fine"),
    "topk_int8_stochastic": (lambda: Compression.topk(0.1, value_dtype=tf.int8, wire_rounding="stochastic"),
                             False, "fine"),
    "rtopk_int8_graph": (lambda: Compression.rtopk(0.1, r_factor=2.0, seed=5, value_dtype=tf.int8), True, "fine"),
    "randomk_int8_stochastic": (lambda: Compression.randomk(0.1, seed=3, value_dtype=tf.int8,
                                                            wire_rounding="stochastic"), False, "fine"),
}


def check_int8_errors():
    """Where the int8 wire cannot run, every rank raises a ValueError at
    construction (the messages, for the parent to check)."""
    out = {}
    for key, make in (("horovod", lambda: Compression.gtopk(0.1, value_dtype=tf.int8, exchange="horovod")),
                      ("threshold", lambda: Compression.threshold(0.1, value_dtype=tf.int8)),
                      ("threshold_butterfly", lambda: Compression.threshold(0.1, merge="butterfly", value_dtype=tf.int8)),
                      ("stochastic_fp16", lambda: Compression.topk(0.1, value_dtype=tf.float16,
                                                                   wire_rounding="stochastic")),
                      ("rounding", lambda: Compression.topk(0.1, value_dtype=tf.int8, wire_rounding="up")),
                      ("elastic", lambda: SparseKerasState(make_model(), tf.keras.optimizers.SGD(0.1),
                                                             compressions=[Compression.gtopk(0.1, value_dtype=tf.int8)])),
                      ):
        try:
            make()
            out[key] = None
        except ValueError as e:
            out[key] = str(e)
    return out


def overflow_grads(rank, step):
    """Values an fp16 wire cannot hold: up to 1e6 on one rank (clamped at the
    sender), 4e4 at the same entries on every rank (their sum overflows fp16
    in a merge), and a fine-grained rest whose fp16 rounding matters."""
    rng = np.random.default_rng(500 + 1000 * step + rank)
    g = [(rng.standard_normal(s) * 3).astype(np.float32) for s in SHAPES]
    g[0][0, :4] = 4e4
    g[0][1, 2] = -4.5e4
    g[2][1, 1] = 1e6 * (rank + 1)
    g[1][3] = -3e5 if rank == 0 else 2e4
    return g


def fine_grads(rank, step):
    """Values with many significant bits (bf16 keeps 8): every wire rounding
    leaves an error."""
    rng = np.random.default_rng(900 + 1000 * step + rank)
    return [rng.standard_normal(s).astype(np.float32) * 10 for s in SHAPES]


def grads_for(rank, step):
    """Local gradients of (rank, step): coarse values, so ties are common."""
    rng = np.random.default_rng(1000 * step + rank)
    return [np.round(rng.standard_normal(s) * 4).astype(np.float32) / 4 for s in SHAPES]


def make_vars(random=False):
    rng = np.random.default_rng(5)
    return [tf.Variable(rng.standard_normal(s).astype(np.float32) if random else tf.zeros(s), name=f"v{i}")
            for i, s in enumerate(SHAPES)]


def loss_with_grads(variables, grads):
    """A loss whose gradient w.r.t. variable i is exactly grads[i]."""
    return tf.add_n([tf.reduce_sum(v * g) for v, g in zip(variables, grads)])


def run_tape(comp, op, steps=STEPS, graph=False, grads_fn=None):
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
        g = (grads_fn or grads_for)(R, s)
        raw.append(g)
        out.append([u.numpy() for u in step_fn(*[tf.constant(x) for x in g])])
    return {"raw": raw, "out": out, "residuals": comp.residual_values(), "step": int(comp.step.numpy()),
            "traffic": comp.last_step_traffic, "velocities": comp.velocity_values()}


def check_keras_momentum_correction(front, nesterov, graph, method, weight_decay):
    """Keras SGD(lr, momentum 0.9[, nesterov, weight_decay]) with
    momentum_correction=True -- the Keras DistributedOptimizer (``front``
    "keras": ``opt.minimize``, Horovod's Keras optimizer reduces in
    compute_gradients) or the tape (``optimizer=sgd``, then
    ``sgd.apply_gradients``) -- trained on fixed gradients: the parent checks
    the weights against the PyTorch oracle's updates (op average) applied as
    w <- w - lr·wd·w - lr·update (Keras' weight decay is decoupled and stays
    with the optimizer)."""
    variables = make_vars(random=True)
    w0 = [v.numpy() for v in variables]
    sgd = tf.keras.optimizers.SGD(0.1, momentum=0.9, nesterov=nesterov, weight_decay=weight_decay)
    if front == "keras":  # the compression's keyword, as in the PyTorch Horovod layer
        comp = getattr(Compression, method)(0.1, momentum_correction=True)
        opt = DistributedOptimizer(sgd, compression=comp)
    else:  # the tape's keyword
        comp = getattr(Compression, method)(0.1)
        opt = sgd

    def step_fn(*grads):
        if front == "keras":
            opt.minimize(lambda: loss_with_grads(variables, grads), variables)
            return
        with tf.GradientTape() as tape:
            loss = loss_with_grads(variables, grads)
        tape = DistributedGradientTape(tape, compression=comp, momentum_correction=True, optimizer=opt)
        opt.apply_gradients(zip(tape.gradient(loss, variables), variables))

    if graph:
        step_fn = tf.function(step_fn)
    raw = []
    for s in range(MC_STEPS):
        g = grads_for(R, s)
        raw.append(g)
        step_fn(*[tf.constant(x) for x in g])
    return {"raw": raw, "w0": w0, "weights": [v.numpy() for v in variables],
            "residuals": comp.residual_values(), "velocities": comp.velocity_values(),
            "momentum_after": (opt.momentum, opt.nesterov, opt.get_config()["momentum"]),
            "step": int(comp.step.numpy())}


def check_momentum_errors():
    """Momentum applied twice, or a correction that cannot be set up: a
    clear ValueError (before any collective, so on every rank)."""
    out = {}
    cases = {
        "adam": lambda: DistributedOptimizer(tf.keras.optimizers.Adam(), compression=Compression.gtopk(0.1),
                                             momentum_correction=True),
        "twice": lambda: DistributedOptimizer(tf.keras.optimizers.SGD(0.1, momentum=0.9),
                                              compression=Compression.gtopk(0.1, momentum_correction=0.9)),
        "both": lambda: DistributedOptimizer(tf.keras.optimizers.SGD(0.1, momentum=0.9),
                                             compression=Compression.gtopk(0.1, momentum_correction=0.9),
                                             momentum_correction=True),
        "tape_no_optimizer": lambda: DistributedGradientTape(tf.GradientTape(), compression=Compression.gtopk(0.1),
                                                             momentum_correction=True),
        "tape_twice": lambda: DistributedGradientTape(
            tf.GradientTape(), compression=Compression.topk(0.1, momentum_correction=0.5),
            optimizer=tf.keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True)),
        "momentum_1": lambda: Compression.gtopk(0.1, momentum_correction=1.0),
        "clip_negative": lambda: Compression.gtopk(0.1, clip_norm=-1.0),
        "nesterov_without_momentum": lambda: Compression.gtopk(0.1, nesterov=True),
    }
    for name, fn in cases.items():
        try:
            fn()
            out[name] = "no error"
        except ValueError as e:
            out[name] = f"ValueError: {e}"
    # allowed: the optimizer built without momentum next to the compression's
    DistributedOptimizer(tf.keras.optimizers.SGD(0.1), compression=Compression.gtopk(0.1, momentum_correction=0.9))
    # dense: momentum_correction changes nothing (the optimizer's momentum is exact)
    dense = DistributedOptimizer(tf.keras.optimizers.SGD(0.1, momentum=0.9), compression=Compression.none,
                                 momentum_correction=True)
    out["dense_momentum_kept"] = not getattr(dense, "_gtopk_momentum_taken", False)
    with warnings.catch_warnings(record=True) as caught:  # momentum without correction: a warning
        warnings.simplefilter("always")
        DistributedOptimizer(tf.keras.optimizers.SGD(0.1, momentum=0.9), compression=Compression.gtopk(0.1))
    out["uncorrected_warning"] = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    return out


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


def check_keras_sparse_and_checkpoint(outdir, momentum_correction=False):
    """Keras fit with gtopk; checkpoint (model + optimizer, which tracks the
    residuals and velocities); a fresh model/optimizer restores it; one more
    step on both must give the same bits.  ``momentum_correction``: SGD with
    Nesterov momentum 0.9, taken over by the compression."""
    def make_opt():
        sgd = tf.keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True) if momentum_correction else \
            tf.keras.optimizers.SGD(0.1)
        return DistributedOptimizer(sgd, compression=Compression.gtopk(0.1), momentum_correction=momentum_correction)

    model = make_model()
    opt = make_opt()
    weights = compile_fit(model, opt)
    comp = opt.gtopk_compression
    res_before = comp.residual_values()
    vel_before = comp.velocity_values()
    ckpt = tf.train.Checkpoint(model=model, optimizer=opt)
    path = ckpt.write(os.path.join(outdir, f"ckpt{int(momentum_correction)}_rank{R}"))

    model2 = make_model()
    opt2 = make_opt()
    model2.compile(optimizer=opt2, loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    tf.train.Checkpoint(model=model2, optimizer=opt2).read(path).expect_partial()
    x, y = keras_data(R)
    model.fit(x[:8], y[:8], batch_size=8, epochs=1, shuffle=False, verbose=0)
    model2.fit(x[:8], y[:8], batch_size=8, epochs=1, shuffle=False, verbose=0)
    return {"weights": weights, "residuals_before": res_before,
            "restored_step_after": int(opt2.gtopk_compression.step.numpy()),
            "step_after": int(comp.step.numpy()),
            "cont": [w.numpy() for w in model.weights], "cont_restored": [w.numpy() for w in model2.weights],
            "res_cont": comp.residual_values(), "res_cont_restored": opt2.gtopk_compression.residual_values(),
            "velocities_before": vel_before, "vel_cont": comp.velocity_values(),
            "vel_cont_restored": opt2.gtopk_compression.velocity_values()}


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


def run_checks(outdir, which="all"):
    """``which``: "all" the checks, or "dense" only Keras Compression.none /
    fp16 against stock Horovod-TF (the P = 2 bit-identity job)."""
    results = {"rank": R, "size": P}

    def record(key, fn):
        t0 = time.time()
        try:
            results[key] = ("ok", fn())
            print(f"rank {R}: {key} ok ({time.time() - t0:.1f} s)", flush=True)
        except BaseException as e:  # noqa: BLE001 - record and go on
            results[key] = ("error", (type(e).__name__, str(e)[:2000], traceback.format_exc()[-4000:]))

    for cname in ("none", "fp16"):
        record(f"keras/dense/{cname}", lambda cname=cname: check_keras_dense(cname))
    if which == "dense":
        with open(os.path.join(outdir, f"rank{R}.pkl"), "wb") as f:
            pickle.dump(results, f)
        return
    for name, (make, op) in SPARSE.items():
        record(f"sparse/{name}", lambda make=make, op=op: run_tape(make(), op))
    for name, make in GRAPH.items():
        record(f"sparse/{name}", lambda make=make: run_tape(make(), hvd.Sum, graph=True))
    for name, (make, graph) in MOMENTUM.items():
        record(f"momentum/{name}", lambda make=make, graph=graph: run_tape(make(), hvd.Sum, MC_STEPS, graph))
    for name, args in (("keras_plain_wd_graph", ("keras", False, True, "gtopk", 0.01)),
                       ("tape_nesterov", ("tape", True, False, "topk", None))):
        record(f"momentum/{name}", lambda args=args: check_keras_momentum_correction(*args))
    record("momentum/errors", check_momentum_errors)
    for name, (make, graph, kind) in WIRE.items():
        fn = overflow_grads if kind == "overflow" else fine_grads
        record(f"wire/{name}", lambda make=make, graph=graph, fn=fn: run_tape(make(), hvd.Sum, STEPS, graph, fn))
    record("wire/int8_errors", check_int8_errors)
    record("keras/gtopk_checkpoint", lambda: check_keras_sparse_and_checkpoint(outdir))
    record("keras/mc_checkpoint", lambda: check_keras_sparse_and_checkpoint(outdir, momentum_correction=True))
    record("keras/backward_passes", check_keras_backward_passes)
    record("tape/checkpoint", lambda: check_tape_checkpoint(outdir))
    record("nonfinite", check_nonfinite)
    with open(os.path.join(outdir, f"rank{R}.pkl"), "wb") as f:
        pickle.dump(results, f)


EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                       "examples", "horovod_tf_train.py")
EXAMPLE_ARGS = ["--compression", "gtopk", "--density", "0.01", "--epochs", "3"]


def run_example(outdir, tape):
    """examples/horovod_tf_train.py run as its own ``__main__`` with the
    command line the docs give (``--tape``: the DistributedGradientTape
    loop); its printed output is pickled for the parent.  Put first in a
    job, it initialises Horovod itself, as in a process of its own."""
    argv = [EXAMPLE] + EXAMPLE_ARGS + (["--tape"] if tape else [])
    buf = io.StringIO()
    saved = sys.argv
    sys.argv = argv
    try:
        with contextlib.redirect_stdout(buf):
            runpy.run_path(EXAMPLE, run_name="__main__")
    finally:
        sys.argv = saved
    init_horovod()
    with open(os.path.join(outdir, f"rank{R}.pkl"), "wb") as f:
        pickle.dump({"rank": R, "argv": argv[1:], "stdout": buf.getvalue()}, f)


def init_horovod():
    global R, P
    hvd.init()  # (a no-op once Horovod is initialised: by an earlier part, or the example)
    R, P = hvd.rank(), hvd.size()


def main(outdir, which="all"):
    """Every part of ``which`` (comma-separated) in turn, each into
    ``outdir/<part>/``; a part that raises leaves ``error.txt`` there and
    the next part runs."""
    for part in which.split(","):
        d = os.path.join(outdir, part)
        os.makedirs(d, exist_ok=True)
        t0 = time.time()
        try:
            if not part.startswith("example-"):
                init_horovod()
            if part in ("all", "dense"):
                run_checks(d, part)
            elif part == "rounds":
                import hvd_tf_rounds_job  # noqa: PLC0415 - its module code sets up that part

                hvd_tf_rounds_job.main(d)
            elif part == "registry":
                import hvd_tf_registry_job  # noqa: PLC0415

                hvd_tf_registry_job.main(d)
            elif part in ("example-fit", "example-tape"):
                run_example(d, tape=part == "example-tape")
            else:
                raise ValueError(f"unknown part {part!r}")
        except BaseException:  # noqa: BLE001 - reported by the parent, the other parts still run
            with open(os.path.join(d, "error.txt"), "w") as f:
                f.write(f"rank {os.environ.get('HOROVOD_RANK', R)}: part {part} raised:\n"
                        f"{traceback.format_exc()[-6000:]}")
        finally:
            gc.collect()  # a part's torch process group is freed here, not at interpreter shutdown
        print(f"rank {os.environ.get('HOROVOD_RANK', R)}: part {part} done ({time.time() - t0:.1f} s)",
              flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:3])
