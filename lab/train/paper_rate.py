"""The paper-matched link rate: the rate at which a dense step of OUR model
on OUR shared CPU cores has the compute : communication ratio it would have
on the gTop-k paper's testbed (Shi et al. 2019, arXiv 1901.04359: one
Nvidia P102-100 GPU per machine, 1 Gbit/s Ethernet).

The arithmetic (every number recorded in the result's ``meta.paper_rate``):

1. The GPU's effective speed, from the paper's own measurement: VGG-16 for
   CIFAR-10 (14.7M parameters), batch 128, computes one iteration in
   0.1395 s (the paper's breakdown, :data:`lab.cluster.shapes.
   PAPER_BREAKDOWN`); its forward + backward FLOPs (counted by torch's
   FlopCounterMode on the same architecture) over that time is the
   P102-100's effective FLOP rate G on a CNN of this kind.
2. Our step on that GPU: c_gpu = FLOPs(our forward + backward, batch per
   worker) / G.  (A lower bound: a step this small on a GPU is also bounded
   by kernel-launch latency, ~10 µs per kernel; ``launch_floor_s`` is
   recorded beside it and the larger of the two is used.)
3. Our step here: c_cpu = the median compute-only time of the step measured
   with P workers sharing this machine's cores (the calibration job, or the
   run's own compute probes).
4. S = c_cpu / c_gpu: how much faster the GPU computes this step.  Keeping
   the compute : communication ratio of the GPU on 1 Gbit/s therefore takes
   a link S times slower: ``rate_gpu`` = 1 Gbit/s / S.  For a model this
   small S is in the hundreds and ``rate_gpu`` a few Mbit/s: OUR model on
   a P102-100 cluster on 1 GbE would spend ~100x more time communicating
   than computing, further out than any of the paper's models.
5. The paper's own regime: its dense VGG-16 (CIFAR) step at P = 4 spends
   R = (1.228 s - 0.140 s) / 0.140 s = 7.8x its compute communicating.
   ``rate_regime`` = the rate at which OUR dense ring (2(P-1)/P * 4N bytes
   per worker, at the gloo ring's measured link efficiency) takes R * c_cpu:
   the link on which our dense step has the paper's VGG-16 compute :
   communication ratio.  This is what ``--rate paper`` uses (the regime in
   which the paper's 2.7-12x was measured); ``rate_gpu`` is recorded beside it.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from lab.train.workloads import fwd_bwd_flops

GBIT = 1e9
#: launch latency per CUDA kernel (order of magnitude; forward + backward +
#: update of a small CNN launches ~3 kernels per layer and pass)
KERNEL_LAUNCH_S = 10e-6

_VGG16 = [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"]


def vgg16_cifar() -> nn.Module:
    """VGG-16 for 3 x 32 x 32 inputs with a 512 -> 10 classifier (the
    paper's 14.7M-parameter CIFAR-10 model; BatchNorm left out: no FLOPs to
    speak of)."""
    layers, c = [], 3
    for v in _VGG16:
        if v == "M":
            layers.append(nn.MaxPool2d(2))
        else:
            layers += [nn.Conv2d(c, v, 3, padding=1), nn.ReLU()]
            c = v
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(512, 10))


def paper_gpu() -> dict:
    """The P102-100's effective FLOP rate from the paper's VGG-16 (CIFAR) compute time."""
    from lab.cluster.shapes import PAPER_BATCH, PAPER_BREAKDOWN, PAPER_THROUGHPUT

    batch = PAPER_BATCH["vgg16-cifar"]
    per_image = fwd_bwd_flops(vgg16_cifar(), torch.zeros(2, 3, 32, 32)) / 2
    compute_s = PAPER_BREAKDOWN["vgg16-cifar"][0]
    flops = per_image * batch
    dense_iter_p4 = batch / PAPER_THROUGHPUT["vgg16-cifar"]["dense"][1]
    return {"model": "vgg16-cifar (14.7M)", "batch": batch, "step_flops": flops, "compute_s": compute_s,
            "effective_flops_per_s": flops / compute_s,
            "paper_dense_iter_s_P4": dense_iter_p4,
            "paper_dense_comm_to_compute_P4": (dense_iter_p4 - compute_s) / compute_s,
            "source": "Shi et al. 2019: VGG-16 (CIFAR-10) compute 0.1395 s/iteration at batch 128 "
                      "(breakdown), dense throughput 104.2 samples/s/worker at P = 4"}


#: the gloo ring's measured share of the tbf rate at P = 4 (lab/reports/benchmarks.md, "Link efficiency")
RING_EFFICIENCY = 0.81


def matched_rate(step_flops: int, n_kernels: int, cpu_compute_s: float, dense_ring_bytes: int,
                 base_bits: float = GBIT, gpu: Optional[dict] = None) -> dict:
    """The arithmetic of the module docstring for one workload."""
    gpu = gpu or paper_gpu()
    by_flops = step_flops / gpu["effective_flops_per_s"]
    floor = n_kernels * KERNEL_LAUNCH_S
    c_gpu = max(by_flops, floor)
    speedup = cpu_compute_s / c_gpu
    rate = base_bits / speedup
    R = gpu["paper_dense_comm_to_compute_P4"]
    regime = dense_ring_bytes * 8 / (R * cpu_compute_s * RING_EFFICIENCY)
    return {"rate_regime_bits": regime, "rate_regime": f"{max(1, int(round(regime / 1e3)))}kbit",
            "paper_comm_to_compute": R, "dense_ring_bytes": dense_ring_bytes,
            "ring_efficiency": RING_EFFICIENCY,
            "regime_statement": (f"the paper's dense VGG-16 step at P = 4 communicates {R:.1f}x its compute; "
                                 f"our dense ring ({dense_ring_bytes / 1e6:.1f} MB sent per worker, at "
                                 f"{RING_EFFICIENCY:.2f} link efficiency) takes {R:.1f} x {1e3 * cpu_compute_s:.0f} ms "
                                 f"at {regime / 1e6:.1f} Mbit/s"),
            "rate_gpu_bits": rate,"gpu": gpu, "our_step_flops": step_flops, "gpu_step_s_by_flops": by_flops,
            "launch_floor_s": floor, "gpu_step_s": c_gpu, "cpu_step_s": cpu_compute_s,
            "gpu_speedup": speedup, "rate_gpu": f"{max(1, int(round(rate / 1e3)))}kbit",
            "statement": (f"a P102-100 computes this step in ~{1e3 * c_gpu:.2f} ms "
                          f"({step_flops / 1e9:.2f} GFLOP at the paper's effective "
                          f"{gpu['effective_flops_per_s'] / 1e12:.2f} TFLOP/s, launch floor "
                          f"{1e3 * floor:.2f} ms); our shared CPU cores take {1e3 * cpu_compute_s:.0f} ms "
                          f"with P workers: {speedup:.0f}x slower, so 1 Gbit/s / {speedup:.0f} = "
                          f"{rate / 1e6:.2f} Mbit/s keeps the GPU-on-1-GbE compute:communication ratio")}
