"""``gtopk-bench``: one console script for every benchmark in this package.

``gtopk-bench NAME [options]`` is ``python -m benchmarks.NAME [options]``;
dashes and underscores in NAME are interchangeable.  Installed with the
package as ``gtopk_plugin.benchmarks`` (setup.py maps this folder there, so
no top-level ``benchmarks`` package lands in site-packages); in a checkout
``python -m benchmarks.NAME`` runs the same modules (every import inside is
relative)."""
from __future__ import annotations

import importlib
import importlib.util
import sys
from typing import Optional, Sequence

#: name -> (module relative to this package, entry point, one-line description)
BENCHMARKS = {
    "cluster": (".cluster.cli", "main", "emulated 1 GbE cluster: comm grid, model replay, α-β model, DDP hooks"),
    "convergence": (".convergence.cli", "main", "convergence study of every method on offline tasks"),
    "selection": (".selection", "main", "CPU selection kernels vs torch.topk and the one-read floor"),
    "bytes_per_step": (".bytes_per_step", "main", "bytes and time per method on loopback gloo"),
    "horovod_overhead": (".horovod_overhead", "main", "Horovod integration overhead vs plain Horovod"),
    "horovod_tf": (".horovod_tf", "main", "Horovod-TensorFlow: bytes and step time per compression"),
    "horovod_idle": (".horovod_idle", "main", "Horovod's idle coordination traffic per cycle time, shaped link"),
    "fp16_allreduce": (".fp16_allreduce", "main", "one dense allreduce, fp32 vs fp16, Horovod's gloo vs torch's"),
    "elastic": (".elastic", "main", "elastic consistency scheduler: step time and accuracy"),
    "ddp_step": (".ddp_step", "main", "DDP step on loopback: allreduce vs sparse_hook gTop-k 1%/0.1%"),
    "soak": (".soak", "main", "10k-step runs per method at P=3: RSS and residual norms bounded"),
    "step": (".step", "main", "reduce() per phase vs the one-read floor and the kernel alone"),
    "train": (".train.cli", "main", "time to accuracy: real training jobs on the emulated cluster"),
    "train_report": (".train.combine", "main", "one time-to-accuracy table over several train JSONs"),
    "wire_precision": (".wire_precision", "main",
                       "mass conservation with fp32/fp16/bf16 wires at P=3,4,7"),
    "half_precision": (".half_precision", "main",
                       "demo model with fp32/fp16/bf16 gradients: finite state, conservation, accuracy"),
}


def usage() -> str:
    lines = ["usage: gtopk-bench NAME [options]   (NAME --help for its options)", ""]
    lines += [f"  {n.replace('_', '-'):<17} {d}" for n, (_, _, d) in BENCHMARKS.items()]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    name = argv[0].replace("-", "_")
    if name not in BENCHMARKS:
        print(f"gtopk-bench: unknown benchmark {argv[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module, attr, _ = BENCHMARKS[name]
    try:
        mod = importlib.import_module(module, __package__)
    except ModuleNotFoundError as e:
        if e.name == importlib.util.resolve_name(module, __package__):
            print(f"gtopk-bench: {argv[0]!r} is not available in this installation ({e})", file=sys.stderr)
            return 2
        raise
    rc = getattr(mod, attr)(argv[1:])
    return rc if isinstance(rc, int) else 0


if __name__ == "__main__":
    sys.exit(main())
