"""Parameter-tensor shapes of the gTop-k paper's models, written out in code
(no torchvision, no downloads), and the paper's published timings.

Every list is (name, shape) in the order the framework registers the
parameters (gradients only: BatchNorm running statistics are buffers, not
parameters).  Totals, checked by tests/distributed/test_cluster.py:

=============  ============  ================================================
model          parameters    what it is
=============  ============  ================================================
resnet20            269,722  CIFAR-10 ResNet-20, option-A (parameter-free)
                             shortcuts, as the paper's models/resnet.py
vgg16-cifar      14,728,266  CIFAR-10 VGG-16 with BatchNorm, fc 512→10: the
                             VGG-16 the paper trained (exp_configs/vgg16.conf:
                             dataset=cifar10)
vgg16           138,357,544  ImageNet VGG-16 (torchvision layout, no BN)
alexnet          61,100,840  ImageNet AlexNet (torchvision layout)
resnet50         25,557,032  ImageNet ResNet-50 (torchvision layout)
lstm-ptb         66,034,000  2-layer LSTM language model on PTB: vocabulary
                             10,000, embedding = hidden = 1500 (the paper's
                             models/lstm.py)
=============  ============  ================================================
"""
from __future__ import annotations

import math
from typing import Dict, List, Tuple

Shape = Tuple[int, ...]


def _bn(name: str, c: int) -> List[Tuple[str, Shape]]:
    return [(f"{name}.weight", (c,)), (f"{name}.bias", (c,))]


def resnet20() -> List[Tuple[str, Shape]]:
    out = [("conv_1_3x3.weight", (16, 3, 3, 3))] + _bn("bn_1", 16)
    inplanes = 16
    for s, planes in enumerate((16, 32, 64), start=1):
        for b in range(3):
            out += [(f"stage_{s}.{b}.conv_a.weight", (planes, inplanes, 3, 3))] + _bn(f"stage_{s}.{b}.bn_a", planes)
            out += [(f"stage_{s}.{b}.conv_b.weight", (planes, planes, 3, 3))] + _bn(f"stage_{s}.{b}.bn_b", planes)
            inplanes = planes  # option-A downsampling has no parameters
    return out + [("classifier.weight", (10, 64)), ("classifier.bias", (10,))]


