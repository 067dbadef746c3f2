"""The two workloads of ``python -m lab train``: offline data and models.

Data: the procedural "glyphs" images of the convergence study
(:mod:`lab.convergence.glyphs`, nothing downloaded), drawn at 16 x 16
and upsampled bilinearly to 32 x 32 (the CIFAR size the seed paper's
VGG-16 and ResNet-20 take), standardised with the training set's mean and
deviation.  A pure function of ``data_seed``: every rank builds the same
arrays.

Models:

- ``vgg``: communication-bound, many parameters per FLOP (the regime of the
  gTop-k paper's VGG-16/AlexNet rows): three 3x3 conv + BatchNorm + max-pool stages
  (1 -> c -> 2c -> 2c channels, 32 -> 4 pixels), then a wide classifier
  ``2c·16 -> fc -> fc -> 10`` with ReLU and dropout.  With the defaults
  (c = 16, fc = 2048) ~5.2M parameters, ~99% of them in the classifier,
  whose FLOPs per parameter per sample are 1 multiply-add.
- ``resnet``: balanced, :class:`lab.convergence.tasks.GlyphResNet`
  (conv stem + BatchNorm, three basic blocks with BatchNorm, global average
  pooling) at widths (16, 32, 64), ~0.1M parameters: conv layers reuse each
  weight at every pixel, so compute dominates.

BatchNorm: each worker normalises with its own shard's statistics; the
running statistics used at evaluation are rank 0's (DDP's default
``broadcast_buffers=True`` gives them to every rank; Horovod's optimizer
does not touch buffers, and rank 0 evaluates).
"""
from __future__ import annotations

from typing import Dict

import torch
import torch.nn.functional as F
from torch import nn

SIZE = 32

#: full-size settings per workload (``--quick`` shrinks them: QUICK)
WORKLOADS = {
    "vgg": {"model": {"channels": 16, "fc": 2048}, "n_train": 6000, "n_test": 2000,
            "batch": 32, "lr": 0.05, "weight_decay": 5e-4,
            "kind": "communication-bound (wide classifier: ~99% of the parameters, 1 MAC per parameter)"},
    "resnet": {"model": {"widths": [16, 32, 64]}, "n_train": 6000, "n_test": 2000,
               "batch": 32, "lr": 0.1, "weight_decay": 5e-4,
               "kind": "balanced (ResNet-style with BatchNorm: conv layers, compute-dominated)"},
}
QUICK = {
    "vgg": {"model": {"channels": 8, "fc": 256}, "n_train": 512, "n_test": 256, "batch": 16, "lr": 0.05},
    "resnet": {"model": {"widths": [4, 8, 8]}, "n_train": 512, "n_test": 256, "batch": 16, "lr": 0.1},
}


class WideVGG(nn.Sequential):
    """VGG-style CNN for 1 x 32 x 32 inputs with a wide classifier (see the
    module docstring)."""

    def __init__(self, channels: int = 32, fc: int = 2048, classes: int = 10, dropout: float = 0.3):
        c = channels

        def stage(cin, cout):  # conv-BN-ReLU-pool (BN: trains from the first steps without tuning)
            return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(),
                    nn.MaxPool2d(2)]
        super().__init__(
            *stage(1, c), *stage(c, 2 * c), *stage(2 * c, 2 * c),                # 2c x 4 x 4
            nn.Flatten(),
            nn.Linear(2 * c * 16, fc), nn.ReLU(), nn.Dropout(dropout),
            nn.Linear(fc, fc), nn.ReLU(), nn.Dropout(dropout),
            nn.Linear(fc, classes))


def build_model(workload: str, model_kw: dict) -> nn.Module:
    if workload == "vgg":
        return WideVGG(**model_kw)
    if workload == "resnet":
        from lab.convergence.tasks import GlyphResNet

        return GlyphResNet(widths=tuple(model_kw["widths"]))
    raise ValueError(f"unknown workload {workload!r}; choose from {', '.join(WORKLOADS)}")


def settings(workload: str, quick: bool) -> dict:
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; choose from {', '.join(WORKLOADS)}")
    s = dict(WORKLOADS[workload])
    if quick:
        s.update(QUICK[workload])
    return s


def load_data(n_train: int, n_test: int, seed: int = 0) -> Dict[str, torch.Tensor]:
    """Glyphs at 32 x 32: the 16 x 16 procedural images upsampled
    (bilinear), standardised; deterministic by ``seed``."""
    from lab.convergence import glyphs

    tr, te = glyphs.generate(n_train, seed * 2 + 1), glyphs.generate(n_test, seed * 2 + 2)
    up = [F.interpolate(d["x"], size=(SIZE, SIZE), mode="bilinear", align_corners=False) for d in (tr, te)]
    mean, std = up[0].mean(), up[0].std()
    return {"x_train": (up[0] - mean) / std, "y_train": tr["y"],
            "x_test": (up[1] - mean) / std, "y_test": te["y"]}


def fwd_bwd_flops(model: nn.Module, x: torch.Tensor) -> int:
    """FLOPs of one forward + backward pass of ``model`` on ``x`` (torch's
    FlopCounterMode: matmuls and convolutions, 2 per multiply-add)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as fc:
        model(x).sum().backward()
    model.zero_grad(set_to_none=True)
    return int(fc.get_total_flops())


def step_flops(model: nn.Module, batch: int) -> int:
    """FLOPs of one forward + backward pass on ``batch`` images."""
    return fwd_bwd_flops(model.train(), torch.zeros(batch, 1, SIZE, SIZE))


def describe(workload: str, model_kw: dict, batch: int) -> dict:
    m = build_model(workload, model_kw)
    n = sum(p.numel() for p in m.parameters())
    flops = step_flops(m, batch)
    return {"workload": workload, "model": type(m).__name__, "model_kw": model_kw, "parameters": n,
            "tensors": sum(1 for _ in m.parameters()), "step_flops_per_worker": flops,
            "flops_per_parameter_per_sample": flops / (n * batch), "kind": WORKLOADS[workload]["kind"]}
