"""``gtopk-bench``: the measurements a user runs on their own machine or
cluster, one console script.

``gtopk-bench NAME [options]`` is ``python -m gtopk_plugin.bench.MODULE
[options]``; dashes and underscores in NAME are interchangeable.  Results
(JSON, and a PNG where the benchmark plots) go to ``gtopk-bench-results/``
in the current directory unless ``--json``/``--out`` says otherwise."""
from __future__ import annotations

import importlib
import sys
from typing import Optional, Sequence

#: name -> (module, entry point, one-line description)
BENCHMARKS = {
    "bytes_per_step": ("gtopk_plugin.bench.bytes_per_step", "main",
                       "bytes and time per method on P loopback gloo workers"),
    "step": ("gtopk_plugin.bench.step_bench", "main",
             "one reduce() per phase against the one-read memory floor and the kernel alone"),
    "selection": ("gtopk_plugin.bench.selection_bench", "main",
                  "CPU selection kernels against torch.topk and the one-read floor"),
    "ddp_step": ("gtopk_plugin.bench.ddp_step", "main",
                 "DDP step: PyTorch's allreduce and compression hooks against the sparse hook"),
    "overlap": ("gtopk_plugin.bench.overlap_bench", "main",
                "DDP on the emulated cluster: exposed exchange time, sync and async hook against PyTorch's"),
    "hsdp_step": ("gtopk_plugin.bench.hsdp_step", "main",
                  "HSDP on emulated nodes: stock and bf16 replica all-reduce against the sparse reduction"),
    "horovod_overhead": ("gtopk_plugin.bench.horovod_overhead", "main",
                         "Horovod step: plain Horovod and its compressions against the sparse optimizer"),
    "half_precision": ("gtopk_plugin.bench.half_precision", "main",
                       "demo model with fp32/fp16/bf16 gradients: finite state, conservation, accuracy"),
    "gpu_check": ("gtopk_plugin.bench.gpu_check", "main",
                  "CUDA kernels against the reference (bit for bit) and their speed, on one GPU"),
}


def usage(table=None, prog: str = "gtopk-bench") -> str:
    table = BENCHMARKS if table is None else table
    lines = [f"usage: {prog} NAME [options]   (NAME --help for its options)", ""]
    lines += [f"  {n.replace('_', '-'):<17} {d}" for n, (_, _, d) in table.items()]
    return "\n".join(lines)


def dispatch(table, prog: str, noun: str, argv: Optional[Sequence[str]] = None) -> int:
    """Run ``table[NAME]`` (module, function, description) on the remaining
    arguments: the command line of ``gtopk-bench`` and of the lab's studies."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(table, prog))
        return 0 if argv else 2
    name = argv[0].replace("-", "_")
    if name not in table:
        print(f"{prog}: unknown {noun} {argv[0]!r}\n\n{usage(table, prog)}", file=sys.stderr)
        return 2
    module, attr, _ = table[name]
    rc = getattr(importlib.import_module(module), attr)(argv[1:])
    return rc if isinstance(rc, int) else 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    return dispatch(BENCHMARKS, "gtopk-bench", "benchmark", argv)


if __name__ == "__main__":
    sys.exit(main())
