"""Worker script of tests/horovod/test_horovod_tf_registry.py, run under
``horovodrun -np N --gloo``: compressors of the registry that the TensorFlow
layer has no code of its own for -- the built-in ``onebit`` codec, a
selector and a codec registered from user code (tests/support/
tf_user_compressors.py) -- through ``gtopk_plugin.tensorflow``'s
``DistributedGradientTape``, eagerly and inside ``tf.function``.

    horovodrun -np N -H localhost:N --gloo python tests/jobs/hvd_tf_registry_job.py OUTDIR

Every rank pickles ``OUTDIR/rank{r}.pkl``: per run its local gradients
(numpy), the reduced ones, its residuals and last-step traffic.
"""
import os
import pickle
import sys
import traceback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import horovod.tensorflow as hvd  # noqa: E402

tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
hvd.init()

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support"))
import tf_user_compressors  # noqa: E402,F401  (registers firstk_user, half_tf_user)

from gtopk_plugin.tensorflow import Compression, DistributedGradientTape  # noqa: E402

R, P = hvd.rank(), hvd.size()
STEPS = 3
SHAPES = [(12, 10), (10,), (10, 6), (6,), (6, 3), (3,)]
RUNS = {  # name -> (Compression factory, traced)
    "onebit": (lambda: Compression.onebit(), False),
    "onebit_graph": (lambda: Compression.onebit(), True),
    "half_tf_user_graph": (lambda: Compression.half_tf_user(), True),
    "firstk_user": (lambda: Compression.firstk_user(0.1), False),
    "firstk_user_butterfly_graph": (lambda: Compression.firstk_user(0.1, merge="gtopk"), True),
}


def grads_for(step):
    rng = np.random.default_rng(1000 * step + R)
    return [(rng.standard_normal(s) * 3).astype(np.float32) for s in SHAPES]


def run(comp, graph):
    variables = [tf.Variable(tf.zeros(s)) for s in SHAPES]

    def step_fn(*grads):
        with tf.GradientTape() as tape:
            loss = tf.add_n([tf.reduce_sum(v * g) for v, g in zip(variables, grads)])
        return DistributedGradientTape(tape, compression=comp, op=hvd.Sum).gradient(loss, variables)

    if graph:
        step_fn = tf.function(step_fn)
    raw, out = [], []
    for s in range(STEPS):
        g = grads_for(s)
        raw.append(g)
        out.append([u.numpy() for u in step_fn(*[tf.constant(x) for x in g])])
    return {"raw": raw, "out": out, "residuals": comp.residual_values(), "step": int(comp.step.numpy()),
            "traffic": comp.last_step_traffic, "repr": repr(comp)}


def main():
    res = {"rank": R, "size": P}
    for name, (factory, graph) in RUNS.items():
        try:
            res[name] = ("ok", run(factory(), graph))
        except BaseException as e:  # noqa: BLE001 - recorded for the parent
            res[name] = ("error", (type(e).__name__, str(e), traceback.format_exc()))
    with open(os.path.join(sys.argv[1], f"rank{R}.pkl"), "wb") as f:
        pickle.dump(res, f)


if __name__ == "__main__":
    main()
