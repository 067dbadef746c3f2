"""Worker script of tests/horovod/test_horovod_tf_rounds.py, run under
``horovodrun -np N --gloo``: PowerSGD (a rounds codec) through
``gtopk_plugin.tensorflow``'s ``DistributedGradientTape`` (eagerly and inside
``tf.function``) and, on the same gradients in the same job, through the
torch ``GradientReducer`` on a torch.distributed gloo group (the oracle);
``dense_below=`` (small tensors dense in the same step) against the torch
reducer with the same threshold; and checkpoint resume (save after two
steps, a fresh compression restores and continues) against an
uninterrupted run, for PowerSGD's warm start, qsgd's keyed rounding and
the int8 wire's stochastic rounding (also against the torch reducer with
``dense_below``).

    horovodrun -np N -H localhost:N --gloo python tests/jobs/hvd_tf_rounds_job.py OUTDIR

The tests run it as the ``rounds`` part of tests/jobs/hvd_tf_jobs.py, in the
same processes as the other Horovod-TF checks (``main(outdir)``).

Every rank pickles ``OUTDIR/rank{r}.pkl``: per run the TF updates, the
torch updates, TF's last-step traffic and the torch reducer's last stats.
"""
import gc
import os
import pickle
import sys
import tempfile
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
from hvd_tf_torch_group import init_torch_group  # noqa: E402
from gtopk_plugin import GradientReducer  # noqa: E402
from gtopk_plugin.collectives.torch_distributed import TorchDistributedTransport  # noqa: E402
from gtopk_plugin.tensorflow import Compression, DistributedGradientTape  # noqa: E402

R, P = hvd.rank(), hvd.size()
STEPS = 4
SHAPES = [(24, 16), (16,), (16, 8), (8,)]  # two matrices compressed, two biases dense
RUNS = {  # name -> (rank, warm_start, traced, TF op, torch op)
    "rank2_sum": (2, True, False, hvd.Sum, "sum"),
    "rank1_average_graph": (1, True, True, hvd.Average, "average"),
    "rank4_cold_graph": (4, False, True, hvd.Sum, "sum"),
}


# dense_below: name -> (TF Compression factory, traced, TF op, torch reducer kwargs);
# with dense_below=20 the biases (16,) and (8,) go dense, the matrices by the method
DENSE_BELOW = {
    "gtopk_dense_below": (lambda: Compression.gtopk(0.1, dense_below=20), False, hvd.Sum,
                          dict(method="gtopk", density=0.1, op="sum")),
    "topk_global_dense_below_graph": (lambda: Compression.topk(0.1, granularity="global", dense_below=20), True,
                                      hvd.Average, dict(method="topk", density=0.1, granularity="global",
                                                        op="average")),
    "mc_gtopk_dense_below_graph": (lambda: Compression.gtopk(0.1, momentum_correction=0.9, clip_norm=20.0, dense_below=20),
                                   True, hvd.Sum, dict(method="gtopk", density=0.1, momentum_correction=0.9, clip_norm=20.0,
                                                       op="sum")),
    "all_small_dense_below": (lambda: Compression.gtopk(0.1, dense_below=1000), False, hvd.Average,
                              dict(method="gtopk", density=0.1, op="average")),
    # the int8 wire against the torch reducer's, stochastic rounding keyed alike
    "gtopk_int8_stochastic_dense_below_graph": (
        lambda: Compression.gtopk(0.1, dense_below=20, value_dtype=tf.int8, wire_rounding="stochastic", seed=4),
        True, hvd.Sum, dict(method="gtopk", density=0.1, value_dtype=torch.int8, wire_rounding="stochastic", seed=4,
                            op="sum")),
}
# checkpoint resume: name -> (Compression factory, traced)
RESUME = {
    "powersgd_resume_graph": (lambda: Compression.powersgd(rank=2), True),
    "qsgd_resume": (lambda: Compression.qsgd(seed=3), False),
    "gtopk_int8_stochastic_resume": (lambda: Compression.gtopk(0.1, value_dtype=tf.int8,
                                                               wire_rounding="stochastic", seed=1), False),
}


def grads_for(step):
    rng = np.random.default_rng(1000 * step + R)
    return [(rng.standard_normal(s) * 3).astype(np.float32) for s in SHAPES]


def run(rank, warm, graph, tf_op, torch_op):
    comp = Compression.powersgd(rank=rank, warm_start=warm)
    variables = [tf.Variable(tf.zeros(s)) for s in SHAPES]

    def step_fn(*grads):
        with tf.GradientTape() as tape:
            loss = tf.add_n([tf.reduce_sum(v * g) for v, g in zip(variables, grads)])
        return DistributedGradientTape(tape, compression=comp, op=tf_op).gradient(loss, variables)

    if graph:
        step_fn = tf.function(step_fn)
    reducer = GradientReducer("powersgd", rank=rank, warm_start=warm, op=torch_op,
                              transport=TorchDistributedTransport())
    names = [f"t{i:04d}" for i in range(len(SHAPES))]  # the TF layer's positional names
    tf_out, torch_out = [], []
    for s in range(STEPS):
        g = grads_for(s)
        tf_out.append([u.numpy() for u in step_fn(*[tf.constant(x) for x in g])])
        upd = reducer.reduce({n: torch.from_numpy(x.copy()) for n, x in zip(names, g)})
        torch_out.append([upd[n].numpy() for n in names])
    stats = reducer.last_stats
    return {"tf": tf_out, "torch": torch_out, "traffic": comp.last_step_traffic,
            "torch_stats": {k: getattr(stats, k) for k in ("bytes_sent", "bytes_received", "rounds")
                            if hasattr(stats, k)},
            "residuals": comp.residual_values()}


