"""Elastic worker run by tests/horovod/test_horovod_tf.py under
``horovodrun --gloo -np 2 --min-np 2 --host-discovery-script ...``.

    python tests/jobs/hvd_tf_elastic_job.py OUTDIR MODE[,MODE]      (MODE: tape or keras)

Trains with gtopk_plugin's DistributedGradientTape (``tape``: the
compression corrects momentum 0.9 itself, SGD has none) or Keras
DistributedOptimizer (``keras``: SGD momentum 0.9 with
``momentum_correction=True``; the state finds ``opt.gtopk_compression``
itself), gTop-k inside tf.function, under ``hvd.elastic.run`` with a
``SparseKerasState`` and, once (tests/jobs/hvd_elastic_failure.py),
raises ``HorovodInternalError`` on every worker after uncommitted steps (what
Horovod raises when a peer is lost).  ``hvd.elastic.run`` then restores the
last commit, re-initialises Horovod and syncs; the script records residuals,
velocities and step counter at the commit, just before the failure and right after the
restore, plus the final weights (pickled to OUTDIR/MODE/rank{r}.pkl).  The
modes run one after the other in the same job, each with its own model,
state and failure (one elastic launch, and AutoGraph converts the layer's
code once per worker).
"""
import os
import pickle
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import horovod.tensorflow as hvd  # noqa: E402

from gtopk_plugin.tensorflow import (Compression, DistributedGradientTape, DistributedOptimizer,  # noqa: E402
                                     SparseKerasState)
from hvd_elastic_failure import run_with_one_failure  # noqa: E402 - this script's folder (tests/jobs/)

tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
hvd.init()
OUT, MODES = sys.argv[1], sys.argv[2].split(",")


def run_mode(mode):
    """One elastic training run (``mode``: tape or keras) with one simulated
    failure; its log pickled to OUT/<mode>/rank{r}.pkl."""
    tf.keras.utils.set_random_seed(0)
    model = tf.keras.Sequential([tf.keras.Input((12,)), tf.keras.layers.Dense(10, activation="relu"),
                                 tf.keras.layers.Dense(3)])
    if mode == "keras":
        comp = Compression.gtopk(0.1)
        opt = DistributedOptimizer(tf.keras.optimizers.SGD(0.1, momentum=0.9), compression=comp,
                                   momentum_correction=True)
    else:
        comp = Compression.gtopk(0.1, momentum_correction=0.9)
        opt = tf.keras.optimizers.SGD(0.1)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        if mode == "keras":  # Horovod's Keras optimizer reduces in compute_gradients (minimize, fit)
            opt.minimize(loss, model.trainable_variables, tape=tape)
            return loss
        tape = DistributedGradientTape(tape, compression=comp)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    opt.build(model.trainable_variables)  # optimizer variables exist before the state copies them
    if mode == "keras":
        state = SparseKerasState(model, opt, batch=0)
        assert state.compressions == [comp], state.compressions
    else:
        state = SparseKerasState(model, opt, compressions=[comp], batch=0)

    def sparse_state():
        return {"step": int(comp.step.numpy()), "residuals": comp.residual_values(),
                "velocities": comp.velocity_values()}

    def step(b):
        rng = np.random.default_rng(100 * b + hvd.rank())
        train_step(tf.constant(rng.standard_normal((8, 12)), tf.float32), tf.constant(rng.integers(0, 3, 8)))

    log = run_with_one_failure(hvd, state, step, sparse_state)
    log["final"] = [w.numpy() for w in model.weights]
    log["final_step"] = int(comp.step.numpy())
    os.makedirs(os.path.join(OUT, mode), exist_ok=True)
    with open(os.path.join(OUT, mode, f"rank{hvd.rank()}.pkl"), "wb") as f:
        pickle.dump(log, f)


for m in MODES:
    run_mode(m)
