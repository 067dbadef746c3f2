"""``python -m lab NAME [options]``: one entry point for every study and
probe of the lab (run from the repository root); dashes and underscores in
NAME are interchangeable.  ``python -m lab`` lists them."""
from __future__ import annotations

import sys
from typing import Optional, Sequence

from gtopk_plugin.bench import bench_cli

#: name -> (module, entry point, one-line description)
STUDIES = {
    "cluster": ("lab.cluster.cli", "main",
                "emulated 1 GbE cluster: comm grid, model replay, α-β model, nodes, DDP hooks"),
    "convergence": ("lab.convergence.cli", "main", "convergence study of every method on offline tasks"),
    "convergence_hier": ("lab.convergence.hier_report", "main",
                         "two-level against flat reduction: convergence on offline tasks"),
    "hsdp_accuracy": ("lab.convergence.hsdp_accuracy", "main",
                      "real FSDP2 HSDP (2x2 gloo mesh): gTop-k replica reduction against stock, accuracy"),
    "train": ("lab.train.cli", "main", "time to accuracy: real training jobs on the emulated cluster"),
    "train_report": ("lab.train.combine", "main", "one time-to-accuracy table over several train JSONs"),
    "elastic": ("lab.elastic", "main", "elastic consistency scheduler: step time and accuracy"),
    "soak": ("lab.soak", "main", "10k-step runs per method at P=3: RSS and residual norms bounded"),
    "wire_precision": ("lab.wire_precision", "main", "mass conservation with fp32/fp16/bf16 wires at P=3,4,7"),
    "horovod_tf": ("lab.horovod_tf", "main", "Horovod-TensorFlow: bytes and step time per compression"),
    "horovod_idle": ("lab.horovod_idle", "main",
                     "Horovod's idle coordination traffic per cycle time, shaped link"),
    "fp16_allreduce": ("lab.fp16_allreduce", "main",
                       "one dense allreduce, fp32 vs fp16, Horovod's gloo vs torch's"),
    "render_results": ("lab.render_results", "main", "docs/results.md from the JSON in docs/results/"),
}


def usage() -> str:
    return bench_cli.usage(STUDIES, "python -m lab")


def main(argv: Optional[Sequence[str]] = None) -> int:
    return bench_cli.dispatch(STUDIES, "python -m lab", "study", argv)


if __name__ == "__main__":
    sys.exit(main())