def tape_step(comp, variables, graph, op=hvd.Sum):
    def step_fn(*grads):
        with tf.GradientTape() as tape:
            loss = tf.add_n([tf.reduce_sum(v * g) for v, g in zip(variables, grads)])
        return DistributedGradientTape(tape, compression=comp, op=op).gradient(loss, variables)

    return tf.function(step_fn) if graph else step_fn


def run_dense_below(factory, graph, tf_op, torch_kw):
    """The TF layer with dense_below=20 and the torch reducer with the same
    settings on the same gradients: updates, residuals, velocities, bytes."""
    comp = factory()
    variables = [tf.Variable(tf.zeros(s)) for s in SHAPES]
    step_fn = tape_step(comp, variables, graph, tf_op)
    reducer = GradientReducer(dense_below=comp.config.dense_below, transport=TorchDistributedTransport(),
                              **torch_kw)
    names = [f"t{i:04d}" for i in range(len(SHAPES))]
    tf_out, torch_out = [], []
    for s in range(STEPS):
        g = grads_for(s)
        tf_out.append([u.numpy() for u in step_fn(*[tf.constant(x) for x in g])])
        upd = reducer.reduce({n: torch.from_numpy(x.copy()) for n, x in zip(names, g)})
        torch_out.append([upd[n].numpy() for n in names])
    st, sd = reducer.last_stats, reducer.state_dict()
    fields = ("payload_bytes_sent", "payload_bytes_received", "header_bytes_sent", "header_bytes_received",
              "control_bytes", "messages_sent", "numel", "k", "sent_entries", "rounds", "dense_bytes")
    velocities = dict(sd["velocities"]) if sd["velocities"] else {}
    velocities.update(sd.get("small", {}).get("velocities") or {})
    return {"tf": tf_out, "torch": torch_out, "repr": repr(comp), "traffic": comp.last_step_traffic,
            "torch_stats": {f: int(getattr(st, f)) for f in fields},
            # the dense part's own (second) check, when the method ran too
            "torch_dense_control": int(st.parts["dense"].control_bytes) if st.parts["method"] else 0,
            "residuals": comp.residual_values(), "velocities": comp.velocity_values(),
            "torch_residuals": {n: t.numpy().reshape(-1) for n, t in sd["residuals"].items()},
            "torch_velocities": {n: t.numpy().reshape(-1) for n, t in velocities.items()},
            "raw": [grads_for(s) for s in range(STEPS)]}


def run_resume(factory, graph):
    """Four steps uninterrupted; then two steps, a checkpoint, a fresh
    compression (and variables) restored from it, two more steps -- and the
    same again with the compressor state dropped after the restore (must
    differ for PowerSGD: its warm start is what the checkpoint adds)."""
    def fresh():
        comp = factory()
        variables = [tf.Variable(tf.zeros(s)) for s in SHAPES]
        return comp, variables, tape_step(comp, variables, graph)

    def steps(fn, lo, hi):
        return [[u.numpy() for u in fn(*[tf.constant(x) for x in grads_for(s)])] for s in range(lo, hi)]

    comp, _, fn = fresh()
    whole = steps(fn, 0, STEPS)
    comp, variables, fn = fresh()
    first = steps(fn, 0, 2)
    with tempfile.TemporaryDirectory() as d:
        path = tf.train.Checkpoint(gtopk=comp, variables=variables).save(os.path.join(d, "ck"))
        saved_state = comp.compressor_state_dict()
        out = {}
        for mode in ("restored", "state_dropped"):
            comp, variables, fn = fresh()
            tf.train.Checkpoint(gtopk=comp, variables=variables).restore(path)
            if mode == "state_dropped" and comp.codec_state() is not None:
                comp.compressor_state.assign(b"")
            out[mode] = {"step": int(comp.step.numpy()), "updates": steps(fn, 2, STEPS),
                         "residuals": comp.residual_values()}
    return {"whole": whole, "first": first, "saved_state_keys": sorted(saved_state.get("q", {})),
            "stateful": comp.codec_state() is not None, **out}


def main(outdir):
    init_torch_group("rounds_job")
    res = {"rank": R, "size": P}
    for name, spec in list(RUNS.items()) + list(DENSE_BELOW.items()) + list(RESUME.items()):
        fn = run_dense_below if name in DENSE_BELOW else run_resume if name in RESUME else run
        try:
            res[name] = ("ok", fn(*spec))
        except BaseException as e:  # noqa: BLE001 - recorded for the parent
            res[name] = ("error", (type(e).__name__, str(e), traceback.format_exc()))
    # the clear error without the side channel (elastic states set exchange='horovod')
    try:
        comp = Compression.powersgd(rank=1, exchange="horovod")
        comp.reduce([tf.ones([8, 4])])
        res["horovod_exchange"] = ("no error", None)
    except ValueError as e:
        res["horovod_exchange"] = ("ValueError", str(e))
    except BaseException as e:  # noqa: BLE001
        res["horovod_exchange"] = (type(e).__name__, str(e))
    with open(os.path.join(outdir, f"rank{R}.pkl"), "wb") as f:
        pickle.dump(res, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    # the torch process group is freed here, not at interpreter shutdown,
    # where gloo's worker thread aborts the process (examples/ddp_train.py)
    gc.collect()
