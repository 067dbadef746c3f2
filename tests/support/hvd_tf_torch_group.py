"""A torch.distributed gloo group beside a running Horovod-TensorFlow job
(tests/jobs/hvd_tf_*_job.py): the TF layer's results are checked against
the torch ``GradientReducer`` on the same gradients, in the same processes.
Rank 0 picks a free port and Horovod broadcasts it, so no fixed port is
needed."""
import socket


def init_torch_group(name: str) -> None:
    """Join every Horovod rank into the default torch.distributed gloo group
    (``name``: the broadcast's Horovod op name prefix)."""
    import horovod.tensorflow as hvd
    import tensorflow as tf
    import torch.distributed as dist

    port = 0
    if hvd.rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = int(hvd.broadcast(tf.constant(port, tf.int64), root_rank=0, name=f"{name}.port"))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=hvd.rank(),
                            world_size=hvd.size())
