"""Worker script of tests/horovod/test_horovod_tf_registry.py, run under
``horovodrun -np N --gloo``: compressors of the registry that the TensorFlow
layer has no code of its own for -- the built-in ``onebit`` codec, a
selector and a codec registered from user code (tests/support/
tf_user_compressors.py) -- through ``gtopk_plugin.tensorflow``'s
``DistributedGradientTape``, eagerly and inside ``tf.function``; and the
codecs' dense warm-up (``start_iter=2``, onebit and qsgd) against the torch
``GradientReducer`` on the same gradients in the same job (a
torch.distributed gloo group).

    horovodrun -np N -H localhost:N --gloo python tests/jobs/hvd_tf_registry_job.py OUTDIR

The tests run it as the ``registry`` part of tests/jobs/hvd_tf_jobs.py, in the
same processes as the other Horovod-TF checks (``main(outdir)``).

Every rank pickles ``OUTDIR/rank{r}.pkl``: per run its local gradients
(numpy), the reduced ones, its residuals and last-step traffic (warm-up
runs: per step, beside the torch reducer's updates and statistics).
"""
import gc
import os
import pickle
import sys
import traceback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import horovod.tensorflow as hvd  # noqa: E402

tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
torch.set_num_threads(1)
hvd.init()

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support"))
import tf_user_compressors  # noqa: E402,F401  (registers firstk_user, half_tf_user)

from hvd_tf_torch_group import init_torch_group  # noqa: E402
from gtopk_plugin import GradientReducer  # noqa: E402
from gtopk_plugin.collectives.torch_distributed import TorchDistributedTransport  # noqa: E402
from gtopk_plugin.tensorflow import Compression, DistributedGradientTape  # noqa: E402

R, P = hvd.rank(), hvd.size()
STEPS = 3
SHAPES = [(12, 10), (10,), (10, 6), (6,), (6, 3), (3,)]
RUNS = {  # name -> (Compression factory, traced)
    "onebit": (lambda: Compression.onebit(), False),
    "onebit_graph": (lambda: Compression.onebit(), True),
    "half_tf_user_graph": (lambda: Compression.half_tf_user(), True),
    "firstk_user": (lambda: Compression.firstk_user(0.1), False),
    "firstk_user_butterfly_graph": (lambda: Compression.firstk_user(0.1, merge="butterfly"), True),
}

# codec dense warm-up (start_iter=2): name -> (TF factory, traced, torch reducer kwargs); 4 steps
WARM_STEPS = 4
WARM = {
    "onebit_warm": (lambda: Compression.onebit(start_iter=2), False, dict(method="onebit", start_iter=2)),
    "onebit_warm_graph": (lambda: Compression.onebit(start_iter=2), True, dict(method="onebit", start_iter=2)),
    "qsgd_warm_graph": (lambda: Compression.qsgd(start_iter=2, seed=3), True,
                        dict(method="qsgd", start_iter=2, seed=3)),
}
STAT_FIELDS = ("payload_bytes_sent", "payload_bytes_received", "header_bytes_sent", "header_bytes_received",
               "control_bytes", "messages_sent", "numel", "k", "sent_entries", "rounds", "dense_bytes")


def grads_for(step):
    rng = np.random.default_rng(1000 * step + R)
    return [(rng.standard_normal(s) * 3).astype(np.float32) for s in SHAPES]


def make_step(comp, graph):
    """The TF layer's step on fresh variables: grads in, reduced grads out
    (``graph``: inside ``tf.function``)."""
    variables = [tf.Variable(tf.zeros(s)) for s in SHAPES]

    def step_fn(*grads):
        with tf.GradientTape() as tape:
            loss = tf.add_n([tf.reduce_sum(v * g) for v, g in zip(variables, grads)])
        return DistributedGradientTape(tape, compression=comp, op=hvd.Sum).gradient(loss, variables)

    return tf.function(step_fn) if graph else step_fn


def run(comp, graph):
    step_fn = make_step(comp, graph)
    raw, out = [], []
    for s in range(STEPS):
        g = grads_for(s)
        raw.append(g)
        out.append([u.numpy() for u in step_fn(*[tf.constant(x) for x in g])])
    return {"raw": raw, "out": out, "residuals": comp.residual_values(), "step": int(comp.step.numpy()),
            "traffic": comp.last_step_traffic, "repr": repr(comp)}


def run_warm(factory, graph, torch_kw):
    """The TF layer and the torch reducer (op sum) on the same gradients,
    step by step: updates, TF residuals and traffic, torch statistics."""
    comp = factory()
    step_fn = make_step(comp, graph)
    reducer = GradientReducer(op="sum", transport=TorchDistributedTransport(), **torch_kw)
    names = [f"t{i:04d}" for i in range(len(SHAPES))]  # the TF layer's positional names
    out = {k: [] for k in ("raw", "tf", "torch", "residuals", "traffic", "torch_stats")}
    for s in range(WARM_STEPS):
        g = grads_for(s)
        out["raw"].append(g)
        out["tf"].append([u.numpy() for u in step_fn(*[tf.constant(x) for x in g])])
        out["residuals"].append(comp.residual_values())
        out["traffic"].append(comp.last_step_traffic)
        upd = reducer.reduce({n: torch.from_numpy(x.copy()) for n, x in zip(names, g)})
        out["torch"].append([upd[n].numpy() for n in names])
        st = reducer.last_stats
        out["torch_stats"].append(dict({f: int(getattr(st, f)) for f in STAT_FIELDS}, aggregation=st.aggregation))
    out["torch_residuals"] = {n: t.numpy().reshape(-1) for n, t in reducer.state_dict()["residuals"].items()}
    out["repr"] = repr(comp)
    return out


def main(outdir):
    init_torch_group("registry_job")
    res = {"rank": R, "size": P}
    for name, spec in list(RUNS.items()) + list(WARM.items()):
        try:
            res[name] = ("ok", run_warm(*spec) if name in WARM else run(spec[0](), spec[1]))
        except BaseException as e:  # noqa: BLE001 - recorded for the parent
            res[name] = ("error", (type(e).__name__, str(e), traceback.format_exc()))
    with open(os.path.join(outdir, f"rank{R}.pkl"), "wb") as f:
        pickle.dump(res, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    # the torch process group is freed here, not at interpreter shutdown,
    # where gloo's worker thread aborts the process (examples/ddp_train.py)
    gc.collect()