_VGG16 = [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"]


def vgg16() -> List[Tuple[str, Shape]]:
    out, cin, i = [], 3, 0
    for v in _VGG16:
        if v == "M":
            i += 1
            continue
        out += [(f"features.{i}.weight", (v, cin, 3, 3)), (f"features.{i}.bias", (v,))]
        cin, i = v, i + 2
    for j, (o, n) in zip((0, 3, 6), ((4096, 512 * 7 * 7), (4096, 4096), (1000, 4096))):
        out += [(f"classifier.{j}.weight", (o, n)), (f"classifier.{j}.bias", (o,))]
    return out


def vgg16_cifar() -> List[Tuple[str, Shape]]:
    out, cin, i = [], 3, 0
    for v in _VGG16:
        if v == "M":
            i += 1
            continue
        out += [(f"features.{i}.weight", (v, cin, 3, 3)), (f"features.{i}.bias", (v,))]
        out += _bn(f"features.{i + 1}", v)
        cin, i = v, i + 3
    return out + [("fc.weight", (10, 512)), ("fc.bias", (10,))]


def alexnet() -> List[Tuple[str, Shape]]:
    convs = [(0, 64, 3, 11), (3, 192, 64, 5), (6, 384, 192, 3), (8, 256, 384, 3), (10, 256, 256, 3)]
    out = []
    for i, o, c, k in convs:
        out += [(f"features.{i}.weight", (o, c, k, k)), (f"features.{i}.bias", (o,))]
    for j, (o, n) in zip((1, 4, 6), ((4096, 256 * 6 * 6), (4096, 4096), (1000, 4096))):
        out += [(f"classifier.{j}.weight", (o, n)), (f"classifier.{j}.bias", (o,))]
    return out


def resnet50() -> List[Tuple[str, Shape]]:
    out = [("conv1.weight", (64, 3, 7, 7))] + _bn("bn1", 64)
    inplanes = 64
    for li, (planes, blocks) in enumerate(((64, 3), (128, 4), (256, 6), (512, 3)), start=1):
        for b in range(blocks):
            p = f"layer{li}.{b}"
            out += [(f"{p}.conv1.weight", (planes, inplanes, 1, 1))] + _bn(f"{p}.bn1", planes)
            out += [(f"{p}.conv2.weight", (planes, planes, 3, 3))] + _bn(f"{p}.bn2", planes)
            out += [(f"{p}.conv3.weight", (planes * 4, planes, 1, 1))] + _bn(f"{p}.bn3", planes * 4)
            if b == 0:
                out += [(f"{p}.downsample.0.weight", (planes * 4, inplanes, 1, 1))] + _bn(f"{p}.downsample.1", planes * 4)
            inplanes = planes * 4
    return out + [("fc.weight", (1000, 2048)), ("fc.bias", (1000,))]


def lstm_ptb(vocab: int = 10000, hidden: int = 1500, layers: int = 2) -> List[Tuple[str, Shape]]:
    out = [("word_embeddings.weight", (vocab, hidden))]
    for l in range(layers):
        out += [(f"lstm.weight_ih_l{l}", (4 * hidden, hidden)), (f"lstm.weight_hh_l{l}", (4 * hidden, hidden)),
                (f"lstm.bias_ih_l{l}", (4 * hidden,)), (f"lstm.bias_hh_l{l}", (4 * hidden,))]
    return out + [("sm_fc.weight", (vocab, hidden)), ("sm_fc.bias", (vocab,))]


MODELS = {
    "resnet20": resnet20,
    "vgg16-cifar": vgg16_cifar,
    "vgg16": vgg16,
    "alexnet": alexnet,
    "resnet50": resnet50,
    "lstm-ptb": lstm_ptb,
}

KNOWN_TOTALS = {
    "resnet20": 269_722,
    "vgg16-cifar": 14_728_266,
    "vgg16": 138_357_544,
    "alexnet": 61_100_840,
    "resnet50": 25_557_032,
    "lstm-ptb": 66_034_000,
}


def shapes(model: str) -> List[Tuple[str, Shape]]:
    try:
        return MODELS[model]()
    except KeyError:
        raise ValueError(f"unknown model {model!r}; known: {', '.join(MODELS)}") from None


def numel(model: str) -> int:
    return sum(math.prod(s) for _, s in shapes(model))


def sizes(model: str) -> List[int]:
    return [math.prod(s) for _, s in shapes(model)]


# ---------------------------------------------------------------------------
# The paper's numbers (Shi et al., ICDCS 2019, arXiv 1901.04359): 32 machines,
# one GPU each (Nvidia P102-100), 1 Gbit/s Ethernet, density 0.001.  The
# per-iteration breakdown (gTop-k at P = 32) and the per-worker throughput
# table are also the data arrays of the authors' public plotting script
# (hclhkbu/gtopkssgd, scripts/icdcs2019/communication.py, plot_breakdown()
# and realdata_speedup()), which is where the batch sizes come from too.
# ---------------------------------------------------------------------------

#: seconds per iteration at P = 32 with gTop-k: compute, compression (local
#: top-k selection and the merges' selections), communication.
PAPER_BREAKDOWN = {
    "vgg16-cifar": (0.139536, 0.091353, 0.811753),
    "resnet20": (0.146005, 0.001618, 0.024686),
    "alexnet": (0.257205, 0.383776, 3.36298),
    "resnet50": (4.882041, 0.15405, 1.424253),
}
#: per-worker batch of one iteration (ResNet-50: 16 accumulated micro-batches)
PAPER_BATCH = {"vgg16-cifar": 128, "resnet20": 128, "alexnet": 64, "resnet50": 256, "lstm-ptb": 20}
#: the paper's compression times are linear in the model size: 6.0-6.3 ns per
#: parameter for all four models above; used for models without a breakdown.
PAPER_SELECT_NS_PER_ELEMENT = 6.15

#: per-worker throughput (samples/s) at P = 1, 4, 8, 16, 32
PAPER_P = (1, 4, 8, 16, 32)
PAPER_THROUGHPUT = {
    "vgg16-cifar": {"dense": (1317.333, 104.200, 92.560, 39.480, 12.600),
                    "topk": (1317.333, 110.576, 109.900, 97.865, 63.002),
                    "gtopk": (1317.333, 131.060, 130.551, 126.434, 123.200)},
    "resnet20": {"dense": (920.632, 821.700, 705.200, 520.400, 287.900),
                 "topk": (920.632, 908.837, 752.985, 737.594, 696.029),
                 "gtopk": (920.632, 916.260, 868.730, 808.500, 789.300)},
    "alexnet": {"dense": (173.469, 14.010, 12.118, 4.936, 1.234),
                "topk": (173.469, 14.238, 13.865, 13.352, 9.236),
                "gtopk": (173.469, 16.536, 16.446, 16.359, 15.777)},
    "resnet50": {"dense": (52.873, 39.002, 36.989, 23.176, 10.721),
                 "topk": (52.873, 37.729, 35.703, 34.495, 30.583),
                 "gtopk": (52.873, 39.795, 39.713, 39.060, 39.119)},
    "lstm-ptb": {"dense": (392.0, 12.657, 8.7, 4.1, 2.1),
                 "topk": (392.0, 19.9, 18.6, 14.8, 5.4),
                 "gtopk": (392.0, 17.8, 17.6, 15.1, 10.8)},
}
# ImageNet VGG-16 is not a model of the paper; its throughput is not given.


def paper_compute(model: str) -> Tuple[float, str]:
    """Emulated compute seconds per iteration and where the number comes from."""
    if model in PAPER_BREAKDOWN:
        return PAPER_BREAKDOWN[model][0], "paper breakdown (gTop-k, P=32)"
    if model == "vgg16":
        return PAPER_BREAKDOWN["vgg16-cifar"][0], ("paper's VGG-16 compute (0.140 s), which was measured "
                                                   "on the CIFAR-10 VGG-16: an ImageNet VGG-16 iteration "
                                                   "would take tens of times longer")
    if model == "lstm-ptb":
        return PAPER_BATCH["lstm-ptb"] / PAPER_THROUGHPUT["lstm-ptb"]["dense"][0], (
            "not in the paper's breakdown: batch 20 / 392 samples/s single-worker throughput")
    raise ValueError(model)


def paper_selection(model: str) -> Tuple[float, str]:
    """The paper's compression seconds per iteration for ``model``."""
    if model in PAPER_BREAKDOWN:
        return PAPER_BREAKDOWN[model][1], "paper breakdown (gTop-k, P=32)"
    return numel(model) * PAPER_SELECT_NS_PER_ELEMENT * 1e-9, (
        f"scaled at the paper's {PAPER_SELECT_NS_PER_ELEMENT} ns per parameter")


def paper_efficiency(model: str, method: str) -> Dict[int, float]:
    """The paper's scaling efficiency (per-worker throughput at P over the
    single-worker throughput) for P = 4, 8, 16, 32."""
    t = PAPER_THROUGHPUT.get(model, {}).get(method)
    if not t:
        return {}
    return {P: v / t[0] for P, v in zip(PAPER_P[1:], t[1:])}
