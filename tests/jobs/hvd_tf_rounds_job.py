"""Worker script of tests/horovod/test_horovod_tf_rounds.py, run under
``horovodrun -np N --gloo``: PowerSGD (a rounds codec, issue #17) through
``gtopk_plugin.tensorflow``'s ``DistributedGradientTape`` (eagerly and inside
``tf.function``) and, on the same gradients in the same job, through the
torch ``GradientReducer`` on a torch.distributed gloo group (the oracle).

    horovodrun -np N -H localhost:N --gloo python tests/jobs/hvd_tf_rounds_job.py OUTDIR

Every rank pickles ``OUTDIR/rank{r}.pkl``: per run the TF updates, the
torch updates, TF's last-step traffic and the torch reducer's last stats.
"""
import os
import pickle
import socket
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


def init_torch_group():
    port = 0
    if R == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = int(hvd.broadcast(tf.constant(port, tf.int64), root_rank=0, name="rounds_job.port"))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=R, world_size=P)


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


def main():
    init_torch_group()
    res = {"rank": R, "size": P}
    for name, spec in RUNS.items():
        try:
            res[name] = ("ok", run(*spec))
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
    with open(os.path.join(sys.argv[1], f"rank{R}.pkl"), "wb") as f:
        pickle.dump(res, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
