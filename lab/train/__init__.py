"""``python -m lab train``: real data-parallel training jobs on the
emulated cluster (one process per worker in its own shaped network
namespace) through DDP + the library's comm hook, Horovod + the library's
DistributedOptimizer, and the elastic scheduler; test accuracy against
wall-clock time and bytes.  Entry point: :mod:`lab.train.cli`."""
