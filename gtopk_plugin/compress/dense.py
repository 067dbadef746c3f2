"""Dense: no selection; the whole accumulator is summed by allreduce (the
S-SGD baseline)."""
import torch

from .base import Selector
from .registry import register


@register("dense")
class DenseSelector(Selector):
    aggregation = "dense"

    def select(self, acc, offsets, k, ctx):
        idx = torch.arange(acc.numel(), device=acc.device)
        return idx, acc
