"""``gtopk-bench`` (:mod:`gtopk_plugin.bench.bench_cli`): the measurements a
user runs on their own machine or cluster -- bytes per step, one step
against the memory floor, selection speed, the DDP and Horovod steps against
PyTorch's and Horovod's own compressions, half-precision gradients, and the
GPU kernels' check.  Nothing here is imported by the library."""
